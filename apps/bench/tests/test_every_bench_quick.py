"""Every `uv run apps/bench NAME` runs once, in its `--quick` mode, so a bench cannot rot
unnoticed: each must exit 0 and end with its one-line JSON object.

Each bench runs as a user starts it (`python apps/bench NAME --quick`, a subprocess in its own
process group, in an empty working directory so nothing lands in the repository's `runs/`).
A bench that overruns is killed with its whole process group (vLLM's engine core and a local
Ray included) and fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from bench_app.cli import BENCHES

BENCH_APP = Path(__file__).resolve().parents[1]
# The longest a quick bench may take on a loaded 2-core machine (the ones run here took up
# to ~10 min with a load average of 13-35: a machine shared by several test runs).
QUICK_TIMEOUT_S = 900
# The test environment of the repository's conftests: an in-process engine core (fast
# start), a small KV cache, no model hub.
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}
# Benches whose quick run starts whole training runs or sweeps model sizes: minutes each on
# 2 cores (measured on a loaded machine: e2e 868 s, trainer 658 s, scale 10-11 min; study runs
# what e2e runs). Together they would cost CI more than the rest of the suite's slow tests, so
# this smoke test leaves them out and says so; `scale --quick` has its own test
# (test_scale_bench.py), and e2e's and study's figures are unit-tested (test_e2e_figures.py,
# test_study_grid.py) on runs the app's own e2e tests exercise.
NOT_IN_CI = {"e2e", "study", "trainer", "scale"}
# Figures a bench's JSON must carry (beyond its name): the queue's comparison with verl's
# MessageQueue (verl is in the workspace's dev group, so it runs here).
REQUIRED_FIGURES = {
    "queue": ("ratio_vs_verl_batched_1k", "ratio_vs_verl_4m", "verl_actor_peak_rss_mb"),
}


def _run_quick(name: str, cwd: Path) -> tuple[int | None, str]:
    """Exit code (None: killed at the timeout) and the combined output."""
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in ENV.items()}}
    proc = subprocess.Popen(
        [sys.executable, str(BENCH_APP), name, "--quick"],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=QUICK_TIMEOUT_S)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


@pytest.mark.slow  # each 1-2 min on an idle 2-core machine (Ray, vLLM or qwen-vl-utils start)
@pytest.mark.timeout(QUICK_TIMEOUT_S + 60)  # beyond the suite's per-test limit
@pytest.mark.parametrize(
    "name",
    sorted(set(BENCHES) - NOT_IN_CI),
)
def test_bench_runs_in_quick_mode(name: str, tmp_path: Path) -> None:
    code, out = _run_quick(name, tmp_path)
    assert code is not None, (
        f"{name} --quick still running after {QUICK_TIMEOUT_S} s:\n{out[-3000:]}"
    )
    assert code == 0, f"{name} --quick exited {code}:\n{out[-3000:]}"
    last = json.loads(out.strip().splitlines()[-1])
    assert last["bench"] == name
    assert len(last) > 1, last  # figures, not only the name
    missing = [key for key in REQUIRED_FIGURES.get(name, ()) if key not in last]
    assert not missing, last

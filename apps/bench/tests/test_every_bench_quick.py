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
# The longest a quick bench may take on a loaded 2-core machine: the slowest, e2e (two app
# runs, each starting Ray and a vLLM engine), took 868 s with a load average of 13-35 (a
# machine shared by several test runs).
QUICK_TIMEOUT_S = 1200
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
# Benches whose quick run cannot finish yet, with why. `rollout` gives the rollouter a
# finite prompt list and no trainer: under fresh pacing it waits for a version that never
# comes, so it never returns (the rollouter must finish a finite run without a consumer).
KNOWN_HANGING = {"rollout": "the rollouter never finishes a finite run without a consumer"}


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


@pytest.mark.slow  # e2e alone took 868 s on a loaded machine (see QUICK_TIMEOUT_S)
@pytest.mark.timeout(QUICK_TIMEOUT_S + 60)  # beyond the suite's per-test limit
@pytest.mark.parametrize(
    "name",
    [
        # Not run: a hang would cost the whole timeout. Remove the entry once it finishes.
        pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_HANGING[n], run=False))
        if n in KNOWN_HANGING
        else n
        for n in sorted(BENCHES)
    ],
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

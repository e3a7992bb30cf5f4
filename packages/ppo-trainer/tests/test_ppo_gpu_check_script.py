"""`gpu_check.sh` runs end to end on a CPU-only machine: the gpu tests skip, the throughput
part runs on a tiny shape, and the last line is the JSON report (also written to --out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "gpu_check.sh"


# Two Python start-ups with torch: measured 33 s at load 10, 153 s at load 16, 222 s at load
# 18-27 (2 cores).
@pytest.mark.slow
def test_gpu_check_script_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),  # everything is installed here
        "GPU_CHECK_TIMEOUT_S": "200",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == report
    assert report["tests_rc"] == 0
    cuda = torch.cuda.is_available()
    assert report["cuda"] is cuda
    assert report["shape"] == ("qwen2.5-0.5b" if cuda else "tiny")
    if not cuda:
        assert "skipped" in report["tests"] and "failed" not in report["tests"]
    assert report["trainer_tokens_per_s"] > 0 and report["minimal_tokens_per_s"] > 0
    assert report["trainer_vs_minimal"] == pytest.approx(
        report["trainer_tokens_per_s"] / report["minimal_tokens_per_s"], rel=0.01
    )

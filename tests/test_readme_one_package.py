"""The README's "Use one package in your stack" snippets, each run as a user would run it:
as a script in a fresh Python process, with its placeholders (`MY_IMAGE`, `MY_MODEL_DIR`)
pointed at files made here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Use one package in your stack"


def _snippets() -> dict[str, str]:
    """The section's python blocks, keyed by the package each one imports first."""
    text = (ROOT / "README.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    keyed = {}
    for block in blocks:
        package = re.search(r"^from (\w+)", block, flags=re.MULTILINE)
        keyed[package.group(1) if package else "?"] = block
    return keyed


def _run(code: str, env: dict[str, str], timeout_s: float) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_section_has_the_four_swaps() -> None:
    assert set(_snippets()) == {"async_queue", "mm_preprocess", "rollout_engine", "ppo_trainer"}


def test_ppo_trainer_losses_on_user_tensors() -> None:
    """A few seconds: imports torch."""
    out = _run(_snippets()["ppo_trainer"], {}, 120)
    loss, clipfrac = map(float, out.split())
    assert np.isfinite(loss) and 0.0 <= clipfrac <= 1.0


def test_vision_drop_ins(tmp_path: Path) -> None:
    from PIL import Image

    image = tmp_path / "photo.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(image)
    out = _run(_snippets()["mm_preprocess"], {"MY_IMAGE": str(image)}, 120)
    assert out.splitlines()[1] == "1 None None"
    width, height = map(int, out.splitlines()[0].split(")")[0].strip("(").split(","))
    assert width % 28 == 0 and height % 28 == 0  # resized to whole 2x2 patches of 14


@pytest.mark.slow  # a fresh local Ray in a subprocess: 20-60 s here, more on a loaded machine
def test_verl_queue_swap() -> None:
    # A loaded machine may need more than the default 30 s to register the raylet.
    env = {"RAY_ADDRESS": "local", "RAY_raylet_start_wait_time_s": "120"}
    out = _run(_snippets()["async_queue"], env, 300)
    assert out.splitlines()[-3:] == [
        "(b'a rollout sample', 1)",
        "(None, 0)",
        "closed and drained",
    ]


@pytest.mark.slow  # vLLM start-up in a subprocess: about 60-120 s on this machine
def test_rollouter_over_a_users_async_llm(tmp_path: Path) -> None:
    from train_app.tiny_model import build_tiny_qwen2

    model = build_tiny_qwen2(tmp_path / "model")
    env = {
        "MY_MODEL_DIR": str(model),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    out = _run(_snippets()["rollout_engine"], env, 540)
    # vLLM may log its engine core's shutdown to stdout after the snippet's own last line.
    assert "4 groups" in out.splitlines(), out[-2000:]

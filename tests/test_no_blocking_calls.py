"""Repository-wide rule: no blocking call inside `async def` (design.md, async rules)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from blocking_calls import check_source, check_tree

ROOT = Path(__file__).resolve().parents[1]


def test_no_async_def_in_the_repository_blocks_its_loop() -> None:
    findings = check_tree(ROOT / "packages", ROOT / "apps")
    assert not findings, "blocking calls in async code:\n" + "\n".join(map(str, findings))


def test_the_checker_scans_real_async_code() -> None:
    # Guard against a checker that silently scans nothing.
    files = list((ROOT / "packages").rglob("*.py"))
    assert any("async def" in f.read_text() for f in files)


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("import ray\nasync def f(ref):\n    return ray.get(ref)\n", "ray.get"),
        ("from ray import get\nasync def f(ref):\n    return get(ref)\n", "ray.get"),
        ("import ray\nasync def f(refs):\n    ray.wait(refs)\n", "ray.wait"),
        ("import ray\nasync def f(refs):\n    ray.wait(refs, timeout=1.0)\n", "ray.wait"),
        ("import time\nasync def f():\n    time.sleep(1)\n", "time.sleep"),
        ("from time import sleep as nap\nasync def f():\n    nap(1)\n", "time.sleep"),
        ("import requests\nasync def f(u):\n    return requests.get(u)\n", "requests.get"),
        ("async def f(fut):\n    return fut.result()\n", ".result()"),
        ("from PIL import Image\nasync def f(p):\n    return Image.open(p)\n", "PIL.Image.open"),
        ("import PIL.Image\nasync def f(p):\n    return PIL.Image.open(p)\n", "PIL.Image.open"),
        (
            "from qwen_vl_utils import process_vision_info\n"
            "async def f(m):\n    return process_vision_info(m)\n",
            "qwen_vl_utils.process_vision_info",
        ),
        (
            "import qwen_vl_utils\nclass A:\n    async def f(self, m):\n"
            "        if m:\n            return qwen_vl_utils.process_vision_info(m)\n",
            "qwen_vl_utils.process_vision_info",
        ),
        (
            "import subprocess\nclass CalculatorEnv:\n    async def step(self, turn):\n"
            "        return subprocess.run(['bc'], input=turn)\n",
            "subprocess.run",
        ),
        ("import os\nasync def tool(cmd):\n    return os.system(cmd)\n", "os.system"),
        (
            "from urllib.request import urlopen\nasync def reset(self, sample):\n"
            "    return urlopen(sample.url).read()\n",
            "urllib.request.urlopen",
        ),
    ],
)
def test_checker_flags_blocking_calls(snippet: str, expected: str) -> None:
    findings = check_source(snippet)
    assert [f.call for f in findings] == [expected]


def test_the_checker_covers_environment_code() -> None:
    """Multi-turn environments and tools (rollout-engine's episode runner, the environments
    of its tests and of the apps) are inside the scanned roots, and a blocking environment
    is fine when its methods are plain `def`s (the rollouter runs them in its tool pool)."""
    scanned = {p.resolve() for root in ("packages", "apps") for p in (ROOT / root).rglob("*.py")}
    episode = ROOT / "packages/rollout-engine/src/rollout_engine/episode.py"
    assert episode.resolve() in scanned
    assert (ROOT / "packages/rollout-engine/tests/test_episode.py").resolve() in scanned
    sync_env = textwrap.dedent(
        """
        import subprocess

        class CalculatorEnv:  # a SyncEnvironment: the rollouter calls it in its tool pool
            def reset(self, sample):
                return []

            def step(self, turn):
                return subprocess.run(["bc"], input=turn, capture_output=True).stdout
        """
    )
    assert check_source(sync_env) == []


def test_pragma_marks_a_deliberate_negative_control() -> None:
    snippet = "import ray\nasync def f(ref):\n    return ray.get(ref)  # blocking-on-purpose\n"
    assert check_source(snippet) == []


def test_checker_passes_well_behaved_async_code() -> None:
    good = textwrap.dedent(
        """
        import asyncio, time, ray
        from PIL import Image
        from qwen_vl_utils import process_vision_info

        def decode(path):
            return Image.open(path)  # sync helper, runs in the executor

        async def f(ref, refs, pool, path, messages):
            value = await ref
            ready, _ = ray.wait(refs, timeout=0)
            await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            image = await loop.run_in_executor(pool, decode, path)
            info = await loop.run_in_executor(pool, lambda: process_vision_info(messages))
            started = time.monotonic()
            return value, ready, image, info, started

        def plain_script(ref):
            time.sleep(0.1)
            return ray.get(ref)
        """
    )
    assert check_source(good) == []

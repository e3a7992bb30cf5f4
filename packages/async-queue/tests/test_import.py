"""`import async_queue` stays light: no torch or vllm; the core does not even need Ray."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr


def test_import_does_not_pull_torch_or_vllm() -> None:
    run_python(
        "import async_queue, sys\n"
        "from async_queue import MessageQueueClient, SyncMessageQueueClient, QueueActor\n"
        "heavy = {'torch', 'vllm', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )


def test_core_imports_without_ray() -> None:
    run_python(
        "import sys, async_queue\n"
        "from async_queue import MessageQueue, QueueItem, QueueStats, QueueClosed\n"
        "assert 'ray' not in sys.modules, 'the core must not import ray'\n"
    )


def test_verl_compat_needs_no_verl() -> None:
    """The drop-in imports neither verl nor what verl brings (it runs where verl does not)."""
    run_python(
        "import sys\n"
        "from async_queue.compat.verl import MessageQueue, MessageQueueClient\n"
        "heavy = {'verl', 'omegaconf', 'torch', 'tensordict'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )

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

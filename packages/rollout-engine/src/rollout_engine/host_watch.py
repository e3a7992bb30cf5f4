"""No orphaned engine core: vLLM's engine-core process ends when the process that started
it (the `VLLMEngine` host) dies, however it dies.

vLLM starts its engine core (and, with multiprocessing, its workers) as child processes. If
the host is killed (SIGKILL, OOM) nothing tells them, and they keep running, reparented to
init, holding memory and CPUs. `watch_host(host_pid)`, called inside a vLLM worker, opens a
pidfd on the host and on every process between the worker and the host (the engine core),
and starts a daemon thread that waits for the host's pidfd to become readable (the host has
exited), then kills those processes and exits the worker. pidfds make this immune to pid
reuse. Linux only (pidfd_open, Linux >= 5.3); elsewhere it logs and does nothing.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading

__all__ = ["watch_host"]

logger = logging.getLogger(__name__)


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[1])  # after the name: state, ppid, ...


def _between(host_pid: int) -> list[int]:
    """Processes from this one's parent up to (not including) `host_pid`, nearest first;
    empty when `host_pid` is not an ancestor (then only the host itself is watched)."""
    chain: list[int] = []
    pid = os.getppid()
    while pid not in (host_pid, 0, 1):
        chain.append(pid)
        pid = _parent_of(pid)
    return chain if pid == host_pid else []


def watch_host(host_pid: int) -> list[int]:
    """Start the watch; returns the ancestor pids it will kill with this process (the
    engine core when the worker runs in its own process), or [] if it could not start."""
    if not hasattr(os, "pidfd_open"):
        logger.warning("no pidfd_open on this platform: the engine core is not tied to its host")
        return []
    try:
        host = os.pidfd_open(host_pid)
        between = _between(host_pid)
        fds = [os.pidfd_open(pid) for pid in between]
    except (OSError, ValueError) as exc:
        logger.warning("cannot watch the engine's host process %d: %r", host_pid, exc)
        return []
    thread = threading.Thread(
        target=_wait_then_exit,
        args=(host, host_pid, fds),
        name="rollout-host-watch",
        daemon=True,
    )
    thread.start()
    return between


def _wait_then_exit(host: int, host_pid: int, ancestors: list[int]) -> None:
    select.select([host], [], [])  # readable once the host has exited
    logger.warning("engine host process %d is gone: shutting this engine down", host_pid)
    for fd in ancestors:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            continue  # already gone
    os._exit(1)

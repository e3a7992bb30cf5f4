"""`start_local_ray`'s retry, with `ray.init` replaced by a stand-in (this is about the retry
logic, not Ray): a start that times out is retried, and what it spawned is killed first."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import ray
from train_app.driver import cluster


def test_a_timed_out_start_is_retried_and_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spawned: list[subprocess.Popen[bytes]] = []

    def init(**_: object) -> None:
        # Like a real start that timed out: its processes (a GCS, a raylet) keep running.
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        if len(spawned) < 3:
            raise RuntimeError("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    cluster.start_local_ray(num_cpus=1, options={})
    assert len(spawned) == 3
    for proc in spawned[:2]:
        assert proc.wait(timeout=10) != 0  # killed, not left running
    assert psutil.pid_exists(spawned[2].pid)  # the start that worked keeps its processes
    spawned[2].kill()
    spawned[2].wait()


def test_another_error_is_raised_at_once_and_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spawned: list[subprocess.Popen[bytes]] = []

    def init(**_: object) -> None:
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        raise ValueError("bad option")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad option"):
        cluster.start_local_ray(num_cpus=1, options={})
    assert len(spawned) == 1 and spawned[0].wait(timeout=10) != 0
    assert time.monotonic() - started < 10

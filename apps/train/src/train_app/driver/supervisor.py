"""Training under watch: the trainer's ranks train while the driver polls metrics and actor
health, restarts a dead rollouter, and ends the run with the cause of any other failure.

A rollouter that dies (its actor, or its engine: the rollout loop fails, or a weight push
into it does, which fails its `wait()`) is replaced by a new `RolloutActor` with the same
`ReplicaPlan`, started from the trainer's last pushed weights and version; its prompt stream
(same seed) skips every prompt already handed to training and every prompt still queued, so
the prompts the dead replica had in flight are admitted again and none twice (the trainer's
source also drops a second group of a prompt, `trainer/duplicates_dropped`). Restarts are
counted (`rollout/restarts`); past `--max-rollout-restarts` the driver fails the queue with
the cause, so the trainer's next read raises `ProducerFailed` and the run exits non-zero
within seconds. If the trainer (any of its ranks) or the queue dies, its error ends the run
the same way (`--resume` continues from the last checkpoint)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rollout_engine import RolloutSnapshot

from train_app.config import TrainConfig
from train_app.driver.aio import await_ref, failure, quietly
from train_app.driver.errors import RunFailed, TrainerRankFailed, actor_died, brief, first_line
from train_app.driver.logs import ACTOR_LOG_CAP_EVERY_S, cap_actor_logs
from train_app.driver.reporting import Reporter, progress_bar
from train_app.driver.signals import Stopper
from train_app.driver.startup import Actors, write_pids
from train_app.inflight import without_prompts
from train_app.outputs import MAX_LOG_BYTES
from train_app.plan import ReplicaPlan, RunPlan, actor_options

logger = logging.getLogger(__name__)

__all__ = ["EVAL_LAST_TIMEOUT_S", "POLL_S", "RANK_FAILURE_GRACE_S", "Supervisor"]

# How often the driver polls metrics and actor health.
POLL_S = 0.5
# Seconds the rollouters have for the evaluation at the end of training (a held-out set);
# one that takes longer is left out of that row (a warning says so).
EVAL_LAST_TIMEOUT_S = 600.0
# After one trainer rank fails, how long the driver waits for the others' errors (a dead
# rank breaks their collectives within a moment) so that the failure names them all.
RANK_FAILURE_GRACE_S = 2.0


def _ignore_outcome(future: asyncio.Future) -> None:
    """Marks a future's error as seen: an actor's end after the run ended is not news."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


class Supervisor:
    """Runs `train()` on every trainer rank and watches every actor until it returns."""

    def __init__(
        self,
        config: TrainConfig,
        run_plan: RunPlan,
        actors: Actors,
        reporter: Reporter,
        stopper: Stopper,
        console: Console,
    ) -> None:
        self.config, self.plan, self.actors = config, run_plan, actors
        self.reporter, self.stopper, self.console = reporter, stopper, console
        self.restarts = 0
        """Rollouters replaced so far (`rollout/restarts`)."""
        self._next_log_cap = time.monotonic() + ACTOR_LOG_CAP_EVERY_S

    async def poll_metrics(self) -> None:
        actors = self.actors
        await self.reporter.collect(actors.rollouts, actors.queue, actors.trainer, self.restarts)

    async def evaluate_last(self, step: int) -> None:
        """The held-out evaluation of the last weights (labelled `step`) on every replica,
        then every evaluation row not written yet; nothing without a held-out set."""
        if self.reporter.evals is None:
            return
        self.console.print(f"evaluating the weights of step {step} on the held-out set")
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(await_ref(r.evaluate_last.remote(step)), EVAL_LAST_TIMEOUT_S)
                for r in self.actors.rollouts
            ),
            return_exceptions=True,
        )
        for replica, reply in enumerate(replies):
            if isinstance(reply, BaseException):
                logger.warning("replica %d: evaluation at the end failed: %r", replica, reply)
        await self.reporter.collect_evals(self.actors.rollouts, flush=True)

    async def train(self) -> dict[str, Any]:
        """Train while watching every actor; returns the trainer's summary."""
        started = time.monotonic()
        train_ref = asyncio.ensure_future(self._train_ranks())
        _ignore_outcome(train_ref)  # its error after another failure ended the run
        self.stopper.graceful = self._stop_training
        rollout_refs = [
            asyncio.ensure_future(await_ref(r.wait.remote())) for r in self.actors.rollouts
        ]
        for ref in rollout_refs:  # their end after a clean stop is not news
            _ignore_outcome(ref)
        summary = await self._watch(train_ref, rollout_refs, started)
        self.stopper.graceful = None  # training is over: a signal now just stops the actors
        if self.stopper.signum is not None:
            step = summary.get("checkpoint_step")
            self.stopper.outcome = (
                f"checkpoint at step {step} saved (continue with --resume {self.reporter.run_dir})"
                if step is not None
                else "no new step since the last checkpoint; nothing to save"
            )
        return summary

    async def _train_ranks(self) -> dict[str, Any]:
        """`train()` on every trainer rank at once (it is collective); rank 0's summary, with
        `rank_steps`: each rank's steps. A failed rank fails it, with every rank's error (a
        dead rank makes the others' collectives fail too, so all are named)."""
        refs = [asyncio.ensure_future(await_ref(t.train.remote())) for t in self.actors.trainers]
        for ref in refs:  # errors read after the run ended (killed actors) are not news
            _ignore_outcome(ref)
        _, pending = await asyncio.wait(refs, return_when=asyncio.FIRST_EXCEPTION)
        if len(refs) == 1 and refs[0].exception() is not None:
            raise refs[0].exception()  # type: ignore[misc]
        if pending:  # one failed: give the others a moment to report theirs
            await asyncio.wait(pending, timeout=RANK_FAILURE_GRACE_S)
        failed = [(r, f.exception()) for r, f in enumerate(refs) if f.done() and f.exception()]
        if failed:
            failed.sort(key=lambda f: not actor_died(f[1]))  # the dead rank is the cause
            causes = "; ".join(f"rank {r} of {len(refs)}: {brief(exc)}" for r, exc in failed)
            raise TrainerRankFailed(causes) from failed[0][1]
        summaries = [await ref for ref in refs]  # all done: returns at once
        return {**summaries[0], "rank_steps": [s["steps"] for s in summaries]}

    def _stop_training(self) -> bool:
        """First SIGINT/SIGTERM while training: the trainer finishes its step, checkpoints
        and returns (see TrainerActor.stop; rank 0 releases the others); `_watch` then sees
        `train` end."""
        self.actors.trainer.stop.remote()  # fire and forget: train()'s end is the answer
        return True

    async def _watch(
        self, train_ref: asyncio.Future, rollout_refs: list[asyncio.Future], started: float
    ) -> Any:
        """Poll metrics and actor health until the trainer returns. A dead rollouter is
        restarted in the background while training goes on (`_restart_rollouter`); any other
        failed actor, or a rollouter past `--max-rollout-restarts`, ends the run with its
        cause (a dead producer first fails the queue, so the trainer stops)."""
        watched: list[asyncio.Future | None] = list(rollout_refs)
        restarting: dict[int, asyncio.Future] = {}
        try:
            with progress_bar(self.console, self.config.progress) as progress:
                bar = progress.add_task("training", total=self.plan.steps, info="")
                while True:
                    waiting = {train_ref, *restarting.values(), *(r for r in watched if r)}
                    done, _ = await asyncio.wait(waiting, timeout=POLL_S)
                    await self._poll(started)
                    progress.update(
                        bar,
                        completed=self.reporter.rows,
                        info=self.reporter.progress_info(),
                    )
                    await self._replace_dead(done, watched, restarting)
                    if train_ref in done:
                        if train_ref.exception() is not None:
                            cause = train_ref.exception()
                            raise RunFailed(f"trainer failed: {cause}") from cause
                        return await train_ref  # already done
        finally:
            for restart in restarting.values():
                restart.cancel()

    async def _poll(self, started: float) -> None:
        """New metrics rows; the first of this run times the first step and weight push."""
        await self.poll_metrics()
        await self._cap_logs()
        first, timings = self.reporter.first_row, self.reporter.timings
        if first is not None and "first_step_s" not in timings:
            timings["first_step_s"] = time.monotonic() - started
            timings["first_push_s"] = first.get("weights/sync_s", 0)

    async def _cap_logs(self) -> None:
        """About once `ACTOR_LOG_CAP_EVERY_S`, cap the actors' logs (`cap_actor_logs`)."""
        log_dir = self.plan.trainer.log_dir
        if log_dir is None or time.monotonic() < self._next_log_cap:
            return
        self._next_log_cap = time.monotonic() + ACTOR_LOG_CAP_EVERY_S
        rotated = await asyncio.to_thread(cap_actor_logs, Path(log_dir))
        for path in rotated:
            logger.info("%s passed %d bytes: moved to %s.1", path, MAX_LOG_BYTES, path.name)

    async def _replace_dead(
        self,
        done: set[asyncio.Future],
        watched: list[asyncio.Future | None],
        restarting: dict[int, asyncio.Future],
    ) -> None:
        """Start a restart for each rollouter whose `wait()` failed; watch each finished
        replacement instead (a restart past the limit raises `RunFailed` here)."""
        for replica, ref in enumerate(watched):
            if ref is not None and ref in done and failure(ref) is not None:
                watched[replica] = None
                restarting[replica] = asyncio.ensure_future(
                    self._restart_rollouter(replica, failure(ref))  # type: ignore[arg-type]
                )
        for replica, restart in list(restarting.items()):
            if restart.done():
                del restarting[replica]
                watched[replica] = await restart  # done; RunFailed past the limit

    async def _restart_rollouter(self, replica: int, cause: BaseException) -> asyncio.Future:
        """Replace dead replica `replica`; returns the new actor's `wait()` future. A
        replacement that fails to start counts as another restart. Past
        `--max-rollout-restarts` the queue is failed with the cause and `RunFailed` raised."""
        import ray

        while True:
            self.restarts += 1
            limit = self.config.max_rollout_restarts
            if self.restarts > limit:
                await quietly(self.actors.queue.close(error=f"rollouter failed: {cause}"))
                after = f" (after {limit} restart{'s' * (limit != 1)})" if limit else ""
                raise RunFailed(f"rollouter {replica} failed{after}: {cause}") from cause
            logger.warning("rollouter %d failed (%s); restarting it", replica, cause)
            self.console.print(
                f"[bold yellow]rollouter {replica} failed:[/] {first_line(cause)}; restarting "
                f"it ({self.restarts}/{limit})"
            )
            with contextlib.suppress(Exception):  # an engine failure leaves the actor alive
                ray.kill(self.actors.rollouts[replica])
            try:
                actor = await self._start_replacement(replica)
            except Exception as exc:
                logger.warning("replacement of rollouter %d failed: %r", replica, exc)
                cause = exc
                continue
            await quietly(write_pids(self.actors, self.reporter.run_dir))
            ref = asyncio.ensure_future(await_ref(actor.wait.remote()))
            _ignore_outcome(ref)
            return ref

    async def _start_replacement(self, replica: int) -> Any:
        """A new rollout actor for `replica` (see `replacement_plan`): it loads the trainer's
        last pushed weights before it is built, is attached to the trainer's weight pushes
        (bringing it up to date), then starts generating. It is in `actors.rollouts` once
        started; one that fails to start is killed."""
        import ray

        from train_app.actors import RolloutActor

        queued = await self.actors.queue.item_ids()  # before `taken`: an item moves on
        trainer = self.actors.trainer
        handoff = await await_ref(trainer.rollout_handoff.remote())
        replica_plan = replacement_plan(
            self.plan.replicas[replica],
            frozenset(handoff["taken"]) | frozenset(queued),
            handoff.get("snapshots", {}).get(replica),
        )
        options = actor_options(replica_plan.resources)
        actor = RolloutActor.options(**options).remote(replica_plan, self.actors.queue)
        self.actors.starting.append(actor)
        try:
            weights, version = handoff["weights"], handoff["version"]
            t0 = time.monotonic()
            await await_ref(actor.start.remote(weights and weights[0], version, begin=False))
            await await_ref(trainer.attach_rollout.remote(replica, actor, version))
            await await_ref(actor.begin.remote())
        except Exception:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            self.actors.starting.remove(actor)
            raise
        # (Cancelled above, e.g. the run ended: it stays in `starting`, which kill() ends.)
        self.actors.starting.remove(actor)
        self.actors.rollouts[replica] = actor
        logger.info("rollouter %d restarted in %.1f s", replica, time.monotonic() - t0)
        return actor


def replacement_plan(
    base: ReplicaPlan, handed_over: frozenset[str], last: RolloutSnapshot | None = None
) -> ReplicaPlan:
    """The plan of a dead replica's replacement: the same prompt stream (same seed),
    skipping every prompt id recently handed over (trained on, in training or queued:
    `handed_over`; the trainer keeps enough to cover two checkpoint intervals,
    `plan.consumed_ids_kept`) besides those the original skipped.

    With `last`, the replica's snapshot at the last checkpoint that records its stream's
    position: the stream starts there and the snapshot's groups not handed over since are
    continued. Without it, the stream starts where the original's did and the resumed run's
    restored partials its predecessor had not delivered are continued again (the base
    plan's skip set holds every restored id, so it cannot tell them apart). Its
    predecessor's share of a resume's put-back groups was counted by it (`requeued=0`)."""
    skip = base.consumed_prompt_ids | handed_over
    position, restore, redo = base.prompt_position, base.restore, base.redo_prompt_ids
    if last is not None and last.prompt_state is not None:
        position = int(last.prompt_state["position"])
        skip = skip | frozenset(last.prompt_state.get("skip", ()))
        restore, redo = last, tuple(last.prompt_state.get("redo", ()))
    return replace(
        base,
        consumed_prompt_ids=skip,
        prompt_position=position,
        redo_prompt_ids=tuple(i for i in redo if i not in handed_over),
        restore=without_prompts(restore, handed_over),
        requeued=0,
    )

"""The rollouter: streams prompts to a generation engine, one GRPO group per task.

Dispatch loop (`run`), one iteration:

1. reap finished group tasks from `active` (always the same set object; never rebound) and
   account for them: delivered, dropped (too stale) or failed (any exception, including
   `CancelledError` and Ray's `TaskCancelledError`; never fatal to the loop);
2. make sure one prompt is fetched (prefetched, so a resume dispatches without waiting for
   the prompt source);
3. if admission is open (not paused by a weight push, staleness budget > 0, fewer than
   `max_concurrency` groups in flight), start the group as a task;
4. otherwise wait on `active | {resume}` with `FIRST_COMPLETED`: a finished task or
   `on_weights()` ends the wait at once. The loop never waits for the slowest sequence.

Async rules (design.md): counters and the task set are changed under `asyncio.Lock` in short
critical sections with no await inside; the lock is never held while waiting on generation.
"Running vs paused" is the `asyncio.Event` `_running`: cleared by `pause()` (weight push) and
when the budget is exhausted, set by `on_weights()`. Weight pushes are serialized by a second
lock that the dispatch loop never takes.

Staleness: see `rollout_engine.admission` for the budget `(j + 1 + v) * batch_size *
sync_every - (delivered + in_flight)`, where the pacing policy's lookahead `j <= k` (eager:
j = k; fresh, the default: the smallest j that keeps the consumer fed), and for why groups
are also checked (and dropped, counted) at delivery. Precisely: a finished group is judged
against the current version immediately before `await sink.put(group)`, with no await in
between, and dropped if too stale. The put itself may wait (a full queue) across weight
pushes, and a group cannot be recalled once handed over, so no drop happens after it; the
staleness recorded for `staleness/mean|max` is measured again when the put returns, at the
version then. It can exceed `max_staleness` in that case (the consumer's own check at
consumption catches such a group); the metric reports what was actually delivered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import warnings
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Literal

from rollout_engine.admission import AdmissionPolicy, PacingPolicy, StalenessBound, make_pacing
from rollout_engine.config import LoopState, RolloutConfig
from rollout_engine.continuation import PartialResponse
from rollout_engine.episode import EnvironmentFactory, EpisodeConfig, EpisodeRunner
from rollout_engine.evaluation import DEFAULT_EVAL_CONCURRENCY, EvalResult, run_eval_groups
from rollout_engine.failures import RolloutFailed
from rollout_engine.group import GroupJob
from rollout_engine.group_filter import GroupFilter, make_group_filter
from rollout_engine.in_flight import InFlightGroups
from rollout_engine.ledger import GroupLedger, is_cancellation
from rollout_engine.metrics import FailedGroup, GroupOutcome, IdleClock, RolloutStats, count_partial
from rollout_engine.prompt_source import PromptSource
from rollout_engine.restore_queue import RestoreQueue
from rollout_engine.runners import make_group_runner
from rollout_engine.snapshot import GroupSnapshot, ResponseSnapshot, RolloutSnapshot
from rollout_engine.stall_watch import StallWatch
from rollout_engine.types import (
    GenerationEngine,
    MultiModalPreprocessor,
    PromptSample,
    RewardFn,
    SamplingConfig,
    Trajectory,
    TrajectorySink,
)
from rollout_engine.weight_gate import WeightGate

__all__ = [
    "FailedGroup",
    "LoopState",
    "RolloutConfig",
    "RolloutFailed",
    "RolloutStats",
    "Rollouter",
    "is_cancellation",
]

logger = logging.getLogger(__name__)

_Blocker = Literal["paused", "budget", "concurrency", "held"]


def __getattr__(name: str) -> Any:
    if name == "FailedSample":
        warnings.warn(
            "FailedSample is deprecated: use FailedGroup", DeprecationWarning, stacklevel=2
        )
        return FailedGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Rollouter:
    """Streams prompts to `engine`, puts each finished group of `group_size` trajectories
    into `sink`, under the staleness budget; see the module docstring for the loop.

    `reward_fn(sample, trajectory)` sets each trajectory's reward before delivery.
    `clock` (monotonic seconds) times the metrics and the pacing estimates.
    `pacing` overrides the policy named by `config.pacing` (any `PacingPolicy`).
    `staleness_bound` is the bound shared with the consumer; without it,
    `StalenessBound(config.max_staleness)`. When given, it is the one that counts.
    `group_filter` (any `GroupFilter`) overrides the filter named by `config.filter_groups`.

    Multi-turn: with `environment` (a factory of one `Environment` per episode), each group
    member is an episode of up to `episode.max_turns` turns (see `rollout_engine.episode`);
    admission, staleness and partial rollout are the same as for single-turn groups.

    Failed groups: `failures` holds the last `config.recent_failures` `FailedGroup`s and
    `failure_counts` the number per error type over the whole run. To keep every one (e.g.
    to append them to a `failures.jsonl`), pass `on_failure`: it is called with each
    `FailedGroup` on the event loop, so it must not block (hand file writes to a thread);
    an exception it raises is logged and ignored.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        prompts: Iterable[PromptSample] | AsyncIterable[PromptSample],
        sink: TrajectorySink,
        reward_fn: RewardFn,
        config: RolloutConfig | None = None,
        preprocessor: MultiModalPreprocessor | None = None,
        clock: Callable[[], float] = time.monotonic,
        pacing: PacingPolicy | None = None,
        on_failure: Callable[[FailedGroup], None] | None = None,
        environment: EnvironmentFactory | None = None,
        episode: EpisodeConfig | None = None,
        staleness_bound: StalenessBound | None = None,
        group_filter: GroupFilter | None = None,
    ) -> None:
        self._engine = engine
        self._sink = sink
        self._config = config = config if config is not None else RolloutConfig()
        self._bound = staleness_bound if staleness_bound is not None else config.staleness_bound
        self._clock = clock
        self._prompts = PromptSource(prompts, self._prompt_executor)
        self._gate = WeightGate(engine, engine.version)
        self._admission = AdmissionPolicy(
            self._bound.max_staleness, config.groups_per_version, base_version=engine.version
        )
        self._pacing = pacing if pacing is not None else self._default_pacing(config)
        self._filter = group_filter or make_group_filter(config.filter_groups)
        self._ledger = GroupLedger.for_config(config, clock, on_failure)
        self._restore_queue = RestoreQueue(config.group_size)
        # Shared state; changed only under _lock, in critical sections without awaits.
        self._lock = asyncio.Lock()
        self._in_flight = InFlightGroups()
        self._stop_requested = asyncio.Event()
        self._pending: PromptSample | GroupSnapshot | None = None
        self._state: LoopState = "idle"
        self._resumed_at: float | None = None
        self._idle = IdleClock()
        self._run_started = False
        self._stall = StallWatch(config.stall_warning_s, _loop_time)
        self._reward_pool: ThreadPoolExecutor | None = None
        self._prompt_pool: ThreadPoolExecutor | None = None
        # What `evaluate` reuses: the same reward path, preprocessor and multi-turn setup.
        self._reward_fn = reward_fn
        self._preprocessor = preprocessor
        self._environment, self._episode = environment, episode
        self._evaluations = 0
        self._groups = make_group_runner(
            engine,
            reward_fn,
            group_size=config.group_size,
            sampling=config.sampling,
            preprocessor=preprocessor,
            environment=environment,
            episode=episode,
            wait_until_resumed=self._gate.wait_live,
            on_resubmit=self._count_resubmit,
            clock=clock,
            reward_executor=self._reward_executor,
        )

    @staticmethod
    def _default_pacing(config: RolloutConfig) -> PacingPolicy:
        return make_pacing(
            config.pacing,
            config.groups_per_version,
            config.max_concurrency,
            margin=config.pacing_margin,
        )

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> RolloutConfig:
        return self._config

    @property
    def staleness_bound(self) -> StalenessBound:
        return self._bound

    @property
    def version(self) -> int:
        """The weight version the rollouter last heard of (`on_weights`)."""
        return self._gate.version

    @property
    def state(self) -> LoopState:
        """What the dispatch loop is doing now; see `LoopState`."""
        return self._state

    @property
    def failures(self) -> deque[FailedGroup]:
        """The last `config.recent_failures` failed groups."""
        return self._ledger.failures

    @property
    def failure_counts(self) -> dict[str, int]:
        """Failed groups per error type name (e.g. `{"CancelledError": 4}`), whole run."""
        return dict(self._ledger.failure_counts)

    async def run(self) -> RolloutStats:
        """Dispatch until the prompts are exhausted (then deliver what is in flight) or
        `stop()` is called. Returns the final stats.

        Raises `RolloutFailed` (`__cause__`: the last group's error) once
        `max_consecutive_failures` groups in a row have failed; in-flight groups are
        cancelled first, as by `stop()`."""
        if self._run_started:
            raise RuntimeError("Rollouter.run() can only be called once")
        self._run_started = True
        self._idle.start(self._clock())
        self._stall.start()
        try:
            await self._dispatch_until_exhausted()
            await self._wait_for_in_flight()
        finally:
            await self._shut_down()
        stats = self.stats()
        logger.info(
            "rollout %s: %d admitted, %d delivered, %d failed, %d dropped, %d filtered",
            stats.state,
            stats.admitted,
            stats.delivered,
            stats.failed,
            stats.dropped,
            stats.filtered,
        )
        if self._ledger.fatal is not None:
            raise self._ledger.fatal
        return stats

    async def _shut_down(self) -> None:
        await self._cancel_in_flight()
        self._restore_queue.settled.set()  # nothing restored is left to wait for
        self._set_state(self._final_state())
        self._idle.stop(self._clock())
        self._ledger.flush()
        for pool in (self._reward_pool, self._prompt_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(self._groups, EpisodeRunner):
            self._groups.close()  # its tool pool

    async def stop(self) -> None:
        """Cancel every in-flight group (each becomes a failed group) and make `run()`
        return. Returns once the cancelled tasks have unwound, or after `stop_timeout_s`:
        a task still running then is counted as failed (cancelled) and leaves the active set
        (`in_flight` returns to 0); it is left to end on its own, and its exception is
        retrieved and logged at debug level when it does."""
        self._stop_requested.set()
        await self._cancel_in_flight()

    def restore(self, snapshot: RolloutSnapshot) -> None:
        """Queue a snapshot's in-flight groups (`snapshot_in_flight`, possibly of another
        process) ahead of the prompt source; call before `run()`.

        Each group is admitted like a prompt (budget, concurrency) and its unfinished
        responses continue from their tokens so far (`rollout_engine.snapshot`). A group
        whose oldest token is more than `max_staleness` versions behind this rollouter's
        version could never be delivered: its partial responses are dropped (counted in
        `restore_dropped` and `restore_dropped_tokens`) and its prompt restarts from scratch,
        so the prompt itself is not lost."""
        if self._run_started:
            raise RuntimeError("restore() must be called before run()")
        self._restore_queue.add(snapshot, self._gate.version, self._bound)

    def hold_new_prompts(self) -> None:
        """Admit no new prompt until `release_new_prompts()`; restored groups still go.

        For several rollouters resumed together: each holds its new prompts until every one
        has delivered its restored groups (`wait_restored_delivered`), so no replica's new
        group reaches the queue ahead of another's restored one, whose oldest tokens may be
        exactly `max_staleness` versions old and must be in the first batch."""
        self._restore_queue.hold()

    def release_new_prompts(self) -> None:
        """End `hold_new_prompts()`; the dispatch loop admits new prompts at once."""
        self._restore_queue.release()

    async def wait_restored_delivered(self) -> None:
        """Returns once no restored group (`restore`) is left to deliver: each was delivered,
        dropped or failed, or `run()` ended. At once when nothing was restored."""
        await self._restore_queue.settled.wait()

    def count_requeued(self, count: int) -> None:
        """Count `count` groups as delivered by this rollouter, before `run()`: a resumed run
        put finished groups of its checkpoint back on the queue ahead of this rollouter's
        (the app's share of them for this replica), and they take admission slots like its
        own deliveries. Without this, admission would run that many groups past the
        staleness budget and they would be dropped as too stale downstream. They are not in
        `stats().delivered` (this rollouter did not deliver them) but are in `budget`, and a
        downstream drop of one frees its slot (`on_downstream_drop`)."""
        if self._run_started:
            raise RuntimeError("count_requeued() must be called before run()")
        self._ledger.count_requeued(count)

    async def snapshot_in_flight(self, settle_timeout_s: float = 5.0) -> RolloutSnapshot:
        """Every admitted, not yet delivered group with its responses so far
        (`rollout_engine.snapshot`); the run goes on afterwards.

        Like a weight push (and serialized with them): admission stops, the engine is
        paused with mode "abort" so running requests hand back their tokens so far, and once
        no engine call is outstanding (at most `settle_timeout_s`; a call still outstanding
        then was sent into the paused engine and holds no token) the state is copied, the
        engine resumed and admission reopened at the same version. The aborted responses
        continue as after an abort-mode push (counted in `resumed`)."""
        async with self._gate.paused_engine("abort", False, self.on_weights, self._refresh_idle):
            try:
                await asyncio.wait_for(self._groups.wait_engine_quiet(), settle_timeout_s)
            except TimeoutError:
                logger.warning(
                    "snapshot: engine calls still outstanding after %.1f s; taken anyway",
                    settle_timeout_s,
                )
            snapshot = self._build_snapshot()
        logger.info(
            "snapshot of %d in-flight groups (%d tokens) at version %d",
            len(snapshot.groups),
            snapshot.generated_tokens,
            snapshot.version,
        )
        return snapshot

    def _build_snapshot(self) -> RolloutSnapshot:
        """The state now; no await, so it is one consistent moment."""
        seed = self._config.sampling.seed
        groups: list[GroupSnapshot] = []
        for task, job in self._in_flight.jobs():
            if task.done():  # delivered, dropped or failed: reaped soon, not in flight
                continue
            live = self._groups.responses_of(job.group_id)
            responses = live if live is not None else job.restored
            groups.append(
                GroupSnapshot(
                    group_id=job.group_id,
                    sample=job.sample,
                    admitted_version=job.version,
                    sampling_seed=seed,
                    responses=[ResponseSnapshot.of(r) for r in responses or ()],
                )
            )
        # Restored groups not admitted yet are still in flight from the checkpoint's view.
        waiting = [self._pending] if isinstance(self._pending, GroupSnapshot) else []
        groups.extend([*waiting, *self._restore_queue.waiting()])
        return RolloutSnapshot(
            version=self._gate.version,
            group_size=self._config.group_size,
            taken_at=time.time(),
            groups=groups,
        )

    async def update_weights(self, weights: Any, version: int) -> None:
        """Pause the engine (`pause_mode`, or "wait" without partial rollout), load the
        weights, resume it, then `on_weights(version)`.

        If loading fails, the engine is resumed with the old weights, the rollouter keeps
        its version and the error is raised. If `engine.resume()` fails, `on_weights` still
        runs (the rollouter never stays paused) with `version` when the weights were loaded
        (tokens the engine produces from now on come from them), then the resume error is
        raised: the caller decides whether a half-resumed engine is fatal; a dead engine
        fails every group, which ends `run()` with `RolloutFailed`."""
        config = self._config
        async with self._gate.paused_engine(
            config.push_pause_mode, config.clear_cache, self.on_weights, self._refresh_idle
        ) as resume:
            await self._engine.load_weights(weights, version)
            resume.version = version

    async def evaluate(
        self,
        prompts: Iterable[PromptSample],
        sampling: SamplingConfig | None = None,
        *,
        n: int = 1,
        reward_fn: RewardFn | None = None,
        max_concurrency: int = DEFAULT_EVAL_CONCURRENCY,
    ) -> EvalResult:
        """Decode held-out `prompts` (`n` responses each, `sampling`, default the training
        sampling) on this rollouter's engine and score them, beside the dispatch loop.

        A separate admission class (`rollout_engine.evaluation`): nothing here is admitted,
        delivered, put on the sink or counted in the staleness budget, the ledger, the pacing
        or `stats()`. Requests go through the weight gate like training's (a push pauses and
        continues them), rewards run in the same reward executor. `reward_fn` scores with
        another function (a held-out set of another task; single-turn); by default the
        rollouter's own (and its environment, for multi-turn). A group that fails is
        reported in the result, never raised. Safe to call while `run()` runs, or without
        it; concurrent evaluations are independent."""
        if n < 1 or max_concurrency < 1:
            raise ValueError(f"n and max_concurrency must be >= 1, got {n}, {max_concurrency}")
        self._evaluations += 1
        own = reward_fn is None
        runner = make_group_runner(
            self._engine,
            self._reward_fn if own else reward_fn,  # type: ignore[arg-type]
            group_size=n,
            sampling=sampling if sampling is not None else self._config.sampling,
            preprocessor=self._preprocessor,
            environment=self._environment if own else None,
            episode=self._episode if own else None,
            wait_until_resumed=self._gate.wait_live,
            on_resubmit=_not_counted,  # training's `resumed` counts training requests
            clock=self._clock,
            reward_executor=self._reward_executor,
        )

        async def run_group(job: GroupJob) -> list[Trajectory]:
            try:
                return await runner.run(job)
            finally:
                runner.forget(job.group_id)

        try:
            return await run_eval_groups(
                list(prompts),
                run_group,
                label=f"eval{self._evaluations}",
                version=self._gate.version,
                clock=self._clock,
                max_concurrency=max_concurrency,
            )
        finally:
            if isinstance(runner, EpisodeRunner):
                runner.close()

    def pause(self) -> None:
        """Stop admitting and hold aborted-request continuations until `on_weights()`.

        `update_weights` calls it; call it yourself if weights reach the engine another way.
        """
        self._gate.pause()
        self._refresh_idle()

    def on_weights(self, version: int) -> None:
        """The engine now serves `version`: reset the budget (it is computed from the
        version) and wake the dispatch loop at once. Call it after every weight push."""
        if self._state in ("draining", "paused"):
            self._resumed_at = self._clock()
        if self._gate.open(version):
            self._pacing.on_version(self._clock())
            self._stall.version_changed()
        self._refresh_idle()

    def on_downstream_drop(self, count: int = 1) -> None:
        """A consumer dropped `count` groups this rollouter delivered (too stale at
        consumption): their admission slots are freed, so generate-ahead does not shrink."""
        self._ledger.count_downstream_drop(count)
        self._gate.admitting.set()  # the budget may have reopened: re-check at once

    @property
    def lookahead(self) -> int:
        """Versions beyond the current one that admission may run ahead (pacing, <= k)."""
        return self._pacing.lookahead(self._bound.max_staleness)

    def stats(self) -> RolloutStats:
        """A snapshot; cheap and lock-free (safe to call while the loop waits)."""
        now = self._clock()
        counters = self._ledger.counters
        restore = self._restore_queue
        return RolloutStats(
            admitted=counters.admitted,
            delivered=counters.delivered,
            failed=counters.failed,
            dropped=counters.dropped,
            filtered=counters.filtered,
            in_flight=len(self._in_flight),
            version=self._gate.version,
            budget=self._budget(),
            state=self._state,
            trajectories=counters.trajectories,
            partial=counters.partial,
            resumed=counters.resumed,
            generated_tokens=counters.generated_tokens,
            elapsed_s=self._idle.elapsed(now),
            idle_s=self._idle.idle(now),
            drain_interrupt_ms=counters.last_drain_interrupt_ms,
            drain_interrupt_ms_max=counters.drain_interrupt_ms_max,
            staleness_mean=counters.staleness_mean,
            staleness_max=counters.staleness_max,
            downstream_dropped=self._ledger.downstream_dropped,
            lookahead=self.lookahead,
            failure_counts=dict(self._ledger.failure_counts),
            restored=restore.restored,
            restore_dropped=restore.dropped,
            restore_dropped_tokens=restore.dropped_tokens,
        )

    def metrics(self) -> dict[str, float]:
        """The rollouter's metrics under their interface names (see `rollout_engine.metrics`)."""
        stats = self.stats()
        elapsed = stats.elapsed_s
        return {
            "rollout/idle_ratio": stats.idle_s / elapsed if elapsed > 0 else 0.0,
            "rollout/active_tasks": float(stats.in_flight),
            "rollout/partial_ratio": self._ledger.counters.partial_ratio,
            "rollout/drain_interrupt_ms": stats.drain_interrupt_ms,
            "rollout/pacing_lookahead": float(stats.lookahead),
            "rollout/filtered_groups": float(stats.filtered),
            "staleness/mean": stats.staleness_mean,
            "staleness/max": float(stats.staleness_max),
            "tokens/s": stats.generated_tokens / elapsed if elapsed > 0 else 0.0,
        }

    # ------------------------------------------------------------------ dispatch loop

    async def _dispatch_until_exhausted(self) -> None:
        while not self._stop_requested.is_set():
            await self._reap_finished()
            if self._stop_requested.is_set():  # stop(), or reaping gave up (RolloutFailed)
                return
            if self._pending is None:
                self._pending = self._restore_queue.pop()
            if self._pending is None:
                self._pending = await self._fetch_prompt()
                if self._pending is None:
                    return  # prompts exhausted (or stop requested)
                continue
            blocker = self._admission_blocker()
            if blocker in (None, "concurrency"):
                self._end_drain_interrupt()
            if blocker is None:
                await self._dispatch(self._pending)
                self._pending = None
                self._note_restored_progress()  # a restored group restarted from scratch
            else:
                await self._wait_while_blocked(blocker)

    def _admission_blocker(self) -> _Blocker | None:
        if self._gate.paused:
            return "paused"
        if not self._config.generation_only and self._budget() <= 0:
            return "budget"
        if len(self._in_flight) >= self._config.max_concurrency:
            return "concurrency"
        new_prompt = not isinstance(self._pending, GroupSnapshot)
        if new_prompt and self._in_flight.restored_running():
            # Restored groups (a resume or a restart) finish before any new prompt starts:
            # their oldest tokens may be k versions old, so they must reach the queue ahead
            # of new groups or be dropped as too stale with every token they carry.
            return "concurrency"
        if new_prompt and self._restore_queue.holding:
            return "held"  # another rollouter's restored groups go first (hold_new_prompts)
        return None

    def _budget(self) -> int:
        return self._admission.budget(
            self._gate.version,
            self._ledger.consumed_slots,
            len(self._in_flight),
            lookahead=self.lookahead,
        )

    async def _wait_while_blocked(self, blocker: _Blocker) -> None:
        if blocker == "concurrency":
            self._set_state("saturated")
            await self._wait_first()
            return
        if blocker == "held":
            self._set_state("held")
            await self._wait_first(events=(self._restore_queue.new_prompts_allowed,))
            return
        # Paused or out of budget: the drain wait. It ends when any task finishes or when
        # on_weights() sets `admitting`, whichever is first; the state lock is not held.
        self._gate.admitting.clear()
        self._set_state("paused" if blocker == "paused" else "draining")
        budget = blocker == "budget"
        timeout = self._stall.seconds_left() if budget else None
        await self._wait_first(events=(self._gate.admitting,), at_most_s=timeout)
        if budget and self._state == "draining" and self._budget() <= 0:
            self._stall.warn_if_stalled(self._describe_stall)

    def _describe_stall(self) -> str:
        return (
            f"version {self._gate.version}, pacing {self._config.pacing!r}, lookahead "
            f"{self.lookahead} of max_staleness {self._bound.max_staleness}, "
            f"{self._ledger.counters.delivered} delivered, {len(self._in_flight)} in flight"
        )

    async def _wait_first(
        self,
        events: tuple[asyncio.Event, ...] = (),
        futures: tuple[asyncio.Future[Any], ...] = (),
        at_most_s: float | None = None,
    ) -> None:
        """Wait for the first of: an active task finishing, an event, a future, stop(), or
        `at_most_s` seconds."""
        waiters = [asyncio.ensure_future(e.wait()) for e in (*events, self._stop_requested)]
        try:
            await asyncio.wait(
                {*self._in_flight.tasks, *futures, *waiters},
                timeout=at_most_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        await self._reap_finished()

    async def _fetch_prompt(self) -> PromptSample | None:
        """The next prompt; finished tasks keep being reaped while the source is slow."""
        self._set_state("fetching")
        fetch = asyncio.ensure_future(self._prompts.next())
        try:
            while not fetch.done() and not self._stop_requested.is_set():
                await self._wait_first(futures=(fetch,))
        finally:
            if not fetch.done():
                fetch.cancel()
        if self._stop_requested.is_set() and not fetch.done():
            return None
        return await fetch

    async def _dispatch(self, item: PromptSample | GroupSnapshot) -> None:
        async with self._lock:
            if isinstance(item, GroupSnapshot):
                restored: tuple[PartialResponse, ...] | None = tuple(
                    r.to_partial() for r in item.responses
                )
                sample, group_id = item.sample, item.group_id
            else:
                restored, sample = None, item
                group_id = f"{sample.prompt_id}:{self._ledger.counters.admitted}"
            job = GroupJob(
                sample=sample,
                group_id=group_id,
                version=self._gate.version,
                admitted_wall=time.time(),
                admitted_at=self._clock(),
                restored=restored or None,
            )
            task = asyncio.create_task(self._run_group(job), name=f"rollout:{job.group_id}")
            self._in_flight.add(task, job)
            self._ledger.admitted()
            self._gate.admitting.set()
        self._set_state("admitting")

    def _end_drain_interrupt(self) -> None:
        """Record `rollout/drain_interrupt_ms`: on_weights() -> the loop is out of its drain
        wait and dispatches (or is limited only by max_concurrency, which is no drain)."""
        if self._resumed_at is not None:
            ms = (self._clock() - self._resumed_at) * 1e3
            self._ledger.counters.record_drain_interrupt(ms)
            self._resumed_at = None

    async def _wait_for_in_flight(self) -> None:
        while self._in_flight and not self._stop_requested.is_set():
            self._set_state("finishing")
            await self._wait_first()

    async def _cancel_in_flight(self) -> None:
        tasks = list(self._in_flight.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self._config.stop_timeout_s)
            if pending:
                await self._abandon(pending)
        await self._reap_finished()

    async def _abandon(self, tasks: set[asyncio.Task[GroupOutcome]]) -> None:
        """Give up on cancelled tasks that did not unwind within `stop_timeout_s`: count each
        as a failed (cancelled) group now and take it out of the in-flight set, so the books
        balance with `in_flight == 0`; each is left to end on its own."""
        timeout = self._config.stop_timeout_s
        async with self._lock:
            abandoned = self._in_flight.abandon(tasks)
            for job in abandoned:
                error = asyncio.CancelledError(f"stopped; did not unwind within {timeout} s")
                self._record_failure(job, error)
        if abandoned:
            logger.warning(
                "%d group tasks did not unwind within stop_timeout_s=%s after cancel; "
                "counted as failed and left to end on their own",
                len(abandoned),
                timeout,
            )
        self._refresh_idle()

    # ------------------------------------------------------------------ one group

    async def _run_group(self, job: GroupJob) -> GroupOutcome:
        try:
            return await self._run_group_inner(job)
        finally:
            self._groups.forget(job.group_id)

    async def _run_group_inner(self, job: GroupJob) -> GroupOutcome:
        trajectories = await self._groups.run(job)
        self._pacing.on_group_generated(self._clock() - job.admitted_at)
        outcome = self._outcome(job, trajectories)
        if not outcome.delivered:
            logger.info(
                "dropping group %s: staleness %d > max_staleness %d",
                job.group_id,
                max(outcome.staleness),
                self._bound.max_staleness,
            )
            return outcome
        if not self._filter.keep(trajectories):  # its slot is freed: a new prompt replaces it
            logger.debug("group %s filtered out (%s)", job.group_id, type(self._filter).__name__)
            return dataclasses.replace(outcome, delivered=False, filtered=True)
        await self._sink.put(trajectories)
        # The put may have waited across weight pushes: the metrics report the staleness of
        # what was delivered, at the version when the sink took it (see the module docstring).
        return dataclasses.replace(outcome, staleness=self._staleness(job, trajectories))

    def _staleness(self, job: GroupJob, trajectories: list[Trajectory]) -> tuple[int, ...]:
        version = self._gate.version
        return tuple(
            self._bound.staleness(version, t.generated_versions, job.version) for t in trajectories
        )

    def _outcome(self, job: GroupJob, trajectories: list[Trajectory]) -> GroupOutcome:
        """Staleness against the current version; `delivered=False` means drop."""
        staleness = self._staleness(job, trajectories)
        return GroupOutcome(
            delivered=not self._bound.too_stale(max(staleness, default=0)),
            staleness=staleness,
            generated_tokens=sum(t.num_generated for t in trajectories),
            partial=count_partial([t.generated_versions for t in trajectories]),
        )

    async def _count_resubmit(self) -> None:
        async with self._lock:
            self._ledger.counters.resumed += 1

    def _prompt_executor(self) -> Executor:
        if self._prompt_pool is None:
            self._prompt_pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="rollout-prompts"
            )
        return self._prompt_pool

    def _reward_executor(self) -> Executor:
        if self._reward_pool is None:
            self._reward_pool = ThreadPoolExecutor(
                max_workers=self._config.reward_workers, thread_name_prefix="rollout-reward"
            )
        return self._reward_pool

    # ------------------------------------------------------------------ accounting

    async def _reap_finished(self) -> None:
        """Take finished tasks out of the in-flight set and account for them."""
        if not self._in_flight.any_done():
            return
        async with self._lock:
            for task, job in self._in_flight.pop_done():
                self._ledger.account(task, job, stopping=self._stop_requested.is_set())
                self._stop_if_fatal()
        self._note_restored_progress()
        self._refresh_idle()

    def _record_failure(self, job: GroupJob, error: BaseException) -> None:
        self._ledger.record_failure(job, error, stopping=self._stop_requested.is_set())
        self._stop_if_fatal()

    def _stop_if_fatal(self) -> None:
        if self._ledger.fatal is not None:
            self._stop_requested.set()  # the loop ends; run() cancels the rest and raises

    def _note_restored_progress(self) -> None:
        self._restore_queue.note_progress(
            restored_pending=isinstance(self._pending, GroupSnapshot),
            restored_running=self._in_flight.restored_running(),
        )

    def _final_state(self) -> LoopState:
        if self._ledger.fatal is not None:
            return "failed"
        return "stopped" if self._stop_requested.is_set() else "finished"

    def _set_state(self, state: LoopState) -> None:
        self._state = state
        self._refresh_idle()

    def _refresh_idle(self) -> None:
        """Idle = a weight push holds us paused, or the budget is out and nothing is in flight."""
        out_of_budget = self._state == "draining" and not self._in_flight
        self._idle.set_idle(self._gate.paused or out_of_budget, self._clock())


async def _not_counted() -> None:
    return None


def _loop_time() -> float:
    """The running loop's time (virtual under a test loop clock); monotonic off the loop."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()

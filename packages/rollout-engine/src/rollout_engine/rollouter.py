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

Async rules (docs/architecture.md): counters and the task set are changed under
`asyncio.Lock` in short critical sections with no await inside; the lock is never held while
waiting on generation. "Admitting vs paused" is the weight gate's `asyncio.Event`
`admitting`: cleared by `pause()` (weight push) and when the budget is exhausted, set by
`on_weights()`. Weight pushes are serialized by a second lock that the dispatch loop never
takes.

Where the rest lives: the staleness budget and pacing in `admission`, one group's run,
staleness check and delivery in `delivery`, the books in `ledger`, weight pushes in
`weight_gate`, restore, hold, snapshots and the prompt stream's position in `resume`
(restored groups wait in `restore_queue`), the thread pools in `executors`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any

from rollout_engine._delegate import Delegate
from rollout_engine.admission import Admission, Blocker, PacingPolicy, StalenessBound
from rollout_engine.config import LoopState, RolloutConfig
from rollout_engine.delivery import GroupDelivery
from rollout_engine.episode import EnvironmentFactory, EpisodeConfig, EpisodeRunner
from rollout_engine.evaluation import EvalSetup, Evaluator
from rollout_engine.executors import RolloutExecutors
from rollout_engine.failures import RolloutFailed
from rollout_engine.group import GroupJob, GroupRunner
from rollout_engine.group_filter import GroupFilter, make_group_filter
from rollout_engine.in_flight import GroupTask, InFlightGroups
from rollout_engine.ledger import GroupLedger, is_cancellation
from rollout_engine.metrics import FailedGroup, IdleClock, RolloutStats, metric_values
from rollout_engine.prompt_source import PromptSource
from rollout_engine.resume import RolloutResume
from rollout_engine.runners import close_group_runner, make_group_runner
from rollout_engine.snapshot import GroupSnapshot
from rollout_engine.stall_watch import StallWatch
from rollout_engine.types import (
    GenerationEngine,
    MultiModalPreprocessor,
    PromptSample,
    RewardFn,
    TrajectorySink,
    WeightStaging,
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
        self._config = config = config if config is not None else RolloutConfig()
        self._bound = staleness_bound if staleness_bound is not None else config.staleness_bound
        self._clock = clock
        self._executors = RolloutExecutors(config.reward_workers)
        self._prompts = PromptSource(prompts, self._executors.prompts)
        self._gate = WeightGate(engine, engine.version)
        self._admission = Admission.for_config(config, self._bound, pacing, engine.version)
        self._ledger = GroupLedger.for_config(config, clock, on_failure)
        # Shared state; changed only under _lock, in critical sections without awaits.
        self._lock = asyncio.Lock()
        self._in_flight = InFlightGroups()
        self._stop_requested = asyncio.Event()
        self._pending: PromptSample | GroupSnapshot | None = None
        self._state: LoopState = "idle"
        self._resumed_at: float | None = None
        self._idle = IdleClock()
        self._run_started = False
        self._stall = StallWatch(config.stall_warning_s)
        # Evaluations reuse the reward path, preprocessor, multi-turn setup and weight gate.
        self._evaluator = Evaluator(
            EvalSetup(reward_fn, preprocessor, environment, episode),
            engine=engine,
            sampling=config.sampling,
            wait_until_resumed=self._gate.wait_live,
            version=lambda: self._gate.version,
            clock=clock,
            reward_executor=self._executors.rewards,
        )
        self._groups = self._make_runner(reward_fn, preprocessor, environment, episode)
        self._resume = self._make_resume(prompts)
        self._delivery = GroupDelivery(
            self._groups,
            sink,
            bound=self._bound,
            group_filter=group_filter or make_group_filter(config.filter_groups),
            version=lambda: self._gate.version,
            clock=clock,
            on_generated=self._admission.pacing.on_group_generated,
            on_stale=self._resume.give_back_stale if config.retry_stale else None,
        )

    def _make_runner(
        self,
        reward_fn: RewardFn,
        preprocessor: MultiModalPreprocessor | None,
        environment: EnvironmentFactory | None,
        episode: EpisodeConfig | None,
    ) -> GroupRunner | EpisodeRunner:
        return make_group_runner(
            self._engine,
            reward_fn,
            group_size=self._config.group_size,
            sampling=self._config.sampling,
            preprocessor=preprocessor,
            environment=environment,
            episode=episode,
            wait_until_resumed=self._gate.wait_live,
            on_resubmit=self._count_resubmit,
            clock=self._clock,
            reward_executor=self._executors.rewards,
        )

    def _make_resume(self, prompts: object) -> RolloutResume:
        return RolloutResume(
            prompts,
            group_size=self._config.group_size,
            sampling_seed=self._config.sampling.seed,
            bound=self._bound,
            gate=self._gate,
            ledger=self._ledger,
            in_flight=self._in_flight,
            runner=self._groups,
            pending=lambda: self._pending,
            started=lambda: self._run_started,
            on_weights=self.on_weights,
            refresh_idle=self._refresh_idle,
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
        self._resume.queue.settled.set()  # nothing restored is left to wait for
        self._set_state(self._final_state())
        self._idle.stop(self._clock())
        self._ledger.flush()
        self._executors.shutdown()
        close_group_runner(self._groups)

    async def stop(self) -> None:
        """Cancel every in-flight group (each becomes a failed group) and make `run()`
        return. Returns once the cancelled tasks have unwound, or after `stop_timeout_s`:
        a task still running then is counted as failed (cancelled) and leaves the active set
        (`in_flight` returns to 0); it is left to end on its own, and its exception is
        retrieved and logged at debug level when it does."""
        self._stop_requested.set()
        await self._cancel_in_flight()

    # Restore, hold and snapshot belong to `RolloutResume` (`rollout_engine.resume`).
    restore = Delegate("_resume", RolloutResume.restore)
    hold_new_prompts = Delegate("_resume", RolloutResume.hold_new_prompts)
    release_new_prompts = Delegate("_resume", RolloutResume.release_new_prompts)
    wait_restored_delivered = Delegate("_resume", RolloutResume.wait_restored_delivered)
    count_requeued = Delegate("_resume", RolloutResume.count_requeued)
    snapshot_in_flight = Delegate("_resume", RolloutResume.snapshot_in_flight)

    async def update_weights(self, weights: Any, version: int) -> None:
        """Pause the engine (`pause_mode`, or "wait" without partial rollout), load the
        weights, resume it, then `on_weights(version)`. An engine that is `WeightStaging`
        stages the weights first, while it still generates, so the pause is the load alone.

        If loading fails, the engine is resumed with the old weights, the rollouter keeps
        its version and the error is raised. If `engine.resume()` fails, `on_weights` still
        runs (the rollouter never stays paused) with `version` when the weights were loaded
        (tokens the engine produces from now on come from them), then the resume error is
        raised: the caller decides whether a half-resumed engine is fatal; a dead engine
        fails every group, which ends `run()` with `RolloutFailed`."""
        config = self._config
        staged = None
        if isinstance(self._engine, WeightStaging):
            # Written while the engine still generates: the pause covers the load alone.
            weights = staged = await self._engine.stage_weights(weights)
        try:
            async with self._gate.paused_engine(
                config.push_pause_mode, config.clear_cache, self.on_weights, self._refresh_idle
            ) as resume:
                await self._engine.load_weights(weights, version)
                resume.version = version
        finally:
            if staged is not None:  # a load consumed it; this frees it if the pause failed
                await asyncio.to_thread(staged.discard)

    evaluate = Delegate("_evaluator", Evaluator.evaluate)

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
            self._admission.pacing.on_version(self._clock())
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
        return self._admission.lookahead

    def stats(self) -> RolloutStats:
        """A snapshot; cheap and lock-free (safe to call while the loop waits)."""
        now = self._clock()
        restore = self._resume.queue
        return self._ledger.stats(
            in_flight=len(self._in_flight),
            version=self._gate.version,
            budget=self._budget(),
            state=self._state,
            lookahead=self.lookahead,
            elapsed_s=self._idle.elapsed(now),
            idle_s=self._idle.idle(now),
            restored=restore.restored,
            restore_dropped=restore.dropped,
            restore_dropped_tokens=restore.dropped_tokens,
        )

    def metrics(self) -> dict[str, float]:
        """The rollouter's metrics under their interface names (see `rollout_engine.metrics`)."""
        return {
            **metric_values(self.stats()),
            "rollout/stale_retried": float(self._resume.stale_retried),
        }

    # ------------------------------------------------------------------ dispatch loop

    async def _dispatch_until_exhausted(self) -> None:
        while not self._stop_requested.is_set():
            await self._reap_finished()
            if self._stop_requested.is_set():  # stop(), or reaping gave up (RolloutFailed)
                return
            if self._pending is None:
                self._pending = self._resume.queue.pop()
            if self._pending is None:
                self._pending = await self._next_prompt()
                if self._pending is not None:
                    continue
                if self._resume.exhausted and self._config.retry_stale and self._in_flight:
                    self._set_state("finishing")
                    await self._wait_first()  # a group still running may give its prompt back
                    continue
                return  # prompts exhausted (or stop requested)
            blocker = self._admission_blocker()
            if blocker in (None, "concurrency"):
                self._end_drain_interrupt()
            if blocker is None:
                await self._dispatch(self._pending)
                self._pending = None
                self._resume.note_progress()  # a restored group restarted from scratch
            else:
                await self._wait_while_blocked(blocker)

    async def _next_prompt(self) -> PromptSample | None:
        """A prompt given back as too stale, else the stream's next (None: exhausted or
        stopping)."""
        returned = self._resume.take_returned()
        if returned is not None or self._resume.exhausted:
            return returned
        sample = await self._fetch_prompt()
        self._resume.read(sample, stopping=self._stop_requested.is_set())
        return sample

    def _admission_blocker(self) -> Blocker | None:
        new_prompt = not isinstance(self._pending, GroupSnapshot)
        return self._admission.blocker(
            paused=self._gate.paused,
            version=self._gate.version,
            consumed=self._ledger.consumed_slots,
            in_flight=len(self._in_flight),
            restored_first=new_prompt and self._in_flight.restored_running(),
            held=new_prompt and self._resume.queue.holding,
        )

    def _budget(self) -> int:
        in_flight = len(self._in_flight)
        return self._admission.budget(self._gate.version, self._ledger.consumed_slots, in_flight)

    async def _wait_while_blocked(self, blocker: Blocker) -> None:
        if blocker == "concurrency":
            self._set_state("saturated")
            await self._wait_first()
            return
        if blocker == "held":
            self._set_state("held")
            await self._wait_first(events=(self._resume.queue.new_prompts_allowed,))
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
        `at_most_s` seconds; then reap."""
        events = (*events, self._stop_requested)
        await self._in_flight.wait_first(events, futures, at_most_s)
        await self._reap_finished()

    async def _fetch_prompt(self) -> PromptSample | None:
        """The next prompt; finished tasks keep being reaped while the source is slow."""
        self._set_state("fetching")
        fetch = asyncio.ensure_future(self._prompts.next())
        self._resume.reading(fetch)
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
            index, version = self._ledger.counters.admitted, self._gate.version
            job = GroupJob.admit(item, index=index, version=version, admitted_at=self._clock())
            task = asyncio.create_task(self._delivery.run(job), name=f"rollout:{job.group_id}")
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
        pending = await self._in_flight.cancel_all(self._config.stop_timeout_s)
        if pending:
            await self._abandon(pending)
        await self._reap_finished()

    async def _abandon(self, tasks: set[GroupTask]) -> None:
        """Give up on cancelled tasks that did not unwind within `stop_timeout_s`: count each
        as a failed (cancelled) group now and take it out of the in-flight set, so the books
        balance with `in_flight == 0`; each is left to end on its own."""
        async with self._lock:
            abandoned = self._in_flight.abandon(tasks)
            stopping = self._stop_requested.is_set()
            self._ledger.record_abandoned(abandoned, self._config.stop_timeout_s, stopping)
            self._stop_if_fatal()
        self._refresh_idle()

    async def _count_resubmit(self) -> None:
        async with self._lock:
            self._ledger.counters.resumed += 1

    # ------------------------------------------------------------------ accounting

    async def _reap_finished(self) -> None:
        """Take finished tasks out of the in-flight set and account for them."""
        if not self._in_flight.any_done():
            return
        async with self._lock:
            for task, job in self._in_flight.pop_done():
                self._ledger.account(task, job, stopping=self._stop_requested.is_set())
                self._stop_if_fatal()
        self._resume.note_progress()
        self._refresh_idle()

    def _stop_if_fatal(self) -> None:
        if self._ledger.fatal is not None:
            self._stop_requested.set()  # the loop ends; run() cancels the rest and raises

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

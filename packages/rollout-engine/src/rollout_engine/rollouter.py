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
from collections import Counter, deque
from collections.abc import AsyncIterable, Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from rollout_engine.admission import AdmissionPolicy, PacingName, PacingPolicy, make_pacing
from rollout_engine.continuation import PartialResponse
from rollout_engine.episode import EnvironmentFactory, EpisodeConfig, EpisodeRunner
from rollout_engine.failures import FailureStreak, RepeatedFailureLog, RolloutFailed
from rollout_engine.group import GroupJob, GroupRunner
from rollout_engine.metrics import (
    FailedSample,
    GroupOutcome,
    IdleClock,
    RolloutCounters,
    RolloutStats,
    count_partial,
)
from rollout_engine.snapshot import GroupSnapshot, ResponseSnapshot, RolloutSnapshot
from rollout_engine.types import (
    GenerationEngine,
    MultiModalPreprocessor,
    PauseMode,
    PromptSample,
    RewardFn,
    SamplingConfig,
    Trajectory,
    TrajectorySink,
)

__all__ = [
    "FailedSample",
    "LoopState",
    "RolloutConfig",
    "RolloutFailed",
    "RolloutStats",
    "Rollouter",
    "is_cancellation",
]

logger = logging.getLogger(__name__)

LoopState = Literal[
    "idle",
    "fetching",
    "admitting",
    "saturated",
    "held",
    "draining",
    "paused",
    "finishing",
    "stopped",
    "finished",
    "failed",
]
"""What the dispatch loop is doing now (`Rollouter.state`, `RolloutStats.state`).

- `"idle"`: `run()` has not started.
- `"fetching"`: waiting for the prompt source's next prompt (finished groups are still
  reaped meanwhile).
- `"admitting"`: a group was just dispatched; the loop goes round again at once.
- `"saturated"`: `max_concurrency` groups are in flight; waiting for one to finish.
- `"held"`: new prompts are held (`hold_new_prompts()`); waiting for
  `release_new_prompts()`. Restored groups are still admitted.
- `"draining"`: the staleness budget is exhausted; waiting for a group to finish or for
  `on_weights()` (which ends the wait at once).
- `"paused"`: a weight push is in progress (`pause()` was called); waiting for
  `on_weights()`.
- `"finishing"`: the prompts are exhausted; waiting for the last groups in flight.
- `"stopped"` (final): `stop()` was called; in-flight groups were cancelled.
- `"finished"` (final): every prompt was delivered, failed or dropped.
- `"failed"` (final): `max_consecutive_failures` groups failed in a row; `run()` raised
  `RolloutFailed`.
"""
_Blocker = Literal["paused", "budget", "concurrency", "held"]


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """How the rollouter admits, generates and syncs. Counts are groups (prompts).

    `samples_per_version = batch_size * sync_every` groups are consumed per weight version;
    at most `max_staleness = k` versions may separate a delivered response's oldest token
    from the rollouter's version. `partial_rollout=False` makes a weight push wait for every
    in-flight request (pause mode "wait"); otherwise requests are kept or aborted
    (`pause_mode`) and continue with the new weights.
    """

    group_size: int = 8
    max_concurrency: int = 16
    batch_size: int = 16
    sync_every: int = 1
    max_staleness: int = 2
    # "fresh": admit only as far ahead as keeps the consumer fed (fresher samples);
    # "eager": spend the whole staleness budget at once. See rollout_engine.admission.
    pacing: PacingName = "fresh"
    # Fresh pacing's relative head-room on the measured batch generation latency.
    pacing_margin: float = 0.25
    partial_rollout: bool = True
    pause_mode: Literal["keep", "abort"] = "keep"
    clear_cache: bool = True
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Threads that run the reward function (off the loop; a reward function marked
    # `blocking = False` runs on the loop instead).
    reward_workers: int = 1
    # How long stop() waits for cancelled tasks to unwind.
    stop_timeout_s: float = 10.0
    # Give up (run() raises RolloutFailed) after this many groups in a row failed: a dead
    # engine or a closed sink fails every group. A delivered group resets the count;
    # cancellations by stop() do not count.
    max_consecutive_failures: int = 32
    # How many recent FailedSamples `Rollouter.failures` keeps (counts per error type are
    # kept for the whole run; pass `on_failure` to see every one).
    recent_failures: int = 256

    def __post_init__(self) -> None:
        for name in (
            "group_size",
            "max_concurrency",
            "batch_size",
            "sync_every",
            "max_consecutive_failures",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.pacing not in ("eager", "fresh"):
            raise ValueError(f"pacing must be 'eager' or 'fresh', got {self.pacing!r}")
        if self.pacing_margin < 0:
            raise ValueError(f"pacing_margin must be >= 0, got {self.pacing_margin}")
        if self.recent_failures < 0:
            raise ValueError(f"recent_failures must be >= 0, got {self.recent_failures}")
        if self.pause_mode not in ("keep", "abort"):
            raise ValueError(f"pause_mode must be 'keep' or 'abort', got {self.pause_mode!r}")

    @property
    def samples_per_version(self) -> int:
        return self.batch_size * self.sync_every

    @property
    def push_pause_mode(self) -> PauseMode:
        """The engine pause mode used by `update_weights`."""
        return self.pause_mode if self.partial_rollout else "wait"


def is_cancellation(error: BaseException) -> bool:
    """`CancelledError`, or Ray's `TaskCancelledError` (matched by class name: no ray import)."""
    if isinstance(error, asyncio.CancelledError):
        return True
    return any(cls.__name__ == "TaskCancelledError" for cls in type(error).__mro__)


class _PromptSource:
    """Reads an iterable or async iterable of prompts one at a time.

    A list or tuple is read on the loop (indexing costs nothing). Any other sync iterable
    (a generator that tokenizes, a dataset) is advanced with `next()` in `executor` (one
    thread: iterators are not thread-safe, and one fetch runs at a time), so tokenizing
    prompts never blocks the loop. An async iterable is awaited.
    """

    def __init__(
        self,
        prompts: Iterable[PromptSample] | AsyncIterable[PromptSample],
        executor: Callable[[], Executor],
    ) -> None:
        self._async = aiter(prompts) if isinstance(prompts, AsyncIterable) else None
        self._sync = iter(prompts) if not isinstance(prompts, AsyncIterable) else None
        self._in_memory = isinstance(prompts, list | tuple)
        self._executor = executor

    async def next(self) -> PromptSample | None:
        """The next prompt, or None once the prompts are exhausted."""
        if self._sync is not None:
            if self._in_memory:
                return next(self._sync, None)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor(), next, self._sync, None)
        assert self._async is not None
        try:
            return await anext(self._async)
        except StopAsyncIteration:
            return None


class Rollouter:
    """Streams prompts to `engine`, puts each finished group of `group_size` trajectories
    into `sink`, under the staleness budget; see the module docstring for the loop.

    `reward_fn(sample, trajectory)` sets each trajectory's reward before delivery.
    `clock` (monotonic seconds) times the metrics and the pacing estimates.
    `pacing` overrides the policy named by `config.pacing` (any `PacingPolicy`).

    Multi-turn: with `environment` (a factory of one `Environment` per episode), each group
    member is an episode of up to `episode.max_turns` turns (see `rollout_engine.episode`);
    admission, staleness and partial rollout are the same as for single-turn groups.

    Failed groups: `failures` holds the last `config.recent_failures` `FailedSample`s and
    `failure_counts` the number per error type over the whole run. To keep every one (e.g.
    to append them to a `failures.jsonl`), pass `on_failure`: it is called with each
    `FailedSample` on the event loop, so it must not block (hand file writes to a thread);
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
        on_failure: Callable[[FailedSample], None] | None = None,
        environment: EnvironmentFactory | None = None,
        episode: EpisodeConfig | None = None,
    ) -> None:
        self._engine = engine
        self._sink = sink
        self._config = config = config if config is not None else RolloutConfig()
        self._clock = clock
        self._prompts = _PromptSource(prompts, self._prompt_executor)
        self._version = engine.version
        self._admission = AdmissionPolicy(
            config.max_staleness, config.samples_per_version, base_version=self._version
        )
        self._pacing = (
            pacing
            if pacing is not None
            else make_pacing(
                config.pacing,
                config.samples_per_version,
                config.max_concurrency,
                margin=config.pacing_margin,
            )
        )
        self._downstream_dropped = 0
        # Groups delivered on this rollouter's behalf before it ran (see `count_requeued`).
        self._requeued = 0
        # Shared state; changed only under _lock, in critical sections without awaits.
        self._lock = asyncio.Lock()
        self._active: set[asyncio.Task[GroupOutcome]] = set()
        self._jobs: dict[asyncio.Task[GroupOutcome], GroupJob] = {}
        # Tasks that ignored cancellation past stop_timeout_s: already counted as failed and
        # out of `_active`; referenced here until they end (see `_abandon`).
        self._abandoned: set[asyncio.Task[GroupOutcome]] = set()
        self._counters = RolloutCounters()
        self.failures: deque[FailedSample] = deque(maxlen=config.recent_failures)
        self._failure_counts: Counter[str] = Counter()
        self._on_failure = on_failure
        self._streak = FailureStreak(config.max_consecutive_failures)
        self._fatal: RolloutFailed | None = None  # set when the streak reaches its limit
        self._failure_log = RepeatedFailureLog(logger, clock)
        # Signals.
        self._running = asyncio.Event()  # set: admitting; clear: paused (push or budget)
        self._running.set()
        self._weights_live = asyncio.Event()  # clear while a weight push is in progress
        self._weights_live.set()
        self._stop_requested = asyncio.Event()
        self._weights_lock = asyncio.Lock()  # serializes update_weights
        self._sync_paused = False
        # Groups restored from a snapshot, admitted before any new prompt (see `restore`).
        self._restored: deque[GroupSnapshot] = deque()
        self._restore_counts = {"restored": 0, "restore_dropped": 0, "restore_dropped_tokens": 0}
        self._restored_settled = asyncio.Event()  # set: no restored group left to deliver
        self._restored_settled.set()
        self._new_prompts_allowed = asyncio.Event()  # clear: hold_new_prompts() is in force
        self._new_prompts_allowed.set()
        # Loop bookkeeping.
        self._pending: PromptSample | GroupSnapshot | None = None
        self._state: LoopState = "idle"
        self._resumed_at: float | None = None
        self._idle = IdleClock()
        self._run_started = False
        self._reward_pool: ThreadPoolExecutor | None = None
        self._prompt_pool: ThreadPoolExecutor | None = None
        self._groups: GroupRunner | EpisodeRunner = GroupRunner(
            engine,
            reward_fn,
            group_size=config.group_size,
            sampling=config.sampling,
            preprocessor=preprocessor,
            wait_until_resumed=self._weights_live.wait,
            on_resubmit=self._count_resubmit,
            clock=clock,
            reward_executor=self._reward_executor,
        )
        if environment is not None:
            self._groups = EpisodeRunner(
                engine,
                reward_fn,
                environment,
                config=episode if episode is not None else EpisodeConfig(),
                group_size=config.group_size,
                sampling=config.sampling,
                wait_until_resumed=self._weights_live.wait,
                on_resubmit=self._count_resubmit,
                clock=clock,
                reward_executor=self._reward_executor,
                preprocessor=preprocessor,
            )

    # ------------------------------------------------------------------ public API

    @property
    def config(self) -> RolloutConfig:
        return self._config

    @property
    def version(self) -> int:
        """The weight version the rollouter last heard of (`on_weights`)."""
        return self._version

    @property
    def state(self) -> LoopState:
        """What the dispatch loop is doing now; see `LoopState`."""
        return self._state

    @property
    def failure_counts(self) -> dict[str, int]:
        """Failed groups per error type name (e.g. `{"CancelledError": 4}`), whole run."""
        return dict(self._failure_counts)

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
        try:
            await self._dispatch_until_exhausted()
            await self._wait_for_in_flight()
        finally:
            await self._cancel_in_flight()
            self._restored_settled.set()  # nothing restored is left to wait for
            self._set_state(self._final_state())
            self._idle.stop(self._clock())
            self._failure_log.flush()
            for pool in (self._reward_pool, self._prompt_pool):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
            if isinstance(self._groups, EpisodeRunner):
                self._groups.close()  # its tool pool
        stats = self.stats()
        logger.info(
            "rollout %s: %d admitted, %d delivered, %d failed, %d dropped",
            stats.state,
            stats.admitted,
            stats.delivered,
            stats.failed,
            stats.dropped,
        )
        if self._fatal is not None:
            raise self._fatal
        return stats

    async def stop(self) -> None:
        """Cancel every in-flight group (each becomes a failed sample) and make `run()`
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
        if snapshot.group_size != self._config.group_size:
            raise ValueError(
                f"snapshot of groups of {snapshot.group_size} responses, "
                f"this rollouter makes {self._config.group_size}"
            )
        for group in snapshot.groups:  # all checked before any is queued
            if group.responses and len(group.responses) != self._config.group_size:
                raise ValueError(
                    f"group {group.group_id}: {len(group.responses)} responses, "
                    f"expected {self._config.group_size}"
                )
        for group in snapshot.groups:
            oldest = group.min_version
            staleness = self._version - oldest if oldest is not None else 0
            if self._admission.too_stale(staleness):
                logger.info(
                    "restored group %s: partials dropped (staleness %d > max_staleness %d); "
                    "its prompt restarts",
                    group.group_id,
                    staleness,
                    self._config.max_staleness,
                )
                self._restore_counts["restore_dropped"] += 1
                self._restore_counts["restore_dropped_tokens"] += group.generated_tokens
                group = msgspec.structs.replace(group, responses=[])
            self._restored.append(group)
            self._restore_counts["restored"] += 1
            self._restored_settled.clear()

    def hold_new_prompts(self) -> None:
        """Admit no new prompt until `release_new_prompts()`; restored groups still go.

        For several rollouters resumed together: each holds its new prompts until every one
        has delivered its restored groups (`wait_restored_delivered`), so no replica's new
        group reaches the queue ahead of another's restored one, whose oldest tokens may be
        exactly `max_staleness` versions old and must be in the first batch."""
        self._new_prompts_allowed.clear()

    def release_new_prompts(self) -> None:
        """End `hold_new_prompts()`; the dispatch loop admits new prompts at once."""
        self._new_prompts_allowed.set()

    async def wait_restored_delivered(self) -> None:
        """Returns once no restored group (`restore`) is left to deliver: each was delivered,
        dropped or failed, or `run()` ended. At once when nothing was restored."""
        await self._restored_settled.wait()

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
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self._requeued += count

    async def snapshot_in_flight(self, settle_timeout_s: float = 5.0) -> RolloutSnapshot:
        """Every admitted, not yet delivered group with its responses so far
        (`rollout_engine.snapshot`); the run goes on afterwards.

        Like a weight push (and serialized with them): admission stops, the engine is
        paused with mode "abort" so running requests hand back their tokens so far, and once
        no engine call is outstanding (at most `settle_timeout_s`; a call still outstanding
        then was sent into the paused engine and holds no token) the state is copied, the
        engine resumed and admission reopened at the same version. The aborted responses
        continue as after an abort-mode push (counted in `resumed`)."""
        async with self._weights_lock:
            self.pause()
            try:
                await self._engine.pause(mode="abort", clear_cache=False)
                try:
                    await asyncio.wait_for(self._groups.wait_engine_quiet(), settle_timeout_s)
                except TimeoutError:
                    logger.warning(
                        "snapshot: engine calls still outstanding after %.1f s; taken anyway",
                        settle_timeout_s,
                    )
                snapshot = self._build_snapshot()
            finally:
                try:
                    await self._engine.resume()
                finally:
                    self.on_weights(self._version)
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
        for task, job in self._jobs.items():
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
        groups.extend([*waiting, *self._restored])
        return RolloutSnapshot(
            version=self._version,
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
        async with self._weights_lock:
            self.pause()
            loaded = False
            try:
                await self._engine.pause(
                    mode=self._config.push_pause_mode, clear_cache=self._config.clear_cache
                )
                await self._engine.load_weights(weights, version)
                loaded = True
            finally:
                try:
                    await self._engine.resume()
                finally:
                    self.on_weights(version if loaded else self._version)

    def pause(self) -> None:
        """Stop admitting and hold aborted-request continuations until `on_weights()`.

        `update_weights` calls it; call it yourself if weights reach the engine another way.
        """
        self._sync_paused = True
        self._running.clear()
        self._weights_live.clear()
        self._refresh_idle()

    def on_weights(self, version: int) -> None:
        """The engine now serves `version`: reset the budget (it is computed from the
        version) and wake the dispatch loop at once. Call it after every weight push."""
        if version < self._version:
            logger.warning("weight version went backwards: %d -> %d", self._version, version)
        if version > self._version:
            self._pacing.on_version(self._clock())
        if self._state in ("draining", "paused"):
            self._resumed_at = self._clock()
        self._version = version
        self._sync_paused = False
        self._weights_live.set()
        self._running.set()
        self._refresh_idle()

    def on_downstream_drop(self, count: int = 1) -> None:
        """A consumer dropped `count` groups this rollouter delivered (too stale at
        consumption): their admission slots are freed, so generate-ahead does not shrink."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self._downstream_dropped = min(
            self._downstream_dropped + count, self._counters.delivered + self._requeued
        )
        self._running.set()  # the budget may have reopened: re-check at once

    @property
    def lookahead(self) -> int:
        """Versions beyond the current one that admission may run ahead (pacing, <= k)."""
        return self._pacing.lookahead(self._config.max_staleness)

    def stats(self) -> RolloutStats:
        """A snapshot; cheap and lock-free (safe to call while the loop waits)."""
        now = self._clock()
        counters = self._counters
        return RolloutStats(
            admitted=counters.admitted,
            delivered=counters.delivered,
            failed=counters.failed,
            dropped=counters.dropped,
            in_flight=len(self._active),
            version=self._version,
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
            downstream_dropped=self._downstream_dropped,
            lookahead=self.lookahead,
            failure_counts=dict(self._failure_counts),
            restored=self._restore_counts["restored"],
            restore_dropped=self._restore_counts["restore_dropped"],
            restore_dropped_tokens=self._restore_counts["restore_dropped_tokens"],
        )

    def metrics(self) -> dict[str, float]:
        """The rollouter's metrics under design.md's names (see `rollout_engine.metrics`)."""
        stats = self.stats()
        elapsed = stats.elapsed_s
        return {
            "rollout/idle_ratio": stats.idle_s / elapsed if elapsed > 0 else 0.0,
            "rollout/active_tasks": float(stats.in_flight),
            "rollout/partial_ratio": self._counters.partial_ratio,
            "rollout/drain_interrupt_ms": stats.drain_interrupt_ms,
            "rollout/pacing_lookahead": float(stats.lookahead),
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
            if self._pending is None and self._restored:
                self._pending = self._restored.popleft()
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
        if self._sync_paused:
            return "paused"
        if self._budget() <= 0:
            return "budget"
        if len(self._active) >= self._config.max_concurrency:
            return "concurrency"
        if not isinstance(self._pending, GroupSnapshot) and any(
            job.restored for job in self._jobs.values()
        ):
            # Restored groups (a resume or a restart) finish before any new prompt starts:
            # their oldest tokens may be k versions old, so they must reach the queue ahead
            # of new groups or be dropped as too stale with every token they carry.
            return "concurrency"
        if not isinstance(self._pending, GroupSnapshot) and not self._new_prompts_allowed.is_set():
            return "held"  # another rollouter's restored groups go first (hold_new_prompts)
        return None

    def _budget(self) -> int:
        return self._admission.budget(
            self._version,
            self._counters.delivered + self._requeued - self._downstream_dropped,
            len(self._active),
            lookahead=self.lookahead,
        )

    async def _wait_while_blocked(self, blocker: _Blocker) -> None:
        if blocker == "concurrency":
            self._set_state("saturated")
            await self._wait_first()
            return
        if blocker == "held":
            self._set_state("held")
            await self._wait_first(events=(self._new_prompts_allowed,))
            return
        # Paused or out of budget: the drain wait. It ends when any task finishes or when
        # on_weights() sets `_running`, whichever is first; the state lock is not held.
        self._running.clear()
        self._set_state("paused" if blocker == "paused" else "draining")
        await self._wait_first(events=(self._running,))

    async def _wait_first(
        self,
        events: tuple[asyncio.Event, ...] = (),
        futures: tuple[asyncio.Future[Any], ...] = (),
    ) -> None:
        """Wait for the first of: an active task finishing, an event, a future, stop()."""
        waiters = [asyncio.ensure_future(e.wait()) for e in (*events, self._stop_requested)]
        try:
            await asyncio.wait(
                {*self._active, *futures, *waiters}, return_when=asyncio.FIRST_COMPLETED
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
                group_id = f"{sample.prompt_id}:{self._counters.admitted}"
            job = GroupJob(
                sample=sample,
                group_id=group_id,
                version=self._version,
                admitted_wall=time.time(),
                admitted_at=self._clock(),
                restored=restored or None,
            )
            task = asyncio.create_task(self._run_group(job), name=f"rollout:{job.group_id}")
            self._active.add(task)
            self._jobs[task] = job
            self._counters.admitted += 1
            self._running.set()
        self._set_state("admitting")

    def _end_drain_interrupt(self) -> None:
        """Record `rollout/drain_interrupt_ms`: on_weights() -> the loop is out of its drain
        wait and dispatches (or is limited only by max_concurrency, which is no drain)."""
        if self._resumed_at is not None:
            self._counters.record_drain_interrupt((self._clock() - self._resumed_at) * 1e3)
            self._resumed_at = None

    async def _wait_for_in_flight(self) -> None:
        while self._active and not self._stop_requested.is_set():
            self._set_state("finishing")
            await self._wait_first()

    async def _cancel_in_flight(self) -> None:
        tasks = list(self._active)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self._config.stop_timeout_s)
            if pending:
                await self._abandon(pending)
        await self._reap_finished()

    async def _abandon(self, tasks: set[asyncio.Task[GroupOutcome]]) -> None:
        """Give up on cancelled tasks that did not unwind within `stop_timeout_s`: count each
        as a failed (cancelled) group now and take it out of `_active`, so the books balance
        with `in_flight == 0`. A done-callback retrieves its exception when it finally ends
        (no "Task exception was never retrieved"); `_abandoned` keeps it referenced."""
        timeout = self._config.stop_timeout_s
        abandoned = 0
        async with self._lock:
            for task in tasks:
                if task.done() or task not in self._active:
                    continue  # finished meanwhile (reaped as usual) or already abandoned
                self._active.discard(task)
                job = self._jobs.pop(task)
                self._abandoned.add(task)
                task.add_done_callback(self._abandoned_task_done)
                error = asyncio.CancelledError(f"stopped; did not unwind within {timeout} s")
                self._record_failure(job, error)
                abandoned += 1
        if abandoned:
            logger.warning(
                "%d group tasks did not unwind within stop_timeout_s=%s after cancel; "
                "counted as failed and left to end on their own",
                abandoned,
                timeout,
            )
        self._refresh_idle()

    def _abandoned_task_done(self, task: asyncio.Task[GroupOutcome]) -> None:
        self._abandoned.discard(task)
        if task.cancelled():
            return
        error = task.exception()  # retrieved: never "Task exception was never retrieved"
        if error is None:
            logger.warning(
                "group task %s ended normally after it was counted as failed at stop",
                task.get_name(),
            )
        else:
            logger.debug("abandoned group task %s ended with %r", task.get_name(), error)

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
                self._config.max_staleness,
            )
            return outcome
        await self._sink.put(trajectories)
        # The put may have waited across weight pushes: the metrics report the staleness of
        # what was delivered, at the version when the sink took it (see the module docstring).
        return dataclasses.replace(outcome, staleness=self._staleness(job, trajectories))

    def _staleness(self, job: GroupJob, trajectories: list[Trajectory]) -> tuple[int, ...]:
        return tuple(
            self._admission.staleness(self._version, t.generated_versions, job.version)
            for t in trajectories
        )

    def _outcome(self, job: GroupJob, trajectories: list[Trajectory]) -> GroupOutcome:
        """Staleness against the current version; `delivered=False` means drop."""
        staleness = self._staleness(job, trajectories)
        return GroupOutcome(
            delivered=not self._admission.too_stale(max(staleness, default=0)),
            staleness=staleness,
            generated_tokens=sum(t.num_generated for t in trajectories),
            partial=count_partial([t.generated_versions for t in trajectories]),
        )

    async def _count_resubmit(self) -> None:
        async with self._lock:
            self._counters.resumed += 1

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
        """Remove finished tasks from `_active` (the same set object) and account for them."""
        if not any(task.done() for task in self._active):
            return
        async with self._lock:
            for task in [task for task in self._active if task.done()]:
                self._active.discard(task)
                self._account(task, self._jobs.pop(task))
        self._note_restored_progress()
        self._refresh_idle()

    def _note_restored_progress(self) -> None:
        """Set `_restored_settled` once no restored group waits, runs or is pending."""
        if (
            not self._restored
            and not isinstance(self._pending, GroupSnapshot)
            and not any(job.restored for job in self._jobs.values())
        ):
            self._restored_settled.set()

    def _account(self, task: asyncio.Task[GroupOutcome], job: GroupJob) -> None:
        if task.cancelled():
            reason = "stopped" if self._stop_requested.is_set() else "group task cancelled"
            self._record_failure(job, asyncio.CancelledError(reason))
            return
        error = task.exception()
        if error is not None:
            self._record_failure(job, error)
            return
        outcome = task.result()
        self._counters.record(outcome)
        if outcome.delivered:  # a dropped (too stale) group neither resets nor counts
            self._streak.success()

    def _record_failure(self, job: GroupJob, error: BaseException) -> None:
        failure = FailedSample(
            prompt_id=job.sample.prompt_id,
            group_id=job.group_id,
            error_type=type(error).__name__,
            message=str(error) or repr(error),
            cancelled=is_cancellation(error),
            version=job.version,
        )
        self._counters.failed += 1
        self.failures.append(failure)
        self._failure_counts[failure.error_type] += 1
        if self._on_failure is not None:
            try:
                self._on_failure(failure)
            except Exception:
                logger.exception("on_failure callback raised; ignored")
        stopping = self._stop_requested.is_set()
        self._failure_log.log(
            logging.DEBUG if stopping else logging.WARNING,
            job.group_id,
            failure.error_type,
            failure.message,
            exc_info=None if failure.cancelled else error,
        )
        if stopping:  # cancellations by stop() (or after giving up) are not a streak
            return
        fatal = self._streak.failure(error)
        if fatal is not None:
            logger.error("giving up: %s", fatal)
            self._fatal = fatal
            self._stop_requested.set()  # the loop ends; run() cancels the rest and raises

    def _final_state(self) -> LoopState:
        if self._fatal is not None:
            return "failed"
        return "stopped" if self._stop_requested.is_set() else "finished"

    def _set_state(self, state: LoopState) -> None:
        self._state = state
        self._refresh_idle()

    def _refresh_idle(self) -> None:
        """Idle = a weight push holds us paused, or the budget is out and nothing is in flight."""
        out_of_budget = self._state == "draining" and not self._active
        self._idle.set_idle(self._sync_paused or out_of_budget, self._clock())

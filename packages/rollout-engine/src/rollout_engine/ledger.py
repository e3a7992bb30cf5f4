"""The group ledger: what happened to every admitted group, and why groups failed.

`GroupLedger` counts groups admitted, delivered, failed and dropped (too stale at delivery)
with the response-level figures behind the metrics (`RolloutCounters`), keeps the recent
`FailedGroup`s and the failure counts per error type, the give-up streak, and the groups
counted on the rollouter's behalf (`requeued`) or taken back by the consumer
(`downstream_dropped`). Mutated only by the rollouter, under its state lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Protocol

from rollout_engine.failures import FailureStreak, RepeatedFailureLog, RolloutFailed
from rollout_engine.group import GroupJob
from rollout_engine.metrics import FailedGroup, GroupOutcome, RolloutCounters, RolloutStats

__all__ = ["GroupLedger", "is_cancellation"]

logger = logging.getLogger(__name__)


class _LedgerConfig(Protocol):
    @property
    def recent_failures(self) -> int: ...

    @property
    def max_consecutive_failures(self) -> int: ...


def is_cancellation(error: BaseException) -> bool:
    """`CancelledError`, or Ray's `TaskCancelledError` (matched by class name: no ray import)."""
    if isinstance(error, asyncio.CancelledError):
        return True
    return any(cls.__name__ == "TaskCancelledError" for cls in type(error).__mro__)


class GroupLedger:
    """Counts per group outcome, the failure record and the give-up rule."""

    def __init__(
        self,
        *,
        recent_failures: int,
        max_consecutive_failures: int,
        clock: Callable[[], float],
        on_failure: Callable[[FailedGroup], None] | None = None,
    ) -> None:
        self.counters = RolloutCounters()
        self.failures: deque[FailedGroup] = deque(maxlen=recent_failures)
        self.failure_counts: Counter[str] = Counter()
        self._on_failure = on_failure
        self._streak = FailureStreak(max_consecutive_failures)
        self._failure_log = RepeatedFailureLog(logger, clock)
        self.fatal: RolloutFailed | None = None  # set when the streak reaches its limit
        self.downstream_dropped = 0
        self.requeued = 0  # delivered on this rollouter's behalf before it ran

    @classmethod
    def for_config(
        cls,
        config: _LedgerConfig,
        clock: Callable[[], float],
        on_failure: Callable[[FailedGroup], None] | None,
    ) -> GroupLedger:
        return cls(
            recent_failures=config.recent_failures,
            max_consecutive_failures=config.max_consecutive_failures,
            clock=clock,
            on_failure=on_failure,
        )

    @property
    def consumed_slots(self) -> int:
        """Groups holding an admission slot that are no longer in flight."""
        return self.counters.delivered + self.requeued - self.downstream_dropped

    def admitted(self) -> None:
        self.counters.admitted += 1

    def account(self, task: asyncio.Task[GroupOutcome], job: GroupJob, stopping: bool) -> None:
        """Record a finished group task: delivered, dropped or failed."""
        if task.cancelled():
            reason = "stopped" if stopping else "group task cancelled"
            self.record_failure(job, asyncio.CancelledError(reason), stopping)
            return
        error = task.exception()
        if error is not None:
            self.record_failure(job, error, stopping)
            return
        outcome = task.result()
        self.counters.record(outcome)
        if outcome.delivered or outcome.filtered:  # generated fine; a too stale one is neither
            self._streak.success()

    def record_failure(self, job: GroupJob, error: BaseException, stopping: bool) -> None:
        """Count a failed group; sets `fatal` once the streak reaches its limit."""
        failure = FailedGroup(
            prompt_id=job.sample.prompt_id,
            group_id=job.group_id,
            error_type=type(error).__name__,
            message=str(error) or repr(error),
            cancelled=is_cancellation(error),
            version=job.version,
        )
        self.counters.failed += 1
        self.failures.append(failure)
        self.failure_counts[failure.error_type] += 1
        if self._on_failure is not None:
            try:
                self._on_failure(failure)
            except Exception:
                logger.exception("on_failure callback raised; ignored")
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
            self.fatal = fatal

    def record_abandoned(self, jobs: Iterable[GroupJob], timeout_s: float, stopping: bool) -> None:
        """Count groups whose cancelled tasks did not unwind within `timeout_s` as failed
        (cancelled); their tasks are left to end on their own."""
        abandoned = 0
        for job in jobs:
            error = asyncio.CancelledError(f"stopped; did not unwind within {timeout_s} s")
            self.record_failure(job, error, stopping)
            abandoned += 1
        if abandoned:
            logger.warning(
                "%d group tasks did not unwind within stop_timeout_s=%s after cancel; "
                "counted as failed and left to end on their own",
                abandoned,
                timeout_s,
            )

    def stats(
        self,
        *,
        in_flight: int,
        version: int,
        budget: int,
        state: str,
        lookahead: int,
        elapsed_s: float,
        idle_s: float,
        restored: int,
        restore_dropped: int,
        restore_dropped_tokens: int,
    ) -> RolloutStats:
        """The books as `RolloutStats`, with the figures of the moment that the rollouter
        owns (passed in)."""
        counters = self.counters
        return RolloutStats(
            admitted=counters.admitted,
            delivered=counters.delivered,
            failed=counters.failed,
            dropped=counters.dropped,
            filtered=counters.filtered,
            in_flight=in_flight,
            version=version,
            budget=budget,
            state=state,
            trajectories=counters.trajectories,
            partial=counters.partial,
            resumed=counters.resumed,
            generated_tokens=counters.generated_tokens,
            elapsed_s=elapsed_s,
            idle_s=idle_s,
            drain_interrupt_ms=counters.last_drain_interrupt_ms,
            drain_interrupt_ms_max=counters.drain_interrupt_ms_max,
            staleness_mean=counters.staleness_mean,
            staleness_max=counters.staleness_max,
            downstream_dropped=self.downstream_dropped,
            lookahead=lookahead,
            failure_counts=dict(self.failure_counts),
            restored=restored,
            restore_dropped=restore_dropped,
            restore_dropped_tokens=restore_dropped_tokens,
            generated_reward_sum=counters.generated_reward_sum,
            generated_responses=counters.generated_responses,
        )

    def count_requeued(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.requeued += count

    def count_downstream_drop(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.downstream_dropped = min(
            self.downstream_dropped + count, self.counters.delivered + self.requeued
        )

    def flush(self) -> None:
        """Log the repeat counts of failures not summarized yet (end of the run)."""
        self._failure_log.flush()

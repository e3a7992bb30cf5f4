"""Counters, idle-time accounting and the metric names of the rollouter.

Metric names are part of the interface:

- `rollout/idle_ratio`: idle seconds / run seconds, where the rollouter is idle while a weight
  push holds it paused (from `pause()` to `on_weights()`: nothing generates new tokens for
  us) and while the admission budget is exhausted with no group in flight. Summed over all
  such windows.
- `rollout/active_tasks`: groups in flight now.
- `rollout/partial_ratio`: delivered responses whose tokens come from more than one weight
  version (generated across a push, in keep or abort mode) / delivered responses.
- `rollout/drain_interrupt_ms`: the last measured time from `on_weights()` (while the loop
  was blocked on a pause or the budget) to the loop dispatching its next group.
- `rollout/pacing_lookahead`: versions beyond the current one that admission may run ahead
  now (the pacing policy's choice; at most `max_staleness`).
- `staleness/mean`, `staleness/max`: `v_now - min(token versions)` of delivered responses,
  over the whole run, with `v_now` the version when the sink's `put` returned. The drop
  check (`> max_staleness`) runs just before the put; a put that waits across weight pushes
  (a full queue) delivers a staler group, and `staleness/max` then reports more than `k`.
- `rollout/filtered_groups`: groups dropped by the group filter (dynamic sampling) so far.
- `rollout/stale_retried`: groups dropped as too stale at delivery whose prompt was admitted
  again (`RolloutConfig.retry_stale`) so far.
- `rollout/generated_reward_sum`, `rollout/generated_responses`: the rewards of every
  response generated so far, whatever became of its group (delivered, filtered out, or too
  stale), and how many: the policy's reward as it samples, which a group filter does not
  bias (the trained batch's `reward/mean` leaves filtered groups out). Cumulative, so a
  reader takes the mean of any interval from two readings.
- `tokens/s`: tokens generated (delivered and dropped groups) / run seconds.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "DRAIN_INTERRUPT_WINDOW",
    "METRIC_NAMES",
    "STATS_SCHEMA_VERSION",
    "FailedGroup",
    "GroupOutcome",
    "IdleClock",
    "RolloutCounters",
    "RolloutStats",
    "count_partial",
    "metric_values",
]

# 2: `FailedGroup.sample_id` became `prompt_id` (it always held the prompt's id).
STATS_SCHEMA_VERSION = 2

# How many recent drain-interrupt latencies the counters keep (the max is kept over the run).
DRAIN_INTERRUPT_WINDOW = 1024

METRIC_NAMES = (
    "rollout/idle_ratio",
    "rollout/active_tasks",
    "rollout/partial_ratio",
    "rollout/drain_interrupt_ms",
    "rollout/pacing_lookahead",
    "rollout/filtered_groups",
    "rollout/stale_retried",
    "rollout/generated_reward_sum",
    "rollout/generated_responses",
    "staleness/mean",
    "staleness/max",
    "tokens/s",
)


class FailedGroup(msgspec.Struct, kw_only=True):
    """A group that never reached the sink because its task raised (or was cancelled).

    Formerly `FailedSample` (the name still imports, with a `DeprecationWarning`)."""

    schema_version: int = STATS_SCHEMA_VERSION
    prompt_id: str  # PromptSample.prompt_id of the failed group
    group_id: str
    error_type: str
    message: str
    cancelled: bool  # CancelledError or Ray's TaskCancelledError
    version: int  # rollouter version when the group was admitted


class RolloutStats(msgspec.Struct, kw_only=True):
    """A snapshot of the rollouter. Counts are groups unless named otherwise.

    Invariant at every snapshot:
    `admitted == delivered + failed + dropped + filtered + in_flight`.
    """

    schema_version: int = STATS_SCHEMA_VERSION
    admitted: int = 0
    delivered: int = 0
    failed: int = 0
    dropped: int = 0  # too stale at delivery (see admission.py)
    filtered: int = 0  # rejected by the group filter (dynamic sampling; group_filter.py)
    in_flight: int = 0
    version: int = 0
    budget: int = 0
    state: str = "idle"
    trajectories: int = 0  # delivered responses
    partial: int = 0  # delivered responses spanning more than one weight version
    resumed: int = 0  # continuation requests sent after an abort
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    idle_s: float = 0.0
    drain_interrupt_ms: float = 0.0
    drain_interrupt_ms_max: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    downstream_dropped: int = 0  # delivered, then dropped by the consumer (on_downstream_drop)
    lookahead: int = 0  # pacing: versions admission may run ahead now (<= max_staleness)
    failure_counts: dict[str, int] = {}  # failed groups by error type name, whole run
    restored: int = 0  # groups restored from a snapshot and queued for admission
    restore_dropped: int = 0  # restored groups whose partials were too stale (prompt restarts)
    restore_dropped_tokens: int = 0  # tokens of those dropped partials
    generated_reward_sum: float = 0.0  # rewards of every generated response, any outcome
    generated_responses: int = 0  # how many responses that sum covers


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """What a finished group task reports back to the loop."""

    delivered: bool
    staleness: tuple[int, ...]  # per response; when the sink's put returned, if delivered
    generated_tokens: int
    partial: int
    filtered: bool = False  # generated, not too stale, rejected by the group filter
    reward_sum: float = 0.0  # the rewards of its responses, whatever its outcome


class IdleClock:
    """Sums the time spent in idle windows, given the idle state at each transition."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._stopped: float | None = None
        self._idle_since: float | None = None
        self._idle_total = 0.0

    def start(self, now: float) -> None:
        self._started = now

    def stop(self, now: float) -> None:
        self.set_idle(False, now)
        self._stopped = now

    def set_idle(self, idle: bool, now: float) -> None:
        if self._started is None or self._stopped is not None:
            return
        if idle and self._idle_since is None:
            self._idle_since = now
        elif not idle and self._idle_since is not None:
            self._idle_total += now - self._idle_since
            self._idle_since = None

    def elapsed(self, now: float) -> float:
        if self._started is None:
            return 0.0
        end = self._stopped if self._stopped is not None else now
        return max(0.0, end - self._started)

    def idle(self, now: float) -> float:
        running = now - self._idle_since if self._idle_since is not None else 0.0
        return self._idle_total + running


@dataclass
class RolloutCounters:
    """Cumulative counts; mutated only by the rollouter under its state lock.

    Nothing here grows with the run: `drain_interrupts_ms` is a window of the last
    `DRAIN_INTERRUPT_WINDOW` values; the run's max is kept in `drain_interrupt_ms_max`.
    """

    admitted: int = 0
    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    filtered: int = 0
    trajectories: int = 0
    partial: int = 0
    resumed: int = 0
    generated_tokens: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    generated_reward_sum: float = 0.0
    generated_responses: int = 0
    drain_interrupts_ms: deque[float] = field(
        default_factory=lambda: deque(maxlen=DRAIN_INTERRUPT_WINDOW)
    )
    drain_interrupt_ms_max: float = 0.0

    def record_drain_interrupt(self, ms: float) -> None:
        self.drain_interrupts_ms.append(ms)
        self.drain_interrupt_ms_max = max(self.drain_interrupt_ms_max, ms)

    def record(self, outcome: GroupOutcome) -> None:
        self.generated_tokens += outcome.generated_tokens
        self.generated_reward_sum += outcome.reward_sum
        self.generated_responses += len(outcome.staleness)
        if outcome.filtered:
            self.filtered += 1
            return
        if not outcome.delivered:
            self.dropped += 1
            return
        self.delivered += 1
        self.trajectories += len(outcome.staleness)
        self.partial += outcome.partial
        self.staleness_sum += sum(outcome.staleness)
        self.staleness_max = max(self.staleness_max, *outcome.staleness, 0)

    @property
    def staleness_mean(self) -> float:
        return self.staleness_sum / self.trajectories if self.trajectories else 0.0

    @property
    def partial_ratio(self) -> float:
        return self.partial / self.trajectories if self.trajectories else 0.0

    @property
    def last_drain_interrupt_ms(self) -> float:
        return self.drain_interrupts_ms[-1] if self.drain_interrupts_ms else 0.0


def metric_values(stats: RolloutStats) -> dict[str, float]:
    """The metrics of `stats` under their interface names (see the module docstring)."""
    elapsed = stats.elapsed_s
    trajectories = stats.trajectories
    return {
        "rollout/idle_ratio": stats.idle_s / elapsed if elapsed > 0 else 0.0,
        "rollout/active_tasks": float(stats.in_flight),
        "rollout/partial_ratio": stats.partial / trajectories if trajectories else 0.0,
        "rollout/drain_interrupt_ms": stats.drain_interrupt_ms,
        "rollout/pacing_lookahead": float(stats.lookahead),
        "rollout/filtered_groups": float(stats.filtered),
        "rollout/generated_reward_sum": stats.generated_reward_sum,
        "rollout/generated_responses": float(stats.generated_responses),
        "staleness/mean": stats.staleness_mean,
        "staleness/max": float(stats.staleness_max),
        "tokens/s": stats.generated_tokens / elapsed if elapsed > 0 else 0.0,
    }


def count_partial(token_versions: Sequence[Sequence[int]]) -> int:
    """Responses whose tokens come from more than one weight version."""
    return sum(1 for versions in token_versions if len(set(versions)) > 1)


def __getattr__(name: str) -> Any:
    if name == "FailedSample":
        warnings.warn(
            "FailedSample is deprecated: use FailedGroup (it always described a failed group)",
            DeprecationWarning,
            stacklevel=2,
        )
        return FailedGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

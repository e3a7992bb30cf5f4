"""One group from generation to the sink: generate it, judge its staleness, filter it,
deliver it.

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

import dataclasses
import logging
from collections.abc import Callable

from rollout_engine.admission import StalenessBound
from rollout_engine.episode import EpisodeRunner
from rollout_engine.group import GroupJob, GroupRunner
from rollout_engine.group_filter import GroupFilter
from rollout_engine.metrics import GroupOutcome, count_partial
from rollout_engine.types import Trajectory, TrajectorySink

__all__ = ["GroupDelivery"]

logger = logging.getLogger(__name__)


class GroupDelivery:
    """Runs one admitted group to its `GroupOutcome`; see the module docstring.

    `version()` is the rollouter's weight version now; `on_generated(latency_s)` is told how
    long each group took to generate (the pacing policy's estimate)."""

    def __init__(
        self,
        runner: GroupRunner | EpisodeRunner,
        sink: TrajectorySink,
        *,
        bound: StalenessBound,
        group_filter: GroupFilter,
        version: Callable[[], int],
        clock: Callable[[], float],
        on_generated: Callable[[float], None],
        on_stale: Callable[[GroupJob], None] | None = None,
    ) -> None:
        self._runner = runner
        self._sink = sink
        self._bound = bound
        self._filter = group_filter
        self._version = version
        self._clock = clock
        self._on_generated = on_generated
        self._on_stale = on_stale  # told of each group dropped as too stale (its prompt)

    async def run(self, job: GroupJob) -> GroupOutcome:
        try:
            return await self._deliver(job)
        finally:
            self._runner.forget(job.group_id)

    async def _deliver(self, job: GroupJob) -> GroupOutcome:
        trajectories = await self._runner.run(job)
        self._on_generated(self._clock() - job.admitted_at)
        outcome = self._outcome(job, trajectories)
        if not outcome.delivered:
            logger.info(
                "dropping group %s: staleness %d > max_staleness %d",
                job.group_id,
                max(outcome.staleness),
                self._bound.max_staleness,
            )
            if self._on_stale is not None:
                self._on_stale(job)
            return outcome
        if not self._filter.keep(trajectories):  # its slot is freed: a new prompt replaces it
            logger.debug("group %s filtered out (%s)", job.group_id, type(self._filter).__name__)
            return dataclasses.replace(outcome, delivered=False, filtered=True)
        await self._sink.put(trajectories)
        # The put may have waited across weight pushes: the metrics report the staleness of
        # what was delivered, at the version when the sink took it (see the module docstring).
        return dataclasses.replace(outcome, staleness=self._staleness(job, trajectories))

    def _staleness(self, job: GroupJob, trajectories: list[Trajectory]) -> tuple[int, ...]:
        version = self._version()
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
            reward_sum=sum(t.reward for t in trajectories),
        )

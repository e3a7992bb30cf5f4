"""The group tasks in flight, each with its job, and the tasks given up on at stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rollout_engine.continuation import PartialResponse
from rollout_engine.group import GroupJob
from rollout_engine.metrics import GroupOutcome
from rollout_engine.snapshot import GroupSnapshot, ResponseSnapshot

__all__ = ["GroupTask", "InFlightGroups"]

logger = logging.getLogger(__name__)

GroupTask = asyncio.Task[GroupOutcome]


class InFlightGroups:
    """Admitted group tasks not yet accounted for. `tasks` is always the same set object
    (never rebound), so a wait on it sees every task. Changed only under the rollouter's
    state lock."""

    def __init__(self) -> None:
        self.tasks: set[GroupTask] = set()
        self._jobs: dict[GroupTask, GroupJob] = {}
        # Tasks that ignored cancellation past the stop timeout: already counted as failed
        # and out of `tasks`; referenced here until they end (see `abandon`).
        self._abandoned: set[GroupTask] = set()

    def __len__(self) -> int:
        return len(self.tasks)

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def add(self, task: GroupTask, job: GroupJob) -> None:
        self.tasks.add(task)
        self._jobs[task] = job

    def snapshot(
        self,
        responses_of: Callable[[str], Sequence[PartialResponse] | None],
        sampling_seed: int | None,
    ) -> list[GroupSnapshot]:
        """The groups still running, each with its responses so far (`responses_of`, the
        group runner's live view; a restored group not yet sent keeps its restored ones)."""
        groups: list[GroupSnapshot] = []
        for task, job in self._jobs.items():
            if task.done():  # delivered, dropped or failed: reaped soon, not in flight
                continue
            live = responses_of(job.group_id)
            responses = live if live is not None else job.restored
            groups.append(
                GroupSnapshot(
                    group_id=job.group_id,
                    sample=job.sample,
                    admitted_version=job.version,
                    sampling_seed=sampling_seed,
                    responses=[ResponseSnapshot.of(r) for r in responses or ()],
                )
            )
        return groups

    def restored_running(self) -> bool:
        """Whether a group restored from a snapshot is still in flight."""
        return any(job.restored for job in self._jobs.values())

    async def wait_first(
        self,
        events: Iterable[asyncio.Event],
        futures: Iterable[asyncio.Future[Any]] = (),
        at_most_s: float | None = None,
    ) -> None:
        """Wait for the first of: a task finishing, one of `events` set, one of `futures`
        done, or `at_most_s` seconds. Give at least one event (the wait needs something)."""
        waiters = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(
                {*self.tasks, *futures, *waiters},
                timeout=at_most_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def cancel_all(self, timeout_s: float) -> set[GroupTask]:
        """Cancel every task and wait up to `timeout_s` for them to unwind; returns those
        that have not (they stay in `tasks`: see `abandon`)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return set()
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        return pending

    def any_done(self) -> bool:
        return any(task.done() for task in self.tasks)

    def pop_done(self) -> list[tuple[GroupTask, GroupJob]]:
        """Take the finished tasks out, with their jobs."""
        done = [task for task in self.tasks if task.done()]
        for task in done:
            self.tasks.discard(task)
        return [(task, self._jobs.pop(task)) for task in done]

    def abandon(self, tasks: Iterable[GroupTask]) -> list[GroupJob]:
        """Take cancelled tasks that did not unwind out of `tasks` (the caller counts them as
        failed). A done-callback retrieves each one's exception when it finally ends (no
        "Task exception was never retrieved"); until then it stays referenced here."""
        jobs: list[GroupJob] = []
        for task in tasks:
            if task.done() or task not in self.tasks:
                continue  # finished meanwhile (reaped as usual) or already abandoned
            self.tasks.discard(task)
            jobs.append(self._jobs.pop(task))
            self._abandoned.add(task)
            task.add_done_callback(self._abandoned_task_done)
        return jobs

    def _abandoned_task_done(self, task: GroupTask) -> None:
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

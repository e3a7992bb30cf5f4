"""The group tasks in flight, each with its job, and the tasks given up on at stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from rollout_engine.group import GroupJob
from rollout_engine.metrics import GroupOutcome

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

    def jobs(self) -> list[tuple[GroupTask, GroupJob]]:
        return list(self._jobs.items())

    def restored_running(self) -> bool:
        """Whether a group restored from a snapshot is still in flight."""
        return any(job.restored for job in self._jobs.values())

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

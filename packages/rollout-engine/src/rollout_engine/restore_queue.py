"""Restored and held groups: what a resumed rollouter admits before any new prompt.

`RestoreQueue` keeps the groups of a `RolloutSnapshot` (`Rollouter.restore`) in order until
the dispatch loop admits them, counts what was restored and what was too stale to continue,
and carries the two events the loop and the app wait on:

- `settled`: set once no restored group waits, runs or is pending (`wait_restored_delivered`);
- `new_prompts_allowed`: cleared by `hold_new_prompts()` so that, with several rollouters
  resumed together, no replica's new group reaches the queue ahead of another's restored one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import msgspec

from rollout_engine.admission import StalenessBound
from rollout_engine.snapshot import GroupSnapshot, RolloutSnapshot

__all__ = ["RestoreQueue"]

logger = logging.getLogger(__name__)


class RestoreQueue:
    """Groups restored from a snapshot, in order, and the hold on new prompts."""

    def __init__(self, group_size: int) -> None:
        self._group_size = group_size
        self._waiting: deque[GroupSnapshot] = deque()
        self.restored = 0
        self.dropped = 0  # groups whose partials were too stale (their prompt restarts)
        self.dropped_tokens = 0
        self.settled = asyncio.Event()  # set: no restored group left to deliver
        self.settled.set()
        self.new_prompts_allowed = asyncio.Event()  # clear: hold_new_prompts() is in force
        self.new_prompts_allowed.set()

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[GroupSnapshot]:
        """The groups not admitted yet, in admission order."""
        return list(self._waiting)

    def pop(self) -> GroupSnapshot | None:
        return self._waiting.popleft() if self._waiting else None

    def add(self, snapshot: RolloutSnapshot, version: int, bound: StalenessBound) -> None:
        """Queue `snapshot`'s groups; one whose oldest token is too stale at `version` keeps
        only its prompt (its partial responses could never be delivered)."""
        self._check(snapshot)
        for group in snapshot.groups:
            oldest = group.min_version
            staleness = version - oldest if oldest is not None else 0
            if bound.too_stale(staleness):
                logger.info(
                    "restored group %s: partials dropped (staleness %d > max_staleness %d); "
                    "its prompt restarts",
                    group.group_id,
                    staleness,
                    bound.max_staleness,
                )
                self.dropped += 1
                self.dropped_tokens += group.generated_tokens
                group = msgspec.structs.replace(group, responses=[])
            self._waiting.append(group)
            self.restored += 1
            self.settled.clear()

    def _check(self, snapshot: RolloutSnapshot) -> None:
        """Every group is checked before any is queued."""
        if snapshot.group_size != self._group_size:
            raise ValueError(
                f"snapshot of groups of {snapshot.group_size} responses, "
                f"this rollouter makes {self._group_size}"
            )
        for group in snapshot.groups:
            if group.responses and len(group.responses) != self._group_size:
                raise ValueError(
                    f"group {group.group_id}: {len(group.responses)} responses, "
                    f"expected {self._group_size}"
                )

    def note_progress(self, restored_pending: bool, restored_running: bool) -> None:
        """Set `settled` once no restored group waits, is pending or runs."""
        if not self._waiting and not restored_pending and not restored_running:
            self.settled.set()

    def hold(self) -> None:
        self.new_prompts_allowed.clear()

    def release(self) -> None:
        self.new_prompts_allowed.set()

    @property
    def holding(self) -> bool:
        return not self.new_prompts_allowed.is_set()

"""Dynamic sampling: which finished groups are worth delivering.

A GRPO group whose responses all get the same reward has zero advantage: the trainer would
spend a step's compute on it for nothing. A `GroupFilter` judges each finished group just
before delivery; a rejected group is not delivered, is counted (`filtered` in the stats,
`rollout/filtered_groups`), and frees its admission slot, so the dispatch loop admits a
replacement from the next prompt. The staleness bound is untouched: the budget counts only
delivered and in-flight groups, so a replacement takes the freed slot under the same bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from rollout_engine.types import Trajectory

__all__ = [
    "GroupFilter",
    "GroupFilterName",
    "KeepEveryGroup",
    "ZeroVarianceFilter",
    "make_group_filter",
]

GroupFilterName = Literal["none", "zero-variance"]


@runtime_checkable
class GroupFilter(Protocol):
    """Decides, on the event loop and cheaply, whether a finished group is delivered."""

    def keep(self, group: Sequence[Trajectory]) -> bool: ...


@dataclass(frozen=True, slots=True)
class KeepEveryGroup:
    """No filtering (`"none"`)."""

    def keep(self, group: Sequence[Trajectory]) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class ZeroVarianceFilter:
    """Drops a group whose rewards all match (`"zero-variance"`): within `tolerance` of each
    other (0: exactly equal, as binary or exact-match rewards are). A group of one response
    has no variance to learn from either."""

    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if self.tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {self.tolerance}")

    def keep(self, group: Sequence[Trajectory]) -> bool:
        rewards = [t.reward for t in group]
        return bool(rewards) and max(rewards) - min(rewards) > self.tolerance


def make_group_filter(name: GroupFilterName) -> GroupFilter:
    """The named filter (`RolloutConfig.filter_groups`)."""
    if name == "none":
        return KeepEveryGroup()
    if name == "zero-variance":
        return ZeroVarianceFilter()
    raise ValueError(f"unknown group filter {name!r}; expected 'none' or 'zero-variance'")

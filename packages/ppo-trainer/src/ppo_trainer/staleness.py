"""Staleness of consumed groups: `v_trainer - min(token versions)`, and its metrics."""

from __future__ import annotations

from dataclasses import dataclass

from ppo_trainer.protocols import MetricValue
from ppo_trainer.types import Trajectory

__all__ = ["MaxStaleness", "group_staleness", "old_token_fraction", "staleness_metrics"]


@dataclass(frozen=True, slots=True)
class MaxStaleness:
    """The trainer's own `StalenessBound` (from `PPOConfig.max_staleness`) when the app
    hands it none: staleness above `max_staleness` is too stale."""

    max_staleness: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def too_stale(self, staleness: int) -> bool:
        return staleness > self.max_staleness


def group_staleness(group: list[Trajectory], version: int) -> int:
    """`version - min(token versions)` over the generated tokens of the group (0 if it has
    none; a multi-turn episode's observation tokens do not count)."""
    versions = [t.min_version for t in group if t.generated_versions]
    return version - min(versions) if versions else 0


# `staleness/hist` has a slot for every staleness up to the bound, so its shape holds from
# step to step; a bound above this (one meant as "no bound") pads only to what was observed.
HIST_PADDED_UP_TO = 64


def staleness_metrics(staleness: list[int], max_staleness: int) -> dict[str, MetricValue]:
    """`staleness/mean|max` and `staleness/hist`, where hist[s] = groups consumed at staleness s
    (length max(max_staleness, observed max) + 1, the bound counting up to
    `HIST_PADDED_UP_TO`)."""
    padded_to = max_staleness if max_staleness <= HIST_PADDED_UP_TO else 0
    hist = [0] * (max(padded_to, max(staleness, default=0)) + 1)
    for value in staleness:
        hist[max(value, 0)] += 1
    return {
        "staleness/mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness/max": float(max(staleness, default=0)),
        "staleness/hist": hist,
    }


def old_token_fraction(groups: list[list[Trajectory]], version: int) -> float:
    """The fraction of the generated tokens of `groups` that weights older than `version`
    (the trainer's current one) produced: how off-policy a step's data is, token by token
    (a group's staleness counts only its oldest token)."""
    old = total = 0
    for group in groups:
        for t in group:
            versions = t.generated_versions
            total += len(versions)
            old += sum(1 for v in versions if v < version)
    return old / total if total else 0.0

"""Admission control: the staleness bound `max_staleness = k` as a prompt budget.

Notation: `v` is the policy version the rollouter last heard of (`on_weights`), counted from
the version it started at; `S = batch_size * sync_every` is the number of groups the trainer
consumes per weight version; `delivered` and `in_flight` count groups.

Budget (design.md): the rollouter may admit a new group while

    budget = (k + 1 + v) * S - (delivered + in_flight) > 0

Why it bounds staleness. The trainer consumes groups in delivery order, S per version, so the
D-th delivered group (1-based) is consumed at trainer version floor((D - 1) / S). A group
admitted at version v takes the slot D = delivered + in_flight (counted after admitting it),
and the budget guarantees D <= (k + 1 + v) * S, hence it is consumed at a version
<= k + v. Its tokens were produced by weights of version >= v, so its staleness
`v_trainer - min(token versions)` is <= k. Failed or dropped groups free their slot (they are
not in `delivered`), so the budget lets a replacement in.

Where it is not enough. The argument assumes a group is delivered in the slot it was
admitted into. With out-of-order completion (a long straggler overtaken by groups admitted
after it, possibly at later versions), the straggler is delivered later than its slot and can
end up staler than k. So at delivery the rollouter also checks the group against its current
version and drops it (counted in `dropped`) when `v_now - min(token versions) > k`. That is a
necessary check, not a sufficient one: the trainer consumes later, at a version >= v_now, so a
consumer must still check staleness at consumption. In the normal case (groups finish near
their admission order) nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AdmissionPolicy"]


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """The budget and the delivery-time staleness check for `max_staleness = k`.

    `base_version` is the version the rollouter started at (a resumed run may start at v > 0);
    budgets count versions from there, because `delivered` counts from there too.
    """

    max_staleness: int
    samples_per_version: int
    base_version: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.samples_per_version < 1:
            raise ValueError(f"samples_per_version must be >= 1, got {self.samples_per_version}")

    def budget(self, version: int, delivered: int, in_flight: int) -> int:
        """`(k + 1 + v) * S - (delivered + in_flight)`; admission stops when it is <= 0."""
        versions_ahead = self.max_staleness + 1 + (version - self.base_version)
        return versions_ahead * self.samples_per_version - (delivered + in_flight)

    @staticmethod
    def staleness(current_version: int, token_versions: Sequence[int], admitted_at: int) -> int:
        """`current_version - min(token_versions)`; a response with no tokens counts from the
        version it was admitted at."""
        oldest = min(token_versions) if token_versions else admitted_at
        return current_version - oldest

    def too_stale(self, staleness: int) -> bool:
        """True when a group must be dropped at delivery (`staleness > k`)."""
        return staleness > self.max_staleness

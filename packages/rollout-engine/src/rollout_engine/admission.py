"""Admission control: the staleness bound `max_staleness = k` as a prompt budget.

Notation: `v` is the policy version the rollouter last heard of (`on_weights`), counted from
the version it started at; `S = batch_size * sync_every` is the number of groups the trainer
consumes per weight version; `delivered` and `in_flight` count groups.

Budget (docs/architecture.md, the staleness model): the rollouter may admit a new group while

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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "Admission",
    "AdmissionPolicy",
    "Blocker",
    "EagerPacing",
    "FreshPacing",
    "PacingName",
    "PacingPolicy",
    "StalenessBound",
    "make_pacing",
]

PacingName = Literal["eager", "fresh"]

# Why the dispatch loop does not admit its next item now: a weight push (or snapshot) holds
# it paused, the staleness budget is spent, `max_concurrency` groups run (or restored groups
# must finish first), or new prompts are held (`hold_new_prompts`).
Blocker = Literal["paused", "budget", "concurrency", "held"]


@dataclass(frozen=True, slots=True)
class StalenessBound:
    """The staleness bound `k`: how many weight versions may separate a response's oldest
    generated token from the version that consumes it.

    Staleness is measured as `current_version - min(token versions)` over the generated
    tokens (a response with none counts from the version its group was admitted at). Build
    one and hand the same value to every component that checks it (rollouter, queue,
    trainer), so they cannot disagree.
    """

    max_staleness: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    @staticmethod
    def staleness(current_version: int, token_versions: Sequence[int], admitted_at: int) -> int:
        """`current_version - min(token_versions)`; a response with no tokens counts from the
        version it was admitted at."""
        oldest = min(token_versions) if token_versions else admitted_at
        return current_version - oldest

    def too_stale(self, staleness: int) -> bool:
        """True when a response (or group, by its stalest response) is beyond the bound."""
        return staleness > self.max_staleness


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

    def budget(
        self, version: int, delivered: int, in_flight: int, lookahead: int | None = None
    ) -> int:
        """`(j + 1 + v) * S - (delivered + in_flight)`; admission stops when it is <= 0.

        `j` is the pacing lookahead (default and upper bound: k). `delivered` should not count
        groups a consumer dropped downstream (see the module docstring).
        """
        j = self.max_staleness if lookahead is None else max(0, min(lookahead, self.max_staleness))
        versions_ahead = j + 1 + (version - self.base_version)
        return versions_ahead * self.samples_per_version - (delivered + in_flight)

    @property
    def bound(self) -> StalenessBound:
        return StalenessBound(self.max_staleness)

    staleness = staticmethod(StalenessBound.staleness)

    def too_stale(self, staleness: int) -> bool:
        """True when a group must be dropped at delivery (`staleness > k`)."""
        return staleness > self.max_staleness


@runtime_checkable
class PacingPolicy(Protocol):
    """Chooses how many versions ahead of the consumer admission may run (see the module
    docstring). The rollouter calls `on_version` at every weight version it hears of and
    `on_group_generated` when a group's generation ends; both are cheap and synchronous."""

    def lookahead(self, max_staleness: int) -> int:
        """Versions ahead to admit, 0 <= j <= max_staleness."""
        ...

    def on_version(self, now: float) -> None: ...

    def on_group_generated(self, latency_s: float) -> None: ...


@dataclass(slots=True)
class EagerPacing:
    """Admit as far ahead as the staleness bound allows (j = k)."""

    def lookahead(self, max_staleness: int) -> int:
        return max_staleness

    def on_version(self, now: float) -> None:
        return None

    def on_group_generated(self, latency_s: float) -> None:
        return None


@dataclass(slots=True)
class FreshPacing:
    """Admit only as far ahead as keeps the consumer fed (see the module docstring).

    `samples_per_version` (S) and `max_concurrency` give the number of generation waves per
    version; `margin` is the relative head-room on the batch latency (0.25: start the batch
    after next as soon as this one would take more than 80 % of a version interval);
    `smoothing` is the weight of a new observation in the exponential moving averages. Until
    both a latency and an interval have been seen, `initial_lookahead` is used (1: assume the
    trainer is the bottleneck; an eager start would make the first batches k stale).
    """

    samples_per_version: int
    max_concurrency: int
    margin: float = 0.25
    smoothing: float = 0.3
    initial_lookahead: int = 1
    interval_s: float | None = field(default=None, init=False)
    latency_s: float | None = field(default=None, init=False)
    _last_version_at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.samples_per_version < 1 or self.max_concurrency < 1:
            raise ValueError("samples_per_version and max_concurrency must be >= 1")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if self.initial_lookahead < 0:
            raise ValueError(f"initial_lookahead must be >= 0, got {self.initial_lookahead}")

    @property
    def batch_latency_s(self) -> float | None:
        """Estimated seconds to generate one version's worth of groups."""
        if self.latency_s is None:
            return None
        waves = math.ceil(self.samples_per_version / self.max_concurrency)
        return self.latency_s * waves

    def lookahead(self, max_staleness: int) -> int:
        batch_latency = self.batch_latency_s
        if batch_latency is None or self.interval_s is None or self.interval_s <= 0:
            wanted = self.initial_lookahead
        else:
            wanted = math.ceil(batch_latency * (1.0 + self.margin) / self.interval_s)
        return max(min(1, max_staleness), min(wanted, max_staleness))

    def on_version(self, now: float) -> None:
        if self._last_version_at is not None:
            self.interval_s = self._average(self.interval_s, now - self._last_version_at)
        self._last_version_at = now

    def on_group_generated(self, latency_s: float) -> None:
        self.latency_s = self._average(self.latency_s, max(0.0, latency_s))

    def _average(self, current: float | None, sample: float) -> float:
        if current is None:
            return sample
        return (1.0 - self.smoothing) * current + self.smoothing * sample


def make_pacing(
    name: PacingName, samples_per_version: int, max_concurrency: int, margin: float = 0.25
) -> PacingPolicy:
    """The named policy for a rollouter (`"eager"` or `"fresh"`)."""
    if name == "eager":
        return EagerPacing()
    if name == "fresh":
        return FreshPacing(samples_per_version, max_concurrency, margin=margin)
    raise ValueError(f"unknown pacing {name!r}; expected 'eager' or 'fresh'")


class _AdmissionConfig(Protocol):
    @property
    def groups_per_version(self) -> int: ...

    @property
    def max_concurrency(self) -> int: ...

    @property
    def generation_only(self) -> bool: ...

    @property
    def pacing(self) -> PacingName: ...

    @property
    def pacing_margin(self) -> float: ...


class Admission:
    """One rollouter's admission rule: the staleness budget of `bound`, paced (`pacing`),
    and the concurrency limit; `generation_only` drops the budget (nothing consumes
    versions)."""

    def __init__(
        self,
        bound: StalenessBound,
        pacing: PacingPolicy,
        *,
        groups_per_version: int,
        max_concurrency: int,
        generation_only: bool,
        base_version: int,
    ) -> None:
        self._bound = bound
        self.pacing = pacing
        self._policy = AdmissionPolicy(
            bound.max_staleness, groups_per_version, base_version=base_version
        )
        self._max_concurrency = max_concurrency
        self._generation_only = generation_only

    @classmethod
    def for_config(
        cls,
        config: _AdmissionConfig,
        bound: StalenessBound,
        pacing: PacingPolicy | None,
        base_version: int,
    ) -> Admission:
        """From a `RolloutConfig`; `pacing` overrides the policy it names."""
        if pacing is None:
            pacing = make_pacing(
                config.pacing,
                config.groups_per_version,
                config.max_concurrency,
                margin=config.pacing_margin,
            )
        return cls(
            bound,
            pacing,
            groups_per_version=config.groups_per_version,
            max_concurrency=config.max_concurrency,
            generation_only=config.generation_only,
            base_version=base_version,
        )

    @property
    def lookahead(self) -> int:
        """Versions beyond the current one that admission may run ahead (pacing, <= k)."""
        return self.pacing.lookahead(self._bound.max_staleness)

    def budget(self, version: int, consumed: int, in_flight: int) -> int:
        """Groups that may still be admitted at `version`, with `consumed` slots used by
        groups no longer in flight (see the module docstring)."""
        return self._policy.budget(version, consumed, in_flight, lookahead=self.lookahead)

    def blocker(
        self,
        *,
        paused: bool,
        version: int,
        consumed: int,
        in_flight: int,
        restored_first: bool,
        held: bool,
    ) -> Blocker | None:
        """What keeps the next item out now, or None to admit it. `restored_first`: it is a
        new prompt while restored groups still run; `held`: it is a new prompt while new
        prompts are held."""
        if paused:
            return "paused"
        if not self._generation_only and self.budget(version, consumed, in_flight) <= 0:
            return "budget"
        if in_flight >= self._max_concurrency:
            return "concurrency"
        if restored_first:
            # Restored groups (a resume or a restart) finish before any new prompt starts:
            # their oldest tokens may be k versions old, so they must reach the queue ahead
            # of new groups or be dropped as too stale with every token they carry.
            return "concurrency"
        if held:
            return "held"  # another rollouter's restored groups go first
        return None

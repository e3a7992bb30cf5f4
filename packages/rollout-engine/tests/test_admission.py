"""Admission budget for `max_staleness = k` (rollout_engine.admission): the formula, and a
discrete simulation of rollouter + trainer that checks the staleness argument of the module
docstring (no engine, no clock: plain counting)."""

from __future__ import annotations

import random

import pytest
from rollout_engine.admission import AdmissionPolicy


def test_budget_formula() -> None:
    policy = AdmissionPolicy(max_staleness=2, samples_per_version=4)
    # (k + 1 + v) * S - (delivered + in_flight)
    assert policy.budget(version=0, delivered=0, in_flight=0) == 12
    assert policy.budget(version=0, delivered=5, in_flight=7) == 0
    assert policy.budget(version=1, delivered=5, in_flight=7) == 4
    assert policy.budget(version=3, delivered=10, in_flight=2) == 12


def test_budget_counts_versions_from_the_base_version() -> None:
    resumed = AdmissionPolicy(max_staleness=1, samples_per_version=8, base_version=40)
    assert resumed.budget(version=40, delivered=0, in_flight=0) == 16
    assert resumed.budget(version=41, delivered=8, in_flight=8) == 8


def test_staleness_and_drop_rule() -> None:
    policy = AdmissionPolicy(max_staleness=1, samples_per_version=1)
    assert policy.staleness(5, [3, 4, 5], admitted_at=3) == 2
    assert policy.staleness(5, [], admitted_at=4) == 1
    assert policy.too_stale(2)
    assert not policy.too_stale(1)


@pytest.mark.parametrize("bad", [{"max_staleness": -1}, {"samples_per_version": 0}])
def test_invalid_policy(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        AdmissionPolicy(**{"max_staleness": 1, "samples_per_version": 1, **bad})


def _simulate(k: int, spv: int, concurrency: int, in_order: bool, seed: int) -> list[int]:
    """Rollouter + trainer by counting. Returns staleness at consumption of every group.

    Each step either finishes one in-flight group (the oldest if `in_order`, else a random
    one) or admits one while the budget allows. The trainer consumes in delivery order and
    pushes version v+1 after consuming spv groups at version v.
    """
    rng = random.Random(seed)
    policy = AdmissionPolicy(max_staleness=k, samples_per_version=spv)
    version, delivered = 0, 0
    in_flight: list[int] = []  # admission version of each in-flight group, oldest first
    staleness: list[int] = []
    for _ in range(400):
        can_admit = (
            len(in_flight) < concurrency and policy.budget(version, delivered, len(in_flight)) > 0
        )
        if can_admit and (not in_flight or rng.random() < 0.6):
            in_flight.append(version)
            continue
        admitted_at = in_flight.pop(0 if in_order else rng.randrange(len(in_flight)))
        delivered += 1
        staleness.append(version - admitted_at)  # consumed right away by the trainer
        version = delivered // spv  # the trainer pushes after every spv groups
    return staleness


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(("k", "spv", "concurrency"), [(0, 4, 8), (1, 4, 16), (2, 3, 5), (1, 1, 4)])
def test_in_order_completion_never_exceeds_k(seed: int, k: int, spv: int, concurrency: int) -> None:
    assert max(_simulate(k, spv, concurrency, in_order=True, seed=seed)) <= k


def test_out_of_order_completion_can_exceed_k_which_is_why_delivery_drops() -> None:
    worst = max(max(_simulate(1, 2, 8, in_order=False, seed=s)) for s in range(20))
    assert worst > 1

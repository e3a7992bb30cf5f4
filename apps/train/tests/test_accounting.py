"""The group balance (`train_app.driver.accounting.balance_groups`): a pure function of the
counts the rollouters, the queue and the trainer report."""

from __future__ import annotations

import pytest
from train_app.driver.accounting import balance_groups


def _counts(
    delivered: int = 10,
    requeued: int = 0,
    produced: int = 10,
    consumed: int = 8,
    dropped: int = 1,
    size: int = 1,
    trained: int = 7,
    trainer_dropped: int = 1,
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    rollout = {"admitted": delivered, "delivered": delivered, "failed": 0, "dropped": 0}
    rollout |= {"filtered": 0, "in_flight": 0}
    queue = {
        "requeued": requeued,
        "produced": produced,
        "consumed": consumed,
        "dropped": dropped,
        "size": size,
    }
    return rollout, queue, {"trained": trained, "dropped": trainer_dropped}


def test_counts_that_add_up_balance() -> None:
    groups = balance_groups(*_counts(), restarts=0, settled=True)
    assert groups["balanced"] and groups["settled"]
    assert "delivered_by_replaced_replicas" not in groups["rollout"]


def test_a_resumes_put_back_groups_count_as_produced() -> None:
    rollout, queue, trainer = _counts(delivered=7, requeued=3, produced=10)
    assert balance_groups(rollout, queue, trainer, restarts=0, settled=True)["balanced"]
    queue["requeued"] = 0
    assert not balance_groups(rollout, queue, trainer, restarts=0, settled=True)["balanced"]


@pytest.mark.parametrize(
    "change",
    [
        {"produced": 11},  # the queue received a group no rollouter delivered
        {"size": 2},  # the queue holds more than it received minus what left it
        {"trained": 6},  # the trainer lost a consumed group
        {"trainer_dropped": 2},  # ...or counted one twice
    ],
)
def test_a_group_missing_or_counted_twice_unbalances(change: dict[str, int]) -> None:
    groups = balance_groups(*_counts(**change), restarts=0, settled=True)
    assert not groups["balanced"]


def test_replaced_replicas_deliveries_are_the_queues_excess() -> None:
    rollout, queue, trainer = _counts(delivered=6, produced=10)
    groups = balance_groups(rollout, queue, trainer, restarts=2, settled=True)
    assert groups["rollout"]["delivered_by_replaced_replicas"] == 4
    assert groups["rollout"]["replaced"] == 2
    assert groups["balanced"]
    # Without a restart the same counts say that groups came from nowhere.
    assert not balance_groups(rollout, queue, trainer, restarts=0, settled=True)["balanced"]


def test_live_replicas_delivering_more_than_the_queue_received_unbalances() -> None:
    rollout, queue, trainer = _counts(delivered=12, produced=10)
    groups = balance_groups(rollout, queue, trainer, restarts=1, settled=True)
    assert groups["rollout"]["delivered_by_replaced_replicas"] == -2
    assert not groups["balanced"]


def test_inputs_are_not_changed_and_settled_is_passed_through() -> None:
    rollout, queue, trainer = _counts(delivered=6, produced=10)
    before = dict(rollout)
    groups = balance_groups(rollout, queue, trainer, restarts=1, settled=False)
    assert rollout == before
    assert groups["settled"] is False
    assert groups["queue"] == queue and groups["trainer"] == trainer


@pytest.mark.parametrize("outcome", ["failed", "dropped", "filtered", "in_flight"])
def test_every_admitted_group_that_was_not_delivered_is_accounted_for(outcome: str) -> None:
    rollout, queue, trainer = _counts()
    rollout["admitted"] += 3
    assert not balance_groups(rollout, queue, trainer, restarts=0, settled=True)["balanced"]
    rollout[outcome] += 3  # the three admitted groups went there
    groups = balance_groups(rollout, queue, trainer, restarts=0, settled=True)
    assert groups["balanced"]
    assert groups["rollout"][outcome] == 3


def test_filtered_groups_never_reach_the_queue() -> None:
    """A filtered group counted as delivered too would be a group the queue never got."""
    rollout, queue, trainer = _counts()
    rollout |= {"admitted": rollout["admitted"] + 2, "filtered": 2, "delivered": 12}
    assert not balance_groups(rollout, queue, trainer, restarts=0, settled=True)["balanced"]

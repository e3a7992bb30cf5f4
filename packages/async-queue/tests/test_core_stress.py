"""Seeded concurrent stress of `MessageQueue`: several producers and consumers, >= 1,000
random operations per run, every policy, end by close and by producer failure."""

from __future__ import annotations

import asyncio

import pytest
from async_queue import MessageQueue

STRESS_TIMEOUT = 120.0  # generous: a hang fails the test instead of blocking CI


@pytest.mark.parametrize("policy", ["block", "drop_oldest", "reject"])
@pytest.mark.parametrize("seed", [0, 1])
async def test_stress_accounts_for_every_item(stress, policy: str, seed: int) -> None:
    run_stress, check_stress = stress
    queue = MessageQueue(maxsize=12, policy=policy)
    result = await asyncio.wait_for(
        run_stress(queue, seed=seed, producer_ops=300, producers=4, consumers=3),
        STRESS_TIMEOUT,
    )
    assert result.operations >= 1_000
    check_stress(result)
    stats = result.stats
    assert stats.consumed > 0
    assert stats.dropped.get("stale", 0) > 0  # the staleness path was exercised
    if policy == "drop_oldest":
        assert stats.dropped.get("overflow", 0) > 0
    if policy == "reject":
        assert stats.rejected > 0


async def test_stress_with_producer_failure(stress) -> None:
    run_stress, check_stress = stress
    queue = MessageQueue(maxsize=12, policy="block")
    result = await asyncio.wait_for(
        run_stress(queue, seed=7, producer_ops=400, producers=3, consumers=4, fail_at=250),
        STRESS_TIMEOUT,
    )
    assert result.operations >= 1_000
    check_stress(result, failed=True)
    assert result.stats.failed

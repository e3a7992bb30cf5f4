"""A cancelled get never loses items, over a real local Ray.

A trainer that stops cancels its in-flight `get_batch`. If a put completes that get in the
actor just before the cancellation arrives, the actor has already taken the items and its
reply is on the way to a caller that no longer listens. The client must hand such items
back, so that every produced item is delivered exactly once.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import ray
from async_queue import MessageQueueClient, QueueClosed, QueueItem, QueueTimeout

pytestmark = pytest.mark.usefixtures("ray_logs_dir")

TRIALS = 50
BATCH = 4


def _item(serial: int) -> QueueItem:
    return QueueItem(payload=serial.to_bytes(4, "little"), version=0, item_id=f"s-{serial}")


async def test_no_item_lost_when_a_get_is_cancelled_while_producing() -> None:
    """50 stop-while-producing trials on one queue actor (~2-4 s on 2 busy cores).

    Each trial starts a consumer waiting for a full batch, feeds it item by item and cancels
    the consumer at a random moment: before, during or right after the put that completes its
    batch (the race above). After every trial, what the consumers received plus what is
    still queued is exactly what was produced: nothing lost, nothing twice.
    """
    client = MessageQueueClient.create(maxsize=64)
    rng = random.Random(16)
    produced: list[str] = []
    delivered: list[str] = []
    serial = 0

    async def consume() -> None:
        batch = await client.get_batch(BATCH, min_items=BATCH)
        delivered.extend(item.item_id for item in batch)  # no await in between

    for trial in range(TRIALS):
        consumer = asyncio.create_task(consume())
        cancel_after = rng.randint(0, 2 * BATCH)  # cancel after this many puts
        for k in range(2 * BATCH):
            if k == cancel_after:
                break
            await client.put(_item(serial))
            produced.append(f"s-{serial}")
            serial += 1
            if rng.random() < 0.3:
                await asyncio.sleep(rng.random() * 0.002)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        stats = await client.stats()
        assert stats.produced == len(produced)
        assert stats.consumed == len(delivered), f"trial {trial}: {stats}"
        assert stats.size + len(delivered) == len(produced), f"trial {trial}: item lost {stats}"

    await client.close()
    rest: list[str] = []
    while True:
        try:
            rest += [i.item_id for i in await client.get_batch(64, timeout=1.0)]
        except QueueTimeout:
            pytest.fail("a closed queue must end with QueueClosed")
        except QueueClosed:
            break
    assert sorted(delivered + rest) == sorted(produced)  # exactly once
    assert len(set(delivered)) == len(delivered)
    ray.kill(client.handle)


async def test_cancelled_gets_stop_waiting_in_the_actor_and_stats_count_waiters() -> None:
    """Waiting consumers are counted (`queue/waiting_consumers`); a cancelled get stops
    waiting in the actor at once and takes nothing later (~0.5 s)."""
    client = MessageQueueClient.create(maxsize=8)
    consumers = [asyncio.create_task(client.get_batch(2, min_items=2)) for _ in range(3)]
    consumers.append(asyncio.create_task(client.get()))
    for _ in range(200):  # until all four calls wait in the actor
        stats = await client.stats()
        if stats.waiting_consumers == 4:
            break
        await asyncio.sleep(0.01)
    assert stats.waiting_consumers == 4, stats
    assert stats.as_metrics()["queue/waiting_consumers"] == 4.0
    assert stats.waiting_producers == 0
    for consumer in consumers:
        consumer.cancel()
    results = await asyncio.gather(*consumers, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert (await client.stats()).waiting_consumers == 0  # abandoned in the actor, not later
    await client.put_many([_item(i) for i in range(3)])
    stats = await client.stats()
    assert (stats.size, stats.consumed, stats.requeued) == (3, 0, 0)
    with pytest.raises(TimeoutError):  # wait_for around a get is safe now, and takes nothing
        await asyncio.wait_for(client.get_batch(4, min_items=4), 0.2)
    assert await client.size() == 3
    ray.kill(client.handle)

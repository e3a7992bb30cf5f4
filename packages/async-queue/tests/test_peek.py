"""`peek_all()`: a read-only copy of the queued items (a consumer's checkpoint saves them), on
a real local Ray. Items of every wire form (encoded, by value, by reference) come back with
their payloads, in queue order; nothing is taken, reordered or counted."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
from async_queue import MessageQueueClient, QueueItem, SyncMessageQueueClient

pytestmark = pytest.mark.usefixtures("ray_logs_dir")

MIB = 1024 * 1024
# One item of each wire form (`async_queue._wire`): encoded (< 8 KiB), the struct itself
# (< by_ref_bytes), by reference (>= by_ref_bytes, 64 KiB by default).
SIZES = (100, 16 * 1024, 3 * MIB, 200)


def _items() -> list[QueueItem]:
    return [
        QueueItem(payload=os.urandom(size), version=v, item_id=f"g-{i}", metadata={"i": str(i)})
        for i, (size, v) in enumerate(zip(SIZES, (3, 1, 2, 1), strict=True))
    ]


def _counters(stats: object) -> tuple:
    return tuple(
        getattr(stats, name)
        for name in ("size", "produced", "consumed", "dropped_total", "requeued", "rejected")
    )


async def test_peek_all_copies_every_queued_item_and_leaves_the_queue_as_it_was() -> None:
    """(~2 s)"""
    client = MessageQueueClient.create(maxsize=8)
    items = _items()
    await client.put_many(items[:2])
    await client.put(items[2])  # its own put call: a second by-ref object
    await client.put(items[3])
    before = await client.stats()
    peeked = await client.peek_all()
    assert peeked == items  # payloads, versions, ids, stamps and metadata, in queue order
    assert await client.peek_all() == items  # again: nothing moved
    assert _counters(await client.stats()) == _counters(before)
    # A consumer still gets exactly those items, in that order, the by-ref payload included.
    got = await client.get_batch(4, timeout=30, min_items=4)
    assert got == items
    assert await client.peek_all() == []
    await client.close()
    ray.kill(client.handle)


async def test_peek_all_of_a_waiting_consumer_takes_nothing_from_it() -> None:
    """A get waiting for a full batch still receives every item after a peek (~1 s)."""
    client = MessageQueueClient.create(maxsize=8)
    waiting = asyncio.ensure_future(client.get_batch(2, timeout=30, min_items=2))
    items = _items()
    await client.put(items[0])
    assert await client.peek_all() == items[:1]
    await client.put(items[1])
    assert await waiting == items[:2]
    ray.kill(client.handle)


def test_sync_peek_all() -> None:
    """The sync client's mirror (~1 s)."""
    client = SyncMessageQueueClient.create(maxsize=8)
    items = _items()
    client.put_many(items)
    assert client.peek_all() == items
    assert client.stats().consumed == 0
    assert client.get_batch(4, timeout=30, min_items=4) == items
    ray.kill(client.handle)

"""Concurrent single puts of one client coalesce into one actor call,
without weakening delivery: each put returns once its item is queued, gets its own error,
and a cancelled caller neither loses nor doubles the others' items. Real local Ray.

`CountingHandle` wraps the real actor handle only to count `put_each` calls; every call still
goes to the real actor.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray
from async_queue import MessageQueueClient, QueueClosed, QueueFull, QueueItem

pytestmark = pytest.mark.usefixtures("ray_logs_dir")

WAIT = 60.0


class CountingHandle:
    """The real handle, counting the items of each `put_each` call (instrumentation only)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.put_each_calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._handle, name)
        if name != "put_each":
            return method
        calls = self.put_each_calls

        class _Method:
            @staticmethod
            def remote(elements: list[Any]) -> Any:
                calls.append(len(elements))
                return method.remote(elements)

        return _Method


def _item(serial: int) -> QueueItem:
    return QueueItem(payload=serial.to_bytes(4, "little"), version=0, item_id=f"s-{serial}")


async def _ids(client: MessageQueueClient, n: int) -> list[str]:
    return [i.item_id for i in await client.get_batch(n, min_items=n, timeout=WAIT)]


async def test_concurrent_puts_coalesce_into_few_calls_in_order() -> None:
    """200 concurrent puts: all return, every item is queued once, in call order, in far
    fewer than 200 actor calls (~1 s)."""
    real = MessageQueueClient.create(maxsize=512).handle
    handle = CountingHandle(real)
    client = MessageQueueClient(handle)  # type: ignore[arg-type]
    await client.size()
    await asyncio.wait_for(asyncio.gather(*(client.put(_item(i)) for i in range(200))), WAIT)
    assert await client.size() == 200  # every put returned after its item was queued
    assert await _ids(client, 200) == [f"s-{i}" for i in range(200)]
    assert sum(handle.put_each_calls) == 200
    assert len(handle.put_each_calls) <= 5, handle.put_each_calls
    # Sequential puts are not delayed: each goes alone.
    for i in range(3):
        await client.put(_item(1000 + i))
    assert handle.put_each_calls[-3:] == [1, 1, 1]
    ray.kill(real)


async def test_each_coalesced_put_gets_its_own_outcome() -> None:
    """Policy reject, room for 5, 8 concurrent puts: 5 return, 3 raise QueueFull (each its own
    instance), where one put_many of 8 would have refused all. After close: all QueueClosed."""
    real = MessageQueueClient.create(maxsize=5, policy="reject").handle
    handle = CountingHandle(real)
    client = MessageQueueClient(handle)  # type: ignore[arg-type]
    await client.size()
    results = await asyncio.gather(
        *(client.put(_item(i)) for i in range(8)), return_exceptions=True
    )
    assert handle.put_each_calls == [8]
    assert results[:5] == [None] * 5
    assert [type(r) for r in results[5:]] == [QueueFull] * 3
    assert len({id(r) for r in results[5:]}) == 3
    stats = await client.stats()
    assert (stats.size, stats.rejected) == (5, 3)
    assert await _ids(client, 5) == [f"s-{i}" for i in range(5)]
    with pytest.raises(QueueFull):
        await client.put_many([_item(i) for i in range(8)])  # all or none, unlike single puts
    await client.close()
    results = await asyncio.gather(
        *(client.put(_item(i)) for i in range(4)), return_exceptions=True
    )
    assert [type(r) for r in results] == [QueueClosed] * 4
    ray.kill(real)


async def test_a_put_returns_only_once_its_item_is_queued() -> None:
    """Policy block, room for 2, 6 concurrent puts: none returns while its item waits for
    room; as a consumer makes room they all return, items in order (~2 s)."""
    client = MessageQueueClient.create(maxsize=2, policy="block")
    await client.size()  # the actor is up
    puts = [asyncio.create_task(client.put(_item(i))) for i in range(6)]
    for _ in range(500):  # until the call waits for room in the actor
        stats = await client.stats()
        if stats.waiting_producers:
            break
        await asyncio.sleep(0.01)
    assert stats.size == 2
    assert stats.waiting_producers == 1
    done = [p.done() for p in puts]
    assert done[2:] == [False] * 4  # items 2..5 are not queued yet: their puts wait
    got = []
    while len(got) < 6:
        got += await _ids(client, 1)
    await asyncio.wait_for(asyncio.gather(*puts), WAIT)
    assert got == [f"s-{i}" for i in range(6)]
    ray.kill(client.handle)


async def test_cancelled_callers_neither_lose_nor_double_the_others_items() -> None:
    """A put waiting in the actor (queue full) and puts waiting behind it in the client; some
    of them are cancelled. The others' items are queued exactly once; items cancelled before
    they were sent never are; the call whose only caller was cancelled stops (~2 s)."""
    client = MessageQueueClient.create(maxsize=2, policy="block")
    await client.put_many([_item(100), _item(101)])  # full
    first = asyncio.create_task(client.put(_item(0)))
    for _ in range(500):  # until it is in flight, waiting for room in the actor
        if (await client.stats()).waiting_producers == 1:
            break
        await asyncio.sleep(0.01)
    assert (await client.stats()).waiting_producers == 1
    behind = {i: asyncio.create_task(client.put(_item(i))) for i in range(1, 6)}
    await asyncio.sleep(0.1)
    for i in (2, 4):  # not sent yet: taken out of the client
        behind[i].cancel()
    first.cancel()  # its call had no other caller: ray.cancel stops its wait in the actor
    results = await asyncio.gather(first, behind[2], behind[4], return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    got = await _ids(client, 2)
    while len(got) < 5:
        got += await _ids(client, 1)
    await asyncio.wait_for(asyncio.gather(behind[1], behind[3], behind[5]), WAIT)
    assert got in (
        ["s-100", "s-101", "s-1", "s-3", "s-5"],
        ["s-100", "s-101", "s-0", "s-1", "s-3"],  # s-0 enqueued before the cancel arrived
    ), got
    rest = await client.size()
    stats = await client.stats()
    assert stats.produced == len(got) + rest
    assert stats.waiting_producers == 0
    if got[2] == "s-0":
        assert await _ids(client, 1) == ["s-5"]
    ray.kill(client.handle)

"""Pulled puts, on a real local Ray.

A producing client inside a Ray actor that serves concurrent calls keeps its by-ref payloads
until the queue actor pulls them (`async_queue._handover`): the queue actor owns them without
the re-owning copy of `PayloadAdopter`. These tests check that the pull path is the one taken
(the queue actor never starts its adopter), that pulled payloads survive their producer, that
a put whose producer died or withdrew enqueues nothing, and that a producer keeps nothing
after its puts ended, however they ended.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import re
import threading
import time
from typing import Any

import pytest
import ray
from async_queue import (
    MessageQueueClient,
    QueueClosed,
    QueueItem,
    QueueTimeout,
    SyncMessageQueueClient,
    _handover,
    _wire,
)
from async_queue.errors import PutWithdrawn

pytestmark = pytest.mark.usefixtures("ray_logs_dir")

WAIT = 60.0
BUSY_S = 90.0  # how long a producer's other call slot stays busy (the put must not wait it)
MIB = 1024 * 1024


def _item(serial: int, size: int = MIB) -> QueueItem:
    payload = serial.to_bytes(4, "little") + os.urandom(size - 4)
    return QueueItem(payload=payload, version=0, item_id=f"s-{serial}")


def plasma_objects() -> int:
    """Objects in the object store of this (one-node) cluster, from Ray's memory summary."""
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address  # ours: other clusters may run here
    summary = memory_summary(address=address, stats_only=True)
    found = re.search(r"Plasma memory usage [\d.]+ MiB, (\d+) objects", summary)
    assert found, summary
    return int(found.group(1))


def wait_for_objects(at_most: int, seconds: float = 30.0) -> int:
    deadline = time.monotonic() + seconds
    while (count := plasma_objects()) > at_most and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


async def _held_once_settled() -> int:
    """Runs in a producer: held puts, once the calls its cancelled puts left in flight end
    (a coalesced call goes on after its callers are cancelled; it releases when it ends)."""
    for _ in range(300):
        if _handover.held_tokens() == 0:
            break
        await asyncio.sleep(0.1)
    return _handover.held_tokens()


def _without_cyclic_gc(_actor: Any) -> None:
    """Runs in an actor (`__ray_call__`): no more cyclic garbage collection there."""
    gc.disable()


def _held_in_producer(_producer: Any) -> int:
    """Runs in a producer (`__ray_call__`): how many puts' payloads it still holds."""
    return _handover.held_tokens()


def _adopter_started(queue_actor: Any) -> bool:
    """Runs in the queue actor (`__ray_call__`): whether a put took the copying path."""
    return queue_actor._adopter is not None


@ray.remote(num_cpus=0)
class AsyncProducer:
    """An async actor that produces (like the app's rollouters)."""

    async def put(self, queue: MessageQueueClient, items: list[QueueItem]) -> int:
        """put_many the first items, single puts (coalesced) for the rest; returns how many
        puts' payloads this process still holds."""
        await queue.put_many(items[:2])
        await asyncio.gather(*(queue.put(item) for item in items[2:]))
        return _handover.held_tokens()

    async def put_after_close(self, queue: MessageQueueClient, items: list[QueueItem]) -> int:
        await queue.close()
        try:
            await queue.put_many(items)
        except QueueClosed:
            return _handover.held_tokens()
        raise AssertionError("a put after close must raise QueueClosed")

    async def cancel_puts(
        self, queue: MessageQueueClient, items: list[QueueItem], seed: int
    ) -> tuple[list[str], int]:
        """Each put (put_many of two, or a single put) cancelled after a random delay, or
        (delay None) left to finish, so that some puts return whatever the machine's load;
        returns the ids of the puts that returned, and how many puts' payloads are held."""
        rng = random.Random(seed)
        returned: list[str] = []
        for k in range(0, len(items), 2):
            batch = items[k : k + 2]
            put = queue.put_many(batch) if k % 4 else queue.put(batch[0])
            task = asyncio.ensure_future(put)
            delay = rng.choice([0.0, 0.001, 0.005, 0.02, 0.1, None])
            if delay is not None:
                await asyncio.sleep(delay)
                task.cancel()
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
            if outcome is None:
                returned.extend(i.item_id for i in (batch if k % 4 else batch[:1]))
        return returned, await _held_once_settled()

    async def held(self, items: list[QueueItem]) -> str:
        """Holds `items`' payloads as a put would, and returns their token."""
        return _handover.hold([i.payload for i in items])


@ray.remote(num_cpus=0)
class ThreadedProducer:
    """A plain (threaded) actor using the blocking client."""

    def put(self, queue: SyncMessageQueueClient, items: list[QueueItem]) -> int:
        queue.put_many(items)
        return _handover.held_tokens()


async def _wait_until_dead(actor: Any) -> None:
    for _ in range(300):
        try:
            await actor.__ray_ready__.remote()
        except ray.exceptions.RayActorError:
            return
        await asyncio.sleep(0.1)
    pytest.fail("the killed actor still answers")


async def test_pulled_payloads_survive_their_async_producer() -> None:
    """An async producer actor puts by-ref items (put_many and coalesced single puts): they
    are pulled (no adopter copy), the producer holds nothing afterwards, and a consumer gets
    them all after the producer is killed (~3 s)."""
    client = MessageQueueClient.create(maxsize=16)
    producer = AsyncProducer.remote()
    items = [_item(i) for i in range(5)] + [_item(5, 100)]
    assert await producer.put.remote(client, items) == 0
    assert not await client.handle.__ray_call__.remote(_adopter_started)
    ray.kill(producer, no_restart=True)
    await _wait_until_dead(producer)
    got = await asyncio.wait_for(client.get_batch(6, min_items=6), WAIT)
    assert sorted(got, key=lambda i: i.item_id) == items
    ray.kill(client.handle)


@pytest.mark.parametrize("max_concurrency", [1, 2])
async def test_threaded_producer_pulls_only_when_it_can_serve_the_hand_over(
    max_concurrency: int,
) -> None:
    """A threaded actor with max_concurrency 1 cannot serve the hand-over while it waits in
    its put: its payloads take the copying path; with 2 they are pulled. Either way they
    survive the producer (~3 s each)."""
    client = SyncMessageQueueClient.create(maxsize=16)
    producer = ThreadedProducer.options(max_concurrency=max_concurrency).remote()
    items = [_item(i) for i in range(3)]
    assert await producer.put.remote(client, items) == 0
    copied = await client.handle.__ray_call__.remote(_adopter_started)
    assert copied == (max_concurrency == 1)
    ray.kill(producer, no_restart=True)
    await _wait_until_dead(producer)
    assert await asyncio.wait_for(client.to_async().get_batch(3, min_items=3), WAIT) == items
    ray.kill(client.handle)


async def test_by_ref_pull_false_copies_from_an_actor() -> None:
    """`by_ref_pull=False` (kept when pickled) makes an actor's client copy instead (~2 s)."""
    client = MessageQueueClient.create(maxsize=16, by_ref_pull=False)
    assert not client.by_ref_pull and not client.to_sync().to_async().by_ref_pull
    producer = AsyncProducer.remote()
    items = [_item(i) for i in range(3)]
    assert await producer.put.remote(client, items) == 0
    assert await client.handle.__ray_call__.remote(_adopter_started)
    assert sorted(await client.get_batch(3, min_items=3), key=lambda i: i.item_id) == items
    ray.kill(producer)
    ray.kill(client.handle)


async def test_put_whose_producer_died_or_withdrew_enqueues_nothing() -> None:
    """The actor's side of a pulled put, called directly: a producer that died before the
    hand-over fails the put (RayActorError); one that no longer holds the token fails it
    with PutWithdrawn. Nothing is enqueued, and a put that pulls is fine after (~3 s)."""
    client = MessageQueueClient.create(maxsize=16)
    items = [_item(i) for i in range(2)]
    elements, _payloads = _wire.to_wire_pulled(items, client.by_ref_bytes)
    producer = AsyncProducer.remote()
    token = await producer.held.remote(items)
    source = _wire.PullSource(producer, "not-a-held-token")
    with pytest.raises(ray.exceptions.RayTaskError) as withdrawn:
        await client.handle.put_many.remote(elements, source)
    assert isinstance(withdrawn.value.cause, PutWithdrawn)
    ray.kill(producer, no_restart=True)
    await _wait_until_dead(producer)
    with pytest.raises(ray.exceptions.RayActorError):
        await client.handle.put_many.remote(elements, _wire.PullSource(producer, token))
    with pytest.raises(ray.exceptions.RayActorError):
        await client.handle.put_each.remote(elements, _wire.PullSource(producer, token))
    stats = await client.stats()
    assert (stats.size, stats.produced) == (0, 0)
    assert not await client.handle.__ray_call__.remote(_adopter_started)
    other = AsyncProducer.remote()
    assert await other.put.remote(client, items) == 0
    assert sorted(await client.get_batch(2, min_items=2), key=lambda i: i.item_id) == items
    ray.kill(other)
    ray.kill(client.handle)


async def test_failed_and_cancelled_pulled_puts_leave_nothing_behind() -> None:
    """A put refused (queue closed) and 30 puts cancelled at random moments: the producer
    holds no payloads afterwards, every put that returned is delivered once and intact,
    nothing else is half queued, and the object store empties without waiting for a
    garbage collection (~5 s)."""
    client = MessageQueueClient.create(maxsize=64)
    await client.size()
    before = await asyncio.to_thread(wait_for_objects, 0, 5.0)
    producer = AsyncProducer.remote()
    # A ref kept alive by a reference cycle is freed only at some later collection, if
    # ever (in an idle actor): with collection off, such a ref fails this test instead.
    for actor in (client.handle, producer):
        await actor.__ray_call__.remote(_without_cyclic_gc)
    items = [_item(i, 256 * 1024) for i in range(60)]
    returned, held = await producer.cancel_puts.remote(client, items, 12)
    assert held == 0
    queued: list[QueueItem] = []
    while True:
        try:
            queued += await client.get_batch(64, timeout=1.0)
        except QueueTimeout:
            break
    by_id = {i.item_id: i for i in items}
    assert all(item == by_id[item.item_id] for item in queued)  # pulled intact
    ids = [i.item_id for i in queued]
    assert len(ids) == len(set(ids)) and set(returned) <= set(ids)
    # Some puts returned (those left to finish, at least), and some were cancelled in time
    # (a put cancelled after `sleep(0)` cannot have had the actor's answer yet).
    assert 0 < len(returned) < len(items)
    del queued
    # Ray frees released objects asynchronously (seconds on a loaded machine); an object
    # left after 90 s is held, e.g. by the traceback of a failed hand-over in a cycle.
    assert await asyncio.to_thread(wait_for_objects, before, 90.0) <= before, plasma_objects()
    closed = MessageQueueClient.create(maxsize=4)
    assert await producer.put_after_close.remote(closed, items[:2]) == 0
    assert (await closed.stats()).produced == 0
    ray.kill(producer)
    ray.kill(client.handle)
    ray.kill(closed.handle)


@ray.remote(num_cpus=0)
class BusyThreadedProducer:
    """A threaded actor whose call slots can be taken by other work than its puts."""

    def __init__(self) -> None:
        self._busy = threading.Event()

    def put(self, queue: SyncMessageQueueClient, items: list[QueueItem]) -> str | None:
        """Puts `items`; returns why pulling is off in this process (None: it is on)."""
        queue.put_many(items)
        return _handover._disabled

    def busy(self, seconds: float) -> None:
        self._busy.set()
        time.sleep(seconds)  # holds one call slot, as a long method of a user's actor would

    def wait_busy(self, timeout: float) -> bool:
        """True once `busy` holds its slot."""
        return self._busy.wait(timeout)

    def put_with_broken_ray_fields(
        self, queue: SyncMessageQueueClient, items: list[QueueItem]
    ) -> str | None:
        """Reading Ray's private worker fields raises something else than AttributeError."""

        def broken(_worker: Any) -> tuple[Any, int]:
            raise RuntimeError("a changed core worker")

        _handover._concurrency = broken
        _handover._this_actor = None
        queue.put_many(items[:1])
        queue.put_many(items[1:])
        return _handover._disabled


async def test_threaded_producer_with_two_slots_making_two_large_puts_at_once() -> None:
    """max_concurrency=2 and two large puts at once: before, both pulled and both slots
    waited in `ray.get`, so neither hand-over was ever served (a hang). Now the second put
    sees no free slot for a hand-over and copies: both return, both are delivered intact
    (~3 s)."""
    client = SyncMessageQueueClient.create(maxsize=16)
    producer = ThreadedProducer.options(max_concurrency=2).remote()
    first, second = [_item(i) for i in range(2)], [_item(i) for i in range(2, 4)]
    await asyncio.wait_for(
        asyncio.gather(producer.put.remote(client, first), producer.put.remote(client, second)),
        WAIT,
    )
    assert await producer.__ray_call__.remote(_held_in_producer) == 0
    got = await asyncio.wait_for(client.to_async().get_batch(4, min_items=4), WAIT)
    assert sorted(got, key=lambda i: i.item_id) == first + second
    ray.kill(producer)
    ray.kill(client.handle)


async def test_hand_over_timeout_fails_the_pull_and_the_put_is_copied() -> None:
    """The producer's other slot is busy in a method of its own, so the hand-over cannot
    run: the queue actor gives up after `hand_over_timeout_s` (nothing queued), the client
    turns pulling off in its process and sends the put again by copying. The put returns
    well before the busy method ends, and its items arrive once (~4 s)."""
    client = SyncMessageQueueClient.create(maxsize=16, hand_over_timeout_s=1.0)
    producer = BusyThreadedProducer.options(max_concurrency=2).remote()
    busy = producer.busy.remote(BUSY_S)
    # Ray does not promise that a threaded actor starts calls in submission order: if the
    # put and its hand-over ran before `busy`, nothing would time out. Put once `busy` runs.
    assert await producer.wait_busy.remote(WAIT)
    items = [_item(i) for i in range(2)]
    started = time.monotonic()
    reason = await asyncio.wait_for(producer.put.remote(client, items), BUSY_S)
    # Not served only once `busy` ended (the margin is for the copying path's helper actor,
    # which a loaded machine may take many seconds to start).
    assert time.monotonic() - started < BUSY_S - 30.0
    assert reason is not None and "timed out" in reason
    assert await client.handle.__ray_call__.remote(_adopter_started)  # copied
    got = await client.to_async().get_batch(4, timeout=2.0)
    assert got == items  # once each: the timed-out pull queued nothing
    ray.kill(producer)
    del busy
    ray.kill(client.handle)


async def test_any_error_reading_rays_worker_fields_falls_back_to_copying() -> None:
    """Not only AttributeError: any exception while reading Ray's private worker fields
    turns pulling off (one warning) and every put copies instead of failing (~3 s)."""
    client = SyncMessageQueueClient.create(maxsize=16)
    producer = BusyThreadedProducer.options(max_concurrency=4).remote()
    items = [_item(i) for i in range(3)]
    reason = await producer.put_with_broken_ray_fields.remote(client, items)
    assert reason is not None and "RuntimeError: a changed core worker" in reason
    assert await client.handle.__ray_call__.remote(_adopter_started)
    assert await client.to_async().get_batch(3, min_items=3) == items
    ray.kill(producer)
    ray.kill(client.handle)

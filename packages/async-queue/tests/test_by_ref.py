"""Payloads by reference, on a real local Ray.

Items whose payload reaches the client's `by_ref_bytes` are `ray.put` by the producing client;
the queue actor holds only refs (re-owned by the actor, so they survive their producer), and
consumers get the values back. Consumed or dropped payloads are freed from the object store.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import re
import time

import pytest
import ray
from async_queue import (
    DEFAULT_BY_REF_BYTES,
    MessageQueueClient,
    QueueClosed,
    QueueItem,
    QueueTimeout,
    SyncMessageQueueClient,
)
from async_queue._wire import ByRef

pytestmark = pytest.mark.usefixtures("ray_logs_dir")

WAIT = 60.0
MIB = 1024 * 1024


def _item(serial: int, size: int, version: int = 0) -> QueueItem:
    payload = (serial.to_bytes(4, "little") + os.urandom(12)) * (size // 16) + bytes(size % 16)
    return QueueItem(payload=payload, version=version, item_id=f"s-{serial}")


def plasma_usage() -> tuple[float, int]:
    """(whole MiB, objects) in the object store of this (one-node) cluster, from Ray's memory
    summary."""
    from ray._private.internal_api import memory_summary

    # Our own cluster's address: other Ray clusters may run on this machine.
    address = ray.get_runtime_context().gcs_address
    summary = memory_summary(address=address, stats_only=True)
    found = re.search(r"Plasma memory usage ([\d.]+) MiB, (\d+) objects", summary)
    assert found, summary
    return float(found.group(1)), int(found.group(2))


def pending_references() -> str:
    """The lines of Ray's memory summary for references whose task or object is not finished
    (what a hung call waits on)."""
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address
    summary = memory_summary(address=address, line_wrap=False, num_entries=500)
    rows = [line for line in summary.splitlines() if "|" in line and "FINISHED" not in line]
    return "\n".join(rows)


def plasma_objects() -> int:
    return plasma_usage()[1]


def wait_for_objects(at_most: int, seconds: float = 30.0) -> int:
    deadline = time.monotonic() + seconds
    while True:
        count = plasma_objects()
        if count <= at_most or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


@ray.remote(num_cpus=0)
class ShortLivedProducer:
    """Puts items, then is killed by the test (a producer that exits)."""

    async def put_and_leak_a_ref(
        self, queue: MessageQueueClient, items: list[QueueItem]
    ) -> list[ray.ObjectRef]:
        await queue.put_many(items[:-1])
        await queue.put(items[-1])
        # Control: an object this actor owns (nested, so the caller gets the ref itself).
        return [ray.put(b"owned by the producer" * 10_000)]


async def test_large_payloads_travel_by_reference_and_come_back_equal() -> None:
    """Around the threshold: below it by value, at it and above by ref; all come back equal,
    and the actor's own get hands refs (ByRef), never payload bytes (~1 s)."""
    client = MessageQueueClient.create(maxsize=16)
    assert client.by_ref_bytes == DEFAULT_BY_REF_BYTES == 64 * 1024
    sizes = [100, 16 * 1024, DEFAULT_BY_REF_BYTES - 1, DEFAULT_BY_REF_BYTES, 3 * MIB]
    items = [_item(i, size, version=i) for i, size in enumerate(sizes)]
    await client.put_many(items[:3])
    await client.put(items[3])
    await client.put(items[4])
    raw = await client.handle.get_batch.remote(2, None, 2, None, None)
    assert [type(e) for e in raw] == [bytes, QueueItem]  # by value: the actor sees payloads
    await client.handle.requeue.remote(raw)
    assert await client.get_batch(2, min_items=2) == items[:2]
    assert await client.get() == items[2]
    raw = await client.handle.get_batch.remote(2, None, 2, None, None)
    assert [type(e) for e in raw] == [ByRef, ByRef]  # the actor holds refs only
    assert all(len(e.header) < 200 for e in raw)
    await client.handle.requeue.remote(raw)
    assert await client.get_batch(2, min_items=2) == items[3:]
    # A client pickled into another process keeps its threshold.
    copy = pickle.loads(pickle.dumps(MessageQueueClient(client.handle, by_ref_bytes=10)))
    assert copy.by_ref_bytes == 10
    with pytest.raises(ValueError):
        MessageQueueClient(client.handle, by_ref_bytes=0)
    with pytest.raises(ValueError):
        MessageQueueClient(client.handle, by_ref_owner="trainer")
    # Producer-owned: no re-owning copy, same values back; the flag travels with the item.
    producer_owned = MessageQueueClient(client.handle, by_ref_owner="producer")
    assert pickle.loads(pickle.dumps(producer_owned)).by_ref_owner == "producer"
    await producer_owned.put(items[4])
    raw = await client.handle.get_batch.remote(1, None, 1, None, None)
    assert raw[0].adopt is False
    await client.handle.requeue.remote(raw)
    assert await client.get() == items[4]
    ray.kill(client.handle)


async def test_item_ids_lists_queued_items_of_every_wire_form_without_taking_them() -> None:
    """`item_ids()` reads the ids of by-value and by-reference items, oldest first, and
    leaves them queued (~1 s)."""
    client = MessageQueueClient.create(maxsize=16)
    items = [_item(i, size) for i, size in enumerate([100, 3 * MIB, 16 * 1024])]
    await client.put_many(items)
    assert await client.item_ids() == ["s-0", "s-1", "s-2"]
    assert await client.size() == 3
    got = await client.get_batch(3, timeout=WAIT)
    assert [i.item_id for i in got] == ["s-0", "s-1", "s-2"]
    assert await client.item_ids() == []
    await client.close()


async def test_by_ref_items_survive_a_producer_that_exits() -> None:
    """A producer actor puts by-ref items and is killed; a consumer still receives them (the
    queue actor owns them). Control: an object the producer owned itself is lost (~3 s)."""
    client = MessageQueueClient.create(maxsize=16)
    producer = ShortLivedProducer.remote()
    items = [_item(i, MIB) for i in range(3)] + [_item(3, 100)]
    (own_ref,) = await producer.put_and_leak_a_ref.remote(client, items)
    ray.kill(producer, no_restart=True)
    for _ in range(100):  # until it is really gone
        try:
            await producer.put_and_leak_a_ref.remote(client, items)
        except ray.exceptions.RayActorError:
            break
        await asyncio.sleep(0.1)
    # The control: an object the producer owned is lost once Ray notices its owner died
    # (~1-2 s here); by then, producer-owned payloads would be lost from the queue too.
    deadline = time.monotonic() + WAIT
    lost: BaseException | None = None
    while lost is None and time.monotonic() < deadline:
        try:
            await asyncio.wait_for(own_ref, WAIT)
        except ray.exceptions.OwnerDiedError as exc:
            lost = exc
        await asyncio.sleep(0.2)
    assert lost is not None, "the control object outlived its owner"
    got = await asyncio.wait_for(client.get_batch(4, min_items=4), WAIT)
    assert got == items
    ray.kill(client.handle)


async def test_consumed_and_dropped_payloads_are_freed_from_the_object_store() -> None:
    """20 x 1 MiB by ref in one put_many: while queued they are in the object store, as ONE
    object (one per put call); once consumed, dropped as stale or dropped by a producer
    failure, none is left (~3 s)."""
    client = MessageQueueClient.create(maxsize=32)
    await client.size()
    before = await asyncio.to_thread(wait_for_objects, 0, 5.0)
    before_mib = (await asyncio.to_thread(plasma_usage))[0]
    await client.put_many([_item(i, MIB, version=i // 5) for i in range(20)])
    # The producer's own copy is freed once the queue actor owns its copy: one object left.
    assert await asyncio.to_thread(wait_for_objects, before + 1) == before + 1
    queued_mib = (await asyncio.to_thread(plasma_usage))[0]
    assert queued_mib >= before_mib + 19, (before_mib, queued_mib)
    got = await client.get_batch(10, current_version=3, max_staleness=1)  # drops versions 0, 1
    assert [i.item_id for i in got] == [f"s-{i}" for i in range(10, 20)]
    assert (await client.stats()).dropped == {"stale": 10}
    del got
    assert await asyncio.to_thread(wait_for_objects, before) <= before
    await client.put_many([_item(i, MIB) for i in range(20, 30)])
    assert (await asyncio.to_thread(plasma_usage))[0] >= before_mib + 9
    await client.close(RuntimeError("producer failed"))  # drops the 10 queued items
    assert await asyncio.to_thread(wait_for_objects, before) <= before
    ray.kill(client.handle)


async def test_no_by_ref_item_lost_or_doubled_when_gets_are_cancelled() -> None:
    """40 trials, 30 of them cancelling a consumer at random moments, also while it fetches
    payloads (every item goes by ref here: by_ref_bytes=1); each item is delivered once
    (~5 s)."""
    # Room for all 120 items: on a loaded machine most consumers are cancelled before they
    # take anything, and a put into a full queue (policy block) would wait forever here.
    client = MessageQueueClient.create(maxsize=128, by_ref_bytes=1)
    rng = random.Random(12)
    produced: list[str] = []
    delivered: list[str] = []
    serial = 0

    async def consume() -> None:
        batch = await client.get_batch(4, min_items=2)
        delivered.extend(item.item_id for item in batch)

    for trial in range(40):
        await client.put_many([_item(serial + k, 64 * 1024) for k in range(3)])
        produced.extend(f"s-{serial + k}" for k in range(3))
        serial += 3
        consumer = asyncio.create_task(consume())
        if trial % 4 == 3:
            # Left to finish: some trials deliver however loaded the machine (under load,
            # every consumer cancelled within 20 ms may have taken nothing yet).
            await asyncio.wait_for(consumer, WAIT)
        else:
            await asyncio.sleep(rng.random() * 0.02)
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        stats = await client.stats()
        assert stats.size + len(delivered) == len(produced), stats
    await client.close()
    rest: list[str] = []
    while True:
        try:
            rest += [i.item_id for i in await client.get_batch(64, timeout=5.0)]
        except QueueTimeout:
            pytest.fail("a closed queue must end with QueueClosed")
        except QueueClosed:
            break
    assert sorted(delivered + rest) == sorted(produced)
    assert 0 < len(delivered) < len(produced)  # some trials delivered, some were cancelled
    assert await _held_deliveries(client) == 0  # hand-backs release their deliveries too
    ray.kill(client.handle)


async def _held_deliveries(client: MessageQueueClient, at_most: int = 0) -> int:
    """The queue actor's held deliveries, once at most `at_most` (releases run in the
    background) or after `WAIT` s."""
    deadline = time.monotonic() + WAIT
    while (held := await client.handle.held_deliveries.remote()) > at_most:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    return held


async def test_a_delivery_holds_its_payloads_until_its_client_releases_them() -> None:
    """The queue actor keeps the payload refs a get delivered until the client says it has
    fetched them, so the payload object outlives every other reference to it; the clients
    release after each get, peek and hand-back (~3 s)."""
    client = MessageQueueClient.create(maxsize=16)
    before = await asyncio.to_thread(wait_for_objects, 0, 5.0)
    await client.put_many([_item(0, MIB), _item(1, 100)])
    raw = await client.handle.get_batch.remote(2, None, 2, None, None, "ticket-1")
    assert [type(e) for e in raw] == [ByRef, bytes]
    del raw  # no other reference is left: only the hold keeps the payload object
    assert await client.handle.held_deliveries.remote() == 1
    await asyncio.sleep(1.0)  # unheld, it would be freed by now (~0.1 s here)
    assert await asyncio.to_thread(plasma_objects) == before + 1
    await client.handle.release.remote("ticket-1")
    assert await client.handle.held_deliveries.remote() == 0
    assert await asyncio.to_thread(wait_for_objects, before) <= before

    items = [_item(i, MIB) for i in range(2, 6)]
    await client.put_many(items)
    assert await client.peek_all() == items
    assert await client.get_batch(2, min_items=2) == items[:2]
    sync = client.to_sync()  # the blocking client too, on a thread without a loop
    assert await asyncio.to_thread(sync.peek_all) == items[2:]
    assert await asyncio.to_thread(sync.get_batch, 2, min_items=2) == items[2:]
    assert await _held_deliveries(client) == 0
    ray.kill(client.handle)


async def test_an_unreleased_delivery_is_dropped_after_the_hold_limit(monkeypatch) -> None:
    """A client that died between a get's reply and its fetch never releases: the actor
    drops that hold once it is `DELIVERY_HOLD_S` old (bookkeeping only: the actor's class
    runs in this process here)."""
    from async_queue import actor

    queue = actor.QueueActor(4, "block")
    element = ByRef(0, b"", ray.put([b"payload"]), 0, adopt=False)
    assert queue._deliver("ticket-1", [element]) == [element]
    assert queue._deliver("ticket-2", [b"no refs"]) == [b"no refs"]  # nothing to hold
    assert await queue.held_deliveries() == 1
    monkeypatch.setattr(actor, "DELIVERY_HOLD_S", -1.0)
    assert await queue.held_deliveries() == 0


@ray.remote(num_cpus=0)
class _Slow:
    async def payloads(self, seconds: float) -> list[bytes]:
        await asyncio.sleep(seconds)
        return [b"late"]


async def test_a_payload_object_never_seen_here_is_fetched_through_the_queue(monkeypatch) -> None:
    """Ray's borrowing rarely never delivers a payload object to a consumer although its
    owner holds it. Here a real ref whose object does not exist yet stands for that: after
    `FETCH_STALL_S` both clients' fetches get it by value from `from_queue`, and stop
    waiting for the ref; an object that arrives in time never asks the queue (~2 s)."""
    from async_queue import _wire

    monkeypatch.setattr(_wire, "FETCH_STALL_S", 0.3)
    slow = _Slow.remote()
    stuck = slow.payloads.remote(30.0)
    here = ray.put([b"here"])
    header = _wire._header(_item(7, 8))
    elements = [ByRef(0, header, stuck, 0), ByRef(0, header, here, 0)]
    asked: list[list[bytes]] = []

    async def from_queue(object_ids: list[bytes]) -> list[list[bytes]]:
        asked.append(object_ids)
        return [[b"by value"]]

    items = await asyncio.wait_for(_wire.resolve(elements, from_queue), WAIT)
    assert [i.payload for i in items] == [b"by value", b"here"]
    assert asked == [[stuck.binary()]]  # only the object not seen here

    def from_queue_blocking(object_ids: list[bytes]) -> list[list[bytes]]:
        asked.append(object_ids)
        return [[b"by value, blocking"]]

    items = await asyncio.to_thread(_wire.from_wire_blocking, elements, from_queue_blocking)
    assert [i.payload for i in items] == [b"by value, blocking", b"here"]
    assert asked[1:] == [[stuck.binary()]]

    async def never(object_ids: list[bytes]) -> list[list[bytes]]:
        raise AssertionError("asked the queue for an object that arrived in time")

    assert [i.payload for i in await _wire.resolve([elements[1]], never)] == [b"here"]
    ray.kill(slow)


async def test_the_queue_hands_out_what_it_holds_for_a_delivery_by_value() -> None:
    """`held_payloads`: the values of the payload objects a get delivered, while the get
    holds them; after `release` the clients raise `PayloadUnavailable` (~2 s)."""
    from async_queue import PayloadUnavailable
    from async_queue.client import _from_queue, _from_queue_blocking

    client = MessageQueueClient.create(maxsize=16)
    items = [_item(0, MIB), _item(1, 200 * 1024)]
    await client.put_many(items[:1])
    await client.put(items[1])
    raw = await client.handle.get_batch.remote(2, None, 2, None, None, "ticket-1")
    ids = [e.ref.binary() for e in raw]
    assert len(set(ids)) == 2
    values = await _from_queue(client.handle, "ticket-1")(ids[::-1])
    assert [bytes(v[e.index]) for v, e in zip(values, raw[::-1], strict=True)] == [
        items[1].payload,
        items[0].payload,
    ]
    blocking = await asyncio.to_thread(_from_queue_blocking(client.handle, "ticket-1"), ids[:1])
    assert bytes(blocking[0][raw[0].index]) == items[0].payload
    await client.handle.release.remote("ticket-1")
    with pytest.raises(PayloadUnavailable, match="ticket-1"):
        await _from_queue(client.handle, "ticket-1")(ids)
    with pytest.raises(PayloadUnavailable):
        await asyncio.to_thread(_from_queue_blocking(client.handle, "ticket-1"), ids)
    ray.kill(client.handle)


def test_sync_client_by_reference() -> None:
    """The blocking client puts and gets by-ref items too (~1 s)."""
    client = SyncMessageQueueClient.create(maxsize=8, by_ref_bytes=1024)
    items = [_item(i, size) for i, size in enumerate([10, 1024, 200 * 1024])]
    client.put_many(items[:2])
    client.put(items[2])
    assert client.get_batch(3, min_items=3) == items
    assert client.to_async().by_ref_bytes == 1024
    memory = client.actor_memory()
    assert memory["peak_rss_bytes"] >= memory["rss_bytes"] > 0
    ray.kill(client.handle)


@pytest.mark.slow
async def test_stress_by_reference(stress) -> None:
    """The seeded stress (3 producers sharing one client, so single puts coalesce; timeouts,
    staleness) with half the items by ref, over 8 seeds: Ray rarely fails to deliver a
    payload object, and a get must then take it through the fetch fallback (~15 s)."""
    run_stress, check_stress = stress
    for seed in range(12, 20):
        client = MessageQueueClient.create(maxsize=12, by_ref_bytes=32)
        run = asyncio.ensure_future(run_stress(client, seed=seed, producer_ops=40))
        done, _ = await asyncio.wait({run}, timeout=120.0)
        if not done:
            # A hang: say where the queue stood and what was pending, before cancelling.
            stats = await asyncio.wait_for(client.stats(), 30.0)
            pending = await asyncio.wait_for(asyncio.to_thread(pending_references), 60.0)
            run.cancel()
            await asyncio.wait({run}, timeout=30.0)  # its gets hand their items back
            pytest.fail(f"seed {seed} did not finish in 120 s; queue: {stats}\n{pending}")
        check_stress(await run)  # done: returns at once
        assert await _held_deliveries(client) == 0  # every get released what it fetched
        ray.kill(client.handle)

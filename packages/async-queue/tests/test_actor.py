"""The queue actor through `MessageQueueClient`, on a real local Ray."""

from __future__ import annotations

import asyncio
import pickle
import uuid

import pytest
import ray
from async_queue import (
    MessageQueueClient,
    ProducerFailed,
    QueueClosed,
    QueueFull,
    QueueItem,
    QueueStats,
    QueueTimeout,
    SyncMessageQueueClient,
)

WAIT = 60.0  # generous "does not hang" bound (2 shared cores, Ray calls)

pytestmark = pytest.mark.usefixtures("ray_logs_dir")


def check_invariant(stats: QueueStats) -> None:
    assert stats.produced == stats.consumed + stats.dropped_total + stats.size, stats


async def wait_until_waiting(client: MessageQueueClient, seconds: float = 0.5) -> None:
    """Give callers time to reach the actor and block there."""
    await client.size()  # the actor is up
    await asyncio.sleep(seconds)


async def test_fifo_order_and_payload_round_trip(make_item) -> None:
    client = MessageQueueClient.create(maxsize=64)
    items = [make_item(i, version=i % 3, size=1024) for i in range(20)]
    await client.put(items[0])
    await client.put_many(items[1:])
    got = [await client.get()] + await client.get_batch(7) + await client.get_batch(100)
    assert got == items  # every field survives the trip, in order
    stats = await client.stats()
    assert (stats.produced, stats.consumed, stats.size) == (20, 20, 0)
    ray.kill(client.handle)


async def test_small_and_large_payloads_mixed_in_one_batch(make_item) -> None:
    """Small items travel encoded, large ones as structs (see _wire); both come back equal."""
    client = MessageQueueClient.create(maxsize=16)
    sizes = [16, 8 * 1024, 100, 300 * 1024, 8 * 1024 - 4]
    items = [make_item(i, version=i, size=size) for i, size in enumerate(sizes)]
    single = make_item(99, size=64 * 1024)
    await client.put_many(items)
    await client.put(single)
    got = await client.get_batch(16, min_items=6)
    assert got == [*items, single]
    assert [len(i.payload) for i in got] == [*sizes, 64 * 1024]
    stats = await client.stats()
    assert (stats.produced, stats.consumed) == (6, 6)
    ray.kill(client.handle)


async def test_block_policy_producer_waits_in_the_actor(make_item) -> None:
    client = MessageQueueClient.create(maxsize=2, policy="block")
    await client.put_many([make_item(0), make_item(1)])
    producer = asyncio.create_task(client.put_many([make_item(2), make_item(3)]))
    await wait_until_waiting(client)
    assert not producer.done()
    assert (await client.stats()).waiting_producers == 1
    assert [i.item_id for i in await client.get_batch(2)] == ["p-0", "p-1"]
    await asyncio.wait_for(producer, WAIT)
    assert [i.item_id for i in await client.get_batch(2, min_items=2)] == ["p-2", "p-3"]
    assert (await client.stats()).put_wait_s > 0
    ray.kill(client.handle)


async def test_drop_oldest_and_reject_policies_through_the_actor(make_item) -> None:
    dropping = MessageQueueClient.create(maxsize=3, policy="drop_oldest")
    await dropping.put_many([make_item(i) for i in range(5)])
    assert [i.item_id for i in await dropping.get_batch(5)] == ["p-2", "p-3", "p-4"]
    stats = await dropping.stats()
    assert stats.dropped == {"overflow": 2}
    check_invariant(stats)

    rejecting = MessageQueueClient.create(maxsize=3, policy="reject")
    await rejecting.put_many([make_item(0), make_item(1)])
    with pytest.raises(QueueFull) as caught:
        await rejecting.put_many([make_item(2), make_item(3)])
    assert type(caught.value) is QueueFull  # the package's own type, not a RayTaskError
    assert await rejecting.size() == 2
    assert (await rejecting.stats()).rejected == 2
    for handle in (dropping.handle, rejecting.handle):
        ray.kill(handle)


async def test_close_while_many_consumers_wait(make_item) -> None:
    client = MessageQueueClient.create(maxsize=8)

    async def iterate() -> list[str]:
        return [item.item_id async for item in client]

    waiters = [asyncio.create_task(client.get()) for _ in range(4)]
    waiters += [asyncio.create_task(client.get_batch(4, min_items=4)) for _ in range(4)]
    iterators = [asyncio.create_task(iterate()) for _ in range(2)]
    await wait_until_waiting(client)
    await client.close()
    results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), WAIT)
    assert [type(r) for r in results] == [QueueClosed] * len(waiters), results
    assert await asyncio.wait_for(asyncio.gather(*iterators), WAIT) == [[], []]
    with pytest.raises(QueueClosed):
        await client.put(make_item(0))
    assert (await client.stats()).closed
    ray.kill(client.handle)


async def test_a_blocked_put_many_closed_midway_says_how_many_were_enqueued(make_item) -> None:
    """`QueueClosed.enqueued` survives the trip from the actor to the caller."""
    client = MessageQueueClient.create(maxsize=2)
    producer = asyncio.create_task(client.put_many([make_item(i) for i in range(5)]))
    await wait_until_waiting(client)
    assert len(await client.get_batch(2)) == 2  # room for two more: four of five queued
    await wait_until_waiting(client)
    await client.close()
    with pytest.raises(QueueClosed) as refused:
        await asyncio.wait_for(producer, WAIT)
    assert refused.value.enqueued == 4
    assert [item.item_id for item in await client.get_batch(4)] == ["p-2", "p-3"]
    assert pickle.loads(pickle.dumps(refused.value)).enqueued == 4
    ray.kill(client.handle)


async def test_close_delivers_the_rest_then_a_partial_batch(make_item) -> None:
    client = MessageQueueClient.create(maxsize=16)
    await client.put_many([make_item(i) for i in range(6)])
    await client.close()
    assert len(await client.get_batch(4, min_items=4)) == 4
    assert len(await client.get_batch(4, min_items=4)) == 2
    with pytest.raises(QueueClosed):
        await client.get_batch(4, min_items=4)
    ray.kill(client.handle)


async def test_producer_failure_reaches_consumers_across_the_actor(make_item) -> None:
    client = MessageQueueClient.create(maxsize=16)
    waiting = asyncio.create_task(client.get_batch(8, min_items=8))
    await client.put_many([make_item(i) for i in range(3)])
    await wait_until_waiting(client, 0.2)
    await client.close(KeyError("reward model unreachable"))
    with pytest.raises(ProducerFailed) as caught:
        await asyncio.wait_for(waiting, WAIT)
    assert type(caught.value) is ProducerFailed
    assert caught.value.cause_type == "KeyError"
    assert "reward model unreachable" in str(caught.value)
    with pytest.raises(ProducerFailed):
        await client.get()
    stats = await client.stats()
    assert stats.failed
    assert stats.dropped == {"producer_failed": 3}
    check_invariant(stats)
    ray.kill(client.handle)


async def test_timeout_and_staleness_through_the_actor(make_item) -> None:
    client = MessageQueueClient.create(maxsize=16)
    with pytest.raises(QueueTimeout):
        await client.get(timeout=0.1)
    with pytest.raises(asyncio.TimeoutError):
        await client.get_batch(2, timeout=0.1, min_items=2)
    await client.put_many([make_item(i, version=v) for i, v in enumerate([1, 5, 2, 6])])
    stats = await client.stats()
    assert (stats.oldest_version, stats.newest_version) == (1, 6)
    batch = await client.get_batch(4, current_version=6, max_staleness=3)
    assert [i.version for i in batch] == [5, 6]
    stats = await client.stats()
    assert stats.dropped == {"stale": 2}
    # Their ids, for a producer to generate again; then only the drops after `since`.
    assert await client.stale_item_ids() == (2, ["p-0", "p-2"])
    assert await client.stale_item_ids(since=1) == (2, ["p-2"])
    assert await client.stale_item_ids(since=2) == (2, [])
    assert stats.get_wait_s >= 0.2
    check_invariant(stats)
    assert set(stats.as_metrics()) == {
        "queue/size",
        "queue/produced",
        "queue/consumed",
        "queue/dropped",
        "queue/put_wait_s",
        "queue/get_wait_s",
        "queue/waiting_consumers",
        "queue/waiting_producers",
    }
    ray.kill(client.handle)


async def test_a_refused_call_frees_its_error_when_the_caller_drops_it() -> None:
    """The queue's own error, re-raised from the Ray error, is in no reference cycle: dropped,
    it is gone at once (and with it the Ray error and call it holds), not at the next garbage
    collection. A cycle kept a finished call's object in the object store until one ran."""
    import gc
    import weakref

    client = MessageQueueClient.create(maxsize=4)
    gc.disable()
    try:
        for call in (lambda: client.get(timeout=0.05), lambda: client.get_batch(2, timeout=0.05)):
            try:
                await call()
            except QueueTimeout as error:
                dropped = weakref.ref(error)
            assert dropped() is None
    finally:
        gc.enable()
    ray.kill(client.handle)


async def test_hundreds_of_waiting_consumers_do_not_lock_out_the_producer(make_item) -> None:
    client = MessageQueueClient.create(maxsize=512)
    consumers = [asyncio.create_task(client.get()) for _ in range(300)]
    await wait_until_waiting(client, 1.0)
    await asyncio.wait_for(client.put_many([make_item(i) for i in range(300)]), WAIT)
    got = await asyncio.wait_for(asyncio.gather(*consumers), WAIT)
    assert sorted(item.item_id for item in got) == sorted(f"p-{i}" for i in range(300))
    ray.kill(client.handle)


async def test_named_queue_connect_and_pickle(make_item) -> None:
    name = f"aq-test-{uuid.uuid4().hex[:8]}"
    creator = MessageQueueClient.create(maxsize=8, name=name, namespace="aq-tests")
    await creator.put(make_item(1))
    found = await MessageQueueClient.connect(name, namespace="aq-tests")
    assert (await found.get()).item_id == "p-1"
    copy = pickle.loads(pickle.dumps(found))
    assert isinstance(copy, MessageQueueClient)
    await copy.put(make_item(2))
    assert await creator.size() == 1
    sync_copy = pickle.loads(pickle.dumps(found.to_sync()))
    assert isinstance(sync_copy, SyncMessageQueueClient)
    ray.kill(creator.handle)


async def test_bad_arguments_fail_in_the_caller(make_item) -> None:
    client = MessageQueueClient.create(maxsize=4)
    with pytest.raises(TypeError):
        await client.put(b"raw bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await client.get_batch(2, min_items=3)
    with pytest.raises(ValueError):
        await client.get_batch(2, max_staleness=1)
    with pytest.raises(ValueError):
        MessageQueueClient.create(policy="sometimes")
    with pytest.raises(ValueError):
        MessageQueueClient.create(detached=True)  # detached needs a name
    assert isinstance(make_item(0), QueueItem)
    ray.kill(client.handle)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["block", "drop_oldest", "reject"])
async def test_stress_through_the_actor(stress, policy: str) -> None:
    run_stress, check_stress = stress
    client = MessageQueueClient.create(maxsize=12, policy=policy)
    result = await asyncio.wait_for(
        run_stress(client, seed=3, producer_ops=60, producers=3, consumers=3), 180.0
    )
    assert result.operations >= 300
    check_stress(result)
    assert result.stats.consumed > 0
    ray.kill(client.handle)

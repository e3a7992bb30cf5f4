"""`MessageQueue` on its own (no Ray): ordering, policies, close, failure, staleness, stats."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from async_queue import (
    FullPolicy,
    MessageQueue,
    ProducerFailed,
    QueueClosed,
    QueueFull,
    QueueItem,
    QueueStats,
    QueueTimeout,
)

WAIT = 10.0  # generous "does not hang" bound


def check_invariant(stats: QueueStats) -> None:
    assert stats.produced == stats.consumed + stats.dropped_total + stats.size, stats


async def _settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_fifo_order_across_put_and_put_many(make_item) -> None:
    queue = MessageQueue(maxsize=100)
    await queue.put(make_item(0))
    await queue.put_many([make_item(i) for i in range(1, 10)])
    got = [await queue.get()] + await queue.get_batch(4) + await queue.get_batch(100)
    assert [item.item_id for item in got] == [f"p-{i}" for i in range(10)]
    stats = queue.stats()
    assert (stats.produced, stats.consumed, stats.size) == (10, 10, 0)
    check_invariant(stats)


async def test_block_policy_waits_for_room_and_counts_wait(make_item) -> None:
    queue = MessageQueue(maxsize=2, policy="block")
    await queue.put_many([make_item(0), make_item(1)])
    producer = asyncio.create_task(queue.put(make_item(2)))
    await asyncio.sleep(0.05)
    assert not producer.done()  # full: the producer waits
    assert (await queue.get()).item_id == "p-0"
    await asyncio.wait_for(producer, WAIT)
    assert [i.item_id for i in await queue.get_batch(5)] == ["p-1", "p-2"]
    stats = queue.stats()
    assert stats.put_wait_s >= 0.04
    assert stats.dropped_total == 0
    check_invariant(stats)


async def test_block_policy_batch_larger_than_maxsize_goes_through_in_order(make_item) -> None:
    queue = MessageQueue(maxsize=3)
    producer = asyncio.create_task(queue.put_many([make_item(i) for i in range(10)]))
    got: list[str] = []
    while len(got) < 10:
        got += [i.item_id for i in await asyncio.wait_for(queue.get_batch(2), WAIT)]
    await asyncio.wait_for(producer, WAIT)
    assert got == [f"p-{i}" for i in range(10)]


async def test_drop_oldest_policy_evicts_and_counts(make_item) -> None:
    queue = MessageQueue(maxsize=3, policy=FullPolicy.DROP_OLDEST)
    await queue.put_many([make_item(i) for i in range(4)])  # p-0 evicted
    await queue.put(make_item(4))  # p-1 evicted
    await queue.put_many([make_item(i) for i in range(5, 10)])  # 3 queued + p-5, p-6 evicted
    assert [i.item_id for i in await queue.get_batch(10)] == ["p-7", "p-8", "p-9"]
    stats = queue.stats()
    assert stats.dropped == {"overflow": 7}
    assert stats.produced == 10
    check_invariant(stats)


async def test_reject_policy_raises_and_enqueues_nothing(make_item) -> None:
    queue = MessageQueue(maxsize=3, policy="reject")
    await queue.put_many([make_item(0), make_item(1)])
    with pytest.raises(QueueFull):
        await queue.put_many([make_item(2), make_item(3)])  # room for 1 only: all refused
    await queue.put(make_item(2))
    with pytest.raises(QueueFull):
        await queue.put(make_item(3))
    assert [i.item_id for i in await queue.get_batch(10)] == ["p-0", "p-1", "p-2"]
    stats = queue.stats()
    assert (stats.rejected, stats.produced, stats.dropped_total) == (3, 3, 0)
    check_invariant(stats)


async def test_close_wakes_every_waiting_consumer_with_queue_closed(make_item) -> None:
    queue = MessageQueue(maxsize=8)

    async def iterate() -> int:
        count = 0
        while True:
            try:
                await queue.get()
            except QueueClosed:
                return count
            count += 1

    waiters = [asyncio.create_task(queue.get()) for _ in range(3)]
    waiters += [asyncio.create_task(queue.get_batch(4, min_items=4)) for _ in range(3)]
    iterator = asyncio.create_task(iterate())
    await _settle()
    await queue.close()
    results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), WAIT)
    assert all(type(r) is QueueClosed for r in results), results
    assert await asyncio.wait_for(iterator, WAIT) == 0
    with pytest.raises(QueueClosed):
        await queue.put(make_item(0))


async def test_close_drains_remaining_then_partial_batch_then_closed(make_item) -> None:
    queue = MessageQueue(maxsize=16)
    await queue.put_many([make_item(i) for i in range(7)])
    await queue.close()
    first = await queue.get_batch(4, min_items=4)
    final = await queue.get_batch(4, min_items=4)  # partial final batch after close
    assert [len(first), len(final)] == [4, 3]
    with pytest.raises(QueueClosed):
        await queue.get_batch(4, min_items=4)
    with pytest.raises(QueueClosed):
        await queue.get()
    assert queue.stats().closed
    check_invariant(queue.stats())


async def test_producer_failure_reaches_waiting_and_later_consumers(make_item) -> None:
    queue = MessageQueue(maxsize=16)
    waiting = asyncio.create_task(queue.get_batch(8, min_items=8))
    await queue.put_many([make_item(i) for i in range(5)])
    await _settle()
    await queue.close(ValueError("tokenizer exploded"))
    with pytest.raises(ProducerFailed) as caught:
        await asyncio.wait_for(waiting, WAIT)
    assert caught.value.cause_type == "ValueError"
    assert "tokenizer exploded" in str(caught.value)
    assert "ValueError" in str(caught.value)
    with pytest.raises(ProducerFailed):
        await queue.get()  # queued items are not delivered after a failure
    with pytest.raises(QueueClosed):
        await queue.put(make_item(9))
    await queue.close()  # a later normal close does not hide the failure
    stats = queue.stats()
    assert stats.failed
    assert stats.closed
    assert stats.dropped == {"producer_failed": 5}
    assert stats.failure is not None
    assert "tokenizer exploded" in stats.failure
    check_invariant(stats)


async def test_failure_after_normal_close_wins(make_item) -> None:
    queue = MessageQueue(maxsize=4)
    await queue.put(make_item(0))
    await queue.close()
    await queue.close("rollouter crashed")
    with pytest.raises(ProducerFailed, match="rollouter crashed"):
        await queue.get()


async def test_get_timeout_raises_and_takes_nothing(make_item) -> None:
    queue = MessageQueue(maxsize=8)
    with pytest.raises(QueueTimeout):
        await queue.get(timeout=0.05)
    with pytest.raises(asyncio.TimeoutError):  # QueueTimeout is a TimeoutError
        await queue.get(timeout=0.01)
    await queue.put_many([make_item(0), make_item(1)])
    with pytest.raises(QueueTimeout):
        await queue.get_batch(4, timeout=0.05, min_items=3)
    assert queue.qsize() == 2  # nothing was taken by the timed-out call
    assert queue.stats().get_wait_s >= 0.1


async def test_min_items_waits_for_a_full_batch(make_item) -> None:
    queue = MessageQueue(maxsize=16)
    consumer = asyncio.create_task(queue.get_batch(4, min_items=4))
    for i in range(3):
        await queue.put(make_item(i))
        await _settle()
        assert not consumer.done()
    await queue.put_many([make_item(3), make_item(4)])
    batch = await asyncio.wait_for(consumer, WAIT)
    assert [i.item_id for i in batch] == ["p-0", "p-1", "p-2", "p-3"]
    assert queue.qsize() == 1


async def test_get_batch_returns_what_is_there_up_to_n(make_item) -> None:
    queue = MessageQueue(maxsize=16)
    await queue.put_many([make_item(i) for i in range(3)])
    assert len(await queue.get_batch(10)) == 3


async def test_on_stale_sees_every_item_dropped_as_too_stale(make_item) -> None:
    seen: list[str] = []
    queue = MessageQueue(maxsize=16, on_stale=lambda items: seen.extend(i.item_id for i in items))
    await queue.put_many([make_item(i, version=v) for i, v in enumerate([0, 3, 1, 4, 5])])
    await queue.get_batch(10, current_version=5, max_staleness=2)
    assert seen == ["p-0", "p-2"]


async def test_staleness_drops_are_counted_and_wait_continues(make_item) -> None:
    queue = MessageQueue(maxsize=16)
    await queue.put_many([make_item(i, version=v) for i, v in enumerate([0, 3, 1, 4, 5])])
    assert (queue.stats().oldest_version, queue.stats().newest_version) == (0, 5)
    # current 5, max_staleness 2: versions < 3 are stale (p-0 v0, p-2 v1).
    batch = await queue.get_batch(10, current_version=5, max_staleness=2)
    assert [(i.item_id, i.version) for i in batch] == [("p-1", 3), ("p-3", 4), ("p-4", 5)]
    stats = queue.stats()
    assert stats.dropped == {"stale": 2}
    assert (stats.oldest_version, stats.newest_version) == (None, None)  # empty queue
    check_invariant(stats)

    # A waiting consumer drops stale arrivals and keeps waiting for fresh ones.
    consumer = asyncio.create_task(
        queue.get_batch(2, min_items=2, current_version=10, max_staleness=1)
    )
    await queue.put_many([make_item(20, version=8), make_item(21, version=9)])
    await _settle()
    assert not consumer.done()
    await queue.put_many([make_item(22, version=10), make_item(23, version=8)])
    await queue.put(make_item(24, version=11))
    batch = await asyncio.wait_for(consumer, WAIT)
    assert [i.item_id for i in batch] == ["p-21", "p-22"]
    assert queue.stats().dropped == {"stale": 4}
    check_invariant(queue.stats())


async def test_staleness_arguments_are_validated(make_item) -> None:
    queue = MessageQueue(maxsize=4)
    with pytest.raises(ValueError):
        await queue.get_batch(2, current_version=3)
    with pytest.raises(ValueError):
        await queue.get_batch(2, min_items=3)
    with pytest.raises(ValueError):
        await queue.get_batch(8, min_items=8)  # can never be met with maxsize 4
    with pytest.raises(ValueError):
        MessageQueue(maxsize=0)
    with pytest.raises(ValueError):
        MessageQueue(policy="sometimes")


async def test_blocked_producer_gets_queue_closed_on_close(make_item) -> None:
    queue = MessageQueue(maxsize=1)
    await queue.put(make_item(0))
    producer = asyncio.create_task(queue.put(make_item(1)))
    await _settle()
    await queue.close()
    with pytest.raises(QueueClosed):
        await asyncio.wait_for(producer, WAIT)
    assert (await queue.get()).item_id == "p-0"


async def test_a_close_during_a_blocked_put_many_says_how_many_were_enqueued(make_item) -> None:
    queue = MessageQueue(maxsize=2)
    producer = asyncio.create_task(queue.put_many([make_item(i) for i in range(5)]))
    await _settle()
    assert len(await queue.get_batch(2)) == 2  # room for the third and fourth, not the fifth
    await _settle()
    await queue.close()
    with pytest.raises(QueueClosed) as refused:
        await asyncio.wait_for(producer, WAIT)
    assert refused.value.enqueued == 4
    assert "4 item(s) of this call were enqueued" in str(refused.value)
    assert [item.item_id for item in await queue.get_batch(4)] == ["p-2", "p-3"]
    assert queue.stats().produced == 4
    with pytest.raises(QueueClosed) as after:  # a put on a closed queue queued nothing
        await queue.put(make_item(9))
    assert after.value.enqueued == 0
    assert str(after.value) == "queue is closed; put refused"


async def test_stats_metrics_use_the_design_names(make_item) -> None:
    queue = MessageQueue(maxsize=2, policy="drop_oldest")
    await queue.put_many([make_item(i) for i in range(3)])
    await queue.get()
    metrics = queue.stats().as_metrics()
    assert metrics == {
        "queue/size": 1.0,
        "queue/produced": 3.0,
        "queue/consumed": 1.0,
        "queue/dropped": 1.0,
        "queue/put_wait_s": 0.0,
        "queue/get_wait_s": 0.0,
        "queue/waiting_consumers": 0.0,
        "queue/waiting_producers": 0.0,
    }
    assert all(isinstance(v, float) for v in metrics.values())


async def test_stats_count_waiting_consumers_and_producers(make_item) -> None:
    queue = MessageQueue(maxsize=2)
    await queue.put(make_item(0))
    consumers = [asyncio.create_task(queue.get_batch(2, min_items=2)) for _ in range(3)]
    await _settle()
    stats = queue.stats()
    assert (stats.waiting_consumers, stats.waiting_producers) == (3, 0)
    assert stats.as_metrics()["queue/waiting_consumers"] == 3.0
    consumers[0].cancel()  # a cancelled wait no longer counts
    with pytest.raises(QueueTimeout):  # nor does a timed-out one
        await queue.get_batch(2, timeout=0.01, min_items=2)
    await _settle()
    assert queue.stats().waiting_consumers == 2
    await queue.close()
    await asyncio.gather(*consumers, return_exceptions=True)
    assert queue.stats().waiting_consumers == 0

    full = MessageQueue(maxsize=1)
    await full.put(make_item(0))
    producers = [asyncio.create_task(full.put(make_item(i))) for i in (1, 2)]
    await _settle()
    stats = full.stats()
    assert (stats.waiting_consumers, stats.waiting_producers) == (0, 2)
    assert stats.as_metrics()["queue/waiting_producers"] == 2.0
    await full.get()  # room for one of them
    await _settle()
    assert full.stats().waiting_producers == 1
    await full.close()
    await asyncio.gather(*producers, return_exceptions=True)
    assert full.stats().waiting_producers == 0


async def test_requeue_puts_items_back_at_the_head_as_not_consumed(make_item) -> None:
    queue = MessageQueue(maxsize=3)
    await queue.put_many([make_item(i, version=i) for i in range(3)])
    taken = await queue.get_batch(2)
    await queue.put(make_item(3, version=3))  # the queue is full again
    await queue.requeue(taken)  # may exceed maxsize: these were queued a moment ago
    stats = queue.stats()
    assert (stats.size, stats.consumed, stats.requeued, stats.oldest_version) == (4, 0, 2, 0)
    check_invariant(stats)
    await queue.close()  # a closed queue still delivers what was handed back
    assert [i.item_id for i in await queue.get_batch(10)] == ["p-0", "p-1", "p-2", "p-3"]
    check_invariant(queue.stats())

    failing = MessageQueue(maxsize=4)
    await failing.put_many([make_item(0), make_item(1)])
    taken = await failing.get_batch(1)
    await failing.close(RuntimeError("producer died"))
    await failing.requeue(taken)  # after a failure: dropped like the rest, never delivered
    stats = failing.stats()
    assert (stats.size, stats.consumed, stats.dropped) == (0, 0, {"producer_failed": 2})
    check_invariant(stats)


def test_item_id_keeps_its_schema_1_wire_name() -> None:
    """`item_id` was `sample_id`; the wire keeps that name, so older producers still decode."""
    encoded = msgspec.msgpack.encode(
        QueueItem(payload=b"x", version=3, item_id="g7", produced_at=1.0)
    )
    wire = msgspec.msgpack.decode(encoded)
    assert wire["sample_id"] == "g7" and "item_id" not in wire
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=QueueItem).item_id == "g7"

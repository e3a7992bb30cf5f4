"""The async client inside other async Ray actors, across processes, with a check that Ray
never warned about a blocking `ray.get` inside those actors (read from their log files).

The log check is shown to work: a control actor that *does* call `ray.get` inside an async
method must be caught by the same check, and each checked actor prints a marker line after its
work that the check must find in that actor's own log files.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path

import pytest
import ray
from async_queue import (
    MessageQueueClient,
    ProducerFailed,
    QueueItem,
    SyncClientInEventLoopError,
)

BLOCKING_WARNING = "Using blocking ray.get inside async actor"
WAIT = 120.0


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, queue: MessageQueueClient) -> None:
        self.queue = queue

    async def produce(self, count: int, batch: int) -> int:
        serial = 0
        while serial < count:
            size = 1 if serial % 3 == 0 else batch
            items = [
                QueueItem(payload=os.urandom(1024), version=serial // 10, item_id=str(n))
                for n in range(serial, min(serial + size, count))
            ]
            if len(items) == 1:
                await self.queue.put(items[0])
            else:
                await self.queue.put_many(items)
            serial += len(items)
        await self.queue.close()
        return serial

    async def fail(self, message: str) -> None:
        await self.queue.close(RuntimeError(message))

    async def marker(self, text: str) -> int:
        print(text, file=sys.stderr, flush=True)
        return os.getpid()


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self, queue: MessageQueueClient) -> None:
        self.queue = queue

    async def consume(self, batch: int) -> list[str]:
        ids = [item.item_id for item in await self.queue.get_batch(batch, min_items=batch)]
        ids += [item.item_id async for item in self.queue]
        return ids

    async def wait_for_failure(self) -> list[str]:
        try:
            async for _ in self.queue:
                pass
        except ProducerFailed as exc:
            return [type(exc).__name__, str(exc)]
        return ["ended without failure"]

    async def sync_client_in_loop(self) -> list[str]:
        try:
            self.queue.to_sync().size()
        except SyncClientInEventLoopError as exc:
            return [type(exc).__name__, str(exc)]
        return ["no error"]

    async def marker(self, text: str) -> int:
        print(text, file=sys.stderr, flush=True)
        return os.getpid()


@ray.remote(num_cpus=0)
class BlockingControl:
    """Deliberately wrong: a blocking ray.get inside an async actor method."""

    async def blocking_get(self) -> int:
        return ray.get(ray.put(41)) + 1  # blocking-on-purpose

    async def marker(self, text: str) -> int:
        print(text, file=sys.stderr, flush=True)
        return os.getpid()


def worker_logs(logs_dir: Path, pid: int) -> str:
    """Everything Ray logged for the worker process `pid` (stdout, stderr, core logs)."""
    pattern = re.compile(rf"[-_]{pid}\.(out|err|log)$")
    texts = [
        path.read_text(errors="replace")
        for path in sorted(logs_dir.glob("*"))
        if path.is_file() and pattern.search(path.name)
    ]
    return "\n".join(texts)


async def logs_after_marker(logs_dir: Path, actor: ray.actor.ActorHandle) -> str:
    """Print a unique marker in `actor` after its work, wait until it is in its log files,
    and return those logs (anything the actor logged before is in them by then)."""
    marker = f"aq-log-marker-{time.time_ns()}"
    pid = await actor.marker.remote(marker)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(worker_logs, logs_dir, pid)
        if marker in text:
            return text
        await asyncio.sleep(0.2)
    pytest.fail(f"marker never reached the log files of pid {pid} under {logs_dir}")


@pytest.mark.slow
async def test_client_inside_async_actors_never_blocks_their_loops(ray_logs_dir: Path) -> None:
    queue = MessageQueueClient.create(maxsize=32)
    producer = Producer.remote(queue)
    consumer = Consumer.remote(queue)
    consumed, produced = await asyncio.wait_for(
        asyncio.gather(consumer.consume.remote(8), producer.produce.remote(500, 16)), WAIT
    )
    assert produced == 500
    assert consumed == [str(n) for n in range(500)]
    stats = await queue.stats()
    assert (stats.produced, stats.consumed, stats.size, stats.closed) == (500, 500, 0, True)

    # The sync client refuses to run on the actor's loop instead of blocking it.
    error_type, message = await consumer.sync_client_in_loop.remote()
    assert error_type == "SyncClientInEventLoopError"
    assert "MessageQueueClient" in message

    for actor in (producer, consumer):
        text = await logs_after_marker(ray_logs_dir, actor)
        assert BLOCKING_WARNING not in text

    # Control: the same check catches a real blocking ray.get inside an async actor.
    control = BlockingControl.remote()
    assert await control.blocking_get.remote() == 42
    assert BLOCKING_WARNING in await logs_after_marker(ray_logs_dir, control)
    for actor in (producer, consumer, control, queue.handle):
        ray.kill(actor)


async def test_producer_actor_failure_reaches_consumer_actor(ray_logs_dir: Path) -> None:
    queue = MessageQueueClient.create(maxsize=8)
    producer = Producer.remote(queue)
    consumer = Consumer.remote(queue)
    waiting = consumer.wait_for_failure.remote()
    await queue.put(QueueItem(payload=b"x", version=0, item_id="0"))
    await producer.fail.remote("vLLM engine died")
    error_type, message = await asyncio.wait_for(waiting, WAIT)
    assert error_type == "ProducerFailed"
    assert "RuntimeError" in message
    assert "vLLM engine died" in message
    stats = await queue.stats()
    assert stats.failed
    assert stats.produced == stats.consumed + stats.dropped_total + stats.size
    for actor in (producer, consumer, queue.handle):
        ray.kill(actor)

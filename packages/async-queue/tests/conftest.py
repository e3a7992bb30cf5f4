"""Shared fixtures. Core tests need no Ray; actor tests use one local Ray per session."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from async_queue import (
    ProducerFailed,
    QueueClosed,
    QueueFull,
    QueueItem,
    QueueStats,
    QueueTimeout,
)

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def _make_item(index: int, version: int = 0, size: int = 8, producer: str = "p") -> QueueItem:
    """An item whose item_id records who made it and in which order."""
    return QueueItem(
        payload=index.to_bytes(4, "little") * (size // 4 or 1),
        version=version,
        item_id=f"{producer}-{index}",
        metadata={"producer": producer},
    )


@pytest.fixture(scope="session")
def make_item() -> Callable[..., QueueItem]:
    """`make_item(index, version=0, size=8, producer="p")` -> QueueItem "producer-index"."""
    return _make_item


@pytest.fixture(scope="session")
def ray_logs_dir() -> Iterator[Path]:
    """Start (or reuse) a local Ray; yield its session log directory.

    A private, short temp dir per test session: this never joins another person's cluster
    (ray.init looks for one under its temp dir) and its logs are only ours.
    """
    import ray

    temp_dir = None
    if not ray.is_initialized():
        temp_dir = tempfile.mkdtemp(prefix="aqtest", dir="/tmp")
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _temp_dir=temp_dir,
            log_to_driver=True,
        )
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    yield logs
    if temp_dir is not None:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# ---------------------------------------------------------------------- seeded stress


@dataclass
class StressResult:
    """What the producers put, what the consumers got, and how it ended."""

    produced_ids: list[str] = field(default_factory=list)
    rejected: int = 0
    consumed: dict[str, list[str]] = field(default_factory=dict)  # consumer -> sample ids
    consumer_endings: list[str] = field(default_factory=list)  # "closed" | "failed"
    operations: int = 0
    stats: QueueStats | None = None


async def _stats_of(queue: Any) -> QueueStats:
    stats = queue.stats()
    return await stats if inspect.isawaitable(stats) else stats


async def run_stress(
    queue: Any,
    *,
    seed: int,
    producer_ops: int,
    producers: int = 3,
    consumers: int = 3,
    max_staleness: int = 2,
    fail_at: int | None = None,
) -> StressResult:
    """Random puts/put_manys and gets/get_batches (with timeouts and staleness) at once.

    Works on `MessageQueue` and on `MessageQueueClient` (same async API). Producers bump a
    shared policy version now and then. When all producers are done the queue is closed
    (or, with `fail_at`, producer 0 fails it after that many operations) and the consumers
    drain it until `QueueClosed` / `ProducerFailed`.
    """
    rng = random.Random(seed)
    result = StressResult()
    version = [0]

    async def produce(index: int, prng: random.Random) -> None:
        name = f"p{index}"
        serial = 0
        for op in range(producer_ops):
            if fail_at is not None and index == 0 and op == fail_at:
                await queue.close(RuntimeError(f"{name} crashed at op {op}"))
                return
            if prng.random() < 0.05:
                version[0] += 1
            count = 1 if prng.random() < 0.5 else prng.randint(1, 8)
            batch = [
                QueueItem(
                    payload=bytes(prng.randint(0, 64)),
                    version=version[0] - prng.randint(0, 3),
                    item_id=f"{name}-{serial + k}",
                )
                for k in range(count)
            ]
            serial += count
            result.operations += 1
            try:
                if count == 1 and prng.random() < 0.5:
                    await queue.put(batch[0])
                else:
                    await queue.put_many(batch)
            except QueueFull:
                result.rejected += count
                await asyncio.sleep(prng.random() * 0.002)  # back off: let consumers make room
                continue
            except QueueClosed as closed:
                # Another producer failed the queue; a blocked put_many may have queued a head.
                result.produced_ids.extend(item.item_id for item in batch[: closed.enqueued])
                return
            result.produced_ids.extend(item.item_id for item in batch)
            if prng.random() < 0.3:
                await asyncio.sleep(prng.random() * 0.002)

    async def consume(index: int, prng: random.Random) -> None:
        got = result.consumed.setdefault(f"c{index}", [])
        while True:
            result.operations += 1
            roll = prng.random()
            try:
                if roll < 0.3:
                    got.append((await queue.get(timeout=prng.random() * 0.01)).item_id)
                elif roll < 0.95:
                    n = prng.randint(1, 8)
                    stale = prng.random() < 0.3
                    batch = await queue.get_batch(
                        n,
                        timeout=prng.random() * 0.02,
                        min_items=prng.randint(1, n),
                        current_version=version[0] if stale else None,
                        max_staleness=max_staleness if stale else None,
                    )
                    assert batch, "get_batch never returns an empty list"
                    got.extend(item.item_id for item in batch)
                else:
                    stats = await _stats_of(queue)
                    assert stats.produced == stats.consumed + stats.dropped_total + stats.size
            except QueueTimeout:
                pass
            except QueueClosed:
                result.consumer_endings.append("closed")
                return
            except ProducerFailed:
                result.consumer_endings.append("failed")
                return

    consumer_tasks = [
        asyncio.create_task(consume(i, random.Random(rng.random()))) for i in range(consumers)
    ]
    await asyncio.gather(*(produce(i, random.Random(rng.random())) for i in range(producers)))
    await queue.close()  # no-op after a failure
    await asyncio.gather(*consumer_tasks)
    result.stats = await _stats_of(queue)
    return result


def check_stress(result: StressResult, *, failed: bool = False) -> None:
    """Every item accounted for exactly once, per-producer FIFO order, all consumers ended."""
    stats = result.stats
    assert stats is not None
    assert stats.produced == stats.consumed + stats.dropped_total + stats.size, stats
    assert stats.size == 0
    assert stats.produced == len(result.produced_ids)
    assert stats.rejected == result.rejected
    consumed = [sid for ids in result.consumed.values() for sid in ids]
    assert len(consumed) == len(set(consumed)) == stats.consumed
    assert set(consumed) <= set(result.produced_ids)
    for ids in result.consumed.values():  # the queue is FIFO: each producer's order holds
        last: dict[str, int] = {}
        for sid in ids:
            producer, serial = sid.rsplit("-", 1)
            assert int(serial) > last.get(producer, -1), (producer, serial, last)
            last[producer] = int(serial)
    assert result.consumer_endings == ["failed" if failed else "closed"] * len(result.consumed)


@pytest.fixture(scope="session")
def stress() -> tuple[Callable[..., Any], Callable[..., None]]:
    """(run_stress, check_stress): see their docstrings."""
    return run_stress, check_stress

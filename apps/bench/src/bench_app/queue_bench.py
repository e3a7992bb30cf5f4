"""Queue actor vs `ray.util.queue.Queue`: items/s and put-to-get latency, same run, same work.

One producer actor and one consumer actor move N `QueueItem`s (1 KiB and 256 KiB payloads)
through each queue, one item per call and in batches. Throughput is
`N / (consumer's last receive - producer's start)`; latency is `receive time - produced_at`
per item (one clock: all actors run on this machine). Both queues are bounded by the same
`maxsize`, so latency includes the time an item waits in a full queue.

How each side is driven (its natural API, and the baseline's best use of it):
- async_queue: async actors, `await client.put/put_many`, `await client.get/get_batch(n)`;
  a full queue makes the producer wait inside the actor, an empty one the consumer.
- ray.util.queue.Queue, single: async actors, `await q.put_async(item)` / `q.get_async()`.
- ray.util.queue.Queue, batched: its batch calls are synchronous (`put_nowait_batch`,
  `get_nowait_batch`), so they run in plain (threaded) actors. The producer retries after
  1 ms when the batch does not fit (`Full`). The consumer first tries `get_nowait_batch(n)`
  (one call when there is a backlog); on `Empty` it blocks in `get()` for one item, then takes
  `min(qsize, n - 1)` more.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench_app.report import BenchReport

__all__ = ["run"]

TARGET_ITEMS_S = 5_000.0  # batched 1 KiB through the actor
TARGET_RATIO = 3.0  # vs ray.util.queue.Queue doing the same
RETRY_S = 0.001  # ray queue producer back-off when a batch does not fit


@dataclass(frozen=True)
class Case:
    """One measured configuration; `rounds` > 1 keeps the median run of each queue."""

    payload_bytes: int
    batch: int  # 1: single-item calls
    items: int
    maxsize: int
    rounds: int = 1

    @property
    def label(self) -> str:
        size = f"{self.payload_bytes // 1024} KiB"
        return f"{size} {'batched x' + str(self.batch) if self.batch > 1 else 'single'}"

    @property
    def key(self) -> str:
        mode = "batched" if self.batch > 1 else "single"
        return f"{mode}_{self.payload_bytes // 1024}k"


@dataclass(frozen=True)
class Contender:
    """A queue under test: how to make one, and its (producer, consumer) actor classes."""

    make_queue: Callable[[Case], Any]
    single: tuple[Any, Any]
    batched: tuple[Any, Any]


def _cases(quick: bool) -> list[Case]:
    scale = 0.2 if quick else 1.0

    def n(count: int) -> int:
        return max(int(count * scale), 50)

    # 64 x 1 KiB keeps each call under Ray's 100 KiB inline limit (bigger goes via plasma).
    return [
        Case(payload_bytes=1024, batch=64, items=n(8_000), maxsize=512, rounds=3),
        Case(payload_bytes=1024, batch=1, items=n(1_000), maxsize=512),
        Case(payload_bytes=256 * 1024, batch=8, items=n(600), maxsize=32),
        Case(payload_bytes=256 * 1024, batch=1, items=n(200), maxsize=32),
    ]


def _define_contenders() -> dict[str, Contender]:
    """The producer/consumer actors (defined lazily: importing the module starts no Ray)."""
    import ray
    from async_queue import MessageQueueClient, QueueItem
    from ray.util.queue import Empty, Full, Queue

    def make_batch(payload: bytes, start: int, count: int) -> list[QueueItem]:
        now = time.time()
        return [
            QueueItem(payload=payload, version=0, sample_id=str(i), produced_at=now)
            for i in range(start, start + count)
        ]

    @ray.remote(num_cpus=0)
    class AsyncQueueProducer:
        async def run(self, queue: MessageQueueClient, case: Case) -> float:
            payload = os.urandom(case.payload_bytes)
            started = time.time()
            for start in range(0, case.items, case.batch):
                batch = make_batch(payload, start, min(case.batch, case.items - start))
                if case.batch == 1:
                    await queue.put(batch[0])
                else:
                    await queue.put_many(batch)
            return started

    @ray.remote(num_cpus=0)
    class AsyncQueueConsumer:
        async def run(self, queue: MessageQueueClient, case: Case) -> tuple[float, list[float]]:
            latencies: list[float] = []
            while len(latencies) < case.items:
                if case.batch == 1:
                    items = [await queue.get()]
                else:
                    items = await queue.get_batch(case.batch)
                now = time.time()
                latencies.extend(now - item.produced_at for item in items)
            return time.time(), latencies

    @ray.remote(num_cpus=0)
    class RayQueueAsyncProducer:
        async def run(self, queue: Queue, case: Case) -> float:
            payload = os.urandom(case.payload_bytes)
            started = time.time()
            for start in range(case.items):
                await queue.put_async(make_batch(payload, start, 1)[0])
            return started

    @ray.remote(num_cpus=0)
    class RayQueueAsyncConsumer:
        async def run(self, queue: Queue, case: Case) -> tuple[float, list[float]]:
            latencies: list[float] = []
            while len(latencies) < case.items:
                item = await queue.get_async()
                latencies.append(time.time() - item.produced_at)
            return time.time(), latencies

    @ray.remote(num_cpus=0)
    class RayQueueBatchProducer:
        def run(self, queue: Queue, case: Case) -> float:
            payload = os.urandom(case.payload_bytes)
            started = time.time()
            for start in range(0, case.items, case.batch):
                batch = make_batch(payload, start, min(case.batch, case.items - start))
                while True:
                    try:
                        queue.put_nowait_batch(batch)
                        break
                    except Full:
                        time.sleep(RETRY_S)
            return started

    @ray.remote(num_cpus=0)
    class RayQueueBatchConsumer:
        def run(self, queue: Queue, case: Case) -> tuple[float, list[float]]:
            latencies: list[float] = []
            while len(latencies) < case.items:
                want = min(case.batch, case.items - len(latencies))
                try:  # a backlog: one call takes a whole batch
                    items = queue.get_nowait_batch(want)
                except Empty:  # fewer than `want`: block for one, then take what is there
                    items = [queue.get()]
                    more = min(queue.qsize(), want - 1)
                    if more:
                        items += queue.get_nowait_batch(more)
                now = time.time()
                latencies.extend(now - item.produced_at for item in items)
            return time.time(), latencies

    return {
        "async_queue": Contender(
            make_queue=lambda case: MessageQueueClient.create(maxsize=case.maxsize),
            single=(AsyncQueueProducer, AsyncQueueConsumer),
            batched=(AsyncQueueProducer, AsyncQueueConsumer),
        ),
        "ray_queue": Contender(
            make_queue=lambda case: Queue(maxsize=case.maxsize),
            single=(RayQueueAsyncProducer, RayQueueAsyncConsumer),
            batched=(RayQueueBatchProducer, RayQueueBatchConsumer),
        ),
    }


async def _measure(name: str, contender: Contender, case: Case) -> dict[str, Any]:
    """One run: fresh queue and actors, all warmed up before the clock starts."""
    import ray
    from async_queue import MessageQueueClient

    producer_cls, consumer_cls = contender.single if case.batch == 1 else contender.batched
    queue = contender.make_queue(case)
    producer, consumer = producer_cls.remote(), consumer_cls.remote()
    if isinstance(queue, MessageQueueClient):
        await queue.size()
        queue_handle = queue.handle
    else:
        queue_handle = queue.actor
        await queue_handle.qsize.remote()
    await asyncio.gather(producer.__ray_ready__.remote(), consumer.__ray_ready__.remote())

    consumer_ref = consumer.run.remote(queue, case)
    started = await producer.run.remote(queue, case)
    finished, latencies = await consumer_ref
    elapsed = finished - started
    for handle in (producer, consumer, queue_handle):
        ray.kill(handle)
    latencies.sort()
    items_s = case.items / elapsed
    return {
        "queue": name,
        "case": case.label,
        "items": case.items,
        "items/s": items_s,
        "MiB/s": items_s * case.payload_bytes / 2**20,
        "p50 ms": 1e3 * statistics.median(latencies),
        "p99 ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "wall s": elapsed,
    }


async def _run_all(cases: list[Case]) -> list[dict[str, Any]]:
    """Each case `rounds` times, the two queues alternating who goes first; per queue the
    run with the median items/s is kept (the machine is shared: single runs are noisy)."""
    contenders = _define_contenders()
    rows: list[dict[str, Any]] = []
    for case in cases:
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
        for round_index in range(case.rounds):
            order = list(contenders)
            if round_index % 2:
                order.reverse()
            for name in order:
                runs[name].append(await _measure(name, contenders[name], case))
        for measured in runs.values():
            ranked = sorted(measured, key=lambda row: row["items/s"])
            rows.append({**ranked[len(ranked) // 2], "rounds": case.rounds})
    return rows


def _figures(cases: list[Case], rows: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    figures: dict[str, Any] = {"quick": quick}
    by_case = {(row["queue"], row["case"]): row for row in rows}
    for case in cases:
        ours = by_case[("async_queue", case.label)]
        theirs = by_case[("ray_queue", case.label)]
        ratio = ours["items/s"] / theirs["items/s"]
        ours["vs ray queue"] = f"{ratio:.2f}x"
        figures[f"{case.key}_items_s"] = round(ours["items/s"], 1)
        figures[f"ray_queue_{case.key}_items_s"] = round(theirs["items/s"], 1)
        figures[f"ratio_{case.key}"] = round(ratio, 2)
        for who, row in (("", ours), ("ray_queue_", theirs)):
            figures[f"{who}{case.key}_p50_ms"] = round(row["p50 ms"], 2)
            figures[f"{who}{case.key}_p99_ms"] = round(row["p99 ms"], 2)
    figures["target_items_s"] = TARGET_ITEMS_S
    figures["target_ratio"] = TARGET_RATIO
    figures["met_items_s"] = figures["batched_1k_items_s"] >= TARGET_ITEMS_S
    figures["met_ratio"] = figures["ratio_batched_1k"] >= TARGET_RATIO
    figures["met"] = figures["met_items_s"] and figures["met_ratio"]
    return figures


def run(quick: bool) -> BenchReport:
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    temp_dir = None
    if not ray.is_initialized():
        temp_dir = tempfile.mkdtemp(prefix="aqbench", dir="/tmp")
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    cases = _cases(quick)
    try:
        rows = asyncio.run(_run_all(cases))
    finally:
        if temp_dir is not None:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    figures = _figures(cases, rows, quick)
    notes = [
        f"target: batched 1 KiB >= {TARGET_ITEMS_S:,.0f} items/s and >= {TARGET_RATIO:g}x "
        "ray.util.queue.Queue; met: items/s "
        f"{figures['met_items_s']}, ratio {figures['met_ratio']} "
        f"({figures['ratio_batched_1k']}x)",
        "latency = receive time - produced_at; both queues have the same maxsize, so it "
        "includes time waiting in a full queue",
        f"ray queue batched: producer retries after {RETRY_S * 1e3:g} ms on Full; consumer "
        "tries get_nowait_batch(n), else get() + qsize() + get_nowait_batch",
        "rows with rounds > 1 are the median run of that many (queues alternate going first)",
    ]
    return BenchReport(
        title="async_queue actor vs ray.util.queue.Queue (1 producer actor, 1 consumer actor)",
        rows=rows,
        figures=figures,
        notes=notes,
    )

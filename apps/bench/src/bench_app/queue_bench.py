"""Queue actor vs `ray.util.queue.Queue`: items/s and put-to-get latency, same run, same work.

One producer actor and one consumer actor move N `QueueItem`s (1 KiB, 256 KiB and 4 MiB
payloads) through each queue, one item per put call and in batches. Throughput is
`N / (consumer's last receive - producer's start)`; latency is `receive time - produced_at`
per item (one clock: all actors run on this machine). Both queues are bounded by the same
`maxsize`, so latency includes the time an item waits in a full queue. Items of 64 KiB and
more go through async_queue by reference (its default `by_ref_bytes`); ray's queue passes
everything by value. After the 4 MiB case (1 GiB through each queue) each queue actor reports
its peak RSS (VmHWM).

How each side is driven (its natural API, and the baseline's best use of it):
- async_queue: async actors, `await client.put/put_many`, `await client.get_batch(n)`;
  a full queue makes the producer wait inside the actor, an empty one the consumer. The
  producer is an async Ray actor, as the app's rollouters are (`train_app.actors.RolloutActor`,
  async, `max_concurrency=64`), so by-ref payloads take async_queue's pulled path (the queue
  actor takes them from the producer: one write into the object store). The "copied" row
  (`by_ref_pull=False`) is the path of a producer that is not such an actor (a driver, a task,
  a `max_concurrency=1` actor): `ray.put` plus the queue actor's re-owning copy.
- ray.util.queue.Queue, single: an async producer actor, `await q.put_async(item)`.
- ray.util.queue.Queue, batched: its batch calls are synchronous (`put_nowait_batch`,
  `get_nowait_batch`), so they run in plain (threaded) actors. The producer retries after
  1 ms when the batch does not fit (`Full`). The consumer first tries `get_nowait_batch(n)`
  (one call when there is a backlog); on `Empty` it blocks in `get()` for one item, then takes
  `min(qsize, n - 1)` more.
- verl 0.9.1's fully-async `MessageQueue` (when verl is installed; the workspace's dev group
  has it), on the batched 1 KiB, single 256 KiB and batched 4 MiB cases, driven as verl's
  rollouter and trainer drive it: `await client.put_sample(bytes)` (a "batch" is that many
  puts at once, sent once the queue has room for them: verl's queue drops when full), and
  `await client.get_sample()` one at a time. Its samples are bare bytes
  (no `produced_at`), so its rows have no latency. The "verl_compat" rows run the same
  actors on `async_queue.compat.verl` (the one-import swap), same calls.
- "single" cases measure single-item puts the way a rollouter makes them: `SINGLE_WINDOW`
  generation tasks each put one item at a time, concurrently, through one client (async_queue
  coalesces them into few actor calls). Both consumers take batches of up to 64 (the
  trainer's pattern; ray's queue with the batch consumer above), so the puts are measured.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
TARGET_RATIO_4M = 2.0  # batched 4 MiB (by reference) vs ray.util.queue.Queue
TARGET_RSS_MB = 150.0  # the queue actor's peak RSS after 1 GiB of 4 MiB items
TARGET_RATIO_VS_VERL_4M = 2.0  # batched 4 MiB vs verl's MessageQueue
TARGET_RSS_VS_VERL = 0.1  # the queue actor's peak RSS as a fraction of verl's, after 1 GiB
# The cases verl's queue (and the compat one) also run: its calls carry one sample each.
VERL_CASE_KEYS = ("batched_1k", "single_256k", "batched_4m")
VERL_CONTENDERS = ("verl_queue", "verl_compat")
RETRY_S = 0.001  # ray queue producer back-off when a batch does not fit
SINGLE_WINDOW = 64  # concurrent single puts in the "single" cases
SINGLE_CONSUMER_BATCH = 64


@dataclass(frozen=True)
class Case:
    """One measured configuration; `rounds` > 1 keeps the median run of each queue."""

    payload_bytes: int
    batch: int  # 1: single-item calls
    items: int
    maxsize: int
    rounds: int = 1
    # async_queue's by_ref_owner and by_ref_pull. Variants ("producer", or pull False) run
    # async_queue only and compare with the ray queue's row of the same case (ray's queue has
    # no such choice).
    owner: str = "queue"
    pull: bool = True

    @property
    def variant(self) -> bool:
        return self.owner != "queue" or not self.pull

    @property
    def label(self) -> str:
        kib = self.payload_bytes // 1024
        size = f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"
        mode = f"batched x{self.batch}" if self.batch > 1 else f"single x{SINGLE_WINDOW} tasks"
        owned = " producer-owned" if self.owner == "producer" else ""
        copied = " copied" if self.owner == "queue" and not self.pull else ""
        return f"{size} {mode}{owned}{copied}"

    @property
    def baseline_label(self) -> str:
        """The ray queue row this case is compared with."""
        return dataclasses.replace(self, owner="queue", pull=True).label

    @property
    def key(self) -> str:
        mode = "batched" if self.batch > 1 else "single"
        kib = self.payload_bytes // 1024
        key = f"{mode}_{kib // 1024}m" if kib >= 1024 else f"{mode}_{kib}k"
        if self.owner == "producer":
            return f"{key}_producer_owned"
        return key if self.pull else f"{key}_copied"

    @property
    def get_batch(self) -> int:
        """How many items the consumer takes per call."""
        return self.batch if self.batch > 1 else SINGLE_CONSUMER_BATCH


@dataclass(frozen=True)
class Contender:
    """A queue under test: how to make one, and its (producer, consumer) actor classes."""

    make_queue: Callable[[Case], Any]
    single: tuple[Any, Any]
    batched: tuple[Any, Any]


def _cases(quick: bool) -> list[Case]:
    # 64 x 1 KiB keeps each call under Ray's 100 KiB inline limit (bigger goes via plasma).
    # 4 MiB: 256 items = 1 GiB through each queue (the RSS figure is for that much).
    cases = [
        Case(payload_bytes=1024, batch=64, items=8_000, maxsize=512, rounds=3),
        Case(payload_bytes=1024, batch=1, items=4_000, maxsize=512),
        Case(payload_bytes=256 * 1024, batch=8, items=400, maxsize=32),
        Case(payload_bytes=256 * 1024, batch=1, items=200, maxsize=32),
        # 4 MiB: the median of 3 runs each (one run is ~2 s; single runs varied by ~1.5x here).
        # The variants do the same work as the ray queue row they are compared with.
        Case(payload_bytes=4 * 2**20, batch=8, items=256, maxsize=32, rounds=3),
        Case(payload_bytes=4 * 2**20, batch=8, items=256, maxsize=32, rounds=3, pull=False),
        Case(payload_bytes=4 * 2**20, batch=8, items=256, maxsize=32, rounds=3, owner="producer"),
    ]
    if not quick:
        return cases
    # A smoke run of every contender on the cases the headline figures need (batched and
    # single 1 KiB, batched 4 MiB): one round of one consumer batch (32 MiB per queue at
    # 4 MiB); its figures are not comparable with a full run's. The by-reference variants
    # have their own tests in packages/async-queue (test_by_ref.py, test_pull.py).
    headline = [case for case in cases if case.payload_bytes != 256 * 1024 and not case.variant]
    return [dataclasses.replace(case, items=case.get_batch, rounds=1) for case in headline]


def _payloads(case: Case) -> list[bytes]:
    """Distinct payloads, at least two batches' worth: a batch that repeated one bytes object
    would be pickled once (pickle's memo), which flatters by-value queues unrealistically."""
    return [os.urandom(case.payload_bytes) for _ in range(max(2 * case.batch, 16))]


def _define_contenders() -> dict[str, Contender]:
    """The producer/consumer actors (defined lazily: importing the module starts no Ray)."""
    return {
        "async_queue": _async_queue_contender(),
        "ray_queue": _ray_queue_contender(),
        **_verl_contenders(),
    }


def _make_batch(payloads: list[bytes], start: int, count: int) -> list[Any]:
    from async_queue import QueueItem

    now = time.time()
    return [
        QueueItem(payload=payloads[i % len(payloads)], version=0, item_id=str(i), produced_at=now)
        for i in range(start, start + count)
    ]


async def _put_concurrently(put: Callable[[Any], Any], payload: list[bytes], case: Case) -> None:
    """`SINGLE_WINDOW` tasks, each putting one item at a time (a rollouter's pattern)."""
    serials = iter(range(case.items))

    async def task() -> None:
        for serial in serials:
            await put(_make_batch(payload, serial, 1)[0])

    await asyncio.gather(*(task() for _ in range(SINGLE_WINDOW)))


def _async_queue_contender() -> Contender:
    import ray
    from async_queue import MessageQueueClient, QueueItem

    @ray.remote(num_cpus=0)
    class AsyncQueueProducer:
        async def warm(self, queue: MessageQueueClient, item: QueueItem) -> None:
            await queue.put(item)

        async def run(self, queue: MessageQueueClient, case: Case) -> float:
            payload = _payloads(case)
            started = time.time()
            if case.batch == 1:
                await _put_concurrently(queue.put, payload, case)
                return started
            for start in range(0, case.items, case.batch):
                await queue.put_many(
                    _make_batch(payload, start, min(case.batch, case.items - start))
                )
            return started

    @ray.remote(num_cpus=0)
    class AsyncQueueConsumer:
        async def run(self, queue: MessageQueueClient, case: Case) -> tuple[float, list[float]]:
            latencies: list[float] = []
            while len(latencies) < case.items:
                items = await queue.get_batch(case.get_batch)
                now = time.time()
                latencies.extend(now - item.produced_at for item in items)
            return time.time(), latencies

    return Contender(
        make_queue=lambda case: MessageQueueClient.create(
            maxsize=case.maxsize, by_ref_owner=case.owner, by_ref_pull=case.pull
        ),
        single=(AsyncQueueProducer, AsyncQueueConsumer),
        batched=(AsyncQueueProducer, AsyncQueueConsumer),
    )


def _ray_queue_contender() -> Contender:
    import ray
    from async_queue import QueueItem
    from ray.util.queue import Empty, Full, Queue

    @ray.remote(num_cpus=0)
    class RayQueueAsyncProducer:
        async def warm(self, queue: Queue, item: QueueItem) -> None:
            await queue.put_async(item)

        async def run(self, queue: Queue, case: Case) -> float:
            payload = _payloads(case)
            started = time.time()
            await _put_concurrently(queue.put_async, payload, case)
            return started

    @ray.remote(num_cpus=0)
    class RayQueueBatchProducer:
        def warm(self, queue: Queue, item: QueueItem) -> None:
            queue.put(item)

        def run(self, queue: Queue, case: Case) -> float:
            payload = _payloads(case)
            started = time.time()
            for start in range(0, case.items, case.batch):
                batch = _make_batch(payload, start, min(case.batch, case.items - start))
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
                want = min(case.get_batch, case.items - len(latencies))
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

    return Contender(
        make_queue=lambda case: Queue(maxsize=case.maxsize),
        single=(RayQueueAsyncProducer, RayQueueBatchConsumer),
        batched=(RayQueueBatchProducer, RayQueueBatchConsumer),
    )


def _verl_contenders() -> dict[str, Contender]:
    """verl's queue and the compat one, driven alike (module doc); none without verl."""
    import ray

    try:
        from verl.experimental.fully_async_policy import message_queue as verl_mq
    except ImportError:
        return {}
    from async_queue.compat import verl as compat

    @ray.remote(num_cpus=0)
    class VerlProducer:
        async def warm(self, client: Any, item: Any) -> None:
            await client.put_sample(item.payload)

        async def run(self, client: Any, case: Case) -> float:
            payload = _payloads(case)
            started = time.time()
            for start in range(0, case.items, case.batch):
                count = min(case.batch, case.items - start)
                # verl's queue drops the oldest sample when full (its consumer would then
                # wait forever for the rest): wait for room first, as its rollouter's
                # staleness control does. The compat queue gets the same calls.
                while await client.get_queue_size() + count > case.maxsize:  # noqa: ASYNC110 (a remote queue: no event to await)
                    await asyncio.sleep(RETRY_S)
                await asyncio.gather(
                    *(client.put_sample(payload[(start + k) % len(payload)]) for k in range(count))
                )
            return started

    @ray.remote(num_cpus=0)
    class VerlConsumer:
        async def run(self, client: Any, case: Case) -> tuple[float, list[float]]:
            for _ in range(case.items):
                await client.get_sample()  # one at a time, as verl's trainer collects
            return time.time(), []

    def make(module: Any) -> Contender:
        def make_queue(case: Case) -> Any:
            return module.MessageQueueClient(module.MessageQueue.remote(None, case.maxsize))

        return Contender(make_queue, (VerlProducer, VerlConsumer), (VerlProducer, VerlConsumer))

    return {"verl_queue": make(verl_mq), "verl_compat": make(compat)}


async def _measure(name: str, contender: Contender, case: Case) -> dict[str, Any]:
    """One run: fresh queue and actors, all warmed up before the clock starts."""
    import ray
    from async_queue import MessageQueueClient, QueueItem

    producer_cls, consumer_cls = contender.single if case.batch == 1 else contender.batched
    queue = contender.make_queue(case)
    producer, consumer = producer_cls.remote(), consumer_cls.remote()
    if isinstance(queue, MessageQueueClient):
        await queue.size()
        queue_handle = queue.handle
    elif hasattr(queue, "queue_actor"):  # verl's client, or the compat one
        await queue.get_queue_size()
        queue_handle = queue.queue_actor
    else:
        queue_handle = queue.actor
        await queue_handle.qsize.remote()
    await asyncio.gather(producer.__ray_ready__.remote(), consumer.__ray_ready__.remote())
    # One item from the producer through each queue first: one-time start-up (async_queue
    # starts its payload helper on the first copied put, ships its hand-over function on the
    # first pulled one) stays out of the timed run.
    warm = QueueItem(payload=os.urandom(case.payload_bytes), version=0, item_id="warm-up")
    await producer.warm.remote(queue, warm)
    if isinstance(queue, MessageQueueClient):
        await queue.get()
    elif hasattr(queue, "queue_actor"):
        await queue.get_sample()
    else:
        await queue.get_async()

    consumer_ref = consumer.run.remote(queue, case)
    started = await producer.run.remote(queue, case)
    finished, latencies = await consumer_ref
    elapsed = finished - started
    # The same probe in both queue actors: ray's cannot be given a method, so both run it
    # through __ray_call__ (async_queue's own `actor_memory()` reads the same numbers).
    peak_rss = await queue_handle.__ray_call__.remote(_peak_rss_bytes)
    for handle in (producer, consumer, queue_handle):
        ray.kill(handle)
    latencies.sort()
    items_s = case.items / elapsed
    p50, p99 = _percentiles(latencies)
    return {
        "queue": name,
        "case": case.label,
        "items": case.items,
        "items/s": items_s,
        "MiB/s": items_s * case.payload_bytes / 2**20,
        "p50 ms": p50,
        "p99 ms": p99,
        "wall s": elapsed,
        "actor peak RSS MB": peak_rss / 2**20,
    }


def _percentiles(latencies: list[float]) -> tuple[float | None, float | None]:
    """(p50, p99) in ms of sorted latencies; None for a queue whose items carry no stamp."""
    if not latencies:
        return None, None
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return 1e3 * statistics.median(latencies), 1e3 * p99


def _peak_rss_bytes(_actor: Any) -> int:
    """Runs inside a queue actor: its process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


async def _run_all(cases: list[Case]) -> list[dict[str, Any]]:
    """Each case `rounds` times, the two queues alternating who goes first; per queue the
    run with the median items/s is kept (the machine is shared: single runs are noisy)."""
    contenders = _define_contenders()
    rows: list[dict[str, Any]] = []
    for case in cases:
        names = ["async_queue"] if case.variant else ["async_queue", "ray_queue"]
        if case.key in VERL_CASE_KEYS:
            names += [name for name in VERL_CONTENDERS if name in contenders]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for round_index in range(case.rounds):
            order = list(names)
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
        theirs = by_case[("ray_queue", case.baseline_label)]
        ratio = ours["items/s"] / theirs["items/s"]
        ours["vs ray queue"] = f"{ratio:.2f}x"
        figures[f"{case.key}_items_s"] = round(ours["items/s"], 1)
        figures[f"ratio_{case.key}"] = round(ratio, 2)
        if case.variant:
            figures[f"{case.key}_p50_ms"] = round(ours["p50 ms"], 2)
            figures[f"{case.key}_p99_ms"] = round(ours["p99 ms"], 2)
            continue
        figures[f"ray_queue_{case.key}_items_s"] = round(theirs["items/s"], 1)
        for who, row in (("", ours), ("ray_queue_", theirs)):
            figures[f"{who}{case.key}_p50_ms"] = round(row["p50 ms"], 2)
            figures[f"{who}{case.key}_p99_ms"] = round(row["p99 ms"], 2)
    big = max((c for c in cases if not c.variant), key=lambda case: case.payload_bytes)
    ours, theirs = by_case[("async_queue", big.label)], by_case[("ray_queue", big.label)]
    figures["passed_through_mib"] = big.items * big.payload_bytes // 2**20
    figures["actor_peak_rss_mb"] = round(ours["actor peak RSS MB"], 1)
    figures["ray_queue_actor_peak_rss_mb"] = round(theirs["actor peak RSS MB"], 1)
    figures["target_items_s"] = TARGET_ITEMS_S
    figures["target_ratio"] = TARGET_RATIO
    figures["target_ratio_batched_4m"] = TARGET_RATIO_4M
    figures["target_actor_peak_rss_mb"] = TARGET_RSS_MB
    figures["met_items_s"] = figures["batched_1k_items_s"] >= TARGET_ITEMS_S
    figures["met_ratio"] = figures["ratio_batched_1k"] >= TARGET_RATIO
    figures["met_ratio_single_1k"] = figures["ratio_single_1k"] >= TARGET_RATIO
    figures["met_ratio_batched_4m"] = figures[f"ratio_{big.key}"] >= TARGET_RATIO_4M
    figures["met_actor_peak_rss"] = figures["actor_peak_rss_mb"] < TARGET_RSS_MB
    figures.update(_verl_figures(cases, by_case))
    figures["met"] = all(
        figures[key]
        for key in (
            "met_items_s",
            "met_ratio",
            "met_ratio_single_1k",
            "met_ratio_batched_4m",
            "met_actor_peak_rss",
            *(("met_ratio_vs_verl_4m", "met_actor_rss_vs_verl") if "verl_ran" in figures else ()),
        )
    )
    return figures


def _verl_figures(cases: list[Case], by_case: dict[tuple[str, str], Any]) -> dict[str, Any]:
    """Ours (and the compat queue's) against verl's queue, per case it ran; {} without it."""
    figures: dict[str, Any] = {}
    for case in cases:
        verl = by_case.get(("verl_queue", case.label))
        if case.variant or verl is None:
            continue
        short = "4m" if case.key == "batched_4m" else case.key
        figures[f"verl_{case.key}_items_s"] = round(verl["items/s"], 1)
        ours = by_case[("async_queue", case.label)]
        figures[f"ratio_vs_verl_{short}"] = round(ours["items/s"] / verl["items/s"], 2)
        ours["vs verl"] = f"{ours['items/s'] / verl['items/s']:.2f}x"
        compat = by_case.get(("verl_compat", case.label))
        if compat is not None:
            compat["vs verl"] = f"{compat['items/s'] / verl['items/s']:.2f}x"
            figures[f"verl_compat_{case.key}_items_s"] = round(compat["items/s"], 1)
            figures[f"compat_ratio_vs_verl_{short}"] = round(compat["items/s"] / verl["items/s"], 2)
        if case.key == "batched_4m":
            figures["verl_ran"] = True
            figures["verl_actor_peak_rss_mb"] = round(verl["actor peak RSS MB"], 1)
            if compat is not None:
                figures["verl_compat_actor_peak_rss_mb"] = round(compat["actor peak RSS MB"], 1)
            figures["target_ratio_vs_verl_4m"] = TARGET_RATIO_VS_VERL_4M
            figures["met_ratio_vs_verl_4m"] = figures["ratio_vs_verl_4m"] >= TARGET_RATIO_VS_VERL_4M
            figures["met_actor_rss_vs_verl"] = (
                ours["actor peak RSS MB"] < TARGET_RSS_VS_VERL * verl["actor peak RSS MB"]
            )
    return figures


def _verl_note(figures: dict[str, Any]) -> str:
    if "verl_ran" not in figures:
        return "verl's MessageQueue: not measured (verl is not installed)"
    return (
        f"vs verl 0.9.1's MessageQueue: batched 1 KiB {figures.get('ratio_vs_verl_batched_1k')}x, "
        f"single 256 KiB {figures.get('ratio_vs_verl_single_256k')}x, 4 MiB "
        f"{figures['ratio_vs_verl_4m']}x (target >= {TARGET_RATIO_VS_VERL_4M:g}x: "
        f"{figures['met_ratio_vs_verl_4m']}); queue actor peak RSS after "
        f"{figures['passed_through_mib']} MiB {figures['actor_peak_rss_mb']} MB vs verl's "
        f"{figures['verl_actor_peak_rss_mb']} MB (target < {TARGET_RSS_VS_VERL:g}x: "
        f"{figures['met_actor_rss_vs_verl']}); the one-import swap (async_queue.compat.verl, "
        f"same calls): 4 MiB {figures.get('compat_ratio_vs_verl_4m')}x, actor peak RSS "
        f"{figures.get('verl_compat_actor_peak_rss_mb')} MB"
    )


def run(quick: bool) -> BenchReport:
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    temp_dir = None
    if not ray.is_initialized():
        temp_dir = tempfile.mkdtemp(prefix="aqbench", dir="/tmp")
        # The app's start: retried when a loaded machine makes the raylet miss its window.
        from train_app.driver.cluster import start_local_ray

        try:
            start_local_ray(2, {"_temp_dir": temp_dir, "log_to_driver": False})
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    cases = _cases(quick)
    try:
        rows = asyncio.run(_run_all(cases))
    finally:
        if temp_dir is not None:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    figures = _figures(cases, rows, quick)
    return BenchReport(
        title=(
            "async_queue actor vs ray.util.queue.Queue and verl's MessageQueue "
            "(1 producer actor, 1 consumer actor)"
        ),
        rows=rows,
        figures=figures,
        notes=_notes(figures),
    )


def _notes(figures: dict[str, Any]) -> list[str]:
    """What the figures mean and how each contender was driven."""
    return [
        f"target: batched 1 KiB >= {TARGET_ITEMS_S:,.0f} items/s and >= {TARGET_RATIO:g}x "
        "ray.util.queue.Queue; met: items/s "
        f"{figures['met_items_s']}, ratio {figures['met_ratio']} "
        f"({figures['ratio_batched_1k']}x)",
        f"target: single 1 KiB >= {TARGET_RATIO:g}x: {figures['met_ratio_single_1k']} "
        f"({figures['ratio_single_1k']}x); batched 4 MiB >= {TARGET_RATIO_4M:g}x: "
        f"{figures['met_ratio_batched_4m']} ({figures.get('ratio_batched_4m')}x; copied "
        f"{figures.get('ratio_batched_4m_copied')}x; producer-owned "
        f"{figures.get('ratio_batched_4m_producer_owned')}x); queue actor "
        f"peak RSS < {TARGET_RSS_MB:g} MB after {figures['passed_through_mib']} MiB: "
        f"{figures['met_actor_peak_rss']} ({figures['actor_peak_rss_mb']} MB; ray's queue "
        f"actor: {figures['ray_queue_actor_peak_rss_mb']} MB)",
        f"single: {SINGLE_WINDOW} concurrent tasks put one item each at a time through one "
        f"client; both consumers take up to {SINGLE_CONSUMER_BATCH} per call",
        "async_queue sends payloads of >= 64 KiB by reference (object store); ray's queue "
        "by value. By default the queue actor owns them (they survive their producer): its "
        "producer here is an async actor (like the app's rollouters), so the queue actor "
        "pulls them from it (one write); 'copied' rows (by_ref_pull=False: a driver's or "
        "task's path) ray.put them and re-own a copy; 'producer-owned' rows "
        "(by_ref_owner='producer') do neither. Variants are compared with the same ray "
        "queue row",
        "latency = receive time - produced_at; both queues have the same maxsize, so it "
        "includes time waiting in a full queue",
        f"ray queue batched: producer retries after {RETRY_S * 1e3:g} ms on Full; consumer "
        "tries get_nowait_batch(n), else get() + qsize() + get_nowait_batch",
        "rows with rounds > 1 are the median run of that many (queues alternate going first)",
        _verl_note(figures),
    ]

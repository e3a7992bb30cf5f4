"""`simulate(config)`: the real Rollouter(s), admission, pacing and queue core, with a modelled
engine per replica and a modelled trainer, on a `looptime` virtual clock.

Why `looptime`: it is an asyncio event loop whose `time()` jumps to the next timer whenever
every coroutine is waiting, so the real asyncio code (locks, events, `asyncio.wait`,
`asyncio.timeout`, `call_at`) runs unchanged; hours of pipeline time take seconds of CPU and
the result does not depend on the machine's load. It is already our test dependency
(test_pacing.py). aiotools' `VirtualClock` patches the loop's time too, but as a context
manager around a running loop built for tests; `looptime.new_event_loop()` gives a loop we own
end to end. Nothing here uses threads (rewards run on the loop, prompts come from an async
generator), so the virtual time never waits for the real clock, and one seed gives one event
order: `SimResult.trace_hash` hashes every engine, queue and trainer event with its virtual
time.

Modes (`SimConfig.mode`):

- `"async"`: k = `max_staleness`, the pacing policy, partial rollout as configured.
- `"sync"`: the same code with k = 0 and no partial rollout (the app's `--mode sync`).
- `"colocate"`: sync on all GPUs: a whole version's batch (`batch_size * sync_every`) is
  generated on `colocate_replicas` replicas, then trained as one step `colocate_speedup` times
  faster, plus `colocate_switch_s` per version (verl's colocated hybrid engine, the baseline of
  its fully-async report: the same GPUs cannot train while they generate).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import logging
import math
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import looptime
from async_queue import MessageQueue, QueueStats
from rollout_engine import (
    PromptSample,
    RolloutConfig,
    Rollouter,
    RolloutStats,
    SamplingConfig,
    Trajectory,
)

from sim_app.engine import EngineStats, SimEngine
from sim_app.models import Contention, DecodeModel, LengthModel, TrainerModel
from sim_app.trainer import ContentionState, QueueSink, Replica, SimItem, SimTrainer

__all__ = ["Mode", "SimConfig", "SimResult", "Trace", "new_loop", "simulate", "simulate_async"]

Mode = Literal["sync", "async", "colocate"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run. Counts of groups are prompts (each `group_size` responses)."""

    mode: Mode = "async"
    steps: int = 100
    seed: int = 0
    batch_size: int = 16  # groups per trainer step, all replicas together (>= replicas)
    group_size: int = 8
    max_concurrency: int = 16  # groups in flight per replica
    max_staleness: int = 2
    pacing: Literal["eager", "fresh"] = "fresh"
    pacing_margin: float = 0.25
    partial_rollout: bool = True
    pause_mode: Literal["keep", "abort"] = "keep"
    sync_every: int = 1
    replicas: int = 1
    # Simulate only this many of the replicas (None: all). Each simulated replica does its
    # share of the batch as in the full system; the trainer's step costs the full batch.
    simulate_replicas: int | None = None
    prompt_tokens: int = 4
    # Tokens are counted in units of this many real tokens (lists stay short at 16k tokens).
    token_unit: int = 1
    failure_rate: float = 0.0
    # The rollouters start this long before the trainer's clock starts (the app starts the
    # engines, then builds the trainer).
    trainer_start_s: float = 0.0
    colocate_replicas: int | None = None
    colocate_speedup: float = 1.0
    colocate_switch_s: float = 0.0
    queue_maxsize: int | None = None  # default: (k + 2) * batch_size, as the app
    decode: DecodeModel = field(default_factory=DecodeModel)
    trainer: TrainerModel = field(default_factory=TrainerModel)
    lengths: LengthModel = field(default_factory=LengthModel)
    contention: Contention = field(default_factory=Contention)
    # Where the models came from (a calibration directory, a preset); reports only.
    source: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async", "colocate"):
            raise ValueError(f"mode must be sync, async or colocate, got {self.mode!r}")
        for name in ("steps", "batch_size", "group_size", "max_concurrency", "replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.batch_size < self.replicas:
            raise ValueError("batch_size must be >= replicas (every replica gets a share)")
        if self.simulate_replicas is not None and not 1 <= self.simulate_replicas <= self.replicas:
            raise ValueError("simulate_replicas must be in [1, replicas]")
        if not 0.0 <= self.failure_rate < 1.0:
            raise ValueError("failure_rate must be in [0, 1)")

    # ---------------------------------------------------------------- effective settings

    @property
    def effective_staleness(self) -> int:
        return self.max_staleness if self.mode == "async" else 0

    @property
    def effective_replicas(self) -> int:
        if self.mode == "colocate" and self.colocate_replicas is not None:
            return self.colocate_replicas
        return self.replicas

    def with_(self, **changes: Any) -> SimConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class SimResult:
    """What one simulated run produced. `records` are per trainer step (app metric names)."""

    config: SimConfig
    records: list[dict[str, Any]]
    wall_s: float  # the trainer's clock at the last step (`trainer/wall_s`)
    virtual_s: float  # the loop's clock at the end (rollouters included)
    cpu_s: float
    trace_hash: str
    events: int
    rollout: list[RolloutStats]
    rollout_metrics: list[dict[str, float]]
    engines: list[EngineStats]
    engine_busy_ratio: float
    queue: QueueStats
    staleness_hist: dict[int, int]
    consumed_groups: int
    duplicates: int
    samples: float
    tokens: float
    trainer_wait_s: float
    conservation_errors: list[str] = field(default_factory=list)
    events_log: list[tuple[Any, ...]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def step_time_s(self) -> float:
        """Mean seconds per trainer step (wall / steps)."""
        return self.wall_s / self.steps if self.steps else math.nan

    @property
    def versions(self) -> int:
        """Weight versions pushed (every `sync_every` steps; every step in colocate mode)."""
        return int(self.records[-1]["trainer/version"]) if self.records else 0

    @property
    def version_time_s(self) -> float:
        """Mean seconds per weight version: comparable across modes (same prompts each)."""
        return self.wall_s / self.versions if self.versions else math.nan

    @property
    def trainer_idle_ratio(self) -> float:
        return self.trainer_wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rollout_idle_ratio(self) -> float:
        values = [m["rollout/idle_ratio"] for m in self.rollout_metrics]
        return statistics.fmean(values) if values else 0.0

    @property
    def staleness_mean(self) -> float:
        total = sum(self.staleness_hist.values())
        return sum(s * c for s, c in self.staleness_hist.items()) / total if total else 0.0

    @property
    def partial_ratio(self) -> float:
        trajectories = sum(s.trajectories for s in self.rollout)
        return sum(s.partial for s in self.rollout) / trajectories if trajectories else 0.0

    @property
    def failed(self) -> int:
        """Groups whose generation failed (not those cancelled by the stop at the end)."""
        return sum(s.failed - s.failure_counts.get("CancelledError", 0) for s in self.rollout)

    def summary(self) -> dict[str, Any]:
        """Flat figures for tables and JSON."""
        return {
            "mode": self.config.mode,
            "steps": self.steps,
            "wall_s": self.wall_s,
            "step_time_s": self.step_time_s,
            "version_time_s": self.version_time_s,
            "samples_per_s": self.samples / self.wall_s if self.wall_s else 0.0,
            "tokens_per_s": self.tokens / self.wall_s if self.wall_s else 0.0,
            "staleness_mean": self.staleness_mean,
            "staleness_hist": [self.staleness_hist.get(s, 0) for s in range(max_key(self))],
            "trainer_idle_ratio": self.trainer_idle_ratio,
            "rollout_idle_ratio": self.rollout_idle_ratio,
            "engine_busy_ratio": self.engine_busy_ratio,
            "partial_ratio": self.partial_ratio,
            "dropped": sum(s.dropped for s in self.rollout) + self.queue.dropped_total,
            "failed": self.failed,
            "cpu_s": self.cpu_s,
            "trace_hash": self.trace_hash,
        }


def max_key(result: SimResult) -> int:
    return max(result.staleness_hist, default=-1) + 1


class Trace:
    """A running hash of events `(kind, time, ...)`; times count in microseconds."""

    def __init__(self, keep: int = 0) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self.count = 0
        self._keep = keep
        self.log: list[tuple[Any, ...]] = []

    def __call__(self, kind: str, when: float, *fields: Any) -> None:
        event = (kind, round(when * 1e6), *fields)
        self._hash.update(repr(event).encode())
        self.count += 1
        if len(self.log) < self._keep:
            self.log.append(event)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class _Reward:
    """Rewards are not modelled; a constant, computed on the loop (no executor thread)."""

    blocking = False

    def __call__(self, sample: PromptSample, trajectory: Trajectory) -> float:
        return 0.0


async def _prompts(replica: int, units: int) -> AsyncIterator[PromptSample]:
    ids = [1 + (j % 97) for j in range(units)]
    index = 0
    while True:
        yield PromptSample(prompt_id=f"r{replica}p{index}", prompt_token_ids=ids)
        index += 1


class _NoExecutors:
    """Stands in for looptime's set of executor futures, which it scans on every loop turn to
    let threads finish in real time. The simulation runs no executor (a thread would make the
    virtual time depend on the real one): the scan is skipped and an executor is refused."""

    def __iter__(self) -> Any:
        return iter(())

    def add(self, future: object) -> None:
        raise RuntimeError(
            "the simulation runs no executors (rewards and prompts stay on the loop)"
        )


def new_loop() -> asyncio.AbstractEventLoop:
    """A looptime loop for the simulation: no no-op turns beyond the one looptime needs
    before it moves the clock, and no executors."""
    loop = looptime.new_event_loop(noop_cycles=1)
    if hasattr(loop, "_LoopTimeEventLoop__sync_futures"):
        loop._LoopTimeEventLoop__sync_futures = _NoExecutors()  # type: ignore[attr-defined]
    return loop


def simulate(config: SimConfig, *, keep_events: int = 0) -> SimResult:
    """Run `config` on a fresh looptime loop; see the module docstring."""
    loop = new_loop()
    logging.getLogger("rollout_engine").setLevel(logging.ERROR)
    # Millions of short-lived objects and few cycles: collect young objects less often.
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], 100_000), *threshold[1:])
    try:
        return loop.run_until_complete(simulate_async(config, keep_events=keep_events))
    finally:
        gc.set_threshold(*threshold)
        loop.close()


async def simulate_async(config: SimConfig, *, keep_events: int = 0) -> SimResult:
    """`simulate` on the running loop (it must be a looptime loop, or this takes real time)."""
    cpu_started = time.process_time()
    loop = asyncio.get_running_loop()
    trace = Trace(keep=keep_events)
    layout = _Layout.of(config)
    queue: MessageQueue[SimItem] = MessageQueue(
        maxsize=config.queue_maxsize or (layout.k + 2) * layout.batch
    )
    contention = ContentionState(config.contention)
    engines, handles = _replicas(config, layout, queue, contention, trace)
    contention.engines = engines
    errors: list[str] = []
    trainer = _trainer(config, layout, queue, handles, contention, trace, errors)
    runs = [asyncio.ensure_future(h.rollouter.run()) for h in handles]
    try:
        if config.trainer_start_s > 0:
            await asyncio.sleep(config.trainer_start_s)
        await trainer.run()
    finally:
        await trainer.abandon()
        for handle in handles:
            await handle.rollouter.stop()
        stats = await asyncio.gather(*runs, return_exceptions=True)
    failures = [s for s in stats if isinstance(s, BaseException)]
    if failures:
        raise failures[0]
    now = loop.time()
    rollout = [s for s in stats if isinstance(s, RolloutStats)]
    _check_end(rollout, queue.stats(), trainer, errors)
    busy = [e.busy_seconds(now) for e in engines]
    return SimResult(
        config=config,
        records=trainer.records,
        wall_s=trainer.wall_s,
        virtual_s=now,
        cpu_s=time.process_time() - cpu_started,
        trace_hash=trace.hexdigest(),
        events=trace.count,
        rollout=rollout,
        rollout_metrics=[h.rollouter.metrics() for h in handles],
        engines=[e.stats for e in engines],
        engine_busy_ratio=statistics.fmean(busy) / now if now > 0 else 0.0,
        queue=queue.stats(),
        staleness_hist=dict(sorted(trainer.staleness_hist.items())),
        consumed_groups=trainer.consumed_groups,
        duplicates=trainer.duplicates,
        samples=trainer.samples,
        tokens=trainer.tokens,
        trainer_wait_s=trainer.wait_s,
        conservation_errors=errors,
        events_log=trace.log,
    )


@dataclass(frozen=True)
class _Layout:
    """How a `SimConfig` maps onto replicas, batches and token units."""

    k: int  # the effective staleness bound
    replicas: int
    simulated: int  # replicas that run (the first ones); the trainer still costs them all
    colocate: bool
    batch_size: int  # groups per step (colocate: a whole version's batch)
    sync_every: int
    shares: list[int]  # each replica's share of a batch
    unit: int  # tokens per simulated token
    max_units: int
    prompt_units: int

    @property
    def batch(self) -> int:
        """Groups per step of the simulated replicas."""
        return sum(self.shares[: self.simulated])

    @classmethod
    def of(cls, config: SimConfig) -> _Layout:
        replicas = config.effective_replicas
        batch_size, sync_every = config.batch_size, config.sync_every
        colocate = config.mode == "colocate"
        if colocate:  # one step per version: training waits for the whole version's batch
            batch_size, sync_every = batch_size * sync_every, 1
        if batch_size < replicas:
            raise ValueError(f"batch_size {batch_size} < {replicas} replicas")
        unit = config.token_unit
        return cls(
            k=config.effective_staleness,
            replicas=replicas,
            simulated=min(config.simulate_replicas or replicas, replicas),
            colocate=colocate,
            batch_size=batch_size,
            sync_every=sync_every,
            # Replica i admits its share of every batch (the first ones one more when it
            # does not divide).
            shares=[batch_size // replicas + (i < batch_size % replicas) for i in range(replicas)],
            unit=unit,
            max_units=max(1, math.ceil(config.lengths.max_tokens / unit)),
            prompt_units=max(1, math.ceil(config.prompt_tokens / unit)),
        )


def _rollout_config(config: SimConfig, layout: _Layout) -> RolloutConfig:
    return RolloutConfig(
        group_size=config.group_size,
        max_concurrency=config.max_concurrency,
        groups_per_step=layout.shares[0],
        sync_every=layout.sync_every,
        max_staleness=layout.k,
        pacing=config.pacing,
        pacing_margin=config.pacing_margin,
        partial_rollout=config.partial_rollout and config.mode == "async",
        pause_mode=config.pause_mode,
        sampling=SamplingConfig(max_tokens=layout.max_units),
        max_consecutive_failures=1_000_000,
        recent_failures=16,
    )


def _replicas(
    config: SimConfig,
    layout: _Layout,
    queue: MessageQueue[SimItem],
    contention: ContentionState,
    trace: Trace,
) -> tuple[list[SimEngine], list[Replica]]:
    """One engine and rollouter per simulated replica, all feeding `queue`."""
    loop = asyncio.get_running_loop()
    decode = config.decode
    if config.mode == "async":
        decode = decode.scaled(config.contention.async_engine_factor)
    sink = QueueSink(queue)
    rollout_config = _rollout_config(config, layout)
    engines: list[SimEngine] = []
    handles: list[Replica] = []
    for index in range(layout.simulated):
        engine = SimEngine(
            decode,
            config.lengths,
            seed=config.seed,
            replica=index,
            token_unit=layout.unit,
            failure_rate=config.failure_rate,
            on_busy=contention.on_engine_busy,
            trace=trace,
        )
        engines.append(engine)
        rollouter = Rollouter(
            engine,
            _prompts(index, layout.prompt_units),
            sink,
            _Reward(),
            dataclasses.replace(rollout_config, groups_per_step=layout.shares[index]),
            clock=loop.time,
        )
        handles.append(Replica(rollouter, queue, index, layout.simulated))
    return engines, handles


def _trainer(
    config: SimConfig,
    layout: _Layout,
    queue: MessageQueue[SimItem],
    handles: list[Replica],
    contention: ContentionState,
    trace: Trace,
    errors: list[str],
) -> SimTrainer:
    """The simulated trainer; after every step it checks that the books balance (a broken
    invariant is appended to `errors`)."""
    trainer_model = config.trainer
    if config.mode == "async":
        trainer_model = trainer_model.scaled(config.contention.async_trainer_factor)
    colocate = layout.colocate
    return SimTrainer(
        queue,
        handles,
        trainer_model,
        contention,
        batch_size=layout.batch,
        max_staleness=layout.k,
        steps=config.steps // config.sync_every if colocate else config.steps,
        sync_every=layout.sync_every,
        token_unit=layout.unit,
        token_scale=layout.batch_size / layout.batch,
        speedup=config.colocate_speedup if colocate else 1.0,
        switch_s=config.colocate_switch_s if colocate else 0.0,
        seed=config.seed,
        trace=trace,
        on_step=_step_check(handles, queue, errors),
    )


def _step_check(
    handles: list[Replica], queue: MessageQueue[SimItem], errors: list[str]
) -> Callable[[SimTrainer], None]:
    def check(trainer: SimTrainer) -> None:
        idle = [h.rollouter.metrics()["rollout/idle_ratio"] for h in handles]
        trainer.records[-1]["rollout/idle_ratio"] = statistics.fmean(idle)
        for index, handle in enumerate(handles):
            s = handle.rollouter.stats()
            if s.admitted != s.delivered + s.failed + s.dropped + s.in_flight:
                errors.append(
                    f"step {trainer.step} replica {index}: {s.admitted} admitted != "
                    f"{s.delivered}+{s.failed}+{s.dropped}+{s.in_flight}"
                )
        q = queue.stats()
        if q.produced != q.consumed + q.dropped_total + q.size:
            errors.append(f"step {trainer.step}: queue {q}")

    return check


def _check_end(
    rollout: list[RolloutStats], queue: QueueStats, trainer: SimTrainer, errors: list[str]
) -> None:
    """Conservation once everything stopped: admitted = delivered + failed + dropped (+ 0 in
    flight) per replica; every delivered group was produced into the queue; the queue's books
    balance; the trainer consumed what the queue handed out, each group once."""
    for index, s in enumerate(rollout):
        if s.admitted != s.delivered + s.failed + s.dropped + s.in_flight or s.in_flight:
            errors.append(f"end replica {index}: {s}")
    delivered = sum(s.delivered for s in rollout)
    if delivered != queue.produced:
        errors.append(f"end: delivered {delivered} != queue produced {queue.produced}")
    if queue.produced != queue.consumed + queue.dropped_total + queue.size:
        errors.append(f"end: queue books {queue}")
    if trainer.consumed_groups != queue.consumed:
        errors.append(f"end: trainer took {trainer.consumed_groups} != {queue.consumed}")
    if trainer.duplicates:
        errors.append(f"end: {trainer.duplicates} groups consumed twice")

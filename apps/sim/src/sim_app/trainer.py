"""The simulated trainer and the adapters around the real Rollouter and queue core.

`SimTrainer` does what `ppo_trainer.PPOTrainer.train` does, minus torch: it takes full batches
from the real `async_queue.MessageQueue` core with the same staleness arguments as the app's
`QueueBatchSource` (`get_batch(n, min_items=n, current_version=v, max_staleness=k)`), checks
every group's staleness again at consumption (the invariant: never more than k), spends the
`TrainerModel`'s step time, bumps the version every `sync_every` steps and pushes the weights to
every replica: in the background (the next step overlaps it; one push at a time, in order) or
inline. A push is the app's `RolloutWeightSink` + `RolloutActor.update_weights`: transfer, then
`Rollouter.update_weights` on every replica at once, then each replica's share of the queue's
stale drops goes back to its rollouter (`on_downstream_drop`).

Per-step records use the app's metric names (`trainer/step_s`, `trainer/wait_s`,
`weights/sync_s`, `weights/push_s`, `trainer/wall_s`, `staleness/mean`, ...), so a simulated
run reads like a real one.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from async_queue import MessageQueue
from rollout_engine import Rollouter, Trajectory

from sim_app.engine import SimEngine
from sim_app.models import Contention, TrainerModel

__all__ = ["ContentionState", "QueueSink", "Replica", "SimItem", "SimTrainer", "StalenessError"]


class StalenessError(AssertionError):
    """The trainer was handed a group staler than k (the invariant broke)."""


@dataclass(slots=True)
class SimItem:
    """A queue item: the group and its oldest token version (the app's `QueueItem.version`)."""

    version: int
    group: list[Trajectory]


class QueueSink:
    """The rollouter's sink: one item per group, stamped like the app's `QueueTrajectorySink`."""

    def __init__(self, queue: MessageQueue[SimItem]) -> None:
        self._queue = queue

    async def put(self, group: list[Trajectory]) -> None:
        versions = [t.min_version for t in group if t.token_versions]
        await self._queue.put(SimItem(min(versions) if versions else 0, group))


class ContentionState:
    """Who is busy now, and the speed that leaves each side (see `models.Contention`)."""

    def __init__(self, model: Contention) -> None:
        self.model = model
        self.engines: list[SimEngine] = []
        self._busy_engines = 0
        self._trainer_busy = False
        self._changed: asyncio.Future[None] | None = None

    def on_engine_busy(self, engine: SimEngine, busy: bool) -> None:
        before = self._busy_engines > 0
        self._busy_engines += 1 if busy else -1
        changed = self._changed
        if (self._busy_engines > 0) != before and changed is not None and not changed.done():
            changed.set_result(None)

    def _set_trainer_busy(self, busy: bool) -> None:
        self._trainer_busy = busy
        speed = 1.0 / self.model.engine_factor if busy else 1.0
        for engine in self.engines:
            engine.set_speed(speed)

    async def work(self, seconds: float) -> None:
        """Spend `seconds` of trainer work (at full speed) on the loop's clock."""
        if seconds <= 0:
            return
        if not self.model.enabled:
            await asyncio.sleep(seconds)
            return
        loop = asyncio.get_running_loop()
        self._set_trainer_busy(True)
        try:
            remaining = seconds
            while remaining > 1e-9:
                slow = self._busy_engines > 0
                speed = 1.0 / self.model.trainer_factor if slow else 1.0
                self._changed = loop.create_future()
                started = loop.time()
                await asyncio.wait({self._changed}, timeout=remaining / speed)
                remaining -= (loop.time() - started) * speed
        finally:
            self._changed = None
            self._set_trainer_busy(False)


class Replica:
    """One rollout replica as the trainer sees it (the app's `RolloutActor`)."""

    def __init__(
        self, rollouter: Rollouter, queue: MessageQueue[SimItem], index: int, count: int
    ) -> None:
        self.rollouter = rollouter
        self._queue = queue
        self._index = index
        self._count = count
        self._stale_seen = 0

    async def update_weights(self, version: int) -> None:
        await self.rollouter.update_weights(None, version)
        # RolloutActor._report_downstream_drops: replica i takes drops i, i + n, ...
        total = self._queue.stats().dropped.get("stale", 0)
        n, i = self._count, self._index
        share = (total - i + n - 1) // n if total > i else 0
        if share > self._stale_seen:
            self.rollouter.on_downstream_drop(share - self._stale_seen)
            self._stale_seen = share


class SimTrainer:
    """See the module docstring. `token_unit` converts the trajectories' token counts to real
    tokens; `token_scale` multiplies the step's tokens (when only some replicas are
    simulated, the batch stands for the whole one)."""

    def __init__(
        self,
        queue: MessageQueue[SimItem],
        replicas: Sequence[Replica],
        model: TrainerModel,
        contention: ContentionState,
        *,
        batch_size: int,
        max_staleness: int,
        steps: int,
        sync_every: int = 1,
        token_unit: int = 1,
        token_scale: float = 1.0,
        speedup: float = 1.0,
        switch_s: float = 0.0,
        seed: int = 0,
        initial_version: int = 0,
        trace: Callable[..., None] | None = None,
        on_step: Callable[[SimTrainer], None] | None = None,
    ) -> None:
        self._queue = queue
        self._replicas = list(replicas)
        self.model = model
        self._contention = contention
        self._batch_size = batch_size
        self._k = max_staleness
        self._steps = steps
        self._sync_every = sync_every
        self._unit = token_unit
        self._scale = token_scale
        self._speedup = speedup
        self._switch_s = switch_s
        self._rng = random.Random(f"trainer:{seed}")
        self._trace = trace
        self._on_step = on_step
        self.version = initial_version
        self.step = 0
        self.records: list[dict[str, Any]] = []
        self.staleness_hist: Counter[int] = Counter()
        self.consumed_groups = 0
        self.consumed_ids: set[str] = set()
        self.duplicates = 0
        self.samples = 0.0  # the whole batch's (scaled when replicas are sampled)
        self.tokens = 0.0
        self.wait_s = 0.0
        self.started_at = 0.0
        self.wall_s = 0.0
        self._push_task: asyncio.Task[None] | None = None
        self._last_push_s: float | None = None
        self.pushes = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.started_at = loop.time()
        model = self.model
        while self.step < self._steps:
            iteration_start = loop.time()
            items = await self._queue.get_batch(
                self._batch_size,
                min_items=self._batch_size,
                current_version=self.version,
                max_staleness=self._k,
            )
            wait_s = loop.time() - iteration_start
            self.wait_s += wait_s
            staleness, tokens, sq_tokens = self._consume(items)
            step_s = self._step_time(tokens, sq_tokens)
            await self._contention.work(step_s)
            await self._contention.work(model.export_s)
            self.step += 1
            metrics: dict[str, Any] = {}
            if self.step % self._sync_every == 0:
                metrics.update(await self._sync_weights())
            now = loop.time()
            self.wall_s = now - self.started_at
            metrics.update(
                {
                    "step": self.step,
                    "trainer/step_s": step_s,
                    "trainer/wait_s": wait_s,
                    "trainer/idle_ratio": wait_s / max(now - iteration_start, 1e-12),
                    "trainer/version": self.version,
                    "trainer/tokens": tokens * self._scale,
                    "trainer/samples": round(sum(len(i.group) for i in items) * self._scale),
                    "trainer/wall_s": self.wall_s,
                    "staleness/mean": sum(staleness) / len(staleness) if staleness else 0.0,
                    "staleness/max": max(staleness, default=0),
                }
            )
            self.records.append(metrics)
            if self._trace is not None:
                self._trace("step", now, self.step, self.version, wait_s, tuple(staleness))
            if self._on_step is not None:
                self._on_step(self)
            await self._step_overhead()
        await self._finish_push()

    def _step_time(self, tokens: float, sq_tokens: float) -> float:
        """The modelled seconds of one step on `tokens` (with jitter, if the model has it)."""
        model = self.model
        step_s = model.step_time(tokens * self._scale, sq_tokens * self._scale)
        step_s = step_s / self._speedup
        if model.jitter > 0:
            noise = model.jitter * max(-3.0, min(3.0, self._rng.gauss(0.0, 1.0)))
            step_s *= max(0.1, 1.0 + noise)
        return step_s

    async def _sync_weights(self) -> dict[str, Any]:
        """Advance the version and push it (in the background if the model says so); the
        sync metrics."""
        loop = asyncio.get_running_loop()
        model = self.model
        metrics: dict[str, Any] = {}
        if self._switch_s > 0:  # colocate: the engines sleep and wake
            await asyncio.sleep(self._switch_s)
        self.version += 1
        sync_started = loop.time()
        await self._finish_push()
        push = self._push(self.version)
        if model.background_push:
            self._push_task = asyncio.ensure_future(push)
        else:
            await push
        metrics["weights/sync_s"] = model.export_s + loop.time() - sync_started
        if self._last_push_s is not None:
            metrics["weights/push_s"] = self._last_push_s
        return metrics

    async def _step_overhead(self) -> None:
        """The fixed per-step overhead, plus a checkpoint's time on checkpoint steps."""
        overhead = self.model.overhead_s
        if self.model.checkpoint_every and self.step % self.model.checkpoint_every == 0:
            overhead += self.model.checkpoint_s
        if overhead > 0:
            await asyncio.sleep(overhead)

    def _consume(self, items: list[SimItem]) -> tuple[list[int], float, float]:
        staleness: list[int] = []
        tokens = sq_tokens = 0.0
        unit, version, seen = self._unit, self.version, self.consumed_ids
        for item in items:
            group = item.group
            group_id = group[0].group_id
            if group_id in seen:
                self.duplicates += 1
            seen.add(group_id)
            group_staleness = [version - min(t.token_versions, default=version) for t in group]
            if max(group_staleness) > self._k:
                raise StalenessError(
                    f"group {group_id} consumed at version {version} with staleness "
                    f"{max(group_staleness)} > max_staleness {self._k}"
                )
            staleness.extend(group_staleness)
            for t in group:
                length = (len(t.prompt_token_ids) + len(t.response_ids)) * unit
                tokens += length
                sq_tokens += length * length
            self.samples += len(group) * self._scale
        self.staleness_hist.update(staleness)
        self.consumed_groups += len(items)
        self.tokens += tokens * self._scale
        return staleness, tokens, sq_tokens

    async def _push(self, version: int) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self._trace is not None:
            self._trace("push", started, version)
        if self.model.push_s > 0:
            await asyncio.sleep(self.model.push_s)
        await asyncio.gather(*(r.update_weights(version) for r in self._replicas))
        self._last_push_s = loop.time() - started
        self.pushes += 1

    async def abandon(self) -> None:
        """After a failure: end the push in flight (cancelled), if any."""
        task, self._push_task = self._push_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})

    async def _finish_push(self) -> None:
        task, self._push_task = self._push_task, None
        if task is not None:
            await task

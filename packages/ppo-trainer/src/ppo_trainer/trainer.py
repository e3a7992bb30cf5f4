"""`PPOTrainer`: the async loop that pulls groups, trains on them and pushes weights.

The loop (on the event loop) only waits: for the source, for the worker thread, for the
weight sink. All torch work of a step (packing, forward/backward, optimizer, weight export)
and checkpoint I/O runs in one dedicated worker thread, so `stats()`, `stop()` and everything
else sharing the loop keep running while a step computes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from ppo_trainer.advantages import grpo_advantages, rloo_advantages
from ppo_trainer.batch import pack_batch
from ppo_trainer.checkpoint import load_checkpoint, save_checkpoint, update_latest
from ppo_trainer.checkpoint_files import CheckpointError, verify_checkpoint, write_manifest
from ppo_trainer.checkpoint_meta import ConsumedIds
from ppo_trainer.config import PPOConfig
from ppo_trainer.protocols import (
    GroupSource,
    MetricsSink,
    MetricValue,
    MultiModalInputsFn,
    StalenessBound,
    WeightSink,
)
from ppo_trainer.sources import iterate_groups
from ppo_trainer.staleness import (
    MaxStaleness,
    group_staleness,
    old_token_fraction,
    staleness_metrics,
)
from ppo_trainer.types import Trajectory
from ppo_trainer.update import PolicyUpdater
from ppo_trainer.weights import WeightPusher

if TYPE_CHECKING:
    from ppo_trainer.distributed import DataParallel

__all__ = ["PPOTrainer", "StopReason", "TrainSummary"]

logger = logging.getLogger(__name__)

StopReason = Literal["end_of_stream", "stopped", "total_steps"]
_T = TypeVar("_T")
_END = object()  # sentinel: the source is exhausted
_STOP = object()  # sentinel: stop() was requested while waiting


@dataclass(frozen=True, slots=True)
class TrainSummary:
    """What `PPOTrainer.train` returns after a clean end (not after a failure)."""

    reason: StopReason
    steps: int  # steps taken by this call
    step: int  # the trainer's step counter afterwards (cumulative over resumes)
    version: int
    groups: int  # groups trained on by this call
    samples: int  # trajectories trained on by this call
    dropped_groups: int  # groups dropped as too stale by this call
    tokens: int  # non-padding tokens trained on by this call
    wall_s: float
    idle_s: float  # time spent waiting for the source
    idle_ratio: float
    metrics: dict[str, MetricValue] = field(default_factory=dict)  # the last snapshot

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class _Tally:
    """What one `train()` call did so far (its `TrainSummary` at the end)."""

    reason: StopReason = "end_of_stream"
    steps: int = 0
    groups: int = 0
    samples: int = 0
    dropped: int = 0
    tokens: int = 0
    idle_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add_step(self, groups: list[list[Trajectory]], tokens: int) -> None:
        self.steps += 1
        self.groups += len(groups)
        self.samples += sum(len(g) for g in groups)
        self.tokens += tokens

    def summary(self, step: int, version: int, metrics: dict[str, MetricValue]) -> TrainSummary:
        wall_s = time.perf_counter() - self.started
        return TrainSummary(
            reason=self.reason,
            steps=self.steps,
            step=step,
            version=version,
            groups=self.groups,
            samples=self.samples,
            dropped_groups=self.dropped,
            tokens=self.tokens,
            wall_s=wall_s,
            idle_s=self.idle_s,
            idle_ratio=self.idle_s / wall_s if wall_s > 0 else 0.0,
            metrics=dict(metrics),
        )


@dataclass(slots=True)
class _Collected:
    groups: list[list[Trajectory]] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    dropped: list[list[Trajectory]] = field(default_factory=list)
    ended: bool = False
    stopped: bool = False


class PPOTrainer:
    """Fully-async PPO/GRPO trainer of a causal LM (or Qwen2-VL) on groups from a source.

    Each step: pull `config.batch_size` fresh groups (dropping any whose staleness exceeds
    `max_staleness`), compute group advantages from `Trajectory.reward`, recompute proximal
    log-probs, run the minibatch updates (decoupled PPO loss), and every `sync_every` steps
    bump the policy version and `await weight_sink.push_weights(weights, version)`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: PPOConfig | None = None,
        *,
        weight_sink: WeightSink | None = None,
        metrics_sink: MetricsSink | None = None,
        ref_model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        mm_inputs_fn: MultiModalInputsFn | None = None,
        pad_token_id: int = 0,
        data_parallel: DataParallel | None = None,
        on_checkpoint: Callable[[Path], Awaitable[None]] | None = None,
        checkpoint_labels: Mapping[str, str] | None = None,
        staleness_bound: StalenessBound | None = None,
        consumed_ids_kept: int | None = None,
    ) -> None:
        self.config = config or PPOConfig()
        # The run's one bound (any object with `max_staleness` and `too_stale`); without
        # one, the config's `max_staleness`.
        self._staleness_bound: StalenessBound = staleness_bound or MaxStaleness(
            self.config.max_staleness
        )
        if data_parallel is not None and data_parallel.strategy == "fsdp2" and optimizer:
            raise ValueError("fsdp2 replaces the model's parameters: leave optimizer=None")
        self._dp = data_parallel
        self._dp_end_due = False  # rank 0 owes the other ranks an end-of-run message
        self._updater = PolicyUpdater(
            model,
            self.config,
            optimizer=optimizer,
            ref_model=ref_model,
            data_parallel=data_parallel,
        )
        self._pusher = WeightPusher(weight_sink, background=self.config.background_push)
        self._metrics_sink = metrics_sink
        # Adds the caller's own files to each checkpoint directory (see `save_checkpoint`).
        self._on_checkpoint = on_checkpoint
        # Written into each checkpoint's manifest; `verify_checkpoint(expect_labels=)` checks
        # them (e.g. {"model": name}: a resume with another model is refused up front).
        self._checkpoint_labels = dict(checkpoint_labels or {})
        self._mm_inputs_fn = mm_inputs_fn
        self._pad_token_id = pad_token_id
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppo-trainer")
        self._step = 0
        self._version = self.config.initial_version
        # True while the weights equal those of `self._version` (at the start, right after a
        # push, after a checkpoint load): only then is `ppo/behav_logprob_diff` meaningful.
        self._weights_are_version = True
        # None: every consumed id, for a source that resumes by skipping them; a number:
        # the most recent ones only (memory and checkpoints that do not grow with the run).
        self._consumed_ids_kept = consumed_ids_kept
        self._consumed = ConsumedIds(limit=consumed_ids_kept)
        self._dropped_total = 0
        self._latest: dict[str, MetricValue] = {}
        self._stop_requested = False
        self._stop_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._in_step = False

    # -- state ----------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        return self._updater.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._updater.optimizer

    @property
    def step(self) -> int:
        """Trainer steps done so far (restored by `load_checkpoint`)."""
        return self._step

    @property
    def staleness_bound(self) -> StalenessBound:
        """The bound that decides which groups are too stale to train on."""
        return self._staleness_bound

    @property
    def version(self) -> int:
        """Policy version of the current weights; +1 at every weight push."""
        return self._version

    @property
    def consumed_response_ids(self) -> tuple[str, ...]:
        """`response_id`s trained on or dropped so far, in first-seen order."""
        return tuple(self._consumed.response_ids)

    @property
    def consumed_group_ids(self) -> tuple[str, ...]:
        """Distinct `group_id`s of the consumed samples, in first-seen order."""
        return tuple(self._consumed.group_ids)

    @property
    def consumed_prompt_ids(self) -> tuple[str, ...]:
        """Distinct `prompt_id`s of the consumed samples, in first-seen order (the last
        `consumed_ids_kept` of them when set): what a resumed prompt stream skips (empty
        ids, from producers older than schema 3, are left out)."""
        return tuple(self._consumed.prompt_ids)

    def stats(self) -> dict[str, MetricValue]:
        """The latest metrics snapshot plus live counters; cheap, safe while a step runs."""
        snapshot = dict(self._latest)
        snapshot.update(
            {
                "trainer/step": float(self._step),
                "trainer/version": float(self._version),
                "trainer/running": float(self._running),
                "trainer/in_step": float(self._in_step),
                "staleness/dropped": float(self._dropped_total),
            }
        )
        return snapshot

    # -- control --------------------------------------------------------------------------

    def stop(self) -> None:
        """Request a graceful stop: the running step (and its weight push) completes, a
        pending wait for data is abandoned, then `train()` returns with reason "stopped".
        Safe to call from any thread."""
        self._stop_requested = True
        loop, event = self._loop, self._stop_event
        if loop is None or event is None:
            return
        if _running_loop() is loop:
            event.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    def close(self) -> None:
        """Release the worker thread (after any work in it finishes)."""
        self._executor.shutdown(wait=False)

    # -- training -------------------------------------------------------------------------

    async def train(
        self,
        source: GroupSource | None,
        weight_sink: WeightSink | None = None,
        *,
        end_of_stream: tuple[type[BaseException], ...] = (),
    ) -> TrainSummary:
        """Train until the source ends, `stop()` is called or `config.total_steps` is reached.

        `source` is an async iterable of groups (its end is the end of stream) or a
        `BatchSource` (`next_batch(n, current_version)`; raising one of `end_of_stream` ends
        the stream). Any other exception of the source (e.g. `ProducerFailed`) propagates
        out of `train()` unchanged, with its `__cause__`. A non-empty partial batch at the
        end of the stream is trained on. `weight_sink`, if given, replaces the constructor's
        for the rest of the trainer's life.

        Data parallel: call it on every rank at once. Rank 0 reads `source` and sends each
        step's groups to the others, whose `source` is ignored (pass None); only rank 0
        pushes weights; the others return when rank 0's `train()` ends (`stop()` matters
        on rank 0 only).
        """
        if self._running:
            raise RuntimeError("train() is already running")
        if weight_sink is not None:
            self._pusher.sink = weight_sink
        if self._dp is not None and not self._dp.is_leader:
            return await self._follow_while_running()
        if source is None:
            raise ValueError("train() needs a source (only data-parallel ranks > 0 take None)")
        self._begin_training()
        iterator = iterate_groups(
            source, self.config.batch_size, lambda: self._version, end_of_stream
        )
        tally = _Tally()
        try:
            await self._train_loop(iterator, tally)
            await self._pusher.finish()
        finally:
            await self._end_training(tally)
        logger.info(
            "training ended (%s) after %d steps, version %d",
            tally.reason,
            tally.steps,
            self._version,
        )
        return tally.summary(self._step, self._version, self._latest)

    async def _follow_while_running(self) -> TrainSummary:
        self._running = True
        try:
            return await self._follow()
        finally:
            self._running = False

    def _begin_training(self) -> None:
        self._running = True
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if self._stop_requested:
            self._stop_event.set()
        self._dp_end_due = self._dp is not None

    async def _end_training(self, tally: _Tally) -> None:
        """Release the other ranks and the weight pusher; ready for the next `train()`."""
        if self._dp is not None and self._dp_end_due:
            # Release the other ranks (also after a source error; not after a failed
            # step, whose collectives may have left them waiting elsewhere).
            self._dp_end_due = False
            await self._in_worker(self._dp.broadcast_object, _DPEnd(tally.reason))
        await self._pusher.abandon(self._version)
        self._running = False
        self._stop_requested = False
        self._stop_event = None
        self._loop = None

    async def _train_loop(self, iterator: AsyncIterator[list[Trajectory]], tally: _Tally) -> None:
        """Collect a batch and train on it until the end of the stream, a stop or
        `total_steps`; `tally.reason` says which."""
        assert self._stop_event is not None
        while True:
            total = self.config.total_steps
            if total is not None and self._step >= total:
                tally.reason = "total_steps"
                return
            if self._stop_event.is_set():
                tally.reason = "stopped"
                return
            iteration_start = time.perf_counter()
            collected = await self._collect(iterator)
            wait_s = time.perf_counter() - iteration_start
            tally.idle_s += wait_s
            if collected.stopped:
                tally.reason = "stopped"  # a partial batch is discarded, not marked consumed
                return
            tally.dropped += len(collected.dropped)
            self._consumed.add_groups(collected.dropped)
            if collected.groups:
                step_tokens = await self._train_step(collected, wait_s, iteration_start)
                tally.add_step(collected.groups, step_tokens)
            if collected.ended:
                tally.reason = "end_of_stream"
                return

    async def _collect(self, iterator: AsyncIterator[list[Trajectory]]) -> _Collected:
        """Pull groups until `batch_size` fresh ones, the end of the stream or a stop."""
        collected = _Collected()
        while len(collected.groups) < self.config.batch_size:
            try:
                item = await self._next_or_stop(iterator)
            except Exception as exc:
                exc.add_note(f"raised by the PPOTrainer source at step {self._step}")
                logger.error("source failed at step %d: %r", self._step, exc)
                raise
            if item is _STOP:
                collected.stopped = True
                break
            if item is _END:
                collected.ended = True
                break
            group: list[Trajectory] = item  # type: ignore[assignment]
            if not group:
                continue
            staleness = group_staleness(group, self._version)
            if self._staleness_bound.too_stale(staleness):
                self._dropped_total += 1
                collected.dropped.append(group)
                logger.warning(
                    "dropped group %s: staleness %d > max_staleness %d",
                    group[0].group_id,
                    staleness,
                    self._staleness_bound.max_staleness,
                )
                continue
            collected.groups.append(group)
            collected.staleness.append(staleness)
        return collected

    async def _next_or_stop(self, iterator: AsyncIterator[list[Trajectory]]) -> object:
        """The next group, `_END` at the end of the stream, or `_STOP` once stop() is called."""
        assert self._stop_event is not None
        if self._stop_event.is_set():
            return _STOP
        fetch = asyncio.ensure_future(_next_item(iterator))
        stop_wait = asyncio.ensure_future(self._stop_event.wait())
        try:
            await asyncio.wait({fetch, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            if not fetch.done():
                fetch.cancel()
        if fetch.done() and not fetch.cancelled():
            return await fetch  # already done: returns at once
        return _STOP

    async def _train_step(
        self, collected: _Collected, wait_s: float, iteration_start: float
    ) -> int:
        """Run one step in the worker thread, push weights if due, log metrics."""
        sync_due = (self._step + 1) % self.config.sync_every == 0
        self._in_step = True
        try:
            result = await self._in_worker(self._step_in_worker, collected.groups, sync_due)
        except BaseException:
            self._dp_end_due = False
            raise
        finally:
            self._in_step = False
        self._step += 1
        self._consumed.add_groups(collected.groups)
        self._weights_are_version = sync_due
        metrics: dict[str, MetricValue] = dict(result.metrics)
        if sync_due:
            self._version += 1
            sync_started = time.perf_counter()
            await self._pusher.push(result.weights, self._version)
            # What the step spent on weights: the export plus any wait for a push.
            metrics["weights/sync_s"] = result.export_s + time.perf_counter() - sync_started
            if self._pusher.last_push_s is not None:
                metrics["weights/push_s"] = self._pusher.last_push_s
        iteration_s = time.perf_counter() - iteration_start
        metrics.update(staleness_metrics(collected.staleness, self._staleness_bound.max_staleness))
        metrics.update(
            {
                "trainer/step_s": result.step_s,
                "trainer/wait_s": wait_s,
                "trainer/idle_ratio": wait_s / iteration_s if iteration_s > 0 else 0.0,
                "tokens/s": result.tokens / result.step_s if result.step_s > 0 else 0.0,
                "reward/mean": result.reward_mean,
                "trainer/groups": float(len(collected.groups)),
                "trainer/samples": float(sum(len(g) for g in collected.groups)),
                "trainer/version": float(self._version),
                "staleness/dropped": float(self._dropped_total),
            }
        )
        self._latest = metrics
        if self._metrics_sink is not None:
            self._metrics_sink.log(metrics, self._step)
        await self._maybe_checkpoint()
        return result.tokens

    async def _maybe_checkpoint(self) -> None:
        every = self.config.checkpoint_every
        if every and self._step % every == 0 and self.config.checkpoint_dir is not None:
            path = await self.save_checkpoint(
                Path(self.config.checkpoint_dir) / f"step_{self._step:06d}"
            )
            if self._dp is None or self._dp.is_leader:
                await self._in_worker(update_latest, path, self.config.keep_checkpoints)

    # -- data parallel --------------------------------------------------------------------

    async def _follow(self) -> TrainSummary:
        """`train()` on a rank other than 0: take each step's groups from rank 0, train on
        this rank's shard, until rank 0 says the run ended."""
        tally = _Tally()
        while True:
            received = await self._in_worker(self._follow_in_worker)
            if isinstance(received, _DPEnd):
                tally.reason = received.reason
                break
            message, result = received
            self._step += 1
            self._consumed.add_groups(message.groups)
            self._weights_are_version = message.sync_due
            self._version = message.version + (1 if message.sync_due else 0)
            metrics: dict[str, MetricValue] = dict(result.metrics)
            metrics.update({"trainer/step_s": result.step_s, "reward/mean": result.reward_mean})
            self._latest = metrics
            if self._metrics_sink is not None:
                self._metrics_sink.log(metrics, self._step)
            tally.add_step(message.groups, result.tokens)
            await self._maybe_checkpoint()
        return tally.summary(self._step, self._version, self._latest)

    def _follow_in_worker(self) -> _DPEnd | tuple[_DPStep, _StepResult]:
        assert self._dp is not None
        message = self._dp.broadcast_object()
        if isinstance(message, _DPEnd):
            return message
        return message, self._step_shard(message, time.perf_counter())

    def _step_in_worker(self, groups: list[list[Trajectory]], sync_due: bool) -> _StepResult:
        """Rank 0's (or the only process's) step: tell the other ranks, then take part."""
        message = _DPStep(
            groups=groups,
            sync_due=sync_due,
            export=sync_due and self._pusher.sink is not None,
            version=self._version,
            current_version=self._version if self._weights_are_version else None,
        )
        started = time.perf_counter()
        if self._dp is not None:
            self._dp.broadcast_object(message)
        result = self._step_shard(message, started)
        result.metrics["staleness/old_token_frac"] = old_token_fraction(groups, self._version)
        return result

    def _step_shard(self, message: _DPStep, started: float) -> _StepResult:
        """This process's part of a step: its group-aligned shard of `message.groups` (all
        of them in one process, the world-size-1 case)."""
        groups, shard = message.groups, None
        if self._dp is not None:
            from ppo_trainer.distributed import shard_groups

            shard = shard_groups(message.groups, self._dp.rank, self._dp.world_size)
            groups = shard.groups
        local = [t for group in groups for t in group]
        advantages = None  # GAE: the updater computes token advantages from its values
        if self.config.advantage != "gae":
            # Per group, and groups are never split: the same advantages as one process.
            advantages = [a for group in groups for a in self._advantages(group)]
        batch = None
        if local:
            batch = pack_batch(
                local,
                advantages,
                pad_token_id=self._pad_token_id,
                mm_inputs_fn=self._mm_inputs_fn,
                current_version=message.current_version,
                version=message.version,
            )
        metrics = self._updater.step(batch, shard)
        step_s = time.perf_counter() - started
        weights, export_s = None, 0.0
        if message.export:
            export_started = time.perf_counter()
            weights = self._updater.export_weights()  # full on rank 0 only (collective)
            export_s = time.perf_counter() - export_started
        everything = [t for group in message.groups for t in group]
        return _StepResult(
            metrics=metrics,
            weights=weights,
            step_s=step_s,
            export_s=export_s,
            tokens=sum(len(t.prompt_token_ids) + len(t.response_ids) for t in everything),
            reward_mean=sum(t.reward for t in everything) / len(everything),
        )

    def _advantages(self, group: list[Trajectory]) -> list[float]:
        rewards = torch.tensor([[t.reward for t in group]], dtype=torch.float32)
        if self.config.advantage == "rloo":
            adv = rloo_advantages(rewards)
        else:
            adv = grpo_advantages(rewards, norm_std=self.config.norm_std, eps=self.config.adv_eps)
        return adv[0].tolist()

    # -- checkpoints ----------------------------------------------------------------------

    async def save_checkpoint(self, path: str | Path) -> Path:
        """Save model, optimizer, scheduler, RNGs, step, version and consumed ids to `path`.

        Runs in the worker thread, so it never overlaps a step. Then `on_checkpoint(path)`
        (rank 0 only, on the event loop) adds the caller's files (the app: the rollouters'
        in-flight partials); periodic checkpoints point `latest` at `path` only after it
        returns, so `latest` never names a checkpoint without them. The manifest is
        rewritten after the caller's files, so it lists them too and is written last."""
        state = self._consumed.state(self._step, self._version)
        labels = self._checkpoint_labels
        saved = await self._in_worker(
            functools.partial(save_checkpoint, labels=labels), path, self._updater, state
        )
        logger.info("saved checkpoint %s (step %d)", saved, self._step)
        if self._on_checkpoint is not None and (self._dp is None or self._dp.is_leader):
            await self._on_checkpoint(saved)
            await self._in_worker(write_manifest, saved, labels)
        return saved

    async def load_checkpoint(self, path: str | Path) -> None:
        """Restore everything `save_checkpoint` wrote, into this trainer's model/optimizer.

        Raises `CheckpointError` (one line) if `verify_checkpoint` finds it damaged, or it
        is another model's."""
        if self._running:
            raise RuntimeError("cannot load a checkpoint while train() is running")
        await self._in_worker(_raise_if_damaged, path)
        state = await self._in_worker(load_checkpoint, path, self._updater)
        self._step = state.step
        self._version = state.version
        self._weights_are_version = True  # the sink is assumed to get these weights as `version`
        self._consumed = ConsumedIds.of_state(state, limit=self._consumed_ids_kept)
        logger.info("loaded checkpoint %s (step %d, version %d)", path, self._step, self._version)

    @classmethod
    async def resume(
        cls,
        path: str | Path,
        model: torch.nn.Module,
        config: PPOConfig | None = None,
        **kwargs: Any,
    ) -> PPOTrainer:
        """A new trainer around `model` (same architecture) restored from checkpoint `path`."""
        trainer = cls(model, config, **kwargs)
        await trainer.load_checkpoint(path)
        return trainer

    async def _in_worker(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)


@dataclass(frozen=True, slots=True)
class _DPStep:
    """Rank 0 to the other ranks: one step's groups and what to do with them."""

    groups: list[list[Trajectory]]
    sync_due: bool  # the step ends with a version bump
    export: bool  # gather the full weights on rank 0 (rank 0 has a weight sink)
    version: int  # the policy version before the step
    current_version: int | None  # see pack_batch(current_version=)


@dataclass(frozen=True, slots=True)
class _DPEnd:
    """Rank 0 to the other ranks: `train()` ended."""

    reason: StopReason


@dataclass(frozen=True, slots=True)
class _StepResult:
    metrics: dict[str, float]
    weights: dict[str, torch.Tensor] | None
    step_s: float
    export_s: float
    tokens: int
    reward_mean: float


def _raise_if_damaged(path: str | Path) -> None:
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"{Path(path).resolve()}: {problem}")


async def _next_item(iterator: AsyncIterator[_T]) -> _T | object:
    try:
        return await anext(iterator)
    except StopAsyncIteration:
        return _END


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

"""Adapters that connect the packages (which never import each other).

- `QueueTrajectorySink`: the rollouter's sink -> the queue (one msgpack-encoded group per item).
- `QueueBatchSource`: the queue -> the trainer (decodes groups into the trainer's own struct).
- `RolloutWeightSink`: the trainer's weight sink -> every rollouter actor (awaited Ray calls).

Elastic rollouters (the driver restarts a dead replica, `driver.supervisor`): each queue item's
`item_id` is its group's prompt id, so a replacement replica can skip the prompts its
predecessor left queued; `QueueBatchSource` hands each prompt id to the trainer at most once
(a backstop for the rare prompt regenerated anyway); `RolloutWeightSink` skips a dead
replica and brings a replacement to the last pushed weights before it joins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import ray
from async_queue import MessageQueueClient, QueueClosed, QueueItem
from ppo_trainer import Trajectory as TrainerTrajectory
from rollout_engine import Trajectory as RolloutTrajectory

if TYPE_CHECKING:  # the rollout actors import this module and need no torch
    import torch

__all__ = ["QueueBatchSource", "QueueTrajectorySink", "RecentIds", "RolloutWeightSink"]

logger = logging.getLogger(__name__)

_group_decoder = msgspec.msgpack.Decoder(list[TrainerTrajectory])


class QueueTrajectorySink:
    """Puts each finished GRPO group on the queue as one item, stamped with its oldest version.

    The item's id is the group's prompt id (one group per prompt; its group id when the
    prompt has none): what a replacement replica reads to skip prompts already queued."""

    def __init__(self, queue: MessageQueueClient) -> None:
        self._queue = queue

    async def put(self, group: list[RolloutTrajectory]) -> None:
        versions = [t.min_version for t in group if t.token_versions]
        await self._queue.put(
            QueueItem(
                payload=msgspec.msgpack.encode(group),
                version=min(versions) if versions else 0,
                item_id=group[0].prompt_id or group[0].group_id,
                produced_at=time.time(),
            )
        )


class QueueBatchSource:
    """`ppo_trainer.BatchSource` over the queue: full batches, stale items dropped there.

    It hands each prompt id over at most once among the last `kept` it handed out (None:
    all): `taken` starts with the prompts trained on before a `--resume` (the most recent the
    checkpoint kept) and takes every group handed out, forgetting the oldest past `kept`, so it
    does not grow with the run. A group whose prompt was
    already taken (a replacement replica regenerated a prompt its predecessor had delivered:
    see `driver.supervisor`) is dropped and counted in `duplicates`. After a `--resume` the queue
    is new and each replica's `PromptSource` already left out the prompts trained on before
    (`train_app.prompts`), so normally nothing is dropped.
    """

    def __init__(
        self,
        queue: MessageQueueClient,
        max_staleness: int,
        taken: Iterable[str] = (),
        kept: int | None = None,
    ) -> None:
        self._queue = queue
        self._max_staleness = max_staleness
        self.taken = RecentIds(kept, taken)
        self.duplicates = 0

    async def next_batch(self, n: int, current_version: int) -> list[list[TrainerTrajectory]]:
        batch: list[list[TrainerTrajectory]] = []
        while len(batch) < n:
            missing = n - len(batch)
            try:
                items = await self._queue.get_batch(
                    missing,
                    min_items=missing,
                    current_version=current_version,
                    max_staleness=self._max_staleness,
                )
            except QueueClosed:
                if batch:  # the end of the stream: what was taken is trained on
                    return batch
                raise
            for item in items:
                group = _group_decoder.decode(item.payload)
                prompt_id = group[0].prompt_id if group else ""
                if prompt_id and prompt_id in self.taken:
                    self.duplicates += 1
                    logger.warning("dropped a second group of prompt %s", prompt_id)
                    continue
                if prompt_id:
                    self.taken.add(prompt_id)
                batch.append(group)
        return batch


class RecentIds:
    """The last `limit` ids added (None: every id), as a set: `in`, iteration, `len`."""

    def __init__(self, limit: int | None = None, ids: Iterable[str] = ()) -> None:
        self._limit = limit
        self._ids: dict[str, None] = {}
        for prompt_id in ids:
            self.add(prompt_id)

    def add(self, prompt_id: str) -> None:
        self._ids[prompt_id] = None
        if self._limit is not None and len(self._ids) > self._limit:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._ids

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class RolloutWeightSink:
    """Pushes weights to every rollouter actor through Ray's object store and awaits them.

    A replica whose push fails (its actor died, or its engine) is skipped from then on; the
    driver restarts it and `attach` puts the replacement in its place. Pushes and attaches are
    serialized, so a replacement misses no version: `attach` loads the last pushed weights
    into it (when newer than what it started with) before later pushes reach it."""

    def __init__(self, rollout_actors: Sequence[Any]) -> None:
        self._actors: list[Any] = list(rollout_actors)
        self._lock = asyncio.Lock()
        self.last: tuple[ray.ObjectRef, int] | None = None
        """The last pushed weights (in the object store) and their version."""

    @property
    def actors(self) -> list[Any]:
        """The current actor of each replica (a restarted one's replacement; None while a
        replica is detached)."""
        return list(self._actors)

    async def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        # One copy in the object store, shared by every replica; the copy runs off the loop.
        # Packed as numpy views, the tensors' bytes go out-of-band: one write, zero-copy reads.
        ref = await asyncio.to_thread(_put_packed, weights)
        async with self._lock:
            self.last = (ref, version)
            live = [(i, a) for i, a in enumerate(self._actors) if a is not None]
            results = await asyncio.gather(
                *(_push(a, ref, version) for _, a in live), return_exceptions=True
            )
            for (index, actor), result in zip(live, results, strict=True):
                if isinstance(result, BaseException):
                    self._detach(index, actor, version, result)

    def _detach(self, index: int, actor: Any, version: int, error: BaseException) -> None:
        """A replica that could not take the weights (its actor died, or its engine did)
        leaves the pushes; its `wait()` fails with the error, so the driver restarts it (or,
        past `--max-rollout-restarts`, fails the run with that cause)."""
        logger.warning("rollouter %d did not load weights v%d: %r", index, version, error)
        self._actors[index] = None

    async def attach(self, index: int, actor: Any, version: int) -> None:
        """Replica `index` is now `actor`, which serves weights of `version`: push it the
        last weights if they are newer, then include it in every later push."""
        async with self._lock:
            if self.last is not None and self.last[1] > version:
                await _push(actor, *self.last)
            self._actors[index] = actor


def _put_packed(weights: Any) -> ray.ObjectRef:
    import torch  # here: the rollout actors import this module and need no torch

    from train_app.weight_wire import pack_weights

    if isinstance(weights, Mapping) and all(isinstance(t, torch.Tensor) for t in weights.values()):
        weights = pack_weights(weights)
    return ray.put(weights)


async def _push(actor: Any, ref: ray.ObjectRef, version: int) -> None:
    await actor.update_weights.remote(ref, version)

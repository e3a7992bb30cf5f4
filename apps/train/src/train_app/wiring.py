"""Adapters that connect the packages (which never import each other).

- `QueueTrajectorySink`: the rollouter's sink -> the queue (one msgpack-encoded group per item).
- `QueueBatchSource`: the queue -> the trainer (decodes groups into the trainer's own struct).
- `RolloutWeightSink`: the trainer's weight sink -> every rollouter actor (awaited Ray calls).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import ray
from async_queue import MessageQueueClient, QueueItem
from ppo_trainer import Trajectory as TrainerTrajectory
from rollout_engine import Trajectory as RolloutTrajectory

if TYPE_CHECKING:  # the rollout actors import this module and need no torch
    import torch

__all__ = ["QueueBatchSource", "QueueTrajectorySink", "RolloutWeightSink"]

_group_decoder = msgspec.msgpack.Decoder(list[TrainerTrajectory])


class QueueTrajectorySink:
    """Puts each finished GRPO group on the queue as one item, stamped with its oldest version."""

    def __init__(self, queue: MessageQueueClient) -> None:
        self._queue = queue

    async def put(self, group: list[RolloutTrajectory]) -> None:
        versions = [t.min_version for t in group if t.token_versions]
        await self._queue.put(
            QueueItem(
                payload=msgspec.msgpack.encode(group),
                version=min(versions) if versions else 0,
                item_id=group[0].group_id,
                produced_at=time.time(),
            )
        )


class QueueBatchSource:
    """`ppo_trainer.BatchSource` over the queue: full batches, stale items dropped there.

    It skips nothing: after a `--resume` the queue is new and each replica's `PromptSource`
    already left out the prompts trained on before (`train_app.prompts`).
    """

    def __init__(self, queue: MessageQueueClient, max_staleness: int) -> None:
        self._queue = queue
        self._max_staleness = max_staleness

    async def next_batch(self, n: int, current_version: int) -> list[list[TrainerTrajectory]]:
        items = await self._queue.get_batch(
            n,
            min_items=n,
            current_version=current_version,
            max_staleness=self._max_staleness,
        )
        return [_group_decoder.decode(i.payload) for i in items]


class RolloutWeightSink:
    """Pushes weights to every rollouter actor through Ray's object store and awaits them."""

    def __init__(self, rollout_actors: Sequence[Any]) -> None:
        self._actors = list(rollout_actors)

    async def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        # One copy in the object store, shared by every replica; the copy runs off the loop.
        ref = await asyncio.to_thread(ray.put, weights)
        await asyncio.gather(*(a.update_weights.remote(ref, version) for a in self._actors))

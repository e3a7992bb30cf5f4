"""The adapters' elastic-rollouter duties (`train_app.wiring`).

`QueueBatchSource` hands each prompt id to training at most once; its queue here is a fake
(a list behind `get_batch`: only the dedupe logic is under test). `RolloutWeightSink` runs on
a real local Ray with small real actors: a dead replica is skipped, not fatal, and a
replacement attached later gets the last pushed weights before later pushes. ~5-15 s (Ray
start and three tiny actors).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import ray
import torch
from async_queue import QueueClosed, QueueItem
from rollout_engine import Timings, Trajectory
from train_app.wiring import QueueBatchSource, QueueTrajectorySink, RolloutWeightSink


def _group(prompt_id: str, group_id: str) -> list[Trajectory]:
    return [
        Trajectory(
            response_id=f"{group_id}:{i}",
            group_id=group_id,
            prompt_id=prompt_id,
            prompt_ids=[1],
            response_ids=[2],
            behaviour_logprobs=[0.0],
            token_versions=[0],
            finish_reason="stop",
            timings=Timings(admitted_at=0.0),
        )
        for i in range(2)
    ]


class _ListQueue:
    """A fake queue: `get_batch` takes up to n items in order; closed when empty."""

    def __init__(self, groups: list[list[Trajectory]]) -> None:
        self.items = [
            QueueItem(payload=msgspec.msgpack.encode(g), version=0, item_id=g[0].prompt_id)
            for g in groups
        ]

    async def get_batch(self, n: int, **_: object) -> list[QueueItem]:
        if not self.items:
            raise QueueClosed("closed")
        batch, self.items = self.items[:n], self.items[n:]
        return batch


async def test_a_second_group_of_a_taken_prompt_is_dropped_and_the_batch_refilled() -> None:
    groups = [_group(p, f"{p}:{n}") for n, p in enumerate(["a", "b", "a", "old", "c", "d"])]
    source = QueueBatchSource(_ListQueue(groups), max_staleness=1, taken=["old"])  # type: ignore[arg-type]
    first = await source.next_batch(2, current_version=0)
    second = await source.next_batch(2, current_version=0)
    assert [g[0].group_id for g in first] == ["a:0", "b:1"]
    assert [g[0].group_id for g in second] == ["c:4", "d:5"]  # "a" again and "old" dropped
    assert source.duplicates == 2
    assert set(source.taken) == {"old", "a", "b", "c", "d"}
    with pytest.raises(QueueClosed):
        await source.next_batch(2, current_version=0)


async def test_the_duplicate_guard_keeps_only_the_most_recent_prompts() -> None:
    """With `kept`, the guard's memory does not grow with the run: the oldest ids go."""
    groups = [_group(p, f"{p}:{n}") for n, p in enumerate(["a", "b", "c", "b", "a", "d"])]
    source = QueueBatchSource(_ListQueue(groups), max_staleness=1, kept=2)  # type: ignore[arg-type]
    first = await source.next_batch(3, current_version=0)
    second = await source.next_batch(2, current_version=0)
    assert [g[0].group_id for g in first] == ["a:0", "b:1", "c:2"]
    # "b" is among the last two taken: dropped; "a" was forgotten (a resume's stream, not
    # this guard, keeps an old prompt from coming again).
    assert [g[0].group_id for g in second] == ["a:4", "d:5"]
    assert source.duplicates == 1 and list(source.taken) == ["a", "d"]


async def test_the_end_of_the_stream_hands_over_what_was_taken() -> None:
    source = QueueBatchSource(_ListQueue([_group("a", "a:0")]), max_staleness=1)  # type: ignore[arg-type]
    assert [g[0].prompt_id for g in await source.next_batch(2, current_version=0)] == ["a"]


async def test_queue_items_are_named_by_their_prompt_id() -> None:
    class Queue:
        def __init__(self) -> None:
            self.put_items: list[QueueItem] = []

        async def put(self, item: QueueItem) -> None:
            self.put_items.append(item)

    queue = Queue()
    await QueueTrajectorySink(queue).put(_group("s0-7", "s0-7:3"))  # type: ignore[arg-type]
    assert [i.item_id for i in queue.put_items] == ["s0-7"]


@ray.remote(num_cpus=0)
class _Replica:
    def __init__(self) -> None:
        self.loaded: list[tuple[int, int]] = []

    async def update_weights(self, weights: dict[str, int], version: int) -> None:
        self.loaded.append((weights["w"], version))

    async def seen(self) -> list[tuple[int, int]]:
        return self.loaded


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


async def test_weight_sink_skips_a_dead_replica_and_brings_a_replacement_up_to_date(
    local_ray: None,
) -> None:
    alive, doomed = _Replica.remote(), _Replica.remote()
    sink = RolloutWeightSink([alive, doomed])
    await sink.push_weights({"w": 1}, 1)  # type: ignore[dict-item]
    ray.kill(doomed)
    await sink.push_weights({"w": 2}, 2)  # type: ignore[dict-item]  # not fatal
    await sink.push_weights({"w": 3}, 3)  # type: ignore[dict-item]
    replacement = _Replica.remote()
    await sink.attach(1, replacement, version=2)  # started from v2: gets v3 now
    await sink.push_weights({"w": 4}, 4)  # type: ignore[dict-item]
    up_to_date = _Replica.remote()
    await sink.attach(1, up_to_date, version=4)  # already at the last version: no push
    assert await alive.seen.remote() == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert await replacement.seen.remote() == [(3, 3), (4, 4)]
    assert await up_to_date.seen.remote() == []
    assert sink.last is not None and sink.last[1] == 4


@ray.remote(num_cpus=0)
class _TensorReplica:
    """Receives a push as `RolloutActor.update_weights` does; keeps what it rebuilt."""

    def __init__(self) -> None:
        self.received: tuple[str, dict[str, torch.Tensor]] | None = None

    async def update_weights(self, weights: Any, version: int) -> None:
        from train_app.weight_wire import unpack_weights

        self.received = (type(weights).__name__, unpack_weights(weights))

    async def seen(self) -> tuple[str, dict[str, torch.Tensor]] | None:
        return self.received


async def test_weight_sink_pushes_tensors_packed_and_the_replica_rebuilds_them(
    local_ray: None,
) -> None:
    weights = {"w": torch.randn(8, 4), "bf16": torch.randn(3, 5).to(torch.bfloat16)}
    replica = _TensorReplica.remote()
    await RolloutWeightSink([replica]).push_weights(weights, 1)
    form, rebuilt = await replica.seen.remote()
    assert form == "PackedWeights"  # numpy views: out-of-band in the object store
    assert rebuilt.keys() == weights.keys()
    assert all(torch.equal(rebuilt[k], weights[k]) for k in weights)

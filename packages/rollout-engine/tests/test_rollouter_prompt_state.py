"""A prompt stream that knows its position, across a snapshot; a too-stale group's prompt is
admitted again (`RolloutConfig.retry_stale`).

The engine is `rollout_engine.testing.FakeEngine`, a fake: these are scheduling and
bookkeeping tests. The positioned stream below is the smallest one that has
`checkpoint_state()` (the app's is `train_app.prompts.PromptSource`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
from rollout_engine import PromptSample, RolloutConfig, Rollouter, SamplingConfig, Trajectory
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts


def _reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return 0.0


class _Positioned:
    """Hands out `prompts` in order; its state is how many it handed out."""

    def __init__(self, prompts: list[PromptSample]) -> None:
        self.prompts = prompts
        self.position = 0

    def __iter__(self) -> Iterator[PromptSample]:
        while self.position < len(self.prompts):
            self.position += 1
            yield self.prompts[self.position - 1]

    def checkpoint_state(self) -> dict[str, int]:
        return {"position": self.position}


@pytest.mark.parametrize("seed", range(6))
async def test_every_prompt_before_the_position_is_in_the_snapshot_or_delivered(
    seed: int,
) -> None:
    """The invariant a resume relies on: at the moment of the snapshot, each prompt the
    stream handed out is either in the snapshot's groups (admitted, not admitted yet, or
    given back as too stale) or was delivered; none is between the two."""
    prompts = make_prompts(40)
    stream = _Positioned(prompts)
    sink = ListSink()
    config = RolloutConfig(
        group_size=2,
        max_concurrency=3,
        groups_per_step=2,
        max_staleness=1,
        sampling=SamplingConfig(max_tokens=12),
        retry_stale=True,  # a dropped group's prompt waits in the snapshot too
    )
    engine = FakeEngine(FakeEngineConfig(seed=seed, time_per_token_s=0.0005, median_length=6))
    rollouter = Rollouter(engine, stream, sink, _reward, config)
    run = asyncio.create_task(rollouter.run())
    rng = random.Random(seed)
    version = 0
    snapshots = 0
    while not run.done() and snapshots < 6:
        await asyncio.sleep(rng.uniform(0, 0.01))
        if rng.random() < 0.5:
            version += 1
            await rollouter.update_weights({"w": version}, version)
            continue
        snapshot = await rollouter.snapshot_in_flight()
        delivered = {g[0].prompt_id for g in sink.groups}
        assert snapshot.prompt_state is not None
        position = snapshot.prompt_state["position"]
        held = snapshot.prompt_ids()
        handed = {p.prompt_id for p in prompts[:position]}
        assert handed == held | delivered, (seed, position)
        assert not held & delivered
        snapshots += 1
    await rollouter.stop()
    await asyncio.wait_for(run, timeout=10)
    assert snapshots > 0


async def test_a_stream_without_a_position_snapshots_as_before() -> None:
    rollouter = Rollouter(FakeEngine(), make_prompts(3), ListSink(), _reward, RolloutConfig())
    snapshot = await rollouter.snapshot_in_flight()
    assert snapshot.prompt_state is None and snapshot.groups == []


@pytest.mark.parametrize("seed", range(8))
async def test_a_too_stale_groups_prompt_is_admitted_again_and_never_lost(seed: int) -> None:
    """k = 0 with long-tailed lengths and a push after every delivered group: stragglers are
    overtaken and dropped at delivery. With `retry_stale` each dropped prompt comes back, so
    every prompt of the stream is delivered once, and none is lost."""
    prompts = make_prompts(24)
    sink = ListSink()
    config = RolloutConfig(
        group_size=2,
        max_concurrency=4,
        groups_per_step=1,
        max_staleness=0,
        pacing="eager",
        partial_rollout=True,
        pause_mode="keep",
        sampling=SamplingConfig(max_tokens=24),
        retry_stale=True,
        generation_only=True,
    )
    engine = FakeEngine(
        FakeEngineConfig(seed=seed, median_length=3, long_tail_fraction=0.3, tokens_per_step=1)
    )
    rollouter = Rollouter(engine, prompts, sink, _reward, config)
    run = asyncio.create_task(rollouter.run())
    version = 0
    async with asyncio.timeout(20):
        while not run.done():
            await asyncio.sleep(0)
            if len(sink.groups) > version:
                version += 1
                await rollouter.update_weights({"w": version}, version)
        stats = await run
    delivered = [g[0].prompt_id for g in sink.groups]
    assert sorted(delivered) == sorted(p.prompt_id for p in prompts)  # each once, none lost
    assert stats.admitted == len(prompts) + stats.dropped
    assert rollouter.metrics()["rollout/stale_retried"] == stats.dropped


async def test_without_retry_a_dropped_prompt_is_gone() -> None:
    """The default (a list of prompts, no retry): what `retry_stale` changes."""
    prompts = make_prompts(24)
    config = RolloutConfig(
        group_size=2,
        max_concurrency=4,
        groups_per_step=1,
        max_staleness=0,
        pacing="eager",
        sampling=SamplingConfig(max_tokens=24),
        generation_only=True,
    )
    dropped = 0
    for seed in range(8):
        engine = FakeEngine(FakeEngineConfig(seed=seed, median_length=3, long_tail_fraction=0.3))
        sink = ListSink()
        rollouter = Rollouter(engine, prompts, sink, _reward, config)
        run = asyncio.create_task(rollouter.run())
        version = 0
        async with asyncio.timeout(20):
            while not run.done():
                await asyncio.sleep(0)
                if len(sink.groups) > version:
                    version += 1
                    await rollouter.update_weights({"w": version}, version)
            stats = await run
        assert stats.admitted == len(prompts)
        dropped += stats.dropped
    assert dropped > 0  # the scenario does drop groups

"""Seeded sampling: a `SamplingConfig.seed` becomes one seed per group, derived from the
run's seed and the prompt id, so a run repeats its samples without every prompt sharing one
random stream. A scheduling-logic test: the fake engine records the requests it gets."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from rollout_engine import PromptSample, SamplingConfig
from rollout_engine.group import GroupJob, GroupRunner, request_seed
from rollout_engine.testing import FakeEngine, FakeEngineConfig


class _RecordingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__(FakeEngineConfig(seed=0, time_per_token_s=0.0))
        self.seeds: dict[str, int | None] = {}

    async def generate(self, request_id, prompt_ids, sampling, n=1, multi_modal_data=None):
        self.seeds[request_id] = sampling.seed
        return await super().generate(request_id, prompt_ids, sampling, n, multi_modal_data)


async def _resumed() -> None:
    return None


def _run_groups(seed: int | None, prompt_ids: list[str]) -> dict[str, int | None]:
    engine = _RecordingEngine()
    pool = ThreadPoolExecutor(max_workers=1)

    async def on_resubmit() -> None:
        return None

    runner = GroupRunner(
        engine,
        lambda sample, trajectory: 1.0,
        group_size=2,
        sampling=SamplingConfig(max_tokens=4, seed=seed),
        preprocessor=None,
        wait_until_resumed=_resumed,
        on_resubmit=on_resubmit,
        clock=time.monotonic,
        reward_executor=lambda: pool,
    )

    async def main() -> None:
        for pid in prompt_ids:
            sample = PromptSample(prompt_id=pid, prompt_token_ids=[1, 2, 3])
            await runner.run(GroupJob(sample, f"g-{pid}", 0, time.time(), time.monotonic()))

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
    return {request.removeprefix("g-"): s for request, s in engine.seeds.items()}


def test_request_seed_is_stable_distinct_and_in_range() -> None:
    assert request_seed(7, "p1") == request_seed(7, "p1")
    seeds = {request_seed(s, f"p{i}") for s in range(3) for i in range(200)}
    assert len(seeds) == 600  # no two (seed, prompt) pairs share a stream here
    assert all(0 <= s < 2**31 - 2**16 for s in seeds)


def test_a_seeded_run_seeds_each_group_from_its_prompt() -> None:
    seeds = _run_groups(5, ["a", "b", "c"])
    assert seeds == {pid: request_seed(5, pid) for pid in "abc"}
    assert _run_groups(5, ["c", "a"]) == {"c": seeds["c"], "a": seeds["a"]}  # order-free
    assert _run_groups(6, ["a"])["a"] != seeds["a"]


def test_an_unseeded_run_stays_unseeded() -> None:
    assert _run_groups(None, ["a", "b"]) == {"a": None, "b": None}

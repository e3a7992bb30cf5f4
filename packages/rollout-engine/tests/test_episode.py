"""Multi-turn episodes through the rollouter: tokens, masks, versions, limits, failures,
weight pushes between and inside turns, stop mid-episode.

The engine is `rollout_engine.testing.FakeEngine`, a fake used because these are scheduling
tests (the real engine's multi-turn run is in test_episode_vllm.py). `RecordingEngine` adds
only a record of what each request returned, to check trajectories token by token.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from rollout_engine import (
    Completion,
    EpisodeConfig,
    ModelTurn,
    PromptSample,
    RolloutConfig,
    Rollouter,
    SamplingConfig,
    StepResult,
    Trajectory,
    environment_reward,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts, wait_until

OBSERVATION = [70, 71, 72]


class RecordingEngine(FakeEngine):
    """FakeEngine that also keeps each request's returned completions by request id."""

    def __init__(self, config: FakeEngineConfig) -> None:
        super().__init__(config)
        self.returned: dict[str, list[Completion]] = {}

    async def generate(self, request_id: str, *args: Any, **kwargs: Any) -> list[Completion]:
        completions = await super().generate(request_id, *args, **kwargs)
        self.returned[request_id] = [
            Completion(
                token_ids=list(c.token_ids),
                logprobs=list(c.logprobs),
                versions=list(c.versions),
                finish_reason=c.finish_reason,
            )
            for c in completions
        ]
        return completions


class ToolEnv:
    """An async environment: observation = OBSERVATION + [turn]; reward 0.25 a step; done
    after `done_after` steps (never if None). Each instance opens with its own 1-token
    observation (so the members of a group have different contexts)."""

    instances: itertools.count[int] = itertools.count()

    def __init__(self, done_after: int | None = None) -> None:
        self.id = next(ToolEnv.instances)
        self.done_after = done_after
        self.turns: list[ModelTurn] = []
        self.closed = False
        self.gate: asyncio.Event | None = None  # if set, step() waits for it

    async def reset(self, sample: PromptSample) -> Sequence[int]:
        return [100 + self.id % 100]

    async def step(self, turn: ModelTurn) -> StepResult:
        if self.gate is not None:
            await self.gate.wait()
        self.turns.append(turn)
        done = self.done_after is not None and len(self.turns) >= self.done_after
        return StepResult(observation=[*OBSERVATION, turn.index], reward=0.25, done=done)

    async def close(self) -> None:
        self.closed = True


def _rollout_config(**overrides: Any) -> RolloutConfig:
    base: dict[str, Any] = {
        "group_size": 2,
        "max_concurrency": 4,
        "groups_per_step": 8,
        "max_staleness": 2,
        "sampling": SamplingConfig(max_tokens=16),
    }
    return RolloutConfig(**{**base, **overrides})


async def _run(
    make_env: Any,
    *,
    prompts: int = 3,
    engine: FakeEngine | None = None,
    episode: EpisodeConfig | None = None,
    **overrides: Any,
) -> tuple[FakeEngine, Rollouter, ListSink]:
    engine = engine or RecordingEngine(FakeEngineConfig(seed=3, median_length=6))
    sink = ListSink()
    rollouter = Rollouter(
        engine,
        make_prompts(prompts),
        sink,
        environment_reward,
        _rollout_config(**overrides),
        environment=make_env,
        episode=episode or EpisodeConfig(max_turns=3, max_total_tokens=200),
    )
    await asyncio.wait_for(rollouter.run(), timeout=30)
    return engine, rollouter, sink


def _segments(t: Trajectory) -> list[tuple[int, int, int]]:
    """(start, end, mask) runs of `loss_mask`."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(t.loss_mask) + 1):
        if i == len(t.loss_mask) or t.loss_mask[i] != t.loss_mask[start]:
            runs.append((start, i, t.loss_mask[start]))
            start = i
    return runs


def _check_against_engine(t: Trajectory, engine: RecordingEngine, prompt: list[int]) -> None:
    """Every generated token, log-prob and version is what the engine returned for that turn
    (continuations included); every observation token is the environment's, masked, with
    log-prob 0.0 and a version no older than the tokens before it."""
    assert len(t.response_ids) == len(t.loss_mask) == len(t.behaviour_logprobs)
    assert len(t.token_versions) == len(t.response_ids)
    assert (
        t.prompt_token_ids[: len(prompt)] == prompt and len(t.prompt_token_ids) == len(prompt) + 1
    )
    member = t.response_id.rsplit(":", 1)[1]
    turn_ends = [*t.turn_starts[1:], len(t.response_ids)]
    for turn, (start, end) in enumerate(zip(t.turn_starts, turn_ends, strict=True)):
        request = f"{t.group_id}:{member}:t{turn}"
        pieces = [engine.returned[request][0]]
        pieces += [
            engine.returned[r][0] for r in sorted(engine.returned) if r.startswith(request + ":r")
        ]
        generated = [tok for c in pieces for tok in c.token_ids]
        n = len(generated)
        assert t.response_ids[start : start + n] == generated
        assert t.behaviour_logprobs[start : start + n] == [lp for c in pieces for lp in c.logprobs]
        assert t.token_versions[start : start + n] == [v for c in pieces for v in c.versions]
        assert t.loss_mask[start : start + n] == [1] * n
        # what follows the turn, up to the next turn, is its observation
        assert t.response_ids[start + n : end] == ([*OBSERVATION, turn] if end > start + n else [])
        assert t.loss_mask[start + n : end] == [0] * (end - start - n)
        assert t.behaviour_logprobs[start + n : end] == [0.0] * (end - start - n)
        if end > start + n:
            assert min(t.token_versions[start + n : end]) >= max(t.token_versions[: start + n])
        # the turn's request saw the prompt and everything before the turn
        call = next(c for c in engine.calls if c.request_id == request)
        assert call.prompt_ids == [*t.prompt_token_ids, *t.response_ids[:start]]
    assert t.min_version == min(v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m)


async def test_episodes_carry_tokens_masks_and_versions_token_by_token() -> None:
    envs: list[ToolEnv] = []

    def make_env(sample: PromptSample) -> ToolEnv:
        envs.append(ToolEnv(done_after=3))
        return envs[-1]

    engine, rollouter, sink = await _run(make_env)
    assert isinstance(engine, RecordingEngine)
    assert rollouter.stats().delivered == 3 and rollouter.stats().failed == 0
    prompts = {p.prompt_id: p.prompt_token_ids for p in make_prompts(3)}
    assert len(sink.trajectories) == 6
    for t in sink.trajectories:
        assert t.finish_reason in ("stop", "length")
        assert len(t.turn_starts) == 3
        assert [m for _, _, m in _segments(t)] == [1, 0, 1, 0, 1]
        assert t.reward == pytest.approx(0.75)  # 3 steps of 0.25, kept by environment_reward
        _check_against_engine(t, engine, prompts[t.prompt_id])
    assert all(env.closed for env in envs) and len(envs) == 6
    # only generated tokens count as generated
    assert rollouter.stats().generated_tokens == sum(sum(t.loss_mask) for t in sink.trajectories)
    assert rollouter.stats().generated_tokens == engine.tokens_generated


async def test_max_turns_cuts_the_episode_without_a_trailing_observation() -> None:
    _, rollouter, sink = await _run(
        lambda s: ToolEnv(done_after=None), episode=EpisodeConfig(max_turns=2)
    )
    assert rollouter.stats().delivered == 3
    for t in sink.trajectories:
        assert t.finish_reason == "max_turns"
        assert len(t.turn_starts) == 2
        assert [m for _, _, m in _segments(t)] == [1, 0, 1]
        assert t.reward == pytest.approx(0.5)


async def test_max_total_tokens_cuts_the_episode() -> None:
    limit = 24
    engine, _, sink = await _run(
        lambda s: ToolEnv(done_after=None),
        episode=EpisodeConfig(max_turns=10, max_total_tokens=limit),
    )
    for t in sink.trajectories:
        assert t.finish_reason == "length"
        assert len(t.prompt_token_ids) + len(t.response_ids) <= limit
        assert t.loss_mask[-1] == 1  # never ends on an observation nobody reads
    for call in engine.calls:
        assert len(call.prompt_ids) + call.max_tokens <= limit


class _Failing:
    def __init__(self, where: str) -> None:
        self.where = where

    def reset(self, sample: PromptSample) -> list[int]:  # a sync env: runs in the tool pool
        if self.where == "reset" and sample.prompt_id == "p1":
            raise KeyError("no such record")
        return []

    def step(self, turn: ModelTurn) -> StepResult:
        if self.where == "tool" and turn.index == 1:
            raise ValueError("tool crashed")
        return StepResult(observation=[5], reward=1.0, done=turn.index == 2)


@pytest.mark.parametrize(
    ("where", "error", "failed"), [("tool", "ValueError", 3), ("reset", "KeyError", 1)]
)
async def test_a_raising_tool_or_environment_is_a_counted_failed_sample(
    where: str, error: str, failed: int
) -> None:
    _, rollouter, sink = await _run(lambda s: _Failing(where))
    stats = rollouter.stats()
    assert (stats.delivered, stats.failed) == (3 - failed, failed)
    assert rollouter.failure_counts == {error: failed}
    assert all(f.error_type == error and not f.cancelled for f in rollouter.failures)
    assert rollouter.state == "finished"
    assert all(t.reward == pytest.approx(3.0) for t in sink.trajectories)


async def test_a_weight_push_between_turns() -> None:
    """Every episode's first step waits on a gate; the push lands while all of them wait, so
    turn 1 is version 0, the observation and turn 2 are version 1."""
    gate = asyncio.Event()
    envs: list[ToolEnv] = []

    def make_env(sample: PromptSample) -> ToolEnv:
        env = ToolEnv(done_after=2)
        env.gate = gate
        envs.append(env)
        return env

    engine = RecordingEngine(FakeEngineConfig(seed=4, median_length=6, time_per_token_s=0.001))
    sink = ListSink()
    rollouter = Rollouter(
        engine,
        make_prompts(2),
        sink,
        environment_reward,
        _rollout_config(),
        environment=make_env,
        episode=EpisodeConfig(max_turns=2),
    )
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: len(envs) == 4 and not engine.running_request_ids and engine.calls)
    assert {c.request_id.rsplit(":", 1)[1] for c in engine.calls} == {"t0"}
    await rollouter.update_weights({"w": 1}, 1)
    gate.set()
    await asyncio.wait_for(run, timeout=30)
    prompts = {p.prompt_id: p.prompt_token_ids for p in make_prompts(2)}
    for t in sink.trajectories:
        first_end = t.turn_starts[1]
        n_first = sum(t.loss_mask[:first_end])
        assert set(t.token_versions[:n_first]) == {0}
        assert set(t.token_versions[n_first:]) == {1}  # observation and turn 2
        assert t.min_version == 0
        _check_against_engine(t, engine, prompts[t.prompt_id])
    assert rollouter.stats().staleness_max == 1


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_a_weight_push_inside_a_turn(mode: str) -> None:
    """Long turns (40 tokens); the push lands while they decode: turns span versions 0 and 1,
    and in abort mode they continue from context + tokens so far with the rest of the
    budget."""
    config = FakeEngineConfig(seed=5, fixed_length=40, time_per_token_s=0.002)
    engine = RecordingEngine(config)
    sink = ListSink()
    rollouter = Rollouter(
        engine,
        make_prompts(2),
        sink,
        environment_reward,
        _rollout_config(pause_mode=mode, sampling=SamplingConfig(max_tokens=48)),
        environment=lambda s: ToolEnv(done_after=2),
        episode=EpisodeConfig(max_turns=2),
    )
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: engine.tokens_generated >= 40 and len(engine.running_request_ids) == 4)
    await rollouter.update_weights({"w": 1}, 1)
    await asyncio.wait_for(run, timeout=30)
    prompts = {p.prompt_id: p.prompt_token_ids for p in make_prompts(2)}
    assert rollouter.stats().delivered == 2
    for t in sink.trajectories:
        first = t.token_versions[: t.turn_starts[1]]
        assert set(first[:40]) == {0, 1} and first[:40] == sorted(first[:40])
        assert t.num_resumes == (1 if mode == "abort" else 0)
        _check_against_engine(t, engine, prompts[t.prompt_id])
        assert len([v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m]) == 80
    if mode == "abort":
        continuations = [c for c in engine.calls if c.request_id.endswith(":r1")]
        assert len(continuations) == 4 == rollouter.stats().resumed
        for call in continuations:
            turn_request = call.request_id.rsplit(":", 1)[0]
            done_before = len(engine.returned[turn_request][0].token_ids)
            original = next(c for c in engine.calls if c.request_id == turn_request)
            assert call.prompt_ids[: len(original.prompt_ids)] == original.prompt_ids
            assert len(call.prompt_ids) == len(original.prompt_ids) + done_before
            assert call.max_tokens == 48 - done_before


async def test_stop_mid_episode_cancels_and_closes_every_environment() -> None:
    envs: list[ToolEnv] = []

    def make_env(sample: PromptSample) -> ToolEnv:
        env = ToolEnv(done_after=3)
        env.gate = asyncio.Event()  # never set: the episodes hang in their first step
        envs.append(env)
        return env

    engine = FakeEngine(FakeEngineConfig(seed=6, median_length=4))
    sink = ListSink()
    rollouter = Rollouter(
        engine, make_prompts(3), sink, environment_reward, _rollout_config(), environment=make_env
    )
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: len(envs) == 6 and not engine.running_request_ids and engine.calls)
    await rollouter.stop()
    stats = await asyncio.wait_for(run, timeout=10)
    assert (stats.delivered, stats.failed, stats.in_flight) == (0, 3, 0)
    assert all(f.cancelled for f in rollouter.failures)
    assert rollouter.state == "stopped"
    assert all(env.closed for env in envs)
    assert not sink.groups


async def test_blocking_sync_environment_runs_in_the_bounded_tool_pool() -> None:
    """A SyncEnvironment's methods run on the rollouter's tool threads, never on the loop."""
    import threading

    threads: set[str] = set()

    class Sync:
        def reset(self, sample: PromptSample) -> list[int]:
            threads.add(threading.current_thread().name)
            return []

        def step(self, turn: ModelTurn) -> StepResult:
            threads.add(threading.current_thread().name)
            return StepResult(done=True, reward=0.5)

    _, rollouter, sink = await _run(lambda s: Sync(), episode=EpisodeConfig(tool_workers=2))
    assert rollouter.stats().delivered == 3
    assert threads and all(name.startswith("rollout-tools") for name in threads)
    assert len(threads) <= 2
    assert all(t.loss_mask == [1] * len(t.response_ids) for t in sink.trajectories)


async def test_step_timeout_fails_a_hung_tool() -> None:
    class Hung(ToolEnv):
        async def step(self, turn: ModelTurn) -> StepResult:
            await asyncio.sleep(60)
            raise AssertionError("unreachable")

    _, rollouter, _ = await _run(
        lambda s: Hung(), prompts=1, episode=EpisodeConfig(step_timeout_s=0.05)
    )
    assert rollouter.failure_counts == {"TimeoutError": 1}

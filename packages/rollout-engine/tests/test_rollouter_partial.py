"""Partial rollout across a weight push: keep, abort (+ continuation) and wait.

The engine is `rollout_engine.testing.FakeEngine`, a fake used because these are scheduling
tests. Its responses are seeded per prompt and a continuation resumes the same response, so
a run with a push must produce exactly the tokens of a run without one; only the version
stamps differ.
"""

from __future__ import annotations

import asyncio

import pytest
from rollout_engine import PromptSample, RolloutConfig, Rollouter, SamplingConfig, Trajectory
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts, wait_until

MAX_TOKENS = 64
ENGINE = FakeEngineConfig(seed=5, time_per_token_s=0.002, median_length=40, length_sigma=0.3)


def _config(**overrides: object) -> RolloutConfig:
    base: dict[str, object] = {
        "group_size": 2,
        "max_concurrency": 4,
        "groups_per_step": 8,
        "max_staleness": 2,
        "sampling": SamplingConfig(max_tokens=MAX_TOKENS),
    }
    return RolloutConfig(**{**base, **overrides})  # type: ignore[arg-type]


def _reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return 0.0


def _by_response(sink: ListSink) -> dict[tuple[str, str], Trajectory]:
    """(prompt id, response index) -> trajectory."""
    return {(t.prompt_id, t.response_id.rsplit(":", 1)[1]): t for t in sink.trajectories}


async def _run(
    config: RolloutConfig, engine_config: FakeEngineConfig, push: bool
) -> tuple[FakeEngine, Rollouter, ListSink]:
    engine = FakeEngine(engine_config)
    sink = ListSink()
    rollouter = Rollouter(engine, make_prompts(6), sink, _reward, config)
    run = asyncio.create_task(rollouter.run())
    if push:
        await wait_until(
            lambda: engine.tokens_generated >= 40 and len(engine.running_request_ids) == 4
        )
        await rollouter.update_weights({"layer": 1}, 1)
    stats = await asyncio.wait_for(run, timeout=30)
    assert (stats.delivered, stats.failed, stats.dropped) == (6, 0, 0)
    return engine, rollouter, sink


def _assert_complete_and_spanning(sink: ListSink, reference: ListSink) -> list[Trajectory]:
    expected = _by_response(reference)
    got = _by_response(sink)
    assert got.keys() == expected.keys()
    for key, trajectory in got.items():
        assert trajectory.finish_reason in ("stop", "length")
        assert trajectory.response_ids == expected[key].response_ids  # same response, completed
        assert trajectory.token_versions == sorted(trajectory.token_versions)
        assert len(trajectory.response_ids) == len(trajectory.token_versions) <= MAX_TOKENS
    spanning = [t for t in got.values() if set(t.token_versions) == {0, 1}]
    assert spanning, "some responses must carry tokens from before and after the push"
    return spanning


async def test_keep_mode_responses_span_the_push_without_resubmission() -> None:
    _, _, reference = await _run(_config(pause_mode="keep"), ENGINE, push=False)
    engine, rollouter, sink = await _run(_config(pause_mode="keep"), ENGINE, push=True)
    spanning = _assert_complete_and_spanning(sink, reference)
    assert engine.pause_modes == ["keep"]
    assert all(t.num_resumes == 0 for t in sink.trajectories)
    assert {c.n for c in engine.calls} == {2}
    stats = rollouter.stats()
    assert stats.resumed == 0
    assert stats.partial == len(spanning)
    assert rollouter.metrics()["rollout/partial_ratio"] == pytest.approx(len(spanning) / 12)


async def test_abort_mode_resubmits_prompt_plus_tokens_with_the_remaining_budget() -> None:
    _, _, reference = await _run(_config(pause_mode="abort"), ENGINE, push=False)
    engine, rollouter, sink = await _run(_config(pause_mode="abort"), ENGINE, push=True)
    spanning = _assert_complete_and_spanning(sink, reference)
    assert engine.pause_modes == ["abort"]
    assert all(t.num_resumes == 1 for t in spanning)
    continuations = [c for c in engine.calls if c.n == 1]
    assert len(continuations) == rollouter.stats().resumed == len(spanning)
    prompts = {p.prompt_id: p.prompt_token_ids for p in make_prompts(6)}
    for call in continuations:
        prompt_id, _admission, index, _resume = call.request_id.split(":")
        trajectory = _by_response(sink)[(prompt_id, index)]
        done_before = trajectory.token_versions.count(0)
        assert call.prompt_ids == prompts[prompt_id] + trajectory.response_ids[:done_before]
        assert call.max_tokens == MAX_TOKENS - done_before


async def test_abort_mode_keeps_the_total_length_budget() -> None:
    # ignore_eos: every response runs to max_tokens, so any budget error shows in the length.
    config = _config(
        pause_mode="abort", sampling=SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    _, rollouter, sink = await _run(config, ENGINE, push=True)
    assert rollouter.stats().resumed > 0
    for trajectory in sink.trajectories:
        assert len(trajectory.response_ids) == MAX_TOKENS
        assert trajectory.finish_reason == "length"


async def test_without_partial_rollout_the_push_waits_for_in_flight() -> None:
    engine, rollouter, sink = await _run(_config(partial_rollout=False), ENGINE, push=True)
    assert engine.pause_modes == ["wait"]
    assert all(len(set(t.token_versions)) == 1 for t in sink.trajectories)
    assert {t.token_versions[0] for t in sink.trajectories} == {0, 1}
    assert rollouter.stats().partial == 0


class _Staged:
    """What `_StagingEngine.stage_weights` returns: the weights and how often it was freed."""

    def __init__(self, weights: object) -> None:
        self.weights = weights
        self.discarded = 0

    def discard(self) -> None:
        self.discarded += 1


class _StagingEngine(FakeEngine):
    """The fake with `stage_weights` (a `WeightStaging` engine): records, per stage, whether
    the engine was paused and how many tokens it generated while the stage took."""

    def __init__(self, config: FakeEngineConfig, fail_pause: bool = False) -> None:
        super().__init__(config)
        self.staged: list[_Staged] = []
        self.loaded: list[object] = []
        self.paused_while_staging: list[bool] = []
        self.tokens_while_staging: list[int] = []
        self._fail_pause = fail_pause

    async def stage_weights(self, weights: object) -> _Staged:
        before = self.tokens_generated
        self.paused_while_staging.append(self._paused)
        await asyncio.sleep(0.05)  # the write of the weights' file
        self.tokens_while_staging.append(self.tokens_generated - before)
        self.staged.append(_Staged(weights))
        return self.staged[-1]

    async def pause(self, mode="keep", clear_cache: bool = True) -> None:  # type: ignore[override]
        if self._fail_pause:
            raise RuntimeError("engine died")
        await super().pause(mode, clear_cache)

    async def load_weights(self, weights: object, version: int) -> None:
        self.loaded.append(weights)
        await super().load_weights(weights, version)


async def test_a_staging_engine_stages_while_it_generates_and_loads_the_staged_push() -> None:
    from rollout_engine import WeightStaging

    engine = _StagingEngine(ENGINE)
    assert isinstance(engine, WeightStaging) and not isinstance(FakeEngine(), WeightStaging)
    sink = ListSink()
    rollouter = Rollouter(engine, make_prompts(6), sink, _reward, _config(pause_mode="keep"))
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: len(engine.running_request_ids) == 4)
    await rollouter.update_weights({"layer": 1}, 1)
    stats = await asyncio.wait_for(run, timeout=30)

    assert (stats.delivered, stats.failed) == (6, 0)
    [staged] = engine.staged
    assert engine.loaded == [staged] and staged.weights == {"layer": 1}
    assert engine.paused_while_staging == [False]
    assert engine.tokens_while_staging[0] > 0  # generation went on during the stage
    assert staged.discarded == 1  # freed once more after the load (idempotent)
    assert rollouter.version == 1


async def test_a_staged_push_is_discarded_when_the_pause_fails() -> None:
    engine = _StagingEngine(ENGINE, fail_pause=True)
    rollouter = Rollouter(engine, make_prompts(2), ListSink(), _reward, _config())
    run = asyncio.create_task(rollouter.run())
    with pytest.raises(RuntimeError, match="engine died"):
        await rollouter.update_weights({"layer": 1}, 1)
    [staged] = engine.staged
    assert engine.loaded == [] and staged.discarded == 1
    assert rollouter.version == 0  # the push did not happen
    stats = await asyncio.wait_for(run, timeout=30)  # and the rollouter was not left paused
    assert (stats.delivered, stats.failed) == (2, 0)

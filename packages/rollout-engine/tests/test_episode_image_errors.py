"""Image observations that cannot be decoded fail their group, counted, and never hang.

The engine is `rollout_engine.testing.FakeEngine`, a fake: these are bookkeeping tests (which
error, counted how). The real decoding path (`mm_preprocess.VisionPreprocessor` on real PNG
files) is tested in the repository's tests/test_episode_images.py, since this package's tests
do not depend on mm-preprocess.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rollout_engine import (
    EpisodeConfig,
    ModelTurn,
    Observation,
    PromptSample,
    RolloutConfig,
    Rollouter,
    SamplingConfig,
    StepResult,
    environment_reward,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts


class ShowsImage:
    """Shows `image` after the first turn (or at reset, with `at_reset`)."""

    def __init__(self, image: Any, *, at_reset: bool = False) -> None:
        self.image = image
        self.at_reset = at_reset

    async def reset(self, sample: PromptSample) -> Observation:
        return Observation(token_ids=[9], images=[self.image] if self.at_reset else [])

    async def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(observation=[63, 70], images=[self.image], done=turn.index > 0)


async def _run(make_env: Any, preprocessor: Any = None) -> tuple[FakeEngine, Rollouter, ListSink]:
    engine = FakeEngine(FakeEngineConfig(seed=21, median_length=4))
    sink = ListSink()
    rollouter = Rollouter(
        engine,
        make_prompts(3),
        sink,
        environment_reward,
        RolloutConfig(group_size=2, groups_per_step=8, sampling=SamplingConfig(max_tokens=8)),
        preprocessor=preprocessor,
        environment=make_env,
        episode=EpisodeConfig(max_turns=3),
    )
    await asyncio.wait_for(rollouter.run(), timeout=30)
    return engine, rollouter, sink


@pytest.mark.parametrize("at_reset", [False, True])
async def test_an_image_observation_without_a_preprocessor_is_a_counted_failed_sample(
    at_reset: bool,
) -> None:
    engine, rollouter, sink = await _run(lambda s: ShowsImage("/x.png", at_reset=at_reset))
    stats = rollouter.stats()
    assert (stats.delivered, stats.failed, stats.in_flight) == (0, 3, 0)
    assert rollouter.failure_counts == {"ValueError": 3}
    assert all("no preprocessor" in f.message for f in rollouter.failures)
    assert rollouter.state == "finished" and not sink.groups
    # The failing observation is never sent: no request carries an image.
    assert all(call.multi_modal_data is None for call in engine.calls)
    if at_reset:
        assert not engine.calls


async def test_a_chat_prompt_without_a_preprocessor_fails_before_any_request() -> None:
    engine = FakeEngine(FakeEngineConfig(seed=22))
    prompt = PromptSample(
        prompt_id="chat", prompt_token_ids=[1, 2], messages=[{"role": "user", "content": "hi"}]
    )
    rollouter = Rollouter(
        engine,
        [prompt],
        ListSink(),
        environment_reward,
        RolloutConfig(group_size=2, groups_per_step=8),
        environment=lambda s: ShowsImage("/x.png"),
    )
    await asyncio.wait_for(rollouter.run(), timeout=30)
    assert rollouter.failure_counts == {"ValueError": 1}
    assert not engine.calls


async def test_an_image_that_is_not_a_reference_is_a_type_error() -> None:
    class Preprocessor:  # never reached: the reference is rejected first
        async def process_vision_info(self, messages: Any) -> Any:
            raise AssertionError("unreachable")

    _, rollouter, _ = await _run(lambda s: ShowsImage(object()), preprocessor=Preprocessor())
    assert rollouter.failure_counts == {"TypeError": 3}

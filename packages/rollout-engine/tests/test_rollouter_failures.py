"""Failures never kill the loop: every group is accounted for as delivered, failed or dropped.

The engine is `rollout_engine.testing.FakeEngine`, a fake used because these are scheduling
tests; the preprocessors are tiny fakes of `mm_preprocess.VisionPreprocessor` with the same
`async process_vision_info(messages)` method.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rollout_engine import PromptSample, RolloutConfig, Rollouter, Trajectory
from rollout_engine.rollouter import is_cancellation
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts


class TaskCancelledError(Exception):
    """Mimics `ray.exceptions.TaskCancelledError` (matched by class name, ray not imported)."""


class ActorDiedError(TaskCancelledError):
    """A subclass: still recognised through the MRO."""


def zero_reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return 0.0


def _errors_by_prompt(request_id: str) -> BaseException | None:
    prompt_id = request_id.split(":")[0]
    return {
        "p1": RuntimeError("engine exploded"),
        "p3": asyncio.CancelledError("cancelled inside the engine"),
        "p5": TaskCancelledError("ray task cancelled"),
        "p6": ActorDiedError("actor died"),
    }.get(prompt_id)


async def test_failing_tasks_leave_the_loop_running_and_every_sample_accounted() -> None:
    engine = FakeEngine(FakeEngineConfig(time_per_token_s=0.001), fail_request=_errors_by_prompt)
    sink = ListSink()
    config = RolloutConfig(group_size=2, max_concurrency=3, groups_per_step=4)
    rollouter = Rollouter(engine, make_prompts(10), sink, zero_reward, config)
    stats = await asyncio.wait_for(rollouter.run(), timeout=30)

    assert stats.state == "finished"
    assert (stats.admitted, stats.delivered, stats.failed, stats.dropped) == (10, 6, 4, 0)
    assert stats.in_flight == 0
    failures = {f.prompt_id: f for f in rollouter.failures}
    assert set(failures) == {"p1", "p3", "p5", "p6"}
    assert failures["p1"].error_type == "RuntimeError"
    assert failures["p1"].message == "engine exploded"
    assert not failures["p1"].cancelled
    assert failures["p3"].error_type == "CancelledError"
    assert failures["p3"].cancelled
    assert failures["p5"].error_type == "TaskCancelledError"
    assert failures["p5"].cancelled
    assert failures["p6"].cancelled
    delivered = {g[0].prompt_id for g in sink.groups}
    assert delivered == {"p0", "p2", "p4", "p7", "p8", "p9"}


def test_is_cancellation() -> None:
    assert is_cancellation(asyncio.CancelledError())
    assert is_cancellation(TaskCancelledError())
    assert is_cancellation(ActorDiedError())
    assert not is_cancellation(RuntimeError())


async def test_reward_and_sink_errors_are_failed_samples() -> None:
    def picky_reward(sample: PromptSample, trajectory: Trajectory) -> float:
        if sample.prompt_id == "p2":
            raise ValueError("cannot score")
        return 1.0

    class FlakySink(ListSink):
        async def put(self, group: list[Trajectory]) -> None:
            if group[0].group_id.startswith("p4:"):
                raise ConnectionError("queue unreachable")
            await super().put(group)

    sink = FlakySink()
    rollouter = Rollouter(FakeEngine(), make_prompts(6), sink, picky_reward, RolloutConfig(2))
    stats = await asyncio.wait_for(rollouter.run(), timeout=30)
    assert (stats.delivered, stats.failed) == (4, 2)
    assert {(f.prompt_id, f.error_type) for f in rollouter.failures} == {
        ("p2", "ValueError"),
        ("p4", "ConnectionError"),
    }


async def test_seeded_random_failures_with_pushes_keep_the_books_balanced() -> None:
    config = FakeEngineConfig(
        seed=11,
        time_per_token_s=0.0005,
        failure_rate=0.25,
        failure_types=(RuntimeError, asyncio.CancelledError, TaskCancelledError),
    )
    engine = FakeEngine(config)
    rollouter = Rollouter(
        engine,
        make_prompts(60),
        ListSink(),
        zero_reward,
        RolloutConfig(group_size=2, max_concurrency=6, groups_per_step=3, pause_mode="abort"),
    )
    run = asyncio.create_task(rollouter.run())
    version = 0
    while not run.done():
        await asyncio.sleep(0.01)
        version += 1
        await rollouter.update_weights(None, version)
        s = rollouter.stats()
        assert s.admitted == s.delivered + s.failed + s.dropped + s.in_flight
    stats = await run
    assert stats.admitted == 60
    assert stats.failed > 5
    assert stats.admitted == stats.delivered + stats.failed + stats.dropped
    assert sum(rollouter.failure_counts.values()) == stats.failed == len(rollouter.failures)


# ------------------------------------------------------------------ multimodal


class FakeImage:
    def __init__(self, source: str) -> None:
        self.source = source


class FakeVisionPreprocessor:
    """Returns (images, videos) like qwen-vl-utils; one fake image per `image` entry."""

    def __init__(self) -> None:
        self.calls = 0

    async def process_vision_info(self, messages: list[dict[str, Any]]) -> Any:
        self.calls += 1
        await asyncio.sleep(0)
        images = [
            FakeImage(item["image"])
            for message in messages
            for item in message["content"]
            if isinstance(item, dict) and "image" in item
        ]
        return images, None


class RaisingVisionPreprocessor(FakeVisionPreprocessor):
    async def process_vision_info(self, messages: list[dict[str, Any]]) -> Any:
        if "broken" in str(messages):
            raise OSError("cannot identify image file 'broken.png'")
        return await super().process_vision_info(messages)


def _vision_prompts(names: list[str]) -> list[PromptSample]:
    return [
        PromptSample(
            prompt_id=f"img{i}",
            prompt_token_ids=[3, 4, 5 + i],
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": f"file:///data/{name}"},
                        {"type": "text", "text": "What is in the picture?"},
                    ],
                }
            ],
        )
        for i, name in enumerate(names)
    ]


async def test_multimodal_prompts_send_images_to_the_engine_and_keep_a_reference() -> None:
    engine = FakeEngine()
    sink = ListSink()
    preprocessor = FakeVisionPreprocessor()
    prompts = [*_vision_prompts(["a.png", "b.png"]), *make_prompts(1, prefix="text")]
    rollouter = Rollouter(
        engine, prompts, sink, zero_reward, RolloutConfig(group_size=2), preprocessor
    )
    stats = await asyncio.wait_for(rollouter.run(), timeout=30)
    assert stats.delivered == 3
    assert preprocessor.calls == 2
    images = {c.request_id.split(":")[0]: c.multi_modal_data for c in engine.calls}
    assert images["text0"] is None
    assert [im.source for im in images["img1"]["image"]] == ["file:///data/b.png"]
    for trajectory in sink.trajectories:
        if trajectory.group_id.startswith("img"):
            assert trajectory.multimodal is not None
            assert trajectory.multimodal.image_sources[0].startswith("file:///data/")
            assert "What is in the picture?" in trajectory.multimodal.messages_json
        else:
            assert trajectory.multimodal is None


@pytest.mark.parametrize("preprocessor", [RaisingVisionPreprocessor(), None])
async def test_preprocessing_errors_are_failed_samples(
    preprocessor: FakeVisionPreprocessor | None,
) -> None:
    prompts = _vision_prompts(["ok.png", "broken.png", "fine.png"])
    rollouter = Rollouter(
        FakeEngine(), prompts, ListSink(), zero_reward, RolloutConfig(group_size=2), preprocessor
    )
    stats = await asyncio.wait_for(rollouter.run(), timeout=30)
    if preprocessor is None:  # messages but no preprocessor: every image prompt fails
        assert (stats.delivered, stats.failed) == (0, 3)
        assert {f.error_type for f in rollouter.failures} == {"ValueError"}
        return
    assert (stats.delivered, stats.failed) == (2, 1)
    [failure] = rollouter.failures
    assert failure.prompt_id == "img1"
    assert failure.error_type == "OSError"
    assert "broken.png" in failure.message

"""Image observations of multi-turn episodes go through a real `mm_preprocess.VisionPreprocessor`.

Cross-package (rollout_engine + mm_preprocess), so it lives here, not in either package. The
engine is `rollout_engine.testing.FakeEngine`, a fake: these tests check scheduling and
bookkeeping (which images reach which engine request, in which order, decoded on which
thread; what the trajectory records), not generation. The images are real PNG files written
with Pillow, decoded and resized by the real preprocessor (qwen-vl-utils' `fetch_image`).
Each test takes well under a second, except that the first decode of the session imports
qwen-vl-utils and torch in the preprocessor's thread (~10 s on this 2-core machine).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from pathlib import Path
from typing import Any

import mm_preprocess.preprocessor
import pytest
from mm_preprocess import VisionPreprocessor, process_vision_info_sync
from PIL import Image
from rollout_engine import (
    EpisodeConfig,
    ModelTurn,
    Observation,
    PromptSample,
    RolloutConfig,
    Rollouter,
    SamplingConfig,
    StepResult,
    Trajectory,
    environment_reward,
)
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts, wait_until

IMAGE_TOKEN = 63  # the placeholder; the environment expands it to the image's token count
PIXELS = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}
NUM_IMAGES = 6


def _colour(k: int) -> tuple[int, int, int]:
    return (40 * k, 255 - 40 * k, 7 * k)


@pytest.fixture
def images(tmp_path: Path) -> list[str]:
    """Image k: 28 * (k + 1) x 28 pixels of one colour, so after qwen-vl-utils' resize (28 is
    its factor) its width and colour say which image it is, and it is k + 1 tokens."""
    paths = []
    for k in range(NUM_IMAGES):
        path = tmp_path / f"image{k}.png"
        Image.new("RGB", (28 * (k + 1), 28), _colour(k)).save(path)
        paths.append(str(path))
    return paths


def _which(image: Image.Image) -> int:
    """The index k of a decoded image (by its width), checked against its colour."""
    k = image.size[0] // 28 - 1
    assert image.size == (28 * (k + 1), 28)
    assert image.convert("RGB").getpixel((image.size[0] // 2, 14)) == _colour(k)
    return k


def _tokens(k: int) -> list[int]:
    """The placeholder run of image k (its token count: (H / 28) * (W / 28))."""
    return [IMAGE_TOKEN] * (k + 1)


class ImageEnv:
    """Shows an image at reset and after every turn: env i's j-th image is (i + j) % 6, so
    episodes differ. The observation after turn t is image tokens + [70, t]. Done after
    `done_after` steps. Records the image indices it showed, in order."""

    ids: itertools.count[int] = itertools.count()

    def __init__(self, images: list[str], done_after: int = 3) -> None:
        self.id = next(ImageEnv.ids)
        self.images = images
        self.done_after = done_after
        self.steps = 0
        self.shown: list[int] = []

    def _next(self) -> int:
        k = (self.id + len(self.shown)) % len(self.images)
        self.shown.append(k)
        return k

    async def reset(self, sample: PromptSample) -> Observation:
        k = self._next()
        return Observation(token_ids=[100 + self.id, *_tokens(k)], images=[self.images[k]])

    async def step(self, turn: ModelTurn) -> StepResult:
        self.steps += 1
        if self.steps >= self.done_after:
            return StepResult(reward=1.0, done=True)
        k = (self.id + len(self.shown)) % len(self.images)
        # A mapping reference with per-image options works too (every other turn).
        ref: Any = self.images[k] if turn.index % 2 else {"image": self.images[k]}
        self.shown.append(k)
        return StepResult(observation=[*_tokens(k), 70, turn.index], images=[ref], reward=0.25)


@pytest.fixture
def decode_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread of every real decode job (`run_vision_info`, still the real function)."""
    threads: list[str] = []
    real = mm_preprocess.preprocessor.run_vision_info

    def recording(messages: Any, config: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(messages, config)

    monkeypatch.setattr(mm_preprocess.preprocessor, "run_vision_info", recording)
    return threads


def _rollouter(
    engine: FakeEngine,
    prompts: list[PromptSample],
    sink: ListSink,
    make_env: Any,
    preprocessor: VisionPreprocessor | None,
    **overrides: Any,
) -> Rollouter:
    config: dict[str, Any] = {
        "group_size": 2,
        "max_concurrency": 4,
        "batch_size": 8,
        "sampling": SamplingConfig(max_tokens=16),
    }
    return Rollouter(
        engine,
        prompts,
        sink,
        environment_reward,
        RolloutConfig(**{**config, **overrides}),
        preprocessor=preprocessor,
        environment=make_env,
        episode=EpisodeConfig(max_turns=4, max_total_tokens=400),
    )


def _env_of(t: Trajectory, envs: list[ImageEnv], prompt_length: int) -> ImageEnv:
    marker = t.prompt_ids[prompt_length]
    return next(env for env in envs if 100 + env.id == marker)


async def test_image_observations_are_decoded_off_the_loop_and_kept_in_order(
    images: list[str], decode_threads: list[str]
) -> None:
    envs: list[ImageEnv] = []

    def make_env(sample: PromptSample) -> ImageEnv:
        envs.append(ImageEnv(images))
        return envs[-1]

    engine = FakeEngine(FakeEngineConfig(seed=11, median_length=5))
    sink = ListSink()
    async with VisionPreprocessor(max_workers=2, **PIXELS) as pre:
        rollouter = _rollouter(engine, make_prompts(2), sink, make_env, pre)
        await asyncio.wait_for(rollouter.run(), timeout=30)
        stats = pre.stats()
    assert rollouter.stats().delivered == 2 and rollouter.stats().failed == 0

    # Every decode ran on the preprocessor's threads, never on the loop's.
    loop_thread = threading.current_thread().name
    assert len(decode_threads) == 4 * 3  # 4 episodes: reset + the observations of turns 0, 1
    assert all(name.startswith("mm-preprocess") and name != loop_thread for name in decode_threads)
    assert stats.completed == 12 and stats.failed == 0

    prompt_length = len(make_prompts(1)[0].prompt_ids)
    for t in sink.trajectories:
        env = _env_of(t, envs, prompt_length)
        assert len(env.shown) == 3  # the done step shows nothing
        paths = [images[k] for k in env.shown]
        # The trajectory names every image of the episode, in order...
        assert t.multimodal is not None
        assert t.multimodal.image_sources == paths
        # ...and the trainer, decoding its messages again, gets the same images in order.
        again, _, _ = process_vision_info_sync(json.loads(t.multimodal.messages_json), **PIXELS)
        assert again is not None and [_which(image) for image in again] == env.shown
        # Tokens: the first image's placeholders follow the prompt; each observation is
        # masked (placeholders included); 3 turns, 2 observations.
        assert t.prompt_ids[prompt_length:] == [100 + env.id, *_tokens(env.shown[0])]
        assert len(t.turn_starts) == 3
        for turn, (start, end) in enumerate(
            zip(t.turn_starts, [*t.turn_starts[1:], len(t.response_ids)], strict=True)
        ):
            masks = t.loss_mask[start:end]
            generated = sum(masks)
            assert masks == [1] * generated + [0] * (end - start - generated)
            observation = t.response_ids[start + generated : end]
            if turn < 2:
                assert observation == [*_tokens(env.shown[turn + 1]), 70, turn]
            else:
                assert observation == []
            # Turn `turn`'s request carries every image shown before it, in order.
            member = t.response_id.rsplit(":", 1)[1]
            call = next(c for c in engine.calls if c.request_id == f"{t.group_id}:{member}:t{turn}")
            assert call.prompt_ids == [*t.prompt_ids, *t.response_ids[:start]]
            assert call.multi_modal_data is not None
            assert [_which(image) for image in call.multi_modal_data["image"]] == env.shown[
                : turn + 1
            ]


async def test_a_chat_prompt_image_comes_first_and_is_decoded_once_per_group(
    images: list[str], decode_threads: list[str]
) -> None:
    envs: list[ImageEnv] = []

    def make_env(sample: PromptSample) -> ImageEnv:
        envs.append(ImageEnv(images, done_after=2))
        return envs[-1]

    prompt_image = images[5]
    prompt = PromptSample(
        prompt_id="chat",
        prompt_ids=[1, *_tokens(5), 2],
        messages=[
            {"role": "user", "content": [{"type": "image", "image": prompt_image}, {"text": "?"}]}
        ],
    )
    engine = FakeEngine(FakeEngineConfig(seed=12, median_length=5))
    sink = ListSink()
    async with VisionPreprocessor(max_workers=1, **PIXELS) as pre:
        rollouter = _rollouter(engine, [prompt], sink, make_env, pre, group_size=3)
        await asyncio.wait_for(rollouter.run(), timeout=30)
    assert rollouter.stats().delivered == 1
    assert len(decode_threads) == 1 + 3 * 2  # the prompt once, then reset + 1 observation each
    for t in sink.trajectories:
        env = _env_of(t, envs, len(prompt.prompt_ids))
        assert t.multimodal is not None
        assert t.multimodal.image_sources == [prompt_image, *(images[k] for k in env.shown)]
        assert "?" in t.multimodal.messages_json  # the prompt's own messages lead
        member = t.response_id.rsplit(":", 1)[1]
        last = next(c for c in engine.calls if c.request_id == f"{t.group_id}:{member}:t1")
        assert last.multi_modal_data is not None
        assert [_which(image) for image in last.multi_modal_data["image"]] == [5, *env.shown]


async def test_an_aborted_turn_continues_with_the_same_images(images: list[str]) -> None:
    """Abort mode: a weight push lands inside the first turn; its continuation request
    carries the images of the original request."""
    engine = FakeEngine(FakeEngineConfig(seed=13, fixed_length=40, time_per_token_s=0.002))
    sink = ListSink()
    async with VisionPreprocessor(max_workers=1, **PIXELS) as pre:
        rollouter = _rollouter(
            engine,
            make_prompts(1),
            sink,
            lambda s: ImageEnv(images, done_after=2),
            pre,
            pause_mode="abort",
            sampling=SamplingConfig(max_tokens=48),
        )
        run = asyncio.create_task(rollouter.run())
        await wait_until(lambda: engine.tokens_generated >= 20 and engine.running_request_ids)
        await rollouter.update_weights({"w": 1}, 1)
        await asyncio.wait_for(run, timeout=30)
    assert rollouter.stats().delivered == 1 and rollouter.stats().resumed >= 1
    continuations = [c for c in engine.calls if c.request_id.rsplit(":", 1)[1].startswith("r")]
    assert continuations
    for call in continuations:
        original = next(
            c for c in engine.calls if c.request_id == call.request_id.rsplit(":", 1)[0]
        )
        assert call.multi_modal_data is not None and original.multi_modal_data is not None
        assert [_which(i) for i in call.multi_modal_data["image"]] == [
            _which(i) for i in original.multi_modal_data["image"]
        ]


async def test_a_corrupt_observation_image_is_a_counted_failed_sample(
    images: list[str], tmp_path: Path
) -> None:
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")

    class Corrupt(ImageEnv):
        async def step(self, turn: ModelTurn) -> StepResult:
            return StepResult(observation=[*_tokens(0), 70], images=[str(corrupt)])

    engine = FakeEngine(FakeEngineConfig(seed=14, median_length=4))
    sink = ListSink()
    async with VisionPreprocessor(max_workers=1, **PIXELS) as pre:
        rollouter = _rollouter(engine, make_prompts(2), sink, lambda s: Corrupt(images), pre)
        await asyncio.wait_for(rollouter.run(), timeout=30)
    assert rollouter.stats().failed == 2 and rollouter.stats().delivered == 0
    assert rollouter.failure_counts == {"VisionDecodeError": 2}
    assert rollouter.state == "finished"

"""`mm_preprocess.compat.verl`: async drop-ins for qwen-vl-utils' `process_vision_info` and
verl's `process_multi_modal_info`, on real image files."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import qwen_vl_utils
from mm_preprocess import EventLoopLagMonitor, VisionDecodeError, VisionPreprocessor
from mm_preprocess.compat import verl as mm_verl
from PIL import Image

pytestmark = pytest.mark.timeout(300)


def _same_images(actual: list[Image.Image] | None, expected: list[Image.Image] | None) -> bool:
    if actual is None or expected is None:
        return actual is expected
    return len(actual) == len(expected) and all(
        a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(actual, expected, strict=True)
    )


@pytest.fixture
def photos(image_factory: Callable[..., Path]) -> list[Path]:
    pngs = [image_factory(900 + 37 * k, 700 + 23 * k, seed=k) for k in range(3)]
    return [*pngs, image_factory(1024, 768, seed=9, ext="jpg")]


async def test_process_vision_info_matches_qwen_vl_utils_in_every_shape(
    photos: list[Path], image_message: Callable[..., list]
) -> None:
    """Same arguments, same return shapes, the same pixels, for patch sizes 14 and 16."""
    messages = image_message(*map(str, photos))
    for patch in (14, 16):
        for kwargs in ({}, {"return_video_metadata": True}, {"return_video_kwargs": True}):
            want = await asyncio.to_thread(
                qwen_vl_utils.process_vision_info, messages, image_patch_size=patch, **kwargs
            )
            got = await mm_verl.process_vision_info(messages, image_patch_size=patch, **kwargs)
            assert len(got) == len(want)
            assert _same_images(got[0], want[0])
            assert got[1] is None and want[1] is None
            assert got[2:] == want[2:]  # video_kwargs: {"do_sample_frames": False, "fps": []}


def _same_videos(actual: list | None, expected: list | None) -> bool:
    """Equal frames (and equal metadata, for `(video, metadata)` pairs)."""
    if actual is None or expected is None:
        return actual is expected
    pairs = zip(actual, expected, strict=True)
    if isinstance(expected[0], tuple):
        return len(actual) == len(expected) and all(
            bool((a[0] == b[0]).all()) and a[1] == b[1] for a, b in pairs
        )
    return len(actual) == len(expected) and all(bool((a == b).all()) for a, b in pairs)


async def test_videos_from_frame_files_match_qwen_vl_utils(
    image_factory: Callable[..., Path],
) -> None:
    """A video given as frame files (beside an image): the same frames, metadata and
    `video_kwargs` as qwen-vl-utils, in each return shape; verl's `(video, metadata)` pairs."""
    frames = [str(image_factory(224, 168, seed=s)) for s in range(4)]
    content = [
        {"type": "video", "video": frames, "sample_fps": 2.0},
        {"type": "image", "image": frames[0]},
    ]
    messages = [{"role": "user", "content": content}]
    for kwargs in ({}, {"return_video_metadata": True}, {"return_video_kwargs": True}):
        want = await asyncio.to_thread(qwen_vl_utils.process_vision_info, messages, **kwargs)
        got = await mm_verl.process_vision_info(messages, **kwargs)
        assert len(got) == len(want)
        assert _same_images(got[0], want[0])
        assert want[1] is not None and _same_videos(got[1], want[1])
        assert got[2:] == want[2:]
    _, videos, _ = await mm_verl.process_multi_modal_info(messages, 14)
    want = await asyncio.to_thread(
        qwen_vl_utils.process_vision_info, messages, return_video_metadata=True
    )
    assert _same_videos(videos, want[1])


async def test_process_multi_modal_info_has_verls_shape(
    photos: list[Path], image_message: Callable[..., list]
) -> None:
    """`(images, videos, audios)`: images equal to qwen-vl-utils', None for absent kinds;
    audio elements collected as verl collects them; a text-only conversation gives Nones."""
    messages = image_message(*map(str, photos[:2]))
    messages[0]["content"].append({"type": "audio", "audio": "clip.wav"})
    images, videos, audios = await mm_verl.process_multi_modal_info(
        messages, image_patch_size=14, config=None
    )
    reference = image_message(*map(str, photos[:2]))
    want, _ = await asyncio.to_thread(qwen_vl_utils.process_vision_info, reference)
    assert _same_images(images, want)
    assert videos is None and audios == ["clip.wav"]
    text_only = [{"role": "user", "content": "hi"}]
    assert await mm_verl.process_multi_modal_info(text_only, 14) == (None, None, None)


async def test_bad_input_and_a_preprocessor_of_ones_own(tmp_path: Path) -> None:
    """A missing file raises VisionDecodeError (a ValueError, as qwen-vl-utils raises);
    `preprocessor=` is used when given, and must match `image_patch_size`."""
    missing = [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "no.png")}]}]
    with pytest.raises(ValueError) as raised:
        await mm_verl.process_vision_info(missing)
    assert isinstance(raised.value, VisionDecodeError)
    async with VisionPreprocessor(max_workers=1, image_patch_size=16) as own:
        with pytest.raises(ValueError, match="image_patch_size"):
            await mm_verl.process_vision_info(missing, preprocessor=own)
    assert mm_verl.shared_preprocessor(14) is mm_verl.shared_preprocessor(14)


async def _lag_while(work: Callable[[], object], seconds_at_least: float) -> float:
    """The loop's lag p99 (ms) while `work()` is awaited in 4 concurrent trajectories."""
    async with EventLoopLagMonitor(interval_s=0.005) as monitor:
        started = time.monotonic()
        await asyncio.gather(*(work() for _ in range(4)))  # type: ignore[misc]
        await asyncio.sleep(max(0.0, seconds_at_least - (time.monotonic() - started)))
        return monitor.snapshot().p99_ms


async def test_loop_lag_p99_drop_in_vs_inline(
    photos: list[Path], image_message: Callable[..., list]
) -> None:
    """Four trajectories decode the same four photos: calling qwen-vl-utils inline (as an
    agent loop without an executor would) stalls the loop for whole decodes; the drop-in
    keeps it responsive. Both measured here, one after the other (~5 s)."""
    messages = image_message(*map(str, photos))
    await mm_verl.process_vision_info(messages)  # imports and thread start-up out of the way

    async def inline() -> None:
        qwen_vl_utils.process_vision_info(messages)  # blocking-on-purpose (the control)

    async def drop_in() -> None:
        await mm_verl.process_vision_info(messages)

    inline_p99 = await _lag_while(inline, 0.2)
    ours_p99 = await _lag_while(drop_in, 0.2)
    print(f"loop lag p99: inline {inline_p99:.1f} ms, drop-in {ours_p99:.1f} ms")
    assert inline_p99 > 20.0  # a decode of four ~1 MP photos blocks the loop
    assert ours_p99 < inline_p99 / 2

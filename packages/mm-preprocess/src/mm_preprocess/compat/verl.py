"""Async drop-ins for `qwen_vl_utils.process_vision_info` and verl's
`RLHFDataset.process_multi_modal_info`, computed in a bounded `VisionPreprocessor` pool.

verl 0.9.x runs qwen-vl-utils in the event loop's default executor (up to 32 threads, shared
with everything else that uses it, and no bound on queued work). These run it in this
package's pool instead: `max_workers` threads, at most `max_inflight` jobs queued, and
sources checked before decoding (file size, pixel count, remote URLs off by default). The
results are those of qwen-vl-utils, pixel for pixel.

The one-line change in verl's agent loop (`verl/experimental/agent_loop/agent_loop.py`,
`AgentLoopBase.process_multi_modal_info`)::

    # was: images, videos, audios = await self.dataset_cls.process_multi_modal_info(
    images, videos, audios = await mm_preprocess.compat.verl.process_multi_modal_info(
        messages, image_patch_size=image_patch_size, config=self.data_config
    )

(with `import mm_preprocess.compat.verl` at the top). Anywhere else, replace
`process_vision_info(...)` from qwen-vl-utils by `await process_vision_info(...)` from here,
with the same arguments.

Each event loop gets its own shared pool per `image_patch_size` (asyncio primitives belong
to one loop), with the package defaults; pass `preprocessor=` to use one of your own (e.g.
`VisionPreprocessor(allow_remote=True)` to fetch http(s) images, which the default refuses).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping
from typing import Any

from mm_preprocess.pipeline import Conversation
from mm_preprocess.preprocessor import VisionPreprocessor
from mm_preprocess.results import VisionInputs

__all__ = ["process_multi_modal_info", "process_vision_info", "shared_preprocessor"]

_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, VisionPreprocessor]] = (
    weakref.WeakKeyDictionary()
)


def shared_preprocessor(image_patch_size: int = 14) -> VisionPreprocessor:
    """The pool these functions use on the running loop for `image_patch_size`."""
    per_loop = _SHARED.setdefault(asyncio.get_running_loop(), {})
    preprocessor = per_loop.get(image_patch_size)
    if preprocessor is None or preprocessor.closed:
        preprocessor = VisionPreprocessor(image_patch_size=image_patch_size)
        per_loop[image_patch_size] = preprocessor
    return preprocessor


def _pool(preprocessor: VisionPreprocessor | None, image_patch_size: int) -> VisionPreprocessor:
    if preprocessor is None:
        return shared_preprocessor(image_patch_size)
    if preprocessor.config.image_patch_size != image_patch_size:
        raise ValueError(
            f"image_patch_size={image_patch_size} but the preprocessor's is "
            f"{preprocessor.config.image_patch_size}"
        )
    return preprocessor


def _sample_fps(metadata: Mapping[str, Any]) -> float:
    """qwen-vl-utils' sampled frame rate: frames kept / frames in the video * its fps."""
    total = max(float(metadata.get("total_num_frames", 0)), 1e-6)
    kept = len(metadata.get("frames_indices", ()))
    return kept / total * float(metadata.get("fps", 0.0))


def _qwen_shape(
    vision: VisionInputs, return_video_kwargs: bool, return_video_metadata: bool
) -> tuple[Any, ...]:
    """`VisionInputs` in the shape qwen-vl-utils' `process_vision_info` returns."""
    videos: list[Any] | None = vision.videos
    metadata = vision.video_metadata or []
    if videos is not None and return_video_metadata:
        videos = list(zip(videos, metadata, strict=True))
    if not return_video_kwargs:
        return vision.images, videos
    video_kwargs: dict[str, Any] = {"do_sample_frames": False}
    if not return_video_metadata:
        video_kwargs["fps"] = [_sample_fps(m) for m in metadata]
    return vision.images, videos, video_kwargs


async def process_vision_info(
    conversations: Conversation,
    return_video_kwargs: bool = False,
    return_video_metadata: bool = False,
    image_patch_size: int = 14,
    *,
    preprocessor: VisionPreprocessor | None = None,
) -> tuple[Any, ...]:
    """`qwen_vl_utils.process_vision_info`, awaited: same arguments, same return value
    (`(images, videos)`, plus `video_kwargs` with `return_video_kwargs`; each video a
    `(video, metadata)` pair with `return_video_metadata`). Bad input raises
    `VisionDecodeError` (a `ValueError`, as qwen-vl-utils raises) naming the element."""
    vision = await _pool(preprocessor, image_patch_size).process_vision_info(conversations)
    return _qwen_shape(vision, return_video_kwargs, return_video_metadata)


def _audios(messages: Conversation) -> list[Any] | None:
    """The audio elements of the messages, as verl's dataset collects them."""
    found: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        for element in content if isinstance(content, list) else ():
            if not isinstance(element, Mapping) or element.get("type") != "audio":
                continue
            if "audio" in element:
                found.append(element["audio"])
            elif "audio_url" in element:
                found.append(element["audio_url"])
            else:
                found.append({k: v for k, v in element.items() if k != "type"})
    return found or None


async def process_multi_modal_info(
    messages: Conversation,
    image_patch_size: int = 14,
    config: Any = None,
    *,
    preprocessor: VisionPreprocessor | None = None,
) -> tuple[Any, Any, Any]:
    """verl's `RLHFDataset.process_multi_modal_info`, awaited: `(images, videos, audios)`,
    videos as `(video, metadata)` pairs, None for a kind that is absent. `config` (verl's
    data config) is accepted and unused, as in verl."""
    del config
    images, videos = await process_vision_info(
        messages,
        return_video_metadata=True,
        image_patch_size=image_patch_size,
        preprocessor=preprocessor,
    )
    return images, videos, _audios(messages)

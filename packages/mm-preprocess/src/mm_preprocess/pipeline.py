"""The synchronous pipeline: conversation -> decoded, resized images/videos (-> processor outputs).

This is the CPU work that `VisionPreprocessor` runs in its thread pool; it is also the
implementation of the `*_sync` entry points for code without an event loop.

Each image is decoded and checked by `mm_preprocess.sources` and then handed to
`qwen_vl_utils.fetch_image` as a PIL image, so resizing (smart_resize to multiples of
`2 * image_patch_size` within [min_pixels, max_pixels], bicubic) is exactly qwen-vl-utils'.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from mm_preprocess.config import VisionConfig
from mm_preprocess.errors import VisionDecodeError
from mm_preprocess.results import MultiModalInfo, VisionInputs
from mm_preprocess.sources import InvalidSource, describe_source, load_image, resolve_video_path

__all__ = [
    "Conversation",
    "build_processor_outputs",
    "process_multi_modal_info_sync",
    "process_vision_info_sync",
    "run_multi_modal_info",
    "run_vision_info",
]

# One conversation (list of chat messages) or a list of conversations, as qwen-vl-utils takes.
Conversation = Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]]

_VISION_TYPES = ("image", "image_url", "video")


class _Location:
    """Where an element sits, to name it in errors."""

    __slots__ = ("content_index", "conversation_index", "message_index")

    def __init__(self, conversation_index: int | None, message_index: int, content_index: int):
        self.conversation_index = conversation_index
        self.message_index = message_index
        self.content_index = content_index

    def error(self, source: Any, reason: str) -> VisionDecodeError:
        return VisionDecodeError(
            message_index=self.message_index,
            content_index=self.content_index,
            conversation_index=self.conversation_index,
            source=describe_source(source),
            reason=reason,
        )


def iter_vision_elements(messages: Conversation) -> Iterator[tuple[_Location, Mapping[str, Any]]]:
    """Yield the image/video elements in order, with the same rule as qwen-vl-utils'
    `extract_vision_info`: an element counts if it has an image/image_url/video key or its
    `type` is one of those."""
    if not messages:
        return
    nested = not isinstance(messages[0], Mapping)
    conversations = messages if nested else [messages]
    for conversation_index, conversation in enumerate(conversations):
        for message_index, message in enumerate(conversation):  # type: ignore[arg-type]
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, list):
                continue
            for content_index, element in enumerate(content):
                if not isinstance(element, Mapping):
                    continue
                if (
                    "image" in element
                    or "image_url" in element
                    or "video" in element
                    or element.get("type", "text") in _VISION_TYPES
                ):
                    location = _Location(
                        conversation_index if nested else None, message_index, content_index
                    )
                    yield location, element


def run_vision_info(messages: Conversation, config: VisionConfig) -> VisionInputs:
    """Decode, check and resize every image and video of `messages` (blocking; CPU-bound)."""
    images: list[Any] = []
    videos: list[Any] = []
    video_metadata: list[dict[str, Any]] = []
    for location, element in iter_vision_elements(messages):
        if "image" in element or "image_url" in element:
            images.append(_fetch_image(location, element, config))
        elif "video" in element:
            video, metadata = _fetch_video(location, element, config)
            videos.append(video)
            video_metadata.append(metadata)
        else:
            raise location.error(
                None, f"element of type {element.get('type')!r} has no image, image_url or video"
            )
    return VisionInputs(images or None, videos or None, video_metadata or None)


def build_processor_outputs(
    messages: Conversation,
    vision: VisionInputs,
    processor: Any,
    *,
    add_generation_prompt: bool = True,
    processor_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Chat-template text and `processor(text=[text], images=..., videos=...)` outputs.

    This is how Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors are used after qwen-vl-utils:
    one text per conversation, the already resized images, videos with their metadata and
    `do_sample_frames=False` (frames were sampled by qwen-vl-utils).
    """
    text = processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if vision.images:
        kwargs["images"] = vision.images
    if vision.videos:
        kwargs["videos"] = vision.videos
        kwargs["video_metadata"] = vision.video_metadata
        kwargs["do_sample_frames"] = False
    kwargs.update(processor_kwargs or {})
    outputs = processor(**kwargs)
    return text, dict(outputs.items())


def run_multi_modal_info(
    messages: Conversation,
    config: VisionConfig,
    processor: Any = None,
    *,
    add_generation_prompt: bool = True,
    processor_kwargs: Mapping[str, Any] | None = None,
) -> MultiModalInfo:
    """`run_vision_info`, then (with a processor) the processor's model inputs."""
    vision = run_vision_info(messages, config)
    if processor is None:
        return MultiModalInfo(*vision)
    text, outputs = build_processor_outputs(
        messages,
        vision,
        processor,
        add_generation_prompt=add_generation_prompt,
        processor_kwargs=processor_kwargs,
    )
    return MultiModalInfo(*vision, text=text, processor_outputs=outputs)


def process_vision_info_sync(
    messages: Conversation, config: VisionConfig | None = None, **overrides: Any
) -> VisionInputs:
    """Blocking twin of `VisionPreprocessor.process_vision_info`, for code with no event loop.

    `overrides` are VisionConfig fields, e.g. `image_patch_size=16, max_pixels=...`.
    """
    return run_vision_info(messages, _config(config, overrides))


def process_multi_modal_info_sync(
    messages: Conversation,
    processor: Any = None,
    config: VisionConfig | None = None,
    *,
    add_generation_prompt: bool = True,
    processor_kwargs: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> MultiModalInfo:
    """Blocking twin of `VisionPreprocessor.process_multi_modal_info`."""
    return run_multi_modal_info(
        messages,
        _config(config, overrides),
        processor,
        add_generation_prompt=add_generation_prompt,
        processor_kwargs=processor_kwargs,
    )


def _config(config: VisionConfig | None, overrides: Mapping[str, Any]) -> VisionConfig:
    base = config or VisionConfig()
    return replace(base, **overrides) if overrides else base


def _image_source(element: Mapping[str, Any]) -> Any:
    source = element["image"] if "image" in element else element["image_url"]
    # OpenAI style {"type": "image_url", "image_url": {"url": ...}}.
    if isinstance(source, Mapping) and "url" in source:
        return source["url"]
    return source


def _fetch_image(location: _Location, element: Mapping[str, Any], config: VisionConfig) -> Any:
    source = _image_source(element)
    try:
        image = load_image(source, config)
    except InvalidSource as exc:
        raise location.error(source, exc.reason) from exc
    request = _with_pixel_defaults(element, config)
    request.pop("image_url", None)
    request["image"] = image
    from qwen_vl_utils import vision_process  # heavy (torch): imported on first use

    try:
        return vision_process.fetch_image(request, image_patch_size=config.image_patch_size)
    except Exception as exc:
        raise location.error(source, f"qwen-vl-utils rejected the image ({exc})") from exc


def _fetch_video(
    location: _Location, element: Mapping[str, Any], config: VisionConfig
) -> tuple[Any, dict[str, Any]]:
    source = element["video"]
    request = dict(element)
    if isinstance(source, list | tuple):
        # A video given as frames: decode and check every frame like an image.
        frames = []
        for frame in source:
            try:
                frames.append(load_image(frame, config))
            except InvalidSource as exc:
                raise location.error(frame, f"video frame: {exc.reason}") from exc
        request["video"] = frames
    elif isinstance(source, str):
        try:
            request["video"] = resolve_video_path(source, config)
        except InvalidSource as exc:
            raise location.error(source, exc.reason) from exc
    else:
        raise location.error(source, "video must be a path, URL or a list of frames")
    from qwen_vl_utils import vision_process

    try:
        (video, metadata), _sample_fps = vision_process.fetch_video(
            request,
            image_patch_size=config.image_patch_size,
            return_video_sample_fps=True,
            return_video_metadata=True,
        )
    except Exception as exc:
        raise location.error(source, f"video decoding failed ({exc})") from exc
    return video, metadata


def _with_pixel_defaults(element: Mapping[str, Any], config: VisionConfig) -> dict[str, Any]:
    request = dict(element)  # never mutate the caller's message
    if config.min_pixels is not None:
        request.setdefault("min_pixels", config.min_pixels)
    if config.max_pixels is not None:
        request.setdefault("max_pixels", config.max_pixels)
    return request

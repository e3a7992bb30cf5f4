"""The multimodal glue of the app: Qwen2-VL through vLLM (rollouts) and transformers (training).

The pieces, in the order a sample meets them (the task itself is `tasks/shapes.py`):

1. A vision task yields `PromptSample`s whose `messages` reference image files
   (qwen-vl-utils format) and whose `prompt_ids` are the chat-template tokens with each
   image's placeholder already *expanded* to its token count (`expand_image_placeholders`,
   `image_token_count`), as the HF processor makes them.
2. `make_vision_preprocessor` builds the rollouter's `mm_preprocess.VisionPreprocessor`
   (threaded, bounded): `await pre.process_vision_info(messages)` -> (images, ...), as the
   Rollouter expects (result[0] = list of PIL images). A missing or corrupt file raises
   `VisionDecodeError` there, and the Rollouter records a failed sample; the run goes on.
3. The rollouter's `VLLMEngine` is configured with the image token
   (`VLLMEngineConfig.image_token_id`): vLLM wants ONE `<|image_pad|>` per image in a
   token-id prompt and expands it itself (given expanded ids it silently expands the first
   pad again and treats the rest as text), so the engine collapses each image's run before
   calling vLLM. Expansion thus happens once, in the task, and
   `Trajectory.prompt_token_ids` (= `PromptSample.prompt_token_ids`) is exactly what the
   trainer feeds the model.
4. `VisionInputsFn` (a `ppo_trainer.MultiModalInputsFn`) rebuilds `pixel_values` and
   `image_grid_thw` from a trajectory's `MultiModalRef` with the same preprocessing and the
   saved processor, in the trainer's worker thread.
5. `train_app.vision_model.Qwen2VLPolicy` runs the forward with those inputs.

Token count of one image (Qwen2-VL): resized to H x W (multiples of 28 within
[min_pixels, max_pixels]), then `tokens = (H / 28) * (W / 28)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGE_TOKEN",
    "VisionInputsFn",
    "VisionSettings",
    "expand_image_placeholders",
    "image_token_count",
    "make_vision_preprocessor",
]

IMAGE_TOKEN = "<|image_pad|>"


@dataclass(frozen=True)
class VisionSettings:
    """Pixel budget and ViT geometry shared by the task, the rollouter's preprocessor and the
    trainer's inputs function (they must agree, or vLLM and the trainer see other pixels).
    Defaults match `vision_model.TinyVLSpec`."""

    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    patch_size: int = 14
    merge_size: int = 2

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def image_token_count(width: int, height: int, settings: VisionSettings = VisionSettings()) -> int:
    """LLM tokens of one image after qwen-vl-utils' resize: (H / 28) * (W / 28)."""
    from qwen_vl_utils.vision_process import smart_resize  # heavy (torch): lazy

    resized_h, resized_w = smart_resize(
        height,
        width,
        factor=settings.factor,
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
    )
    return (resized_h // settings.factor) * (resized_w // settings.factor)


# ---------------------------------------------------------------- placeholder tokens


def expand_image_placeholders(
    ids: Sequence[int], image_token_id: int, counts: Sequence[int]
) -> list[int]:
    """Repeat the i-th single `<|image_pad|>` `counts[i]` times (what the HF processor does)."""
    out: list[int] = []
    image = 0
    for token in ids:
        if token == image_token_id:
            if image >= len(counts):
                raise ValueError(f"more image placeholders than the {len(counts)} images")
            out.extend([image_token_id] * counts[image])
            image += 1
        else:
            out.append(token)
    if image != len(counts):
        raise ValueError(f"{image} image placeholders for {len(counts)} images")
    return out


# ---------------------------------------------------------------- rollouter side


def make_vision_preprocessor(
    settings: VisionSettings = VisionSettings(), *, max_workers: int = 1, max_inflight: int = 8
) -> Any:
    """The rollouter's `MultiModalPreprocessor`: an `mm_preprocess.VisionPreprocessor` with
    the task's pixel budget. Its `process_vision_info(messages)` runs in its own bounded
    thread pool and returns `(images, videos, video_metadata)`; bad files raise
    `VisionDecodeError`. Close it with `await pre.aclose()`."""
    from mm_preprocess import VisionPreprocessor

    return VisionPreprocessor(
        max_workers=max_workers,
        max_inflight=max_inflight,
        image_patch_size=settings.patch_size,
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
    )


# ---------------------------------------------------------------- trainer side


class VisionInputsFn:
    """`ppo_trainer.MultiModalInputsFn` for Qwen2-VL: a trajectory's `MultiModalRef` ->
    `{"pixel_values": [patches, C*T*P*P], "image_grid_thw": [images, 3]}`.

    Re-runs the rollouter's preprocessing (qwen-vl-utils resize with the same `settings`) and
    the saved processor's image processor, so the pixels equal what vLLM saw. Blocking: the
    trainer calls it in its worker thread. The processor loads on first use.
    """

    def __init__(self, model_dir: str | Path, settings: VisionSettings = VisionSettings()):
        self._model_dir = str(model_dir)
        self._settings = settings
        self._image_processor: Any = None

    def __call__(self, ref: Any) -> Mapping[str, Any]:
        from mm_preprocess import process_vision_info_sync

        messages = json.loads(ref.messages_json)
        images, _videos, _meta = process_vision_info_sync(
            messages,
            image_patch_size=self._settings.patch_size,
            min_pixels=self._settings.min_pixels,
            max_pixels=self._settings.max_pixels,
        )
        if not images:
            raise ValueError("multimodal reference without images")
        outputs = self._processor()(images=images, return_tensors="pt")
        return {
            "pixel_values": outputs["pixel_values"],
            "image_grid_thw": outputs["image_grid_thw"],
        }

    def _processor(self) -> Any:
        if self._image_processor is None:
            from transformers import AutoProcessor

            self._image_processor = AutoProcessor.from_pretrained(self._model_dir).image_processor
        return self._image_processor

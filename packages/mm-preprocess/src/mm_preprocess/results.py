"""Result types: what one conversation turns into, and one-result-or-error for batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["ItemResult", "MultiModalInfo", "VisionInputs"]

T = TypeVar("T")


class VisionInputs(NamedTuple):
    """What `qwen_vl_utils.process_vision_info(..., return_video_metadata=True)` returns.

    qwen-vl-utils returns `(images, [(video, metadata), ...])`; here the pairs are split into
    `videos` and `video_metadata` (same order). Each list is None when there is no such
    input, as in qwen-vl-utils. Unpacks as `images, videos, video_metadata = ...`.
    """

    images: list[Image.Image] | None
    videos: list[Any] | None  # torch.Tensor (T, C, H, W) float, as qwen-vl-utils returns
    video_metadata: list[dict[str, Any]] | None


@dataclass(frozen=True)
class MultiModalInfo:
    """Everything the model needs from one conversation.

    Attributes:
        images, videos, video_metadata: as in `VisionInputs`.
        text: the chat-template text given to the processor (None without a processor).
        processor_outputs: the Hugging Face processor's outputs as a plain dict of tensors,
            e.g. `input_ids`, `attention_mask`, `pixel_values`, `image_grid_thw` (None without
            a processor).
    """

    images: list[Image.Image] | None
    videos: list[Any] | None
    video_metadata: list[dict[str, Any]] | None
    text: str | None = None
    processor_outputs: dict[str, Any] | None = None

    @property
    def vision(self) -> VisionInputs:
        return VisionInputs(self.images, self.videos, self.video_metadata)

    @property
    def num_images(self) -> int:
        return len(self.images) if self.images else 0


@dataclass(frozen=True)
class ItemResult(Generic[T]):
    """One item of a batch: either `value` (ok) or `error`, never both."""

    value: T | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> T:
        """The value, or raise the item's error."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]

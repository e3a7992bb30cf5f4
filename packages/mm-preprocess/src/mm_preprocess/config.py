"""What a preprocessing job is allowed to do: sizes, limits and URL policy."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VisionConfig"]

# PIL's own default for Image.MAX_IMAGE_PIXELS (about 0.25 GB for a 3-channel image).
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
DEFAULT_MAX_ENCODED_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class VisionConfig:
    """Settings shared by the async and sync entry points.

    Attributes:
        image_patch_size: ViT patch size (14 for Qwen2/2.5-VL, 16 for Qwen3-VL); images are
            resized to multiples of `image_patch_size * 2` (the 2x2 spatial merge).
        min_pixels, max_pixels: default pixel budget for images whose message element does not
            set its own `min_pixels` / `max_pixels` (None: qwen-vl-utils' defaults). Videos keep
            qwen-vl-utils' per-frame defaults.
        allow_remote: fetch http(s) URLs. Off by default: a training loop should not reach
            out to the network unless asked to.
        remote_timeout_s: total time budget for one remote fetch (connect + all reads).
        max_image_pixels: width * height above which an image is refused from its header,
            before any pixel is decoded (decompression-bomb guard). PIL's own guard, which
            refuses anything above 2 * Image.MAX_IMAGE_PIXELS, still applies on top.
        max_encoded_bytes: largest file, data URI payload or download accepted.
        verify: also run PIL's `verify()` (chunk CRCs for PNG) before decoding, which catches
            corruption even when `ImageFile.LOAD_TRUNCATED_IMAGES` was turned on globally.
    """

    image_patch_size: int = 14
    min_pixels: int | None = None
    max_pixels: int | None = None
    allow_remote: bool = False
    remote_timeout_s: float = 10.0
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_encoded_bytes: int = DEFAULT_MAX_ENCODED_BYTES
    verify: bool = True

    def __post_init__(self) -> None:
        if self.image_patch_size <= 0:
            raise ValueError(f"image_patch_size must be positive, got {self.image_patch_size}")
        if (
            self.min_pixels is not None
            and self.max_pixels is not None
            and self.min_pixels > self.max_pixels
        ):
            raise ValueError(f"min_pixels {self.min_pixels} > max_pixels {self.max_pixels}")
        if self.remote_timeout_s <= 0:
            raise ValueError(f"remote_timeout_s must be positive, got {self.remote_timeout_s}")
        if self.max_image_pixels <= 0 or self.max_encoded_bytes <= 0:
            raise ValueError("max_image_pixels and max_encoded_bytes must be positive")

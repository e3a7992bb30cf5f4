"""Pixel-for-pixel equality with qwen_vl_utils.process_vision_info, for every input kind."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import qwen_vl_utils
from mm_preprocess import (
    VisionConfig,
    VisionInputs,
    VisionPreprocessor,
    process_multi_modal_info_sync,
    process_vision_info_sync,
)
from PIL import Image


def reference(messages: list, image_patch_size: int = 14) -> VisionInputs:
    images, pairs = qwen_vl_utils.process_vision_info(
        messages, image_patch_size=image_patch_size, return_video_metadata=True
    )
    if pairs is None:
        return VisionInputs(images, None, None)
    return VisionInputs(images, [v for v, _ in pairs], [m for _, m in pairs])


def assert_same_images(actual: list[Image.Image] | None, expected: list[Image.Image]) -> None:
    assert actual is not None
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert got.mode == want.mode == "RGB"
        assert got.size == want.size
        assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.fixture(scope="module")
async def pre():
    async with VisionPreprocessor(max_workers=2) as preprocessor:
        yield preprocessor


def _open_pil(path: Path) -> Image.Image:
    """A lazily opened PIL image, as a caller would pass it (helper: no decoding in async def)."""
    return Image.open(path)


def _data_uri(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.mark.parametrize("fixture_name", ["png_path", "jpeg_path", "rgba_png_path"])
async def test_path_file_uri_and_data_uri_match_qwen(
    image_message: Callable[..., list],
    request: pytest.FixtureRequest,
    pre: VisionPreprocessor,
    fixture_name: str,
) -> None:
    path: Path = request.getfixturevalue(fixture_name)
    mime = "image/jpeg" if path.suffix == ".jpg" else "image/png"
    sources = [str(path), f"file://{path}", _data_uri(path, mime)]
    messages = image_message(*sources)
    expected = reference(messages)

    images, videos, metadata = await pre.process_vision_info(messages)

    assert_same_images(images, expected.images)
    assert videos is None
    assert metadata is None
    assert len(images) == 3


async def test_bytes_and_pil_inputs_match_qwen(
    image_message: Callable[..., list], pre: VisionPreprocessor, png_path: Path, jpeg_path: Path
) -> None:
    # qwen-vl-utils takes no raw bytes: its reference is the same file given as a path.
    ours = image_message(png_path.read_bytes(), _open_pil(jpeg_path), png_path)
    theirs = image_message(str(png_path), _open_pil(jpeg_path), str(png_path))

    result = await pre.process_vision_info(ours)

    assert_same_images(result.images, reference(theirs).images)


async def test_image_url_key_and_openai_style_url(
    image_message: Callable[..., list], pre: VisionPreprocessor, png_path: Path
) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": str(png_path)},
                {"type": "image_url", "image_url": {"url": f"file://{png_path}"}},
            ],
        }
    ]
    expected = reference(image_message(str(png_path), str(png_path)))

    result = await pre.process_vision_info(messages)

    assert_same_images(result.images, expected.images)


async def test_min_max_pixels_from_constructor_and_element(
    image_factory: Callable[..., Path],
) -> None:
    big = image_factory(640, 480, seed=5)
    small = image_factory(40, 30, seed=6, ext="jpg")
    min_pixels, max_pixels = 128 * 28 * 28, 256 * 28 * 28
    # The constructor's budget is a default; an element's own min/max_pixels wins.
    element_budget = {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28}
    ours = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(big)},
                {"type": "image", "image": str(small)},
                {"type": "image", "image": str(big), **element_budget},
            ],
        }
    ]
    budget = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    theirs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(big), **budget},
                {"type": "image", "image": str(small), **budget},
                {"type": "image", "image": str(big), **element_budget},
            ],
        }
    ]

    async with VisionPreprocessor(
        max_workers=1, min_pixels=min_pixels, max_pixels=max_pixels
    ) as preprocessor:
        result = await preprocessor.process_vision_info(ours)

    expected = reference(theirs)
    assert_same_images(result.images, expected.images)
    sizes = [image.width * image.height for image in result.images]
    assert all(min_pixels <= s <= max_pixels for s in sizes[:2])
    assert sizes[2] <= element_budget["max_pixels"]
    assert "min_pixels" not in ours[0]["content"][0]  # the caller's message is not mutated


async def test_image_patch_size_16(image_message: Callable[..., list], png_path: Path) -> None:
    messages = image_message(str(png_path))
    async with VisionPreprocessor(max_workers=1, image_patch_size=16) as preprocessor:
        result = await preprocessor.process_vision_info(messages)
    assert_same_images(result.images, reference(messages, image_patch_size=16).images)
    assert result.images[0].width % 32 == 0
    assert result.images[0].height % 32 == 0


async def test_video_as_frame_list_matches_qwen(
    pre: VisionPreprocessor, image_factory: Callable[..., Path]
) -> None:
    frames = [str(image_factory(112, 84, seed=s)) for s in range(3)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": frames, "sample_fps": 1.0},
                {"type": "image", "image": frames[0]},
            ],
        }
    ]
    expected = reference(messages)

    images, videos, metadata = await pre.process_vision_info(messages)

    assert_same_images(images, expected.images)
    assert videos is not None
    assert metadata is not None
    assert len(videos) == 1
    assert videos[0].shape == expected.videos[0].shape
    assert bool((videos[0] == expected.videos[0]).all())
    assert metadata == expected.video_metadata


def _sync_results(pre: VisionPreprocessor, messages: list) -> tuple:
    return (
        pre.process_vision_info_sync(messages),
        process_vision_info_sync(messages, VisionConfig()),
        process_multi_modal_info_sync(messages),
    )


async def test_sync_functions_give_the_same_result(
    image_message: Callable[..., list], pre: VisionPreprocessor, png_path: Path
) -> None:
    messages = image_message(str(png_path), png_path.read_bytes())
    from_async = await pre.process_vision_info(messages)
    from_method, from_function, from_multi = _sync_results(pre, messages)

    for other in (from_method.images, from_function.images, from_multi.images):
        assert_same_images(other, from_async.images)
    assert from_multi.processor_outputs is None
    assert from_multi.text is None


async def test_no_vision_content_gives_nones(pre: VisionPreprocessor) -> None:
    messages = [{"role": "user", "content": "just text"}]
    assert await pre.process_vision_info(messages) == (None, None, None)
    info = await pre.process_multi_modal_info([])
    assert info.images is None
    assert info.num_images == 0


async def test_list_of_conversations(
    image_message: Callable[..., list], pre: VisionPreprocessor, png_path: Path, jpeg_path: Path
):
    conversations = [image_message(str(png_path)), image_message(str(jpeg_path))]
    result = await pre.process_vision_info(conversations)
    assert_same_images(result.images, reference(conversations).images)

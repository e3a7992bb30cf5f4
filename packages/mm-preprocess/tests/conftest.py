"""Real image files written by the tests: PNG (RGB, RGBA), JPEG, and the bad inputs."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def noisy_array(width: int, height: int, seed: int, channels: int = 3) -> np.ndarray:
    """A gradient plus noise: compresses like a photo, so decoding is real work."""
    rng = np.random.default_rng(seed)
    xs = np.linspace(0, 255, width)[None, :, None]
    ys = np.linspace(0, 255, height)[:, None, None]
    noise = rng.integers(0, 48, (height, width, channels))
    return ((xs + 0.5 * ys + noise) % 256).astype(np.uint8)


def write_image(path: Path, width: int, height: int, seed: int = 0, mode: str = "RGB") -> Path:
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = noisy_array(width, height, seed, channels)
    Image.fromarray(pixels, mode=mode).save(path)
    return path


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def bomb_png_bytes(width: int = 40_000, height: int = 40_000) -> bytes:
    """A valid PNG header (IHDR with correct CRC) claiming width x height RGB pixels, followed
    by a tiny IDAT: a few hundred bytes that would decode to width * height * 3 bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


@pytest.fixture
def image_factory(tmp_path: Path) -> Callable[..., Path]:
    counter = iter(range(1_000_000))

    def make(
        width: int = 200, height: int = 150, seed: int = 0, mode: str = "RGB", ext: str = "png"
    ) -> Path:
        return write_image(tmp_path / f"img{next(counter)}.{ext}", width, height, seed, mode)

    return make


@pytest.fixture
def png_path(image_factory: Callable[..., Path]) -> Path:
    return image_factory(300, 200, seed=1)


@pytest.fixture
def jpeg_path(image_factory: Callable[..., Path]) -> Path:
    return image_factory(257, 411, seed=2, ext="jpg")


@pytest.fixture
def rgba_png_path(image_factory: Callable[..., Path]) -> Path:
    return image_factory(120, 90, seed=3, mode="RGBA")


def build_image_message(*sources: object, text: str = "describe") -> list:
    """One user message holding the given images and a text part."""
    content: list[dict] = [{"type": "image", "image": s} for s in sources]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


@pytest.fixture
def image_message() -> Callable[..., list]:
    """`image_message(*sources)`: one user message with those images and a text part."""
    return build_image_message


@pytest.fixture
def bomb_png() -> bytes:
    return bomb_png_bytes()

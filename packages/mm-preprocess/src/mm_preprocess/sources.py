"""Turn one image source (path, URI, bytes, PIL image) into a fully decoded, checked PIL image.

Runs inside a worker thread. Everything that can go wrong raises `InvalidSource` with a
readable reason; the pipeline adds the message index and source and re-raises it as
`VisionDecodeError`.

Order of checks for encoded data (cheapest first, nothing large allocated before the size
check): non-empty -> header parses -> width * height <= max_image_pixels -> verify() (PNG
chunk CRCs) -> full decode with load().
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
import time
import urllib.error
import urllib.request
from typing import Any

from PIL import Image, UnidentifiedImageError

from mm_preprocess.config import VisionConfig

__all__ = ["InvalidSource", "describe_source", "load_image", "resolve_video_path"]

# "<scheme>://..." where the scheme is not one we read; a bare Windows drive ("C:\") does not
# match because of the double slash.
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_REMOTE_SCHEMES = ("http://", "https://")
_READ_CHUNK = 1 << 16
_MAX_SOURCE_CHARS = 120


class InvalidSource(Exception):
    """A source that cannot be decoded; `reason` says why (internal, see VisionDecodeError)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def describe_source(source: Any) -> str:
    """A short printable description: paths and URLs as given, payloads summarised."""
    if isinstance(source, Image.Image):
        return f"<PIL.Image mode={source.mode} size={source.width}x{source.height}>"
    if isinstance(source, bytes | bytearray | memoryview):
        return f"<{len(source)} bytes>"
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        if source.startswith("data:"):
            header = source.split(",", 1)[0]
            return f"<{header[:40]}, {len(source)} chars>"
        if len(source) > _MAX_SOURCE_CHARS:
            return source[: _MAX_SOURCE_CHARS - 3] + "..."
        return source
    return f"<{type(source).__name__}>"


def load_image(source: Any, config: VisionConfig) -> Image.Image:
    """Decode `source` fully and return the PIL image (pixels loaded, not yet converted)."""
    if isinstance(source, Image.Image):
        return _check_pil_image(source, config)
    if isinstance(source, bytes | bytearray | memoryview):
        return decode_image_bytes(bytes(source), config)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise InvalidSource(
            f"unsupported image type {type(source).__name__}; expected a path, file:// or "
            "http(s) URL, base64 data URI, bytes or PIL.Image"
        )
    return decode_image_bytes(_read_string_source(source, config), config)


def resolve_video_path(source: str, config: VisionConfig) -> str:
    """Check a video path or URL the way images are checked; return what the backend reads.

    Videos are decoded by qwen-vl-utils' backend (torchcodec, decord or torchvision), so only
    the location is validated here: the scheme policy and that a local file exists and is
    not empty.
    """
    if source.startswith(_REMOTE_SCHEMES):
        if not config.allow_remote:
            raise InvalidSource(_remote_disabled_reason())
        return source
    path = _local_path(source)
    _check_regular_file(path, config)
    return path


def decode_image_bytes(data: bytes, config: VisionConfig) -> Image.Image:
    """Decode encoded image bytes, refusing oversize headers before any pixel is decoded."""
    if not data:
        raise InvalidSource("empty input (0 bytes)")
    probe = _open_header(data)
    with probe:
        _check_pixel_budget(probe.size, config)
        if config.verify:
            try:
                probe.verify()
            except Exception as exc:
                raise InvalidSource(f"corrupt image data ({_exc_text(exc)})") from exc
    # verify() leaves the image unusable, so decode from a fresh handle.
    image = _open_header(data)
    try:
        image.load()
    except Exception as exc:
        raise InvalidSource(f"truncated or corrupt image data ({_exc_text(exc)})") from exc
    return image


def _open_header(data: bytes) -> Image.Image:
    try:
        # Image.open parses the header only; pixels are decoded by load().
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise InvalidSource(f"decompression bomb refused ({exc})") from exc
    except UnidentifiedImageError as exc:
        raise InvalidSource("not a recognised image format") from exc
    except Exception as exc:
        raise InvalidSource(f"unreadable image header ({_exc_text(exc)})") from exc


def _check_pil_image(image: Image.Image, config: VisionConfig) -> Image.Image:
    _check_pixel_budget(image.size, config)
    try:
        image.load()  # a lazily opened image given by the caller: decode it here, not later
    except Exception as exc:
        raise InvalidSource(f"PIL image cannot be loaded ({_exc_text(exc)})") from exc
    return image


def _check_pixel_budget(size: tuple[int, int], config: VisionConfig) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidSource(f"image has no pixels ({width}x{height})")
    if width * height > config.max_image_pixels:
        raise InvalidSource(
            f"decompression bomb refused: header says {width}x{height} = {width * height:,} "
            f"pixels > max_image_pixels {config.max_image_pixels:,}"
        )


def _read_string_source(source: str, config: VisionConfig) -> bytes:
    if source.startswith(_REMOTE_SCHEMES):
        if not config.allow_remote:
            raise InvalidSource(_remote_disabled_reason())
        return _fetch_remote(source, config)
    if source.startswith("data:"):
        return _decode_data_uri(source, config)
    path = _local_path(source)
    _check_regular_file(path, config)
    try:
        with open(path, "rb") as handle:
            data = handle.read(config.max_encoded_bytes + 1)
    except OSError as exc:
        raise InvalidSource(f"cannot read file ({_exc_text(exc)})") from exc
    if len(data) > config.max_encoded_bytes:
        raise InvalidSource(f"file larger than max_encoded_bytes {config.max_encoded_bytes:,}")
    return data


def _local_path(source: str) -> str:
    if source.startswith("file://"):
        # Same rule as qwen-vl-utils: "file:///a/b.png" -> "/a/b.png".
        return source[len("file://") :]
    match = _SCHEME_RE.match(source)
    if match:
        raise InvalidSource(
            f"unsupported URL scheme {match.group(1)!r}; use a local path, file://, "
            "http(s):// (with allow_remote=True) or a base64 data URI"
        )
    if not source:
        raise InvalidSource("empty path")
    return source


def _check_regular_file(path: str, config: VisionConfig) -> None:
    try:
        info = os.stat(path)
    except FileNotFoundError as exc:
        raise InvalidSource("file not found") from exc
    except OSError as exc:
        raise InvalidSource(f"cannot access file ({_exc_text(exc)})") from exc
    if not stat.S_ISREG(info.st_mode):
        # A FIFO or device would block the worker thread forever on read.
        raise InvalidSource("not a regular file")
    if info.st_size == 0:
        raise InvalidSource("file is empty (0 bytes)")
    if info.st_size > config.max_encoded_bytes:
        raise InvalidSource(
            f"file is {info.st_size:,} bytes > max_encoded_bytes {config.max_encoded_bytes:,}"
        )


def _decode_data_uri(uri: str, config: VisionConfig) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep or not header.startswith("data:image"):
        raise InvalidSource("data URI is not an image (expected data:image/...;base64,...)")
    if not header.endswith(";base64"):
        raise InvalidSource("only base64 data URIs are supported")
    if len(payload) * 3 // 4 > config.max_encoded_bytes:
        raise InvalidSource(
            f"data URI payload larger than max_encoded_bytes {config.max_encoded_bytes:,}"
        )
    try:
        return base64.b64decode(payload)
    except (binascii.Error, ValueError) as exc:
        raise InvalidSource(f"invalid base64 payload ({_exc_text(exc)})") from exc


def _fetch_remote(url: str, config: VisionConfig) -> bytes:
    """GET `url` within `remote_timeout_s`.

    The socket timeout bounds each blocking step; the deadline bounds the whole body, checked
    between reads, so a trickling server is cut off after at most about 2 * remote_timeout_s.
    """
    deadline = time.monotonic() + config.remote_timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "mm-preprocess"})
    chunks: list[bytes] = []
    received = 0
    try:
        with urllib.request.urlopen(request, timeout=config.remote_timeout_s) as response:
            while True:
                if time.monotonic() > deadline:
                    raise InvalidSource(f"remote fetch timed out after {config.remote_timeout_s} s")
                chunk = response.read(_READ_CHUNK)
                if not chunk:
                    break
                received += len(chunk)
                if received > config.max_encoded_bytes:
                    raise InvalidSource(
                        f"download larger than max_encoded_bytes {config.max_encoded_bytes:,}"
                    )
                chunks.append(chunk)
    except InvalidSource:
        raise
    except TimeoutError as exc:
        raise InvalidSource(f"remote fetch timed out after {config.remote_timeout_s} s") from exc
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise InvalidSource(
                f"remote fetch timed out after {config.remote_timeout_s} s"
            ) from exc
        raise InvalidSource(f"remote fetch failed ({_exc_text(exc)})") from exc
    except (OSError, ValueError) as exc:
        raise InvalidSource(f"remote fetch failed ({_exc_text(exc)})") from exc
    return b"".join(chunks)


def _remote_disabled_reason() -> str:
    return "remote URLs are disabled; construct the preprocessor with allow_remote=True"


def _exc_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

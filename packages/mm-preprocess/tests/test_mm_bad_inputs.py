"""Bad input never crashes the caller's loop and never hangs: each raises VisionDecodeError."""

from __future__ import annotations

import asyncio
import base64
import http.server
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mm_preprocess import ItemResult, VisionDecodeError, VisionPreprocessor

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
async def pre():
    async with VisionPreprocessor(max_workers=2, max_inflight=4) as preprocessor:
        yield preprocessor


def _bad_sources(tmp_path: Path, png_path: Path, bomb_png: bytes) -> dict[str, object]:
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    data = png_path.read_bytes()
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(data[: len(data) // 2])
    not_image = tmp_path / "notes.png"
    not_image.write_bytes(b"this is plain text, not an image\n" * 20)
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(bomb_png)
    return {
        "missing file": str(tmp_path / "does-not-exist.png"),
        "zero-byte file": str(empty),
        "truncated png": str(truncated),
        "truncated png bytes": data[: len(data) // 2],
        "non-image file": str(not_image),
        "non-image bytes": b"\x00\x01garbage" * 100,
        "bomb file": str(bomb),
        "bomb data uri": "data:image/png;base64," + base64.b64encode(bomb_png).decode(),
        "unsupported scheme": "ftp://example.com/cat.png",
        "s3 scheme": "s3://bucket/cat.png",
        "remote disabled": "https://example.com/cat.png",
        "bad base64": "data:image/png;base64,@@@not-base64@@@",
        "non-base64 data uri": "data:image/png,rawpayload",
        "directory": str(tmp_path),
        "unsupported type": 12345,
    }


_EXPECTED_REASON = {
    "missing file": "file not found",
    "zero-byte file": "0 bytes",
    "truncated png": "corrupt",
    "truncated png bytes": "corrupt",
    "non-image file": "not a recognised image",
    "non-image bytes": "not a recognised image",
    "bomb file": "decompression bomb",
    "bomb data uri": "decompression bomb",
    "unsupported scheme": "unsupported URL scheme 'ftp'",
    "s3 scheme": "unsupported URL scheme 's3'",
    "remote disabled": "allow_remote=True",
    "bad base64": "base64",
    "non-base64 data uri": "only base64",
    "directory": "not a regular file",
    "unsupported type": "unsupported image type",
}


async def test_each_bad_input_raises_decode_error_naming_message_and_source(
    pre: VisionPreprocessor, tmp_path: Path, png_path: Path, bomb_png: bytes
) -> None:
    for label, source in _bad_sources(tmp_path, png_path, bomb_png).items():
        # The bad image sits in message 2 (after a system and a good user message).
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image", "image": str(png_path)}]},
            {"role": "user", "content": [{"type": "text", "text": "and"}, {"image": source}]},
        ]
        with pytest.raises(VisionDecodeError) as info:
            await asyncio.wait_for(pre.process_vision_info(messages), timeout=60)
        error = info.value
        assert error.message_index == 2, label
        assert error.content_index == 1, label
        assert _EXPECTED_REASON[label] in str(error), (label, str(error))
        assert "message 2" in str(error)
        if isinstance(source, str) and not source.startswith("data:"):
            assert error.source == source
        assert len(error.source) < 200, label  # payloads are summarised, not echoed
    stats = pre.stats()
    assert stats.inflight == 0
    assert stats.failed >= len(_EXPECTED_REASON)


async def test_decode_error_in_a_video_frame_and_missing_key(
    pre: VisionPreprocessor, tmp_path: Path, png_path: Path
) -> None:
    missing = str(tmp_path / "nope.png")
    frames = [{"role": "user", "content": [{"type": "video", "video": [str(png_path), missing]}]}]
    with pytest.raises(VisionDecodeError, match="video frame: file not found") as info:
        await pre.process_vision_info(frames)
    assert info.value.message_index == 0
    assert info.value.source == missing

    keyless = [{"role": "user", "content": [{"type": "image"}]}]
    with pytest.raises(VisionDecodeError, match="no image, image_url or video"):
        await pre.process_vision_info(keyless)

    video_file = [{"role": "user", "content": [{"type": "video", "video": missing}]}]
    with pytest.raises(VisionDecodeError, match="file not found"):
        await pre.process_vision_info(video_file)


async def test_extreme_aspect_ratio_rejected_by_qwen_becomes_decode_error(
    pre: VisionPreprocessor, image_factory: Callable[..., Path], image_message
) -> None:
    sliver = image_factory(2000, 5)
    with pytest.raises(VisionDecodeError, match="aspect ratio"):
        await pre.process_vision_info(image_message(str(sliver)))


def test_bomb_is_refused_from_the_header_without_allocating(tmp_path: Path, bomb_png: bytes):
    """In a fresh process, so the peak RSS belongs to this check alone: decoding the 40,000 x
    40,000 header would need 4.8 GB; refusing it must stay near the interpreter's baseline."""
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(bomb_png)
    script = (
        "import resource, sys\n"
        "from mm_preprocess import VisionDecodeError, process_vision_info_sync\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"msgs = [{{'role': 'user', 'content': [{{'image': {str(bomb)!r}}}]}}]\n"
        "try:\n"
        "    process_vision_info_sync(msgs)\n"
        "except VisionDecodeError as e:\n"
        "    print('refused:', e)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print('grew_kb', after - before)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "refused:" in result.stdout
    assert "decompression bomb" in result.stdout
    grew_kb = int(result.stdout.split("grew_kb")[1])
    assert grew_kb < 200_000, result.stdout  # < 200 MB, vs 4.8 GB to decode


async def test_own_pixel_limit_applies_below_pils(image_factory, image_message) -> None:
    path = image_factory(300, 200)
    async with VisionPreprocessor(max_workers=1, max_image_pixels=300 * 200 - 1) as strict:
        with pytest.raises(VisionDecodeError, match=r"300x200 = 60,000 pixels > max_image_pixels"):
            await strict.process_vision_info(image_message(str(path)))


async def test_process_many_keeps_good_items(
    pre: VisionPreprocessor, tmp_path: Path, png_path: Path, jpeg_path: Path, image_message
) -> None:
    batch = [
        image_message(str(png_path)),
        image_message(str(tmp_path / "missing.png")),
        image_message(str(jpeg_path), b"not an image at all"),
        image_message(str(jpeg_path)),
    ]
    results = await pre.process_many(batch)

    assert [r.ok for r in results] == [True, False, False, True]
    assert all(isinstance(r, ItemResult) for r in results)
    assert results[0].value is not None
    assert results[0].value.num_images == 1
    assert isinstance(results[1].error, VisionDecodeError)
    assert isinstance(results[2].error, VisionDecodeError)
    assert results[2].error.content_index == 1
    with pytest.raises(VisionDecodeError):
        results[1].unwrap()
    assert results[3].unwrap().images is not None


def test_decode_error_pickles() -> None:
    error = VisionDecodeError(message_index=3, source="a.png", reason="file not found")
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.message_index, clone.source, str(clone)) == (3, "a.png", str(error))


# -- remote URLs (a local HTTP server on 127.0.0.1; nothing leaves the machine) -----------------


@pytest.fixture
def http_server(png_path: Path) -> Iterator[str]:
    body = png_path.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections and never answers: a fetch must time out, not hang."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/slow.png"
    listener.close()


async def test_remote_enabled_fetches_and_matches_local(
    http_server: str, png_path: Path, image_message
) -> None:
    async with VisionPreprocessor(max_workers=1, allow_remote=True) as remote:
        fetched = await remote.process_vision_info(image_message(f"{http_server}/cat.png"))
        local = await remote.process_vision_info(image_message(str(png_path)))
        assert fetched.images[0].tobytes() == local.images[0].tobytes()
        with pytest.raises(VisionDecodeError, match="404"):
            await remote.process_vision_info(image_message(f"{http_server}/dog.png"))


async def test_remote_timeout_is_a_decode_error(silent_server: str, image_message) -> None:
    async with VisionPreprocessor(max_workers=1, allow_remote=True, remote_timeout_s=0.5) as remote:
        started = time.monotonic()
        with pytest.raises(VisionDecodeError, match="timed out") as info:
            await asyncio.wait_for(
                remote.process_vision_info(image_message(silent_server)), timeout=30
            )
        assert time.monotonic() - started < 20  # generous: it must not hang
        assert info.value.source == silent_server

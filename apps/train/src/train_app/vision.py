"""Vision tasks and the multimodal glue of the app (Qwen2-VL through vLLM and transformers).

The pieces, in the order a sample meets them:

1. `ShapeColorTask` draws a dataset of PNGs (one coloured shape each, Pillow) with a
   verifiable answer, and yields `PromptSample`s whose `messages` reference the files
   (qwen-vl-utils format) and whose `prompt_ids` are the chat-template tokens with each
   image's placeholder already *expanded* to its token count, as the HF processor makes them.
2. `make_vision_preprocessor` builds the rollouter's `mm_preprocess.VisionPreprocessor`
   (threaded, bounded): `await pre.process_vision_info(messages)` -> (images, ...), as the
   Rollouter expects (result[0] = list of PIL images). A missing or corrupt file raises
   `VisionDecodeError` there, and the Rollouter records a failed sample; the run goes on.
3. `ImagePlaceholderEngine` wraps the `GenerationEngine` (VLLMEngine): vLLM wants ONE
   `<|image_pad|>` per image in a token-id prompt and expands it itself (given expanded ids it
   silently expands the first pad again and treats the rest as text), so the wrapper
   collapses each image's run before calling vLLM. Expansion thus happens once, in the task,
   and `Trajectory.prompt_ids` (= `PromptSample.prompt_ids`) is exactly what the trainer feeds
   the model.
4. `VisionInputsFn` (a `ppo_trainer.MultiModalInputsFn`) rebuilds `pixel_values` and
   `image_grid_thw` from a trajectory's `MultiModalRef` with the same preprocessing and the
   saved processor, in the trainer's worker thread.
5. `train_app.vision_model.Qwen2VLPolicy` runs the forward with those inputs.

Token count of one image (Qwen2-VL): resized to H x W (multiples of 28 within
[min_pixels, max_pixels]), then `tokens = (H / 28) * (W / 28)`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollout_engine import Completion, PauseMode, PromptSample, SamplingConfig, Trajectory

from train_app.tasks import partial_credit

logger = logging.getLogger(__name__)

__all__ = [
    "COLORS",
    "SHAPES",
    "VISION_TASKS",
    "ImagePlaceholderEngine",
    "ShapeColorTask",
    "ShapeItem",
    "VisionInputsFn",
    "VisionSettings",
    "collapse_image_placeholders",
    "expand_image_placeholders",
    "image_token_count",
    "is_vision_task",
    "make_vision_preprocessor",
    "write_shape_dataset",
]

IMAGE_TOKEN = "<|image_pad|>"

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
CorruptKind = Literal["", "truncated", "missing"]


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


def collapse_image_placeholders(
    ids: Sequence[int], image_token_id: int, num_images: int
) -> list[int]:
    """Shrink the first `num_images` runs of `<|image_pad|>` to one token each (what vLLM
    wants for a token-id prompt). Later image tokens (e.g. sampled in a response that is
    being continued) are left alone, as vLLM treats them: plain text."""
    out: list[int] = []
    runs = 0
    collapsing = False  # inside one of the first `num_images` runs
    previous_was_image = False
    for token in ids:
        if token != image_token_id:
            out.append(token)
            previous_was_image = False
            continue
        if not previous_was_image:  # a run starts
            runs += 1
            collapsing = runs <= num_images
            out.append(token)
        elif not collapsing:
            out.append(token)
        previous_was_image = True
    if runs < num_images:
        raise ValueError(f"prompt has {runs} image placeholders for {num_images} images")
    return out


# ---------------------------------------------------------------- dataset


@dataclass(frozen=True)
class ShapeItem:
    """One dataset image and its answers. `corrupt` says how it was broken (tests)."""

    path: str
    color: str
    shape: str
    corrupt: CorruptKind = ""

    @property
    def uri(self) -> str:
        return Path(self.path).resolve().as_uri()


def write_shape_dataset(
    directory: Path | str,
    size: int,
    *,
    image_size: int = 56,
    corrupt_fraction: float = 0.0,
    seed: int = 0,
) -> list[ShapeItem]:
    """Draw `size` PNGs (one coloured shape on a light background each) into `directory`,
    seeded; reuse them if an identical manifest is there. `corrupt_fraction` of them are
    broken on purpose, alternately truncated (half the PNG bytes) and missing (never
    written). Writes are atomic, so replicas may share a directory."""
    directory = Path(directory)
    params = {
        "size": size,
        "image_size": image_size,
        "corrupt_fraction": corrupt_fraction,
        "seed": seed,
    }
    manifest = directory / "manifest.json"
    if manifest.exists():
        data = json.loads(manifest.read_text())
        if data.get("params") == params:
            return [ShapeItem(**item) for item in data["items"]]
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    broken = set(rng.sample(range(size), round(corrupt_fraction * size)))
    items: list[ShapeItem] = []
    broken_so_far = 0
    for index in range(size):
        color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
        png = _draw_shape(rng, image_size, color, shape)
        kind: CorruptKind = ""
        if index in broken:
            kind = "truncated" if broken_so_far % 2 == 0 else "missing"
            broken_so_far += 1
        path = directory / f"{index:05d}-{color}-{shape}.png"
        if kind == "truncated":
            png = png[: len(png) // 2]
        if kind == "missing":
            path.unlink(missing_ok=True)  # an older dataset may have left it there
        else:
            _atomic_write(path, png)
        items.append(ShapeItem(path=str(path.resolve()), color=color, shape=shape, corrupt=kind))
    record = {"params": params, "items": [item.__dict__ for item in items]}
    _atomic_write(manifest, json.dumps(record, indent=1).encode())
    logger.info("wrote %d shape images (%d broken) to %s", size, len(broken), directory)
    return items


def _draw_shape(rng: random.Random, image_size: int, color: str, shape: str) -> bytes:
    import io

    from PIL import Image, ImageDraw

    shade = rng.randint(200, 255)  # a light grey background, never a shape colour
    image = Image.new("RGB", (image_size, image_size), (shade, shade, shade))
    extent = rng.randint(image_size * 2 // 5, image_size * 9 // 10)
    left = rng.randint(0, image_size - extent)
    top = rng.randint(0, image_size - extent)
    box = (left, top, left + extent - 1, top + extent - 1)
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    else:
        apex = (left + extent // 2, top)
        draw.polygon([apex, (box[0], box[3]), (box[2], box[3])], fill=COLORS[color])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _atomic_write(path: Path, data: bytes) -> None:
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "wb") as file:
        file.write(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------- the task


@dataclass
class ShapeColorTask:
    """An image of one coloured shape; the question asks for its colour (`ask="color"`,
    answer e.g. `red`) or its shape (`ask="shape"`, answer e.g. `circle`).

    Reward: `tasks.partial_credit` of the decoded response (before `<|im_end|>`) against the
    answer. The images are written once at construction (`num_images` of them, seeded by
    `dataset_seed`) under `image_dir` (default: a temporary directory); `corrupt_fraction`
    breaks that share of them (truncated or missing) to exercise failure handling.
    Construct it off the event loop (it writes files): `await asyncio.to_thread(make_task, ...)`.
    """

    tokenizer: Any
    image_dir: str | None = None
    num_images: int = 256
    image_size: int = 56
    corrupt_fraction: float = 0.0
    dataset_seed: int = 0
    ask: Literal["color", "shape"] = "color"
    settings: VisionSettings = field(default_factory=VisionSettings)
    name: str = "shapes"

    def __post_init__(self) -> None:
        if not 0.0 <= self.corrupt_fraction <= 1.0:
            raise ValueError(f"corrupt_fraction must be in [0, 1], got {self.corrupt_fraction}")
        if self.ask not in ("color", "shape"):
            raise ValueError(f"ask must be 'color' or 'shape', got {self.ask!r}")
        directory = self.image_dir or os.path.join(
            tempfile.gettempdir(), f"asyncrl-shapes-{self.dataset_seed}-{self.image_size}"
        )
        self.items = write_shape_dataset(
            directory,
            self.num_images,
            image_size=self.image_size,
            corrupt_fraction=self.corrupt_fraction,
            seed=self.dataset_seed,
        )
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.eos_token_id = self.tokenizer.eos_token_id
        # Every prompt has the same text and image size, hence the same token ids.
        self._prompt_ids = self._encode(self.messages(self.items[0]))

    @property
    def question(self) -> str:
        return f"{self.ask}?"

    def answer(self, item: ShapeItem) -> str:
        return item.color if self.ask == "color" else item.shape

    def messages(self, item: ShapeItem) -> list[dict[str, Any]]:
        content = [{"type": "image", "image": item.uri}, {"type": "text", "text": self.question}]
        return [{"role": "user", "content": content}]

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        """An endless, seeded stream of prompts over the dataset's images."""
        rng = random.Random(seed)
        index = 0
        while True:
            item = self.items[rng.randrange(len(self.items))]
            yield PromptSample(
                prompt_id=f"s{seed}-{index}",
                prompt_ids=list(self._prompt_ids),
                answer=self.answer(item),
                metadata={"image": item.path, "color": item.color, "shape": item.shape},
                messages=self.messages(item),
            )
            index += 1

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float:
        ids = list(trajectory.response_ids)
        ended = bool(ids) and ids[-1] == self.eos_token_id
        if ended:
            ids = ids[:-1]
        return partial_credit(self.tokenizer.decode(ids), sample.answer, ended)

    def _encode(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        count = image_token_count(self.image_size, self.image_size, self.settings)
        return expand_image_placeholders(ids, self.image_token_id, [count])


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


class ImagePlaceholderEngine:
    """A `GenerationEngine` that hands vLLM one `<|image_pad|>` per image.

    Prompts carry expanded image placeholders (what the trainer's model needs); vLLM expands
    a single placeholder itself, so image runs are collapsed here before `generate`. Every
    other call and attribute (`startup_s`, `llm`, ...) goes to the wrapped engine.
    """

    def __init__(self, engine: Any, image_token_id: int) -> None:
        self._engine = engine
        self._image_token_id = image_token_id

    @property
    def version(self) -> int:
        return self._engine.version

    @property
    def inner(self) -> Any:
        return self._engine

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[Completion]:
        images = (multi_modal_data or {}).get("image") or []
        if images:
            prompt_ids = collapse_image_placeholders(prompt_ids, self._image_token_id, len(images))
        return await self._engine.generate(request_id, prompt_ids, sampling, n, multi_modal_data)

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        await self._engine.pause(mode, clear_cache)

    async def resume(self) -> None:
        await self._engine.resume()

    async def load_weights(self, weights: Any, version: int) -> None:
        await self._engine.load_weights(weights, version)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._engine.abort(request_ids)

    async def close(self) -> None:
        await self._engine.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never recurse into ourselves (e.g. before __init__)
            raise AttributeError(name)
        return getattr(self._engine, name)


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


VISION_TASKS = {"shapes": ShapeColorTask}
"""Built-in vision tasks by name (for `--task`); they need a Qwen2-VL model."""


def is_vision_task(name: str) -> bool:
    return name in VISION_TASKS

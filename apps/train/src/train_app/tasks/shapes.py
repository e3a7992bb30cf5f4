"""`shapes`: name the colour (or the shape) of a drawn shape; a vision task for a tiny Qwen2-VL.

The dataset is a directory of PNGs drawn with Pillow (one coloured shape each), written once
and reused; a fraction can be broken on purpose (truncated or missing files) to exercise the
failure path. The multimodal plumbing it relies on is `train_app.multimodal`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from rollout_engine import PromptSample, Trajectory

from train_app.multimodal import (
    IMAGE_TOKEN,
    VisionSettings,
    expand_image_placeholders,
    image_token_count,
)
from train_app.tasks.scoring import partial_credit

logger = logging.getLogger(__name__)

__all__ = ["COLORS", "SHAPES", "ShapeColorTask", "ShapeItem", "write_shape_dataset"]

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
CorruptKind = Literal["", "truncated", "missing"]


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
    vision: ClassVar[bool] = True

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
                prompt_token_ids=list(self._prompt_ids),
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

"""The Hugging Face processor path with a full, tiny Qwen2-VL processor built locally.

Qwen2VLProcessor = Qwen2VLImageProcessor + Qwen2VLVideoProcessor + a byte-level BPE tokenizer
trained here with `tokenizers` (holding <|vision_start|>, <|image_pad|>, <|vision_end|>, ...)
+ a Qwen-style chat template. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import qwen_vl_utils
import torch
from mm_preprocess import VisionDecodeError, VisionPreprocessor, process_multi_modal_info_sync

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def processor():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["user assistant system describe the image and the video in one word"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        video_processor=Qwen2VLVideoProcessor(),
        tokenizer=hf_tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def _direct(processor, messages: list) -> tuple[str, dict]:
    """What a caller would write by hand: qwen-vl-utils, chat template, processor."""
    images, videos = qwen_vl_utils.process_vision_info(messages, return_video_metadata=True)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs: dict = {"text": [text], "images": images, "return_tensors": "pt"}
    if videos:
        kwargs["videos"] = [v for v, _ in videos]
        kwargs["video_metadata"] = [m for _, m in videos]
        kwargs["do_sample_frames"] = False
    return text, dict(processor(**kwargs))


async def test_processor_outputs_match_direct_use(
    processor, image_factory: Callable[..., Path], image_message
) -> None:
    png = image_factory(300, 200, seed=1)
    jpg = image_factory(120, 260, seed=2, ext="jpg")
    messages = image_message(str(png), str(jpg), text="describe the image")
    text, expected = _direct(processor, messages)

    async with VisionPreprocessor(max_workers=2) as pre:
        info = await pre.process_multi_modal_info(messages, processor)

    assert info.text == text
    outputs = info.processor_outputs
    assert outputs is not None
    assert {"input_ids", "attention_mask", "pixel_values", "image_grid_thw"} <= set(outputs)
    assert set(outputs) == set(expected)
    for key, value in expected.items():
        assert torch.equal(outputs[key], value), key
    # One grid per image: (t, h, w) in 14-px patches of the resized image.
    grid = outputs["image_grid_thw"]
    assert grid.tolist() == [[1, im.height // 14, im.width // 14] for im in info.images]
    # The chat template's single <|image_pad|> per image expands to grid / merge^2 tokens.
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merge = processor.image_processor.merge_size
    assert int((outputs["input_ids"] == image_pad).sum()) == int(grid.prod(-1).sum()) // merge**2
    assert outputs["pixel_values"].shape[0] == int(grid.prod(-1).sum())


def test_processor_with_video_frames(processor, image_factory, image_message) -> None:
    frames = [str(image_factory(112, 112, seed=s)) for s in range(4)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": frames, "sample_fps": 2.0},
                {"type": "text", "text": "describe the video"},
            ],
        }
    ]
    _, expected = _direct(processor, messages)

    info = process_multi_modal_info_sync(messages, processor)

    assert info.processor_outputs is not None
    assert "pixel_values_videos" in info.processor_outputs
    for key, value in expected.items():
        assert torch.equal(info.processor_outputs[key], value), key


async def test_process_many_with_processor(processor, png_path, tmp_path, image_message) -> None:
    batch = [image_message(str(png_path)), image_message(str(tmp_path / "gone.png"))]
    async with VisionPreprocessor(max_workers=1) as pre:
        good, bad = await pre.process_many(batch, processor)
    assert good.ok
    assert good.value is not None
    assert good.value.processor_outputs is not None
    assert "pixel_values" in good.value.processor_outputs
    assert isinstance(bad.error, VisionDecodeError)

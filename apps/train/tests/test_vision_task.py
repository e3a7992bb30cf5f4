"""The vision task and its glue, without vLLM: real PNGs, the real tiny Qwen2-VL processor
and model (random init), real mm_preprocess decoding."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import torch
from mm_preprocess import VisionDecodeError, process_vision_info_sync
from PIL import Image
from rollout_engine import MultiModalRef, Timings, Trajectory
from rollout_engine.vllm_engine import collapse_image_runs
from train_app.multimodal import (
    VisionInputsFn,
    expand_image_placeholders,
    make_vision_preprocessor,
)
from train_app.tasks.shapes import COLORS, ShapeColorTask
from train_app.vision_model import image_placeholder_types, load_vision_policy
from transformers import AutoProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

PAD = 5  # any id works for the pure token-list helpers


@pytest.fixture(scope="module")
def tokenizer(tiny_vl_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_vl_dir)


@pytest.fixture(scope="module")
def processor(tiny_vl_dir: Path):
    return AutoProcessor.from_pretrained(tiny_vl_dir)


def _task(tokenizer, directory: Path, **options) -> ShapeColorTask:
    return ShapeColorTask(tokenizer, image_dir=str(directory), num_images=20, **options)


def _trajectory(prompt_ids, response_ids, messages) -> Trajectory:
    return Trajectory(
        response_id="s:0",
        group_id="s",
        prompt_ids=list(prompt_ids),
        response_ids=list(response_ids),
        behaviour_logprobs=[0.0] * len(response_ids),
        token_versions=[0] * len(response_ids),
        finish_reason="stop",
        timings=Timings(admitted_at=0.0),
        multimodal=MultiModalRef(messages_json=json.dumps(messages)),
    )


def test_expand_then_collapse_round_trips() -> None:
    ids = [1, 3, PAD, 4, 9, 3, PAD, 4, 2]
    expanded = expand_image_placeholders(ids, PAD, [4, 2])
    assert expanded == [1, 3, PAD, PAD, PAD, PAD, 4, 9, 3, PAD, PAD, 4, 2]
    assert collapse_image_runs(expanded, PAD, 2) == ids
    with pytest.raises(ValueError):
        expand_image_placeholders(ids, PAD, [4])


def test_collapse_leaves_image_tokens_after_the_images_alone() -> None:
    """A continued response may hold sampled <|image_pad|> tokens: vLLM reads them as text."""
    prompt = [3, PAD, PAD, PAD, PAD, 4, 8]
    response = [PAD, PAD, 7]
    assert collapse_image_runs(prompt + response, PAD, 1) == [3, PAD, 4, 8, PAD, PAD, 7]
    with pytest.raises(ValueError):
        collapse_image_runs([1, 2], PAD, 1)


def test_task_writes_images_with_verifiable_answers(tokenizer, tmp_path: Path) -> None:
    task = _task(tokenizer, tmp_path)
    assert len(list(tmp_path.glob("*.png"))) == 20
    for item in task.items:
        with Image.open(item.path) as image:
            assert image.size == (56, 56)
            colors = {rgb for _, rgb in image.convert("RGB").getcolors(56 * 56)}
        # The answer colour is drawn, no other shape colour is.
        assert COLORS[item.color] in colors
        assert not (set(COLORS.values()) - {COLORS[item.color]}) & colors
    assert len({item.color for item in task.items}) > 1


def test_prompts_are_seeded_and_reference_the_pngs(tokenizer, tmp_path: Path) -> None:
    task = _task(tokenizer, tmp_path)
    first = list(islice(task.prompts(seed=3), 8))
    again = list(islice(task.prompts(seed=3), 8))
    assert [p.metadata for p in first] == [p.metadata for p in again]
    for sample in first:
        image = sample.messages[0]["content"][0]
        assert image["type"] == "image" and image["image"].startswith("file:///")
        assert Path(sample.metadata["image"]).exists()
        assert sample.answer == sample.metadata["color"]


def test_prompt_ids_are_the_processors_expanded_ids(tokenizer, processor, tmp_path) -> None:
    """The trainer feeds `prompt_ids` to the HF model: they must match the processor."""
    task = _task(tokenizer, tmp_path)
    sample = next(task.prompts(seed=0))
    images, _, _ = process_vision_info_sync(sample.messages, min_pixels=56 * 56)
    text = processor.apply_chat_template(
        sample.messages, tokenize=False, add_generation_prompt=True
    )
    expected = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0]
    assert sample.prompt_ids == expected.tolist()
    assert sample.prompt_ids.count(task.image_token_id) == 4  # 56 x 56 -> 2 x 2 tokens


def test_reward_is_partial_credit_until_eos(tokenizer, tmp_path: Path) -> None:
    task = ShapeColorTask(tokenizer, image_dir=str(tmp_path), num_images=4, ask="shape")
    sample = next(task.prompts(seed=0))
    eos = tokenizer.eos_token_id

    def reward(text: str, ended: bool) -> float:
        ids = tokenizer.encode(text, add_special_tokens=False) + ([eos] if ended else [])
        return task.reward(sample, _trajectory(sample.prompt_ids, ids, sample.messages))

    assert reward(sample.answer, ended=True) == 1.0
    assert reward(sample.answer, ended=False) == 0.5
    assert reward(sample.answer[:2], ended=True) == pytest.approx(2 / len(sample.answer))
    assert reward("zzzzzzzzz", ended=True) == 0.0


async def test_corrupt_images_fail_in_the_preprocessor(tokenizer, tmp_path: Path) -> None:
    task = ShapeColorTask(
        tokenizer, image_dir=str(tmp_path), num_images=20, corrupt_fraction=0.1, dataset_seed=1
    )
    kinds = sorted(item.corrupt for item in task.items if item.corrupt)
    assert kinds == ["missing", "truncated"]
    preprocessor = make_vision_preprocessor()
    try:
        for item in task.items:
            messages = task.messages(item)
            if item.corrupt:
                with pytest.raises(VisionDecodeError) as error:
                    await preprocessor.process_vision_info(messages)
                assert Path(item.path).name in str(error.value)
            else:
                images = (await preprocessor.process_vision_info(messages))[0]
                assert images[0].size == (56, 56)
    finally:
        await preprocessor.aclose()


def test_inputs_fn_rebuilds_the_processors_pixels(tokenizer, processor, tiny_vl_dir, tmp_path):
    task = _task(tokenizer, tmp_path)
    sample = next(task.prompts(seed=0))
    inputs = VisionInputsFn(tiny_vl_dir)(MultiModalRef(messages_json=json.dumps(sample.messages)))
    images, _, _ = process_vision_info_sync(sample.messages, min_pixels=56 * 56)
    expected = processor.image_processor(images=images, return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])


def test_placeholder_types_skip_image_tokens_in_responses() -> None:
    start, end = 3, 4
    row = [1, start, PAD, PAD, PAD, PAD, end, 9, PAD, start, PAD, 0]  # response has 2 strays
    types = image_placeholder_types(
        torch.tensor([row, row]),
        torch.tensor([[1, 4, 4], [1, 4, 4]]),
        image_token_id=PAD,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    assert types[0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert torch.equal(types[0], types[1])
    with pytest.raises(ValueError):
        image_placeholder_types(
            torch.tensor([row]),
            torch.tensor([[1, 4, 4], [1, 4, 4]]),
            image_token_id=PAD,
            vision_start_token_id=start,
            vision_end_token_id=end,
        )


def test_policy_forward_matches_transformers_qwen2_vl(tokenizer, tiny_vl_dir, tmp_path) -> None:
    """`Qwen2VLPolicy` (trainer inputs only) == stock Qwen2-VL fed by the HF processor, on a
    right-padded batch of two prompt + response sequences; a stray image token in a
    response does not break it."""
    task = _task(tokenizer, tmp_path)
    fn = VisionInputsFn(tiny_vl_dir)
    samples = list(islice(task.prompts(seed=0), 2))
    responses = [[10, 11, 12, 2], [13, 2]]
    lengths = [len(s.prompt_ids) + len(r) for s, r in zip(samples, responses, strict=True)]
    input_ids = torch.zeros(2, max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (sample, response) in enumerate(zip(samples, responses, strict=True)):
        input_ids[row, : lengths[row]] = torch.tensor(sample.prompt_ids + response)
        attention_mask[row, : lengths[row]] = 1
    mm = [fn(MultiModalRef(messages_json=json.dumps(s.messages))) for s in samples]
    pixel_values = torch.cat([m["pixel_values"] for m in mm])
    grid = torch.cat([m["image_grid_thw"] for m in mm])

    policy = load_vision_policy(tiny_vl_dir).eval()
    reference = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir).eval()
    types = (input_ids == task.image_token_id).long()
    with torch.no_grad():
        ours = policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=grid,
        ).logits
        theirs = reference(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=types,
        ).logits
    mask = attention_mask.bool()
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)

    # A sampled <|image_pad|> in a response is text for the policy (stock HF would raise).
    input_ids[1, lengths[1] - 2] = task.image_token_id
    with torch.no_grad():
        logits = policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=grid,
        ).logits
    assert torch.isfinite(logits).all()

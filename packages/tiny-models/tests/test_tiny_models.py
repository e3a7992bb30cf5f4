"""The tiny model and tokenizer: built from nothing, loadable by transformers, reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import (
    ALPHABET,
    build_char_tokenizer,
    build_tiny_llama,
    build_tiny_qwen2,
    build_tiny_qwen3,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
)


def test_tokenizer_has_one_token_per_character_and_round_trips(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer(tmp_path)
    text = "3*4=3333"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert len({tokenizer.convert_tokens_to_ids(c) for c in ALPHABET}) == len(ALPHABET)


def test_model_loads_and_is_seeded_and_reused(tmp_path: Path) -> None:
    first = build_tiny_qwen2(tmp_path / "a", seed=0)
    again = build_tiny_qwen2(tmp_path / "b", seed=0)
    other = build_tiny_qwen2(tmp_path / "c", seed=1)
    load = AutoModelForCausalLM.from_pretrained
    weights = [next(load(d).parameters()).detach() for d in (first, again, other)]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert load(first).config.vocab_size == len(tokenizer)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert build_tiny_qwen2(first, seed=5) == first  # reused, not rebuilt
    assert (first / "config.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_qwen3], ids=["llama", "qwen3"])
def test_other_architectures_load_and_train_one_step(tmp_path: Path, build) -> None:
    """Each loads through transformers' Auto classes as its own architecture, is seeded and
    reused, and one optimiser step on a tokenised prompt lowers its loss."""
    model_dir = build(tmp_path / "m", seed=0)
    again = build(tmp_path / "n", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert (
        type(model).__name__
        == json.loads((model_dir / "config.json").read_text())["architectures"][0]
    )
    first = next(model.parameters()).detach().clone()
    assert torch.equal(first, next(AutoModelForCausalLM.from_pretrained(again).parameters()))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tokenizer("3*4=3333")["input_ids"] + [tokenizer.eos_token_id]])
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
    assert losses[1] < losses[0]


def test_llama_has_no_chat_template_and_untied_head(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template is None
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()


def test_qwen3_chat_template_and_two_eos_ids(tmp_path: Path) -> None:
    """The template renders role markers as single tokens; EOS is `<|im_end|>` in the
    tokenizer and the generation config lists `<eos>` as well."""
    model_dir = build_tiny_qwen3(tmp_path, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "3*4="}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens == ["<|system|>", "a", "<|im_end|>", "<|user|>", *"3*4=", "<|im_end|>",
                      "<|assistant|>"]  # fmt: skip
    assert tokenizer.unk_token_id not in ids
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == im_end
    generation = GenerationConfig.from_pretrained(model_dir)
    assert generation.eos_token_id == [im_end, tokenizer.convert_tokens_to_ids("<eos>")]
    assert generation.pad_token_id == tokenizer.pad_token_id != im_end


def test_extra_characters_are_appended_sorted_after_the_default_ids(tmp_path: Path) -> None:
    default = build_char_tokenizer(tmp_path / "default").get_vocab()
    model_dir = build_tiny_qwen2(tmp_path / "m", extra_characters=["Zoë (x)\n", "3 + y"])
    # As saved (transformers' AutoTokenizer rebuilds a qwen2 tokenizer as byte-level BPE).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    vocab = tokenizer.get_vocab()
    assert {t: vocab[t] for t in default} == default
    new = sorted(set("Zoë (x)\n3 + y") - set(default))
    assert [vocab[c] for c in new] == list(range(len(default), len(vocab)))
    text = "Zoë (3 + x)\n\ny"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size == len(vocab)

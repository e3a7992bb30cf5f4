"""The tiny model and tokenizer: built from nothing, loadable by transformers, reused."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import ALPHABET, build_char_tokenizer, build_tiny_qwen2
from transformers import AutoModelForCausalLM, AutoTokenizer


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

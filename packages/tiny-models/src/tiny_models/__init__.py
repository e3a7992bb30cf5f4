"""A tiny random-init Qwen2 and a character tokenizer, made locally (nothing downloaded).

The model is saved where the caller says and reused if it is there already (a run reuses
its run directory's, and so does `--resume`).
"""

from __future__ import annotations

import logging
import string
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["ALPHABET", "SPECIAL_TOKENS", "build_char_tokenizer", "build_tiny_qwen2"]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# Characters the built-in tasks use; one token each.
ALPHABET = list(string.digits) + list("*=+-?, ") + list("abcdefghij")


def build_char_tokenizer(directory: Path):
    """Train a character-level WordLevel tokenizer with `tokenizers` and save it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tokenizer.train_from_iterator(["".join(ALPHABET)], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)
    return fast


def build_tiny_qwen2(directory: Path, *, seed: int = 0, hidden_size: int = 64) -> Path:
    """Create (or reuse) the default model: ~125k parameters, tied embeddings, float32."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(directory)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=2,
        # head_dim 32: the smallest vLLM's CPU attention kernels support.
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("created tiny Qwen2 (%d parameters) in %s", n_params, directory)
    return directory

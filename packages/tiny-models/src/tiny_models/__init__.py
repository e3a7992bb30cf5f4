"""Tiny random-init causal LMs and a character tokenizer, made locally (nothing downloaded).

`build_tiny_qwen2` is the app's default model. `build_tiny_llama` and `build_tiny_qwen3` are
two more architectures of the same size, for checking that `--model` takes any causal LM
that vLLM and transformers both load; the Qwen3 one has a chat template and stops on two
EOS ids (its generation config lists `<|im_end|>` and `<eos>`), as chat models do.

Each model is saved where the caller says and reused if it is there already (a run reuses
its run directory's, and so does `--resume`).

`extra_characters` extends the character vocabulary for text beyond `ALPHABET` (a task's
prompts and answers): the new characters get one token each, appended in sorted order after
the existing ones, whose ids do not change; without any, the tokenizer is the default one.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "ALPHABET",
    "CHAT_SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_tiny_llama",
    "build_tiny_qwen2",
    "build_tiny_qwen3",
]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# Characters the built-in tasks use; one token each.
ALPHABET = list(string.digits) + list("*=+-?, ") + list("abcdefghij")
# One token per chat role marker, so a templated prompt stays within the tiny vocabulary.
CHAT_SPECIAL_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|im_end|>"]
# A ChatML-like template over those tokens (role names are not in the character alphabet).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Layer sizes shared by every tiny model: head_dim 32 is the smallest vLLM's CPU attention
# kernels support; 128 positions cover the built-in tasks' prompts and answers.
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
MAX_POSITIONS = 128


def build_char_tokenizer(
    directory: Path,
    *,
    extra_special_tokens: Sequence[str] = (),
    eos_token: str = "<eos>",
    chat_template: str | None = None,
    extra_characters: Iterable[str] = (),
):
    """Train a character-level WordLevel tokenizer with `tokenizers` and save it.

    `extra_special_tokens` are whole tokens after the base ones (`eos_token` may name one);
    `chat_template` is saved with the tokenizer. `extra_characters` (strings: each of their
    characters) adds the characters not yet in the vocabulary, sorted, after the others."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    specials = [*SPECIAL_TOKENS, *extra_special_tokens]
    trainer = trainers.WordLevelTrainer(special_tokens=specials, min_frequency=1)
    tokenizer.train_from_iterator(["".join(ALPHABET)], trainer=trainer)
    _append_characters(tokenizer, extra_characters)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token=eos_token, unk_token="<unk>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return fast


def _append_characters(tokenizer: Any, texts: Iterable[str]) -> None:
    """Give every character of `texts` not in the vocabulary a token, in sorted order after
    the existing ids. The pre-tokenizer then splits before every character, line breaks
    included (`.` matches none, so a run of them would be one unknown piece)."""
    from tokenizers import Regex, models, pre_tokenizers

    known = tokenizer.get_vocab(with_added_tokens=True)
    new = sorted({c for text in texts for c in text} - set(known))
    if not new:
        return
    start = max(known.values()) + 1
    vocab = tokenizer.get_vocab(with_added_tokens=False)  # the model's: specials included
    vocab.update({c: start + i for i, c in enumerate(new)})
    tokenizer.model = models.WordLevel(vocab=vocab, unk_token="<unk>")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")


def build_tiny_qwen2(
    directory: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    extra_characters: Iterable[str] = (),
) -> Path:
    """Create (or reuse) the default model: ~125k parameters, tied embeddings, float32;
    `extra_characters`: see the module docstring (the vocabulary size follows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def make(tokenizer: Any) -> Any:
        return Qwen2Config(
            **_shape(hidden_size, len(tokenizer)),
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )

    options = {"extra_characters": tuple(extra_characters)}
    return _build(directory, "Qwen2", Qwen2ForCausalLM, make, seed=seed, tokenizer_options=options)


def build_tiny_llama(directory: Path, *, seed: int = 0, hidden_size: int = 64) -> Path:
    """Create (or reuse) a tiny Llama: untied embeddings, no chat template, EOS `<eos>`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(tokenizer: Any) -> Any:
        return LlamaConfig(
            **_shape(hidden_size, len(tokenizer)),
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )

    return _build(directory, "Llama", LlamaForCausalLM, make, seed=seed)


def build_tiny_qwen3(directory: Path, *, seed: int = 0, hidden_size: int = 64) -> Path:
    """Create (or reuse) a tiny Qwen3 chat model: `CHAT_TEMPLATE`, EOS `<|im_end|>`, and a
    generation config that also stops on `<eos>` (two EOS ids, as chat checkpoints list)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def make(tokenizer: Any) -> Any:
        return Qwen3Config(
            **_shape(hidden_size, len(tokenizer)),
            head_dim=hidden_size // NUM_HEADS,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
        )

    chat = {"extra_special_tokens": CHAT_SPECIAL_TOKENS, "eos_token": "<|im_end|>"}
    return _build(
        directory,
        "Qwen3",
        Qwen3ForCausalLM,
        make,
        seed=seed,
        tokenizer_options={**chat, "chat_template": CHAT_TEMPLATE},
        extra_eos=("<eos>",),
    )


def _shape(hidden_size: int, vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "torch_dtype": "float32",
    }


def _build(
    directory: Path,
    name: str,
    model_class: Any,
    make_config: Any,
    *,
    seed: int,
    tokenizer_options: dict[str, Any] | None = None,
    extra_eos: Sequence[str] = (),
) -> Path:
    """Tokenizer, config, seeded random weights and generation config, saved to `directory`
    (reused when it already holds a config)."""
    import torch

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(directory, **(tokenizer_options or {}))
    torch.manual_seed(seed)
    model = model_class(make_config(tokenizer))
    eos = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(extra_eos))]
    model.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("created tiny %s (%d parameters) in %s", name, n_params, directory)
    return directory

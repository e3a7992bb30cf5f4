"""Shared helpers of the ppo-trainer tests: tiny real models, trajectories, sources, sinks.

The sources and sinks here are small in-memory stand-ins for the queue client and the
rollouter (the real ones live in other packages, which this package must not import).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch
from ppo_trainer import Timings, Trajectory

VOCAB = 32


def tiny_qwen2(seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen2ForCausalLM (~100k parameters)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config)


def make_group(
    group_id: str,
    *,
    n: int = 4,
    prompt_len: int = 5,
    response_lens: Sequence[int] | None = None,
    version: int = 0,
    seed: int = 0,
    rewards: Sequence[float] | None = None,
    logprob: float = -3.0,
) -> list[Trajectory]:
    """A deterministic GRPO group of `n` responses to one random prompt."""
    rng = random.Random(f"{group_id}-{seed}")
    prompt = [rng.randrange(3, VOCAB) for _ in range(prompt_len)]
    lens = (
        list(response_lens) if response_lens is not None else [rng.randint(2, 8) for _ in range(n)]
    )
    out = []
    for i in range(n):
        response = [rng.randrange(3, VOCAB) for _ in range(lens[i])]
        reward = rewards[i] if rewards is not None else float(rng.random())
        out.append(
            Trajectory(
                response_id=f"{group_id}/{i}",
                group_id=group_id,
                prompt_id=f"prompt-{group_id}",
                prompt_token_ids=prompt,
                response_ids=response,
                behaviour_logprobs=[logprob] * len(response),
                token_versions=[version] * len(response),
                finish_reason="stop",
                reward=reward,
                timings=Timings(admitted_at=0.0),
            )
        )
    return out


class ListSource:
    """Async iterator over pre-built groups; optionally raises `error` once exhausted."""

    def __init__(
        self,
        groups: Sequence[list[Trajectory]],
        *,
        error: BaseException | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self._groups = list(groups)
        self._error = error
        self._delay_s = delay_s
        self.yielded = 0
        self.last_yield_at = 0.0

    def __aiter__(self) -> AsyncIterator[list[Trajectory]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[list[Trajectory]]:
        for group in self._groups:
            if self._delay_s:
                await asyncio.sleep(self._delay_s)
            self.yielded += 1
            self.last_yield_at = time.perf_counter()
            yield group
        if self._error is not None:
            raise self._error


class RecordingWeightSink:
    """Records every push; optionally loads the weights into a sampler model."""

    def __init__(self, sampler: torch.nn.Module | None = None) -> None:
        self.pushes: list[tuple[int, dict[str, torch.Tensor], float]] = []
        self._sampler = sampler

    async def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.pushes.append((version, weights, time.perf_counter()))
        if self._sampler is not None:
            await asyncio.to_thread(self._sampler.load_state_dict, weights, strict=False)

    @property
    def versions(self) -> list[int]:
        return [v for v, _, _ in self.pushes]


class RecordingMetricsSink:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, Any]]] = []

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.records.append((step, dict(metrics)))

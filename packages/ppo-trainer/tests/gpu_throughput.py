"""Trainer throughput against a minimal torch loop, on whatever device is here; one JSON line.

Run by `gpu_check.sh` (not a pytest module). On a GPU: the Qwen2.5-0.5B shape (random init,
bf16), ~32k tokens a step; on a CPU (CI): a tiny shape, so the same code path runs in seconds.
Both sides do the same tensor work per step: one no-grad forward for the proximal log-probs,
then `MINIBATCHES` forward/backward/clip/AdamW steps of the clipped PPO loss. Rounds alternate
between the sides; each side's fastest round counts (interference only adds time).

MFU = model FLOPs/s / the device's peak: 8 x parameters per token (2 for the no-grad pass,
6 for forward + backward; attention FLOPs left out, so it is a slight under-estimate).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from ppo_trainer import PPOConfig, PPOTrainer, Timings, Trajectory

__all__ = ["Workload", "main", "measure"]

MINIBATCHES = 4  # bounds the logits' memory at 0.5B (vocab 151,936) to a few GiB
# Dense bf16 peak FLOP/s by device name (datasheet figures, no sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


@dataclass(frozen=True)
class Workload:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    prompt_len: int
    response_len: int
    group_size: int
    groups_per_step: int
    steps: int
    rounds: int


# Qwen2.5-0.5B's shape (494M parameters, tied embeddings); 8 x 8 x 512 = 32k tokens a step.
QWEN_05B = Workload(896, 24, 14, 2, 4864, 151_936, 64, 448, 8, 8, 3, 2)
TINY = Workload(64, 2, 2, 1, 256, 256, 8, 24, 4, 2, 2, 2)


def build_model(w: Workload, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=w.hidden,
        num_hidden_layers=w.layers,
        num_attention_heads=w.heads,
        num_key_value_heads=w.kv_heads,
        intermediate_size=w.ffn,
        vocab_size=w.vocab,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    )
    return Qwen2ForCausalLM(config).to(device, dtype)


def make_batches(w: Workload, count: int) -> list[list[list[Trajectory]]]:
    rng = random.Random(0)
    batches = []
    for b in range(count):
        batch = []
        for g in range(w.groups_per_step):
            prompt = [rng.randrange(3, w.vocab) for _ in range(w.prompt_len)]
            batch.append([_trajectory(w, rng, prompt, f"{b}-{g}", i) for i in range(w.group_size)])
        batches.append(batch)
    return batches


def _trajectory(w: Workload, rng: random.Random, prompt: list[int], gid: str, i: int) -> Any:
    n = w.response_len
    return Trajectory(
        response_id=f"{gid}/{i}",
        group_id=gid,
        prompt_id=f"p{gid}",
        prompt_token_ids=prompt,
        response_ids=[rng.randrange(3, w.vocab) for _ in range(n)],
        behaviour_logprobs=[-11.0 + rng.random() for _ in range(n)],
        token_versions=[0] * n,
        finish_reason="length",
        reward=rng.random(),
        timings=Timings(admitted_at=0.0),
    )


def _config(w: Workload) -> PPOConfig:
    return PPOConfig(
        lr=1e-6, batch_size=w.groups_per_step, num_minibatches=MINIBATCHES, max_staleness=10**6
    )


def minimal_step(model: torch.nn.Module, optimizer: Any, groups: list[list[Trajectory]]) -> None:
    """GRPO advantages, padded rows, proximal log-probs without grad, minibatch PPO steps."""
    device = next(model.parameters()).device
    trajs = [t for g in groups for t in g]
    rewards = torch.tensor([[t.reward for t in g] for g in groups])
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    adv = adv.reshape(-1, 1).to(device)
    ids = torch.tensor([t.prompt_token_ids + t.response_ids for t in trajs], device=device)
    p = len(trajs[0].prompt_token_ids)
    behav = torch.tensor([t.behaviour_logprobs for t in trajs], device=device)
    chunks = torch.tensor_split(torch.randperm(len(trajs), device=device), MINIBATCHES)

    def logprobs(rows: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids[rows]).logits[:, p - 1 : -1].float()
        target = ids[rows, p:].unsqueeze(-1)
        return logits.gather(-1, target).squeeze(-1) - logits.logsumexp(-1)

    with torch.no_grad():
        old = torch.cat([logprobs(rows) for rows in chunks])
    order = torch.cat(list(chunks))
    old = old[torch.argsort(order)]
    for rows in chunks:
        ratio = torch.exp(logprobs(rows) - old[rows])
        a = adv[rows]
        loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        loss = (loss * torch.exp(old[rows] - behav[rows]).clamp(max=2.0)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class _NullMetrics:
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass


async def _source(batches: list[list[list[Trajectory]]]) -> AsyncIterator[list[Trajectory]]:
    for batch in batches:
        for group in batch:
            yield group


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_minimal(base: torch.nn.Module, batches: list, device: str) -> float:
    model = copy.deepcopy(base).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    minimal_step(model, optimizer, batches[0])  # warm-up
    _sync(device)
    started = time.perf_counter()
    for batch in batches[1:]:
        minimal_step(model, optimizer, batch)
    _sync(device)
    return time.perf_counter() - started


def _time_trainer(base: torch.nn.Module, batches: list, w: Workload, device: str) -> float:
    trainer = PPOTrainer(copy.deepcopy(base), _config(w), metrics_sink=_NullMetrics())

    async def run() -> float:
        await trainer.train(_source(batches[:1]))  # warm-up
        _sync(device)
        started = time.perf_counter()
        await trainer.train(_source(batches[1:]))
        _sync(device)
        return time.perf_counter() - started

    try:
        return asyncio.run(run())
    finally:
        trainer.close()


def measure(w: Workload, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Best-of-rounds tokens/s of both sides, their ratio, and MFU where the peak is known."""
    base = build_model(w, device, dtype)
    params = sum(p.numel() for p in base.parameters())
    batches = make_batches(w, w.steps + 1)
    tokens = (w.steps) * w.groups_per_step * w.group_size * (w.prompt_len + w.response_len)
    trainer_s, minimal_s = [], []
    for _ in range(w.rounds):
        minimal_s.append(_time_minimal(base, batches, device))
        trainer_s.append(_time_trainer(base, batches, w, device))
    trainer_tps, minimal_tps = tokens / min(trainer_s), tokens / min(minimal_s)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    peak = next((f for key, f in PEAK_FLOPS.items() if key in name), None)
    result: dict[str, Any] = {
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "params": params,
        "tokens_per_step": tokens // w.steps,
        "trainer_tokens_per_s": round(trainer_tps, 1),
        "minimal_tokens_per_s": round(minimal_tps, 1),
        "trainer_vs_minimal": round(trainer_tps / minimal_tps, 3),
        "mfu_trainer": round(8 * params * trainer_tps / peak, 4) if peak else None,
        "mfu_minimal": round(8 * params * minimal_tps / peak, 4) if peak else None,
    }
    if device.startswith("cuda"):
        result["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=["qwen2.5-0.5b", "tiny"], default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    shape = args.shape or ("qwen2.5-0.5b" if cuda else "tiny")
    w = QWEN_05B if shape == "qwen2.5-0.5b" else TINY
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        # One intra-op thread for both sides: on a shared CPU, spinning OpenMP workers of
        # the main thread were measured 30x slower than the trainer's worker thread.
        torch.set_num_threads(1)
    started = time.perf_counter()
    result = {"shape": shape, "cuda": cuda, "torch": torch.__version__, **measure(w, device, dtype)}
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

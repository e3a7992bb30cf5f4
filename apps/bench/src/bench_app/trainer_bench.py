"""Training throughput: `PPOTrainer` vs a minimal hand-written torch loop, same run, same data.

Both train a fresh copy of the same random Qwen2 on the same GRPO groups and do the same
tensor work per step: one no-grad forward for the proximal log-probs, then `num_minibatches`
forward/backward/clip/AdamW steps with the decoupled, clipped PPO loss. The minimal loop is
what someone would write by hand in a script: pad the groups, slice rows, no event loop,
no metrics. `PPOTrainer` is timed end to end through `train()` on an async in-memory source:
batching, the worker-thread hop, the loss with all its metrics, logging.

Throughput = non-padding tokens (prompt + response) of the batches / wall time. The two are
run alternately for several rounds (the machine is shared; alternating spreads any
interference over both) and each side's fastest round is compared (interference only ever
adds time, so the minimum is the least noisy estimate); medians are reported too.

Data parallel: the same run with `PPOTrainer(data_parallel=...)` over 1 rank (a plain
trainer) and 2 gloo ranks (spawned processes, one intra-op thread each, strategies ddp and
fsdp2); per-step wall time on rank 0, best of `rounds` runs after a warm-up step. On a
2-core machine shared with other work the 2-rank speedup may be below 1; it is reported as
measured.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import random
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ppo_trainer import PPOConfig, PPOTrainer, Timings, Trajectory

from bench_app.report import BenchReport

__all__ = ["run"]

TARGET_RATIO = 0.9  # PPOTrainer tokens/s / minimal loop tokens/s


@dataclass(frozen=True)
class _Setup:
    hidden: int
    layers: int
    vocab: int
    prompt_len: int
    response_len: tuple[int, int]  # min, max (uniform)
    group_size: int
    groups_per_step: int
    steps: int
    rounds: int


FULL = _Setup(
    hidden=256,
    layers=4,
    vocab=2048,
    prompt_len=32,
    response_len=(32, 96),
    group_size=8,
    groups_per_step=4,
    steps=4,
    rounds=3,
)
QUICK = _Setup(
    hidden=64,
    layers=2,
    vocab=256,
    prompt_len=8,
    response_len=(8, 24),
    group_size=4,
    groups_per_step=2,
    steps=2,
    rounds=2,
)

# Same hyperparameters for both sides.
CONFIG = PPOConfig(
    lr=1e-4,
    batch_size=1,  # overwritten per setup
    ppo_epochs=1,
    num_minibatches=2,
    clip_eps=0.2,
    is_cap=2.0,
    max_grad_norm=1.0,
    max_staleness=1_000_000,
)


def _model(setup: _Setup) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=setup.hidden,
        num_hidden_layers=setup.layers,
        num_attention_heads=8 if setup.hidden >= 128 else 4,
        num_key_value_heads=2,
        intermediate_size=4 * setup.hidden,
        vocab_size=setup.vocab,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config)


def _groups(setup: _Setup, count: int, seed: int) -> list[list[Trajectory]]:
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        prompt = [rng.randrange(3, setup.vocab) for _ in range(setup.prompt_len)]
        group = []
        for i in range(setup.group_size):
            length = rng.randint(*setup.response_len)
            group.append(
                Trajectory(
                    response_id=f"{g}/{i}",
                    group_id=str(g),
                    prompt_id=f"p{g}",
                    prompt_token_ids=prompt,
                    response_ids=[rng.randrange(3, setup.vocab) for _ in range(length)],
                    behaviour_logprobs=[-7.0 + rng.random() for _ in range(length)],
                    token_versions=[0] * length,
                    finish_reason="length",
                    reward=rng.random(),
                    timings=Timings(admitted_at=0.0),
                )
            )
        groups.append(group)
    return groups


def _tokens(groups: Sequence[list[Trajectory]]) -> int:
    return sum(len(t.prompt_token_ids) + len(t.response_ids) for g in groups for t in g)


# -- the minimal hand-written loop ---------------------------------------------------------


def _minimal_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[list[Trajectory]]
) -> None:
    """GRPO advantages, pad, old log-probs (no grad), then minibatch PPO updates."""
    trajs = [t for g in groups for t in g]
    advs: list[float] = []
    for g in groups:
        r = torch.tensor([t.reward for t in g])
        advs.extend(((r - r.mean()) / (r.std() + 1e-6)).tolist())
    lens = torch.tensor([len(t.prompt_token_ids) + len(t.response_ids) for t in trajs])
    width = int(lens.max())
    ids = torch.zeros(len(trajs), width, dtype=torch.long)
    attn = torch.zeros(len(trajs), width, dtype=torch.long)
    mask = torch.zeros(len(trajs), width - 1)
    behav = torch.zeros(len(trajs), width - 1)
    for row, t in enumerate(trajs):
        p, n = len(t.prompt_token_ids), len(t.response_ids)
        ids[row, : p + n] = torch.tensor(t.prompt_token_ids + t.response_ids)
        attn[row, : p + n] = 1
        mask[row, p - 1 : p - 1 + n] = 1
        behav[row, p - 1 : p - 1 + n] = torch.tensor(t.behaviour_logprobs)
    adv = torch.tensor(advs).unsqueeze(-1)
    chunks = torch.tensor_split(torch.randperm(len(trajs)), CONFIG.num_minibatches)

    def logprobs(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        w = int(lens[rows].max())
        logits = model(input_ids=ids[rows, :w], attention_mask=attn[rows, :w]).logits[:, :-1]
        logits = logits.float()
        target = ids[rows, 1:w].unsqueeze(-1)
        return logits.gather(-1, target).squeeze(-1) - logits.logsumexp(-1), w

    old = torch.zeros_like(behav)
    with torch.no_grad():
        for rows in chunks:
            lp, w = logprobs(rows)
            old[rows, : w - 1] = lp
    for rows in chunks:
        lp, w = logprobs(rows)
        m, o, b = mask[rows, : w - 1], old[rows, : w - 1], behav[rows, : w - 1]
        ratio = torch.exp(lp - o)
        a = adv[rows]
        loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CONFIG.clip_eps, 1 + CONFIG.clip_eps))
        loss = loss * torch.exp(o - b).clamp(max=CONFIG.is_cap)
        ((loss * m).sum() / m.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG.max_grad_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _time_minimal(
    base: torch.nn.Module, batches: list[list[list[Trajectory]]], warmup: list[list[Trajectory]]
) -> float:
    model = copy.deepcopy(base).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=CONFIG.lr)
    _minimal_step(model, optimizer, warmup)
    started = time.perf_counter()
    for batch in batches:
        _minimal_step(model, optimizer, batch)
    return time.perf_counter() - started


# -- PPOTrainer -----------------------------------------------------------------------------


class _NullMetrics:
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass


async def _source(batches: list[list[list[Trajectory]]]) -> AsyncIterator[list[Trajectory]]:
    for batch in batches:
        for group in batch:
            yield group


def _time_trainer(
    base: torch.nn.Module,
    batches: list[list[list[Trajectory]]],
    warmup: list[list[Trajectory]],
    groups_per_step: int,
) -> tuple[float, float]:
    """Wall time of `train()` over `batches`, and the trainer's `tokens/s` of the last step."""
    config = dataclasses.replace(CONFIG, batch_size=groups_per_step)
    trainer = PPOTrainer(copy.deepcopy(base), config, metrics_sink=_NullMetrics())

    async def main() -> tuple[float, float]:
        await trainer.train(_source([warmup]))
        started = time.perf_counter()
        steps_before = trainer.step
        summary = await trainer.train(_source(batches))
        wall = time.perf_counter() - started
        assert summary.step - steps_before == len(batches)
        return wall, float(summary.metrics["tokens/s"])  # type: ignore[arg-type]

    try:
        return asyncio.run(main())
    finally:
        trainer.close()


# -- data parallel: 1 vs 2 ranks ------------------------------------------------------------


def _dp_rank(rank: int, world: int, port: int, strategy: str, quick: bool, out: str) -> None:
    """One rank of a timed data-parallel round (a spawned process); rank 0 writes the
    mean per-step wall time to `out`."""
    torch.set_num_threads(1)
    dp = None
    if world > 1:
        from ppo_trainer import DataParallel

        init = f"tcp://127.0.0.1:{port}"
        dp = DataParallel.init(rank, world, init_method=init, strategy=strategy)  # type: ignore[arg-type]
    setup = QUICK if quick else FULL
    base = _model(setup)
    groups = _groups(setup, setup.groups_per_step * (setup.steps + 1), seed=0)
    warmup, rest = groups[: setup.groups_per_step], groups[setup.groups_per_step :]
    batches = [
        rest[i : i + setup.groups_per_step] for i in range(0, len(rest), setup.groups_per_step)
    ]
    config = dataclasses.replace(CONFIG, batch_size=setup.groups_per_step)
    trainer = PPOTrainer(base, config, metrics_sink=_NullMetrics(), data_parallel=dp)

    async def main() -> float:
        await trainer.train(_source([warmup]))
        started = time.perf_counter()
        await trainer.train(_source(batches))
        return (time.perf_counter() - started) / len(batches)

    try:
        step_s = asyncio.run(main())
        if rank == 0:
            Path(out).write_text(json.dumps(step_s))
    finally:
        trainer.close()
        if dp is not None:
            dp.close()


def _time_data_parallel(world: int, strategy: str, quick: bool) -> float:
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "steps.json")
        mp.spawn(_dp_rank, args=(world, port, strategy, quick, out), nprocs=world, join=True)
        return float(json.loads(Path(out).read_text()))


def _data_parallel_rows(quick: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    configs = {"1 rank": (1, "ddp"), "2 ranks ddp": (2, "ddp"), "2 ranks fsdp2": (2, "fsdp2")}
    runs: dict[str, list[float]] = {name: [] for name in configs}
    # Rounds alternate between the configurations (one fresh spawn each), so a burst of
    # load from other work on the machine is spread over all of them.
    for _ in range((QUICK if quick else FULL).rounds):
        for name, (world, strategy) in configs.items():
            runs[name].append(_time_data_parallel(world, strategy, quick))
    one = min(runs["1 rank"])
    rows = [
        {
            "loop": f"data parallel, {name}",
            "step_ms (best round)": 1000 * min(times),
            "rounds_s": ", ".join(f"{t:.3f}" for t in times),
            "speedup vs 1 rank": one / min(times),
        }
        for name, times in runs.items()
    ]
    figures = {
        "dp_step_ms_1": round(1000 * one, 1),
        "dp_step_ms_2_ddp": round(1000 * min(runs["2 ranks ddp"]), 1),
        "dp_step_ms_2_fsdp2": round(1000 * min(runs["2 ranks fsdp2"]), 1),
        "dp_speedup_2_ddp": round(one / min(runs["2 ranks ddp"]), 3),
        "dp_speedup_2_fsdp2": round(one / min(runs["2 ranks fsdp2"]), 3),
        "cpu_count": os.cpu_count(),
    }
    return rows, figures


@dataclass(frozen=True)
class _Rounds:
    """Wall seconds of each alternating round of both loops over the same batches."""

    tokens: int  # non-padding tokens of the timed batches
    params: int
    trainer_walls: list[float]
    minimal_walls: list[float]
    trainer_metric: list[float]  # the trainer's own tokens/s metric, per round


def _time_rounds(setup: _Setup) -> _Rounds:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one intra-op thread for both sides
    try:
        base = _model(setup)
        groups = _groups(setup, setup.groups_per_step * (setup.steps + 1), seed=0)
        warmup = groups[: setup.groups_per_step]
        batches = [
            groups[i : i + setup.groups_per_step]
            for i in range(setup.groups_per_step, len(groups), setup.groups_per_step)
        ]
        rounds = _Rounds(
            tokens=sum(_tokens(b) for b in batches),
            params=sum(p.numel() for p in base.parameters()),
            trainer_walls=[],
            minimal_walls=[],
            trainer_metric=[],
        )
        for _ in range(setup.rounds):
            torch.manual_seed(1)
            rounds.minimal_walls.append(_time_minimal(base, batches, warmup))
            torch.manual_seed(1)
            wall, metric = _time_trainer(base, batches, warmup, setup.groups_per_step)
            rounds.trainer_walls.append(wall)
            rounds.trainer_metric.append(metric)
    finally:
        torch.set_num_threads(threads)
    return rounds


def run(quick: bool) -> BenchReport:
    setup = QUICK if quick else FULL
    timed = _time_rounds(setup)
    tokens, params = timed.tokens, timed.params
    trainer_walls, minimal_walls = timed.trainer_walls, timed.minimal_walls
    trainer_tps = tokens / min(trainer_walls)
    minimal_tps = tokens / min(minimal_walls)
    ratio = trainer_tps / minimal_tps
    median_ratio = statistics.median(minimal_walls) / statistics.median(trainer_walls)
    trainer_metric = timed.trainer_metric
    dp_rows, dp_figures = _data_parallel_rows(quick)
    rows = [
        {
            "loop": "PPOTrainer.train()",
            "tokens/s": trainer_tps,
            "step_ms (best round)": 1000 * min(trainer_walls) / setup.steps,
            "rounds_s": ", ".join(f"{w:.2f}" for w in trainer_walls),
        },
        {
            "loop": "minimal torch loop",
            "tokens/s": minimal_tps,
            "step_ms (best round)": 1000 * min(minimal_walls) / setup.steps,
            "rounds_s": ", ".join(f"{w:.2f}" for w in minimal_walls),
        },
        *dp_rows,
    ]
    return BenchReport(
        title=f"Trainer throughput ({'quick' if quick else 'full'})",
        rows=rows,
        figures={
            "trainer_tokens_per_s": round(trainer_tps, 1),
            "minimal_tokens_per_s": round(minimal_tps, 1),
            "ratio": round(ratio, 3),
            "target": TARGET_RATIO,
            "met": ratio >= TARGET_RATIO,
            "ratio_of_medians": round(median_ratio, 3),
            "trainer_metric_tokens_per_s": round(statistics.median(trainer_metric), 1),
            "params": params,
            "tokens_per_step": tokens // setup.steps,
            "steps": setup.steps,
            "rounds": setup.rounds,
            "quick": quick,
            **dp_figures,
        },
        notes=[
            f"Qwen2 random init, {params / 1e6:.2f}M params, vocab {setup.vocab}; "
            f"{setup.groups_per_step} groups x {setup.group_size} responses per step, "
            f"prompt {setup.prompt_len}, response {setup.response_len[0]}-"
            f"{setup.response_len[1]} tokens; ppo_epochs=1, num_minibatches=2 "
            "(so both do one no-grad proximal forward + 2 forward/backward/AdamW steps).",
            "torch.set_num_threads(1) for both; best of alternating rounds; "
            "tokens = non-padding prompt+response tokens.",
            "data parallel: spawned gloo ranks, 1 thread each, same batches (each rank trains "
            "its group-aligned half); step time on rank 0; on a shared 2-core machine the "
            "2-rank speedup can be below 1 (reported as measured).",
        ],
    )

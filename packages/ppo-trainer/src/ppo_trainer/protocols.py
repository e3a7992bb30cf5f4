"""The services the trainer needs from the outside, as Protocols (the app wires real ones in)."""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

from ppo_trainer.types import MultiModalRef, Trajectory

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchSource",
    "GroupSource",
    "MetricValue",
    "MetricsSink",
    "MultiModalInputsFn",
    "StalenessBound",
    "WeightSink",
]

MetricValue: TypeAlias = float | list[int]
"""Every metric is a float except `staleness/hist` (counts indexed by staleness)."""


@runtime_checkable
class BatchSource(Protocol):
    """A pull-style source (e.g. the queue client): returns up to `n` groups.

    `current_version` lets the source drop or hold samples that would be too stale. End of
    stream is signalled by an exception the caller names (`train(..., end_of_stream=...)`).
    """

    async def next_batch(self, n: int, current_version: int) -> list[list[Trajectory]]: ...


GroupSource: TypeAlias = AsyncIterable[list[Trajectory]] | BatchSource
"""What `PPOTrainer.train` consumes: an async iterable of groups (its end = end of stream),
or a `BatchSource`. One item = all responses of one prompt (same `group_id`)."""


@runtime_checkable
class WeightSink(Protocol):
    """Receives the new policy weights (e.g. the rollouter, which loads them into vLLM)."""

    async def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> None: ...


@runtime_checkable
class MetricsSink(Protocol):
    """Receives one metrics snapshot per trainer step (JSONL, TensorBoard, W&B...)."""

    def log(self, metrics: Mapping[str, MetricValue], step: int) -> None: ...


@runtime_checkable
class MultiModalInputsFn(Protocol):
    """Rebuilds the model inputs of a multimodal trajectory from its reference.

    Returns tensors for *one* sequence that the trainer concatenates along dim 0 across the
    sequences of a micro-batch and passes to `model.forward` by name, e.g. for Qwen2-VL
    `{"pixel_values": [num_patches, C*T*P*P], "image_grid_thw": [num_images, 3]}`.
    Called in the trainer's worker thread (never on the event loop), once per distinct
    `MultiModalRef` in a step. The trajectory's `prompt_token_ids` must already contain the
    expanded image placeholder tokens, as the HF processor produces them.
    """

    def __call__(self, ref: MultiModalRef) -> Mapping[str, torch.Tensor]: ...


@runtime_checkable
class StalenessBound(Protocol):
    """The one staleness bound of a run (the app builds it once and hands it to every
    component): a group whose staleness (trainer version minus its oldest generated token's
    version) is `too_stale` is dropped, not trained on. `max_staleness` is the bound k."""

    @property
    def max_staleness(self) -> int: ...

    def too_stale(self, staleness: int) -> bool: ...

"""Wire types and protocols of the rollout engine.

`Trajectory` crosses process boundaries (rollouter -> queue -> trainer) as msgpack. The trainer
keeps its own struct with the same fields; a root test decodes one into the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

__all__ = [
    "TRAJECTORY_SCHEMA_VERSION",
    "Completion",
    "GenerationEngine",
    "MultiModalPreprocessor",
    "MultiModalRef",
    "PauseMode",
    "PromptSample",
    "RewardFn",
    "SamplingConfig",
    "Timings",
    "Trajectory",
    "TrajectorySink",
]

TRAJECTORY_SCHEMA_VERSION = 1

PauseMode = Literal["keep", "abort", "wait"]


class MultiModalRef(msgspec.Struct, kw_only=True):
    """What the trainer needs to rebuild the multimodal inputs of a trajectory.

    `messages_json` is the chat (with image paths/URIs) as JSON; the trainer re-runs the same
    preprocessing. Keeping a reference, not pixels, keeps queue items small.
    """

    messages_json: str
    image_sources: list[str] = []


class Timings(msgspec.Struct, kw_only=True):
    """Wall-clock (time.time()) stamps of one trajectory's life."""

    admitted_at: float
    finished_at: float = 0.0
    generation_s: float = 0.0


class Trajectory(msgspec.Struct, kw_only=True):
    """One response of a GRPO group, with everything the trainer needs.

    `token_versions[i]` is the policy version whose weights produced `response_ids[i]`;
    staleness at consumption is `trainer_version - min(token_versions)`.
    """

    schema_version: int = TRAJECTORY_SCHEMA_VERSION
    sample_id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    reward: float = 0.0
    timings: Timings
    multimodal: MultiModalRef | None = None
    num_resumes: int = 0

    @property
    def min_version(self) -> int:
        return min(self.token_versions) if self.token_versions else -1


class PromptSample(msgspec.Struct, kw_only=True):
    """A prompt to roll out: one GRPO group of `n` responses is generated from it."""

    prompt_id: str
    prompt_ids: list[int]
    answer: str = ""
    metadata: dict[str, str] = {}
    # Chat messages in qwen-vl-utils format (for VLM prompts); images are preprocessed by the
    # multimodal preprocessor in a thread pool, never on the event loop.
    messages: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Generate exactly max_tokens (benchmarks, tests); never set for RL rollouts.
    ignore_eos: bool = False


class Completion(msgspec.Struct, kw_only=True):
    """One finished (or aborted) sequence from an engine."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"


@runtime_checkable
class GenerationEngine(Protocol):
    """What the rollouter needs from an inference engine (vLLM or the fake)."""

    @property
    def version(self) -> int: ...

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[Completion]: ...

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, weights: Any, version: int) -> None: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def close(self) -> None: ...


class TrajectorySink(Protocol):
    """Where finished groups go (the app wires in the queue client)."""

    async def put(self, group: list[Trajectory]) -> None: ...


class RewardFn(Protocol):
    """Scores one response of a prompt. It runs in the rollouter's reward thread pool (off
    the event loop) unless it has an attribute `blocking = False`, which runs it on the loop:
    set that only for functions that take microseconds."""

    def __call__(self, sample: PromptSample, trajectory: Trajectory) -> float: ...


class MultiModalPreprocessor(Protocol):
    """The part of `mm_preprocess.VisionPreprocessor` the rollouter uses."""

    async def process_vision_info(self, messages: list[dict[str, Any]]) -> Any: ...

"""Wire types the trainer consumes.

These mirror `rollout_engine.types` field for field (same names, types, defaults and order):
packages never import each other, so the trainer keeps its own copy and a root test decodes
the producer's msgpack into these classes so the two schemas cannot drift apart.
"""

from __future__ import annotations

import msgspec

__all__ = ["TRAJECTORY_SCHEMA_VERSION", "MultiModalRef", "Timings", "Trajectory"]

TRAJECTORY_SCHEMA_VERSION = 1


class MultiModalRef(msgspec.Struct, kw_only=True):
    """What the trainer needs to rebuild the multimodal inputs of a trajectory.

    `messages_json` is the chat (with image paths/URIs) as JSON; the trainer re-runs the same
    preprocessing (through a `MultiModalInputsFn` the app provides).
    """

    messages_json: str
    image_sources: list[str] = []


class Timings(msgspec.Struct, kw_only=True):
    """Wall-clock (time.time()) stamps of one trajectory's life."""

    admitted_at: float
    finished_at: float = 0.0
    generation_s: float = 0.0


class Trajectory(msgspec.Struct, kw_only=True):
    """One response of a GRPO group.

    `behaviour_logprobs[i]` is the engine's log-prob of `response_ids[i]`;
    `token_versions[i]` is the policy version whose weights produced it. Staleness at
    consumption is `trainer_version - min(token_versions)`.
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

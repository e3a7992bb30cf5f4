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

    Size: without a limit they grow with the run. `consumed_ids_kept` (None: every id) says
    they are only the most recent ones, a window kept to catch a group delivered twice; a
    prompt stream that checkpoints its own position needs no more. The file stays compact:
    when the response ids are exactly `f"{group_id}:{i}"` for `i < n` group by group (the
    rollouter's naming), only the group ids and run-length-encoded group
    sizes are written (`consumed_group_sizes: [[n, repeat], ...]`) instead of every response
    id; anything else falls back to the full `consumed_response_ids` list.
    `read_checkpoint_meta` reads both, and the key `consumed_sample_ids` of older files.
    """

    step: int
    version: int
    consumed_response_ids: tuple[str, ...] = ()
    consumed_group_ids: tuple[str, ...] = ()
    consumed_prompt_ids: tuple[str, ...] = ()
    consumed_ids_kept: int | None = None

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
                **(
                    {"consumed_ids_kept": self.consumed_ids_kept}
                    if self.consumed_ids_kept is not None
                    else {}
                ),
                # Checkpoints written from now on have a manifest: one without it is damaged.
                "has_manifest": True,
                "config": config or {},
            }
        )


class ConsumedIds:
    """Distinct response, group and prompt ids consumed so far, each in first-seen order.

    Insertion-ordered sets (dict keys): a response seen twice (re-delivered) is stored once.
    Without `limit` they grow with the run; with it, only the last `limit` group and prompt
    ids are kept (and the response ids of those groups), so memory and the checkpoint stay
    the same size however long the run. `TrainerState.to_json` writes them compactly.
    """

    def __init__(
        self,
        response_ids: Sequence[str] = (),
        group_ids: Sequence[str] = (),
        prompt_ids: Sequence[str] = (),
        *,
        limit: int | None = None,
    ) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        self.limit = limit
        if limit is not None:  # cut before building: deleting a dict's head one by one is slow
            group_ids, prompt_ids = group_ids[-limit:], prompt_ids[-limit:]
            response_ids = _responses_of(response_ids, group_ids, limit)
        self.response_ids: dict[str, None] = dict.fromkeys(response_ids)
        self.group_ids: dict[str, None] = dict.fromkeys(group_ids)
        self.prompt_ids: dict[str, None] = dict.fromkeys(prompt_ids)
        self._largest_group = 1

    @classmethod
    def of_state(cls, state: TrainerState, limit: int | None = None) -> ConsumedIds:
        """The ids a checkpoint's `TrainerState` recorded (the last `limit` of them)."""
        return cls(
            state.consumed_response_ids,
            state.consumed_group_ids,
            state.consumed_prompt_ids,
            limit=limit,
        )

    def add_groups(self, groups: Sequence[list[Trajectory]]) -> None:
        for group in groups:
            self._largest_group = max(self._largest_group, len(group))
            for t in group:
                self.response_ids[t.response_id] = None
                self.group_ids[t.group_id] = None
                if t.prompt_id:
                    self.prompt_ids[t.prompt_id] = None
        self._trim()

    def _trim(self) -> None:
        """Drop the oldest ids past `limit` (a group's response ids go with it)."""
        limit = self.limit
        if limit is None:
            return
        _drop_oldest(self.prompt_ids, len(self.prompt_ids) - limit)
        responses = self.response_ids
        while len(self.group_ids) > limit:
            group = next(iter(self.group_ids))
            del self.group_ids[group]
            index = 0
            while responses and next(iter(responses)) == f"{group}:{index}":
                del responses[f"{group}:{index}"]
                index += 1
        _drop_oldest(responses, len(responses) - limit * self._largest_group)

    def state(self, step: int, version: int) -> TrainerState:
        """A `TrainerState` at `step` / `version` with these ids."""
        return TrainerState(
            step=step,
            version=version,
            consumed_response_ids=tuple(self.response_ids),
            consumed_group_ids=tuple(self.group_ids),
            consumed_prompt_ids=tuple(self.prompt_ids),
            consumed_ids_kept=self.limit,
        )


def _responses_of(
    response_ids: Sequence[str], group_ids: Sequence[str], limit: int
) -> Sequence[str]:
    """The response ids of `group_ids` when they follow the `f"{group_id}:{i}"` naming, else
    the last `limit` of them."""
    kept = set(group_ids)
    mine = [r for r in response_ids if r.rpartition(":")[0] in kept]
    return mine if mine or not response_ids else response_ids[-limit:]


def _drop_oldest(ids: dict[str, None], count: int) -> None:
    for _ in range(max(0, count)):
        del ids[next(iter(ids))]


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
        consumed_ids_kept=meta.get("consumed_ids_kept"),
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

"""`PromptSource`: one replica's prompt stream and the only owner of its resume state.

A task's `prompts(seed)` is an endless, seeded (so reproducible) stream. What a resumed run
must not generate again is exactly what the trainer consumed before the checkpoint: the
`prompt_id`s its trajectories carried (`PPOTrainer.consumed_prompt_ids`, stored in the
checkpoint), plus the prompts a resume continues or puts back on the queue from the
checkpoint (`train_app.inflight`). Any other prompt admitted but not consumed before the
interruption is generated again. A position in the stream (what a source without a
queue in front of it would checkpoint) cannot express that, so the state is the seed and the
set of consumed prompt ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from rollout_engine import PromptSample

__all__ = ["PromptSource", "PromptStream"]


class PromptStream(Protocol):
    """What `PromptSource` needs of a task: an endless stream per seed whose `prompt_id`s
    never repeat, within a stream or across seeds (the tasks name them `s{seed}-{index}`).
    Each replica has its own seed (`plan.py`), so the set of every replica's consumed ids
    serves each replica, whatever the replica count of the resumed run."""

    def prompts(self, seed: int) -> Iterator[PromptSample]: ...


class PromptSource:
    """Iterates `task.prompts(seed)`, skipping the prompt ids consumed before a resume.

    `state_dict()` / `load_state_dict()` carry `{"seed": int, "consumed_prompt_ids": [...]}`;
    load before iterating (the stream is built when iteration starts)."""

    def __init__(self, task: PromptStream, seed: int, consumed: Iterable[str] = ()) -> None:
        self._task = task
        self._seed = seed
        self._consumed = frozenset(consumed)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self._seed, "consumed_prompt_ids": sorted(self._consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"seed", "consumed_prompt_ids"}
        if unknown:
            raise ValueError(f"unknown PromptSource state keys {sorted(unknown)}")
        self._seed = int(state["seed"])
        self._consumed = frozenset(state.get("consumed_prompt_ids", ()))

    def __iter__(self) -> Iterator[PromptSample]:
        # A task that can skip ids before building a prompt (a dataset: no tokenizing of the
        # rows a resume passes over) gets the set; the filter below then is a no-op for it.
        skipping = getattr(self._task, "prompts_skipping", None)
        stream = (
            skipping(self._seed, self._consumed)
            if skipping is not None
            else self._task.prompts(self._seed)
        )
        return (p for p in stream if p.prompt_id not in self._consumed)

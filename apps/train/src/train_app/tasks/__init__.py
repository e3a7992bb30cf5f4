"""Built-in verifiable tasks, one module each, and their registry.

A task makes prompts and scores responses (`Task`). `TASKS` maps a `--task` name to its
class; `make_task(name, tokenizer, **options)` builds one. A task class with
`vision = True` needs a Qwen2-VL model and the multimodal glue (`train_app.multimodal`).

Adding a task: a module here with a class that has `prompts(seed)` (an endless, seeded
iterator of `rollout_engine.PromptSample`) and `reward(sample, trajectory) -> float`, then an
entry in `TASKS`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from rollout_engine import PromptSample, Trajectory

from train_app.tasks.repeat import RepeatTask
from train_app.tasks.scoring import partial_credit
from train_app.tasks.shapes import ShapeColorTask
from train_app.tasks.tool import ToolTask

__all__ = [
    "TASKS",
    "RepeatTask",
    "ShapeColorTask",
    "Task",
    "ToolTask",
    "all_tasks",
    "is_vision_task",
    "make_task",
    "partial_credit",
]


class Task(Protocol):
    name: str

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        """An endless, seeded stream of prompts."""
        ...

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float: ...


TASKS: dict[str, Any] = {"repeat": RepeatTask, "shapes": ShapeColorTask, "tool": ToolTask}
"""Built-in tasks by `--task` name."""


def all_tasks() -> dict[str, Any]:
    return dict(TASKS)


def is_vision_task(name: str) -> bool:
    """True for a task that needs a vision-language model (`vision = True` on its class)."""
    return bool(getattr(TASKS.get(name), "vision", False))


def make_task(name: str, tokenizer: Any, **options: Any) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name](tokenizer=tokenizer, **options)

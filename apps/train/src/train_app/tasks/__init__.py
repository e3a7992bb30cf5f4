"""Tasks: a prompt stream and a scorer (or an environment), whatever their source.

A task makes prompts and scores responses (`Task`). Every source becomes one:

- `--task NAME`: a task registered under the entry-point group `asyncrl.tasks` (the built-in
  `repeat`, `shapes` and `tool` register there in apps/train's pyproject.toml; an installed
  package adds its own the same way, `NAME = "module:factory"`);
- `--dataset PATH` with `--reward MODULE:FUNCTION` (`train_app.tasks.dataset`);
- `--env reasoning-gym:NAME` (`train_app.tasks.gym`);
- `--env verifiers:TARGET` (`train_app.tasks.verifiers_env`).

`make_task(name, tokenizer, **options)` builds one from its factory, called as
`factory(tokenizer=tokenizer, **options)`; `train_app.tasks.spec` turns a run's configuration
into that name and those options. A task class with `vision = True` needs a Qwen2-VL model and
the multimodal glue (`train_app.multimodal`).

A task has `prompts(seed)` (a seeded iterator of `rollout_engine.PromptSample` whose
`prompt_id`s never repeat) and `reward(sample, trajectory) -> float`; optionally
`environment(sample)` and `episode` (multi-turn), `metrics()` (extra scalars the rollout
actor reports, e.g. `reward/<component>`), and `sample_texts(count)` (its prompts' and
answers' text, which the default tiny tokenizer then covers: `train_app.tasks.vocabulary`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any, Protocol

from rollout_engine import PromptSample, Trajectory

from train_app.tasks.repeat import RepeatTask
from train_app.tasks.scoring import partial_credit
from train_app.tasks.shapes import ShapeColorTask
from train_app.tasks.tool import ToolTask

__all__ = [
    "ENTRY_POINT_GROUP",
    "TASKS",
    "RepeatTask",
    "ShapeColorTask",
    "Task",
    "ToolTask",
    "UnknownTask",
    "all_tasks",
    "is_vision_task",
    "make_task",
    "partial_credit",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "asyncrl.tasks"
"""Entry-point group an installed package registers its tasks under."""


class Task(Protocol):
    name: str

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        """A seeded stream of prompts (endless, or finite for a dataset capped by epochs)."""
        ...

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float: ...


TASKS: dict[str, Any] = {"repeat": RepeatTask, "shapes": ShapeColorTask, "tool": ToolTask}
"""The built-in tasks by name: what apps/train registers under `asyncrl.tasks` (used as is
only when the installed metadata predates the entry points, e.g. a stale editable install)."""

_SOURCES: dict[str, str] = {
    "dataset": "train_app.tasks.dataset:DatasetTask",
    "reasoning-gym": "train_app.tasks.gym:ReasoningGymTask",
    "verifiers": "train_app.tasks.verifiers_env:VerifiersTask",
}
"""Tasks made from `--dataset` / `--env` (not `--task` names: they need those flags)."""


class UnknownTask(ValueError):
    """A `--task` name no installed package registers."""


def all_tasks() -> dict[str, Any]:
    """Every `--task` name: the registered factories (loaded), by name."""
    found: dict[str, Any] = dict(TASKS)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            found[point.name] = point.load()
        except Exception as exc:  # a broken plugin must not hide the others
            logger.warning("task plugin %s (%s) failed to load: %s", point.name, point.value, exc)
    return found


def _factory(name: str) -> Any:
    if name in _SOURCES:
        module, _, attr = _SOURCES[name].partition(":")
        return getattr(__import__(module, fromlist=[attr]), attr)
    tasks = all_tasks()
    if name not in tasks:
        raise UnknownTask(f"unknown task {name!r}; available: {', '.join(sorted(tasks))}")
    return tasks[name]


def is_vision_task(name: str) -> bool:
    """True for a task that needs a vision-language model (`vision = True` on its class)."""
    if name in _SOURCES:
        return False
    return bool(getattr(all_tasks().get(name), "vision", False))


def make_task(name: str, tokenizer: Any, **options: Any) -> Task:
    """Build task `name` (a registered `--task` name, `dataset`, `reasoning-gym` or
    `verifiers`)."""
    return _factory(name)(tokenizer=tokenizer, **options)

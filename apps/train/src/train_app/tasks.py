"""Built-in verifiable tasks. A task makes prompts and scores responses.

`repeat` (default): prompt `d*k=`, answer: the digit d written k times, then EOS. A tiny
random-init model learns it by RL alone, but only with partial credit: an exact-match reward
gives no signal from scratch (measured, see design.md).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_engine import PromptSample, Trajectory

__all__ = ["TASKS", "RepeatTask", "Task", "all_tasks", "make_task"]


class Task(Protocol):
    name: str

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        """An endless, seeded stream of prompts."""
        ...

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float: ...


def partial_credit(output: str, target: str, ended: bool) -> float:
    """Correct positions / max(output, target length); halved when the model did not stop."""
    if not target and not output:
        return 1.0 if ended else 0.5
    correct = sum(a == b for a, b in zip(output, target, strict=False))
    score = correct / max(len(output), len(target))
    return score if ended else score / 2


@dataclass
class RepeatTask:
    """`d*k=` -> d repeated k times (k in 1..max_repeat)."""

    tokenizer: Any
    max_repeat: int = 6
    name: str = "repeat"

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        rng = random.Random(seed)
        index = 0
        while True:
            digit, count = rng.randrange(10), rng.randint(1, self.max_repeat)
            text = f"{digit}*{count}="
            yield PromptSample(
                prompt_id=f"s{seed}-{index}",
                prompt_ids=self.tokenizer.encode(text),
                answer=str(digit) * count,
                metadata={"text": text},
            )
            index += 1

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float:
        ids = list(trajectory.response_ids)
        ended = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        if ended:
            ids = ids[:-1]
        output = self.tokenizer.decode(ids)
        return partial_credit(output, sample.answer, ended)


TASKS = {"repeat": RepeatTask}


def all_tasks() -> dict[str, Any]:
    # Imported here: vision.py and tool_task.py import partial_credit from this module.
    from train_app.tool_task import TOOL_TASKS
    from train_app.vision import VISION_TASKS

    return {**TASKS, **VISION_TASKS, **TOOL_TASKS}


def make_task(name: str, tokenizer: Any, **options: Any) -> Task:
    tasks = all_tasks()
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(tasks)}")
    return tasks[name](tokenizer=tokenizer, **options)

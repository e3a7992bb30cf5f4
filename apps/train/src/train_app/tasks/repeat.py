"""`repeat` (the default task): prompt `d*k=`, answer: the digit d written k times, then EOS.

A tiny random-init model learns it by RL alone, but only with partial credit: an exact-match
reward gives no signal from scratch (measured: its reward stays at zero).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from rollout_engine import PromptSample, Trajectory

from train_app.tasks.scoring import partial_credit

__all__ = ["RepeatTask"]


@dataclass
class RepeatTask:
    """`d*k=` -> d repeated k times (k in 1..max_repeat)."""

    tokenizer: Any
    max_repeat: int = 6
    name: str = "repeat"
    vision: ClassVar[bool] = False

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        rng = random.Random(seed)
        index = 0
        while True:
            digit, count = rng.randrange(10), rng.randint(1, self.max_repeat)
            text = f"{digit}*{count}="
            yield PromptSample(
                prompt_id=f"s{seed}-{index}",
                prompt_token_ids=self.tokenizer.encode(text),
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

"""`repeat` (the default task): prompt `d*k=`, answer: the digit d written k times, then EOS.

A tiny random-init model learns it by RL alone, but only with partial credit: an exact-match
reward gives no signal from scratch (measured: its reward stays at zero).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
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
        return (sample for _, sample in self.stream_from(seed, 0))

    def stream_from(
        self, seed: int, position: int, skip: AbstractSet[str] = frozenset()
    ) -> Iterator[tuple[int, PromptSample]]:
        """`(position, prompt)` from `position` on: each prompt is drawn from its own
        `(seed, position)`, so a resume starts anywhere at once; `skip` ids are not built."""
        index = position
        while True:
            prompt_id = f"s{seed}-{index}"
            if prompt_id not in skip:
                yield index, self.prompt_at(seed, index)
            index += 1

    def prompt_at(self, seed: int, index: int) -> PromptSample:
        rng = random.Random(f"{seed}:{index}")
        digit, count = rng.randrange(10), rng.randint(1, self.max_repeat)
        text = f"{digit}*{count}="
        return PromptSample(
            prompt_id=f"s{seed}-{index}",
            prompt_token_ids=self.tokenizer.encode(text),
            answer=str(digit) * count,
            metadata={"text": text},
        )

    def position_of(self, seed: int, prompt_id: str) -> int | None:
        """The position of `prompt_id` in the stream of `seed` (None: another stream's)."""
        head, _, index = prompt_id.rpartition("-")
        return int(index) if head == f"s{seed}" and index.isdigit() else None

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float:
        ids = list(trajectory.response_ids)
        ended = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        if ended:
            ids = ids[:-1]
        output = self.tokenizer.decode(ids)
        return partial_credit(output, sample.answer, ended)

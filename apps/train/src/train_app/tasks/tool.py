"""`--task tool`: a two-turn task whose answer only a tool call can give.

Each prompt comes with its own secret lookup table (the letters a-j to random 3-digit
values) that the model never sees. The prompt is `k?` (a key letter). An episode:

    prompt      c?
    turn 1      the tool call: the first letter a-j the model writes is the key looked up
    observation =472         the tool's answer (the table's value of that key; `=?` if the
                             turn named no letter); in the sequence, never trained on
    turn 2      the answer: the value, then EOS

Reward (partial credit, as in `repeat`): 0.2 if the call named the prompt's key, plus
0.8 x `partial_credit(answer, value)` (correct positions / max length, halved without EOS).
Guessing cannot win: a wrong key returns another key's value. A tiny model learns it by
RL because both turns are copies (the key from the prompt, the digits from the observation).

The environment is a `SyncEnvironment` (plain methods): the rollouter runs it in its bounded
tool pool, off the event loop, as it would a real tool.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout_engine import EpisodeConfig, ModelTurn, PromptSample, StepResult, Trajectory

from train_app.tasks.scoring import partial_credit

__all__ = ["LookupEnvironment", "ToolTask"]

KEYS = "abcdefghij"
CALL_CREDIT = 0.2


def _parse_table(text: str) -> dict[str, str]:
    return dict(item.split(":", 1) for item in text.split(",") if item)


class LookupEnvironment:
    """One episode of the tool task (see the module docstring)."""

    def __init__(self, tokenizer: Any, sample: PromptSample) -> None:
        self._tokenizer = tokenizer
        self._key = sample.metadata["key"]
        self._value = sample.answer
        self._table = _parse_table(sample.metadata["table"])

    def reset(self, sample: PromptSample) -> list[int]:
        return []  # the prompt says it all

    def step(self, turn: ModelTurn) -> StepResult:
        ids = list(turn.token_ids)
        ended = bool(ids) and ids[-1] == self._tokenizer.eos_token_id
        text = self._tokenizer.decode(ids[:-1] if ended else ids)
        if turn.index == 0:
            called = next((c for c in text if c in KEYS), None)
            result = self._table.get(called, "?") if called is not None else "?"
            reward = CALL_CREDIT if called == self._key else 0.0
            return StepResult(observation=self._tokenizer.encode(f"={result}"), reward=reward)
        score = partial_credit(text, self._value, ended)
        return StepResult(reward=(1.0 - CALL_CREDIT) * score, done=True)


@dataclass
class ToolTask:
    """Prompts `k?`; the answer is the value of key k in the prompt's secret table."""

    tokenizer: Any
    value_digits: int = 3
    name: str = "tool"
    # Two turns (call, answer); short, so the 128-position tiny model has room.
    episode: EpisodeConfig = field(
        default_factory=lambda: EpisodeConfig(max_turns=2, max_total_tokens=48, tool_workers=2)
    )

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        rng = random.Random(seed)
        index = 0
        while True:
            table = {
                k: "".join(rng.choice("0123456789") for _ in range(self.value_digits)) for k in KEYS
            }
            key = rng.choice(KEYS)
            text = f"{key}?"
            yield PromptSample(
                prompt_id=f"s{seed}-{index}",
                prompt_token_ids=self.tokenizer.encode(text),
                answer=table[key],
                metadata={
                    "text": text,
                    "key": key,
                    "table": ",".join(f"{k}:{v}" for k, v in table.items()),
                },
            )
            index += 1

    def environment(self, sample: PromptSample) -> LookupEnvironment:
        return LookupEnvironment(self.tokenizer, sample)

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float:
        """The environment's summed rewards (already in `trajectory.reward`)."""
        return trajectory.reward


ToolTask.reward.blocking = False  # type: ignore[attr-defined]

"""`--env reasoning-gym:NAME[,NAME...]`: reasoning-gym's procedural datasets as a task.

Each prompt is a generated question of one of the named datasets (taken in turn), built by
reasoning-gym's own generator from a seed (offline, deterministic); the answer is scored by
that dataset's `score_answer`. Needs the app's `reasoning-gym` extra.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollout_engine import PromptSample, Trajectory

from train_app.tasks.dataset import format_prompt, prompt_text, resolve_template

__all__ = ["ReasoningGymTask", "check_names", "item_index"]

EXTRA_HINT = "install the app's `reasoning-gym` extra: pip install 'asyncrl-train[reasoning-gym]'"

DATASET_SIZE = 1_000_000
"""Questions per generator: its items are made on demand by index, so this only bounds the
stream before it wraps (far beyond any run here)."""


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            f"--env reasoning-gym needs the `reasoning-gym` package; {EXTRA_HINT}"
        ) from None
    return reasoning_gym


def item_index(seed: int, index: int) -> int:
    """The generator item of position `index` of the stream seeded `seed`."""
    return (seed * 7919 + index) % DATASET_SIZE


def check_names(names: Sequence[str]) -> None:
    """Raise `ValueError` naming the unknown datasets and listing the available ones."""
    available = sorted(_library().factory.DATASETS)
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(
            f"--env reasoning-gym: unknown dataset(s) {', '.join(unknown)}; available: "
            f"{', '.join(available)}"
        )


@dataclass
class ReasoningGymTask:
    """Questions of reasoning-gym datasets `names`, in turn; scored by their own scorers."""

    tokenizer: Any
    names: Sequence[str]
    seed: int = 0
    chat_template: str = "auto"
    system_prompt: str | None = None
    name: str = "reasoning-gym"
    vision: ClassVar[bool] = False
    _datasets: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        library = _library()
        check_names(self.names)
        self._datasets = {
            n: library.create_dataset(n, size=DATASET_SIZE, seed=self.seed) for n in self.names
        }
        self._template = resolve_template(self.tokenizer, self.chat_template)

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        """Replica streams are disjoint: `seed` (distinct per replica) picks the indices."""
        index = 0
        while True:
            name = self.names[index % len(self.names)]
            item = item_index(seed, index)
            entry = self._datasets[name][item]
            yield PromptSample(
                prompt_id=f"s{seed}-{index}",
                prompt_token_ids=format_prompt(
                    self.tokenizer, entry["question"], self._template, self.system_prompt
                ),
                answer=str(entry["answer"]),
                metadata={"dataset": name, "item": str(item)},
            )
            index += 1

    def sample_texts(self, count: int) -> Iterator[str]:
        """The text of `count` questions (the named datasets in turn, as the model reads them)
        and of their answers: what a tokenizer made for this task must cover."""
        for index in range(count):
            entry = self._datasets[self.names[index % len(self.names)]][index]
            yield prompt_text(self.tokenizer, entry["question"], self._template, self.system_prompt)
            yield str(entry["answer"])

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float:
        """The dataset's `score_answer` of the decoded response (runs in the reward pool)."""
        dataset = self._datasets[sample.metadata["dataset"]]
        entry = dataset[int(sample.metadata["item"])]
        ids = list(trajectory.response_ids)
        if ids and ids[-1] == self.tokenizer.eos_token_id:
            ids = ids[:-1]
        completion = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return float(dataset.score_answer(answer=completion, entry=entry))

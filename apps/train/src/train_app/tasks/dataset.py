"""`--dataset PATH`: a finite dataset file as an epoch-ordered prompt stream, scored by
`--reward` functions (`train_app.tasks.rewards`).

The file is JSONL, JSON, Parquet, or a `datasets.save_to_disk` directory, read through Hugging
Face `datasets` (the `datasets` extra; local files only). `prompt_field` holds a string or a
chat `messages` list; `answer_field` is optional; every other column reaches the reward as
`metadata`. Prompts are formatted with the tokenizer's chat template when it has one
(`chat_template="auto"`), never (`"none"`), or with a Jinja template file.

The stream: epoch e visits every row once, in an order shuffled by `(seed, e)`; replica
`shard` of `shards` takes every `shards`-th position of that order, so replicas never share a
prompt. Prompt ids are `e{epoch}-r{row}`: unique across epochs and replicas. With `epochs`
the stream ends after that many epochs; without, it repeats as long as the run needs.
`stream_from(seed, position)` starts the stream anywhere (a resume): it shuffles the epoch
of `position` and builds no prompt before it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rollout_engine import PromptSample, Trajectory

from train_app.tasks.rewards import RewardSet

__all__ = [
    "DatasetError",
    "DatasetTask",
    "check_dataset",
    "format_prompt",
    "load_rows",
    "prompt_text",
    "resolve_template",
]

# `position_of` keeps the inverse order of this many epochs (a row index array each).
_EPOCHS_PLACED = 4
EXTRA_HINT = "install the app's `datasets` extra: pip install 'asyncrl-train[datasets]'"


class DatasetError(ValueError):
    """A `--dataset` that cannot be used (missing, empty, no such field, unknown format)."""


def load_rows(path: str | Path) -> Any:
    """The rows of a local dataset file or `save_to_disk` directory (a `datasets.Dataset`)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"--dataset needs the `datasets` package; {EXTRA_HINT}") from None
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"--dataset {path}: no such file or directory")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bad file's error is one line, with no bar above it
    try:
        return _read_rows(datasets, path)
    finally:
        if bars:
            datasets.enable_progress_bars()


def _read_rows(datasets: Any, path: Path) -> Any:
    """`load_rows` of an existing path, by its format."""
    try:
        if path.is_dir():
            rows = datasets.load_from_disk(str(path))
            if isinstance(rows, datasets.DatasetDict):
                split = "train" if "train" in rows else next(iter(rows))
                rows = rows[split]
        elif path.suffix in (".jsonl", ".json"):
            rows = datasets.Dataset.from_json(str(path), keep_in_memory=True)
        elif path.suffix == ".parquet":
            rows = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
        else:
            raise DatasetError(
                f"--dataset {path}: unknown format {path.suffix!r} (use .jsonl, .json, "
                ".parquet or a save_to_disk directory)"
            )
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(
            f"--dataset {path}: cannot read it ({type(exc).__name__}: {exc})"
        ) from None
    return rows


def check_dataset(path: str | Path, prompt_field: str, answer_field: str | None) -> int:
    """Raise `DatasetError` for a dataset the run cannot use; returns its row count."""
    rows = load_rows(path)
    columns = list(rows.column_names)
    if len(rows) == 0:
        raise DatasetError(f"--dataset {path}: the dataset is empty")
    for flag, name in (("--prompt-field", prompt_field), ("--answer-field", answer_field)):
        if name is not None and name not in columns:
            raise DatasetError(
                f"--dataset {path}: no column {name!r} ({flag}); its columns: {', '.join(columns)}"
            )
    return len(rows)


def _plain_text(prompt: Any, system_prompt: str | None) -> str:
    if isinstance(prompt, str):
        text = prompt
    else:  # a messages list without a chat template: the contents, one per line
        text = "\n".join(str(m.get("content", "")) for m in prompt)
    return f"{system_prompt}\n{text}" if system_prompt else text


def prompt_text(
    tokenizer: Any, prompt: Any, template: str | None, system_prompt: str | None
) -> str:
    """The text of a prompt (a string or a messages list) as the model reads it: rendered
    with `template` (a Jinja chat template), or plain text (None)."""
    if template is None:
        return _plain_text(prompt, system_prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def format_prompt(
    tokenizer: Any, prompt: Any, template: str | None, system_prompt: str | None
) -> list[int]:
    """Token ids of a prompt (a string or a messages list). `template`: a Jinja chat template
    (None: plain text, encoded as the built-in tasks encode theirs)."""
    text = prompt_text(tokenizer, prompt, template, system_prompt)
    if template is None:
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, add_special_tokens=False))


def resolve_template(tokenizer: Any, chat_template: str) -> str | None:
    """`auto`: the tokenizer's own template if it has one; `none`: None; else a file's text."""
    if chat_template == "none":
        return None
    if chat_template == "auto":
        return getattr(tokenizer, "chat_template", None) or None
    return Path(chat_template).read_text()


def _metadata_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


@dataclass
class DatasetTask:
    """Prompts from a dataset file, scored by reward functions (see the module docstring)."""

    tokenizer: Any
    path: str
    rewards: Sequence[str]
    reward_weights: Sequence[float] = ()
    reward_timeout: float = 30.0
    reward_search_paths: Sequence[str] = ()
    prompt_field: str = "prompt"
    answer_field: str | None = "answer"
    chat_template: str = "auto"
    system_prompt: str | None = None
    seed: int = 0
    epochs: int | None = None
    shard: int = 0
    shards: int = 1
    name: str = "dataset"
    vision: ClassVar[bool] = False
    _rows: Any = field(init=False, repr=False)
    _scorer: RewardSet = field(init=False, repr=False)
    # epoch -> (row -> index in the epoch's order), for the last few epochs asked about
    _where: dict[int, Any] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._rows = load_rows(self.path)
        if self.answer_field is not None and self.answer_field not in self._rows.column_names:
            self.answer_field = None
        self._template = resolve_template(self.tokenizer, self.chat_template)
        self._scorer = RewardSet(
            self.rewards,
            self.reward_weights,
            timeout_s=self.reward_timeout,
            search_paths=self.reward_search_paths,
        )

    def epoch_order(self, epoch: int) -> Any:
        """Row indices of `epoch` in visiting order (all replicas together): a numpy array,
        a permutation seeded by `(seed, epoch)` (tens of ms for a million rows, so a resume
        into a new epoch does not wait on a Python shuffle)."""
        import numpy as np  # a dependency of torch and transformers, both the app's

        return np.random.default_rng([self.seed, epoch]).permutation(len(self._rows))

    def epoch_length(self, seed: int = 0) -> int:
        """Prompts per epoch of this replica's shard."""
        return len(range(self.shard, len(self._rows), self.shards))

    def prompts(self, seed: int) -> Iterator[PromptSample]:
        """The stream of this replica's shard (`seed`: unused; the order is `self.seed`'s)."""
        return (sample for _, sample in self.stream_from(seed, 0))

    def prompts_skipping(self, seed: int, skip: AbstractSet[str]) -> Iterator[PromptSample]:
        """`prompts(seed)` without the ids in `skip`, which are never read or tokenized."""
        return (sample for _, sample in self.stream_from(seed, 0, skip))

    def stream_from(
        self, seed: int, position: int, skip: AbstractSet[str] = frozenset()
    ) -> Iterator[tuple[int, PromptSample]]:
        """`(position, prompt)` of this shard's stream from `position` on (position counts
        across epochs); the rows before it and those in `skip` are never read or
        tokenized (what a resume passes over costs nothing, or a set lookup each)."""
        length = self.epoch_length()
        if length == 0:  # more replicas than rows: this shard has none
            return
        epoch, offset = divmod(position, length)
        while self.epochs is None or epoch < self.epochs:
            order = self.epoch_order(epoch)
            for cursor in range(offset, length):
                row = int(order[self.shard + cursor * self.shards])
                if f"e{epoch}-r{row}" not in skip:
                    yield epoch * length + cursor, self._sample(row, epoch)
            epoch, offset = epoch + 1, 0

    def position_of(self, seed: int, prompt_id: str) -> int | None:
        """The stream position of `prompt_id` (None: another shard's, or not a row id)."""
        epoch_text, _, row_text = prompt_id.partition("-r")
        if not (epoch_text[:1] == "e" and epoch_text[1:].isdigit() and row_text.isdigit()):
            return None
        epoch, row = int(epoch_text[1:]), int(row_text)
        if row >= len(self._rows):
            return None
        where = self._where.get(epoch)
        if where is None:
            import numpy as np

            if len(self._where) >= _EPOCHS_PLACED:
                self._where.clear()
            order = self.epoch_order(epoch)
            where = self._where[epoch] = np.empty_like(order)
            where[order] = np.arange(len(order))
        index = int(where[row])
        if index % self.shards != self.shard:
            return None
        return epoch * self.epoch_length() + index // self.shards

    def _row(self, index: int) -> dict[str, Any]:
        return dict(self._rows[index])

    def _sample(self, index: int, epoch: int) -> PromptSample:
        row = self._row(index)
        prompt = row[self.prompt_field]
        answer = row.get(self.answer_field) if self.answer_field else None
        extra = {k: _metadata_text(v) for k, v in row.items() if k not in self._fields()}
        return PromptSample(
            prompt_id=f"e{epoch}-r{index}",
            prompt_token_ids=format_prompt(
                self.tokenizer, prompt, self._template, self.system_prompt
            ),
            answer="" if answer is None else str(answer),
            metadata=extra,
        )

    def sample_texts(self, count: int) -> Iterator[str]:
        """The text of the first `count` prompts of epoch 0 (as the model reads them) and of
        their answers: what a tokenizer made for this dataset must cover."""
        for index in self.epoch_order(0)[:count]:
            row = self._row(index)
            yield prompt_text(
                self.tokenizer, row[self.prompt_field], self._template, self.system_prompt
            )
            if self.answer_field and row.get(self.answer_field) is not None:
                yield str(row[self.answer_field])

    def close(self) -> None:
        """Stop the reward functions' threads (a task made only to read its prompts)."""
        self._scorer.close()

    def _fields(self) -> set[str]:
        return {self.prompt_field, self.answer_field} - {None}

    def reward(self, sample: PromptSample, trajectory: Trajectory) -> float:
        """Runs in the rollouter's reward executor (blocking: it waits for the functions)."""
        row = self._row(int(sample.prompt_id.rpartition("-r")[2]))
        ids = list(trajectory.response_ids)
        finished = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        text_ids = ids[:-1] if finished else ids
        return self._scorer.score(
            completion=self.tokenizer.decode(text_ids, skip_special_tokens=True),
            prompt=row[self.prompt_field],
            answer=sample.answer,
            metadata={k: v for k, v in row.items() if k not in self._fields()},
            finished=finished,
            completion_ids=ids,
        )

    def metrics(self) -> dict[str, float]:
        """`reward/<component>` means since the last call."""
        return self._scorer.metrics()

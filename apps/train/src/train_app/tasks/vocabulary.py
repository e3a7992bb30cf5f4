"""The characters of a task's text, for the default tiny model's tokenizer.

The tiny model's character vocabulary covers the built-in tasks' text only. A task that can
show its text, `sample_texts(count)` (its first prompts as the model reads them, chat
template and system prompt included, and their answers: the `--dataset`, reasoning-gym and
verifiers tasks, and any plugin task that defines it), gets a tiny model with one more token
for each new character of that sample, so its prompts are not `<unk>`. The built-in tasks
define none: their model is the default one, unchanged.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

from train_app.config import TrainConfig

__all__ = ["VOCABULARY_SAMPLE", "task_characters"]

VOCABULARY_SAMPLE = 1000
"""Prompts (each with its answer) whose characters the tokenizer covers."""


def task_characters(config: TrainConfig, run_dir: Path, count: int = VOCABULARY_SAMPLE) -> str:
    """Every character of the first `count` prompts and answers of the run's task, sorted;
    "" for a task without `sample_texts`. Blocking (it builds the task: imports its library,
    reads its data), so never on an event loop."""
    from tiny_models import build_char_tokenizer

    from train_app.tasks import _factory, make_task
    from train_app.tasks.spec import task_name, task_options

    name = task_name(config)
    if not hasattr(_factory(name), "sample_texts"):
        return ""
    with tempfile.TemporaryDirectory() as scratch:
        # The task reads its prompts through the tokenizer the tiny model starts from.
        tokenizer = build_char_tokenizer(Path(scratch))
    task = make_task(name, tokenizer, **task_options(config, run_dir))
    try:
        texts = itertools.islice(task.sample_texts(count), 2 * count)
        return "".join(sorted({c for text in texts for c in text}))
    finally:
        close = getattr(task, "close", None)
        if callable(close):
            close()

"""Which checkpoint a `--resume` continues from, chosen before Ray starts.

Every checkpoint's manifest lists its files (the trainer's tensors and state, and the side
files the app reads back: the queue's and each replica's in-flight groups, the pending
metrics rows) with sizes and checksums, and labels naming the model it was written for
(`model_labels`: its architecture and sizes). A checkpoint whose manifest does not match
its files, or whose labels are another model's, is passed over for the previous kept one,
with one warning that says what was wrong; with none usable the run ends with one line."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

from train_app.driver.errors import RunFailed

__all__ = ["MODEL_LABEL", "MODEL_SIZE_KEYS", "choose_checkpoint", "model_labels"]

logger = logging.getLogger(__name__)

# The manifest label that names the model a checkpoint was written for.
MODEL_LABEL = "model"
# The model config's fields that fix every tensor's shape: a checkpoint of a model that
# differs in any of them cannot be loaded (two models equal in all of them can, on purpose:
# a resume may point --model at a copy of the same weights elsewhere).
MODEL_SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)


def model_labels(model_dir: str | Path) -> dict[str, str]:
    """The checkpoint labels of the HF model in `model_dir` (from its config.json): its
    architecture and the sizes of its language model, e.g. `{"model": "Qwen2ForCausalLM
    hidden_size=64 ..."}`. The trainer writes them into every manifest; a resume expects
    those of its own model."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or config
    architecture = ",".join(config.get("architectures") or [config.get("model_type", "?")])
    sizes = " ".join(f"{k}={text.get(k, config.get(k))}" for k in MODEL_SIZE_KEYS)
    return {MODEL_LABEL: f"{architecture} {sizes}"}


def choose_checkpoint(run_dir: Path, labels: Mapping[str, str]) -> Path:
    """The newest usable checkpoint of `run_dir` for the model of `labels`. The newer ones
    passed over are named with what was wrong, in one warning; with none usable, `RunFailed`
    says why in one line. Reads no tensors, starts nothing."""
    from ppo_trainer import find_usable_checkpoint

    checkpoints = run_dir / "checkpoints"
    with _quiet(logging.getLogger(find_usable_checkpoint.__module__)):  # one warning: ours
        search = find_usable_checkpoint(checkpoints, expect_labels=labels)
    problems = "; ".join(f"{path.name}: {problem}" for path, problem in search.rejected)
    if search.path is None:
        if not search.rejected:
            raise RunFailed(f"--resume {run_dir}: no checkpoint in {checkpoints}")
        raise RunFailed(f"--resume {run_dir}: no usable checkpoint ({problems})")
    if search.rejected:
        logger.warning(
            "resuming from %s, the newest usable checkpoint, not %s", search.path.name, problems
        )
    return search.path


@contextlib.contextmanager
def _quiet(target: logging.Logger) -> Iterator[None]:
    level = target.level
    target.setLevel(logging.ERROR)
    try:
        yield
    finally:
        target.setLevel(level)

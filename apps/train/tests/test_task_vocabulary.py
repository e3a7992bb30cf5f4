"""The default tiny model's tokenizer covers the run's task text: a task that shows its text
(`sample_texts`: `--dataset`, `--env`) gets one token per new character, appended after the
default vocabulary; the built-in tasks keep the default model byte for byte (their learning
figures were measured on it); a rebuilt or resumed run gets the same vocabulary. Real
tokenizers, real `datasets`, real reasoning-gym; no engine. Costs about 20 s (mostly
imports; the reasoning-gym test ~2 s after them)."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import replace
from itertools import islice
from pathlib import Path

import pytest
from train_app.config import TrainConfig
from train_app.driver.startup import ensure_model
from train_app.models import load_tokenizer
from train_app.tasks import RepeatTask, make_task
from train_app.tasks import vocabulary as vocabulary_module
from train_app.tasks.spec import task_options
from train_app.tasks.vocabulary import task_characters
from train_app.tiny_model import ALPHABET, SPECIAL_TOKENS, build_char_tokenizer
from transformers import AutoConfig, AutoTokenizer

# The default vocabulary, id by id.
DEFAULT_VOCAB = {
    **{token: i for i, token in enumerate(SPECIAL_TOKENS)},
    **{c: 3 + i for i, c in enumerate(" *+,-0123456789=?abcdefghij")},
}
# The default model's files for seed 0 (under the locked torch / transformers / tokenizers):
# the built-in tasks' learning figures were measured on exactly these.
DEFAULT_SHA256 = {
    "tokenizer.json": "358b5bd1934c67b60d23f801c3d9fe53aaee99d05115b749647c41a9226df411",
    "model.safetensors": "768da37ccfa2766dcbbad34572e1db69c998702320a3f46afb1becf4cfbf31be",
}
ROWS = [
    {"prompt": "What is 7/2? (Round down.)", "answer": "3"},
    {"prompt": "Quote: «Zürich» — twice", "answer": "ZZ"},
    {"prompt": "Two lines:\n\nsecond", "answer": "Ok!"},
]


def _dataset(tmp_path: Path) -> TrainConfig:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    reward = tmp_path / "score.py"
    reward.write_text("def exact(completion, answer):\n    return float(completion == answer)\n")
    return TrainConfig(dataset=data, reward=(f"{reward}:exact",), system_prompt="Solve [it]")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("task", ["repeat", "tool"])
def test_builtin_tasks_keep_the_default_model(tmp_path: Path, task: str) -> None:
    config = TrainConfig(task=task)
    assert task_characters(config, tmp_path) == ""  # no task built, nothing sampled
    model_dir = ensure_model(config, tmp_path)
    assert AutoTokenizer.from_pretrained(model_dir).get_vocab() == DEFAULT_VOCAB
    assert AutoConfig.from_pretrained(model_dir).vocab_size == len(DEFAULT_VOCAB)
    assert {name: _sha256(model_dir / name) for name in DEFAULT_SHA256} == DEFAULT_SHA256


def test_a_dataset_within_the_default_characters_keeps_the_default_model(tmp_path: Path) -> None:
    """Example (a), the repeat task as a JSONL file: no new character, the same model as
    `--task repeat` (whose learning it must match)."""
    root = Path(__file__).resolve().parents[3] / "examples" / "repeat-jsonl"
    reward = (f"{root / 'reward.py'}:repeat_reward",)
    model_dir = ensure_model(TrainConfig(dataset=root / "repeat.jsonl", reward=reward), tmp_path)
    assert {name: _sha256(model_dir / name) for name in DEFAULT_SHA256} == DEFAULT_SHA256


def test_the_default_model_reads_the_builtin_tasks_as_auto_tokenizer_does(tmp_path: Path) -> None:
    """The run loads the tiny tokenizer as saved (`load_tokenizer`), where `AutoTokenizer`
    rebuilds a qwen2 one as byte-level BPE; on the built-in tasks' prompts, observations and
    any response the two agree token for token, so the default run is unchanged."""
    model_dir = ensure_model(TrainConfig(), tmp_path)
    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours).__name__ != type(auto).__name__  # the two loaders do differ
    texts = [s.metadata["text"] for s in islice(RepeatTask(ours).prompts(0), 200)]
    texts += [f"{k}?" for k in "abcdefghij"] + [f"={n}" for n in range(100, 1000, 37)]
    assert [ours.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(DEFAULT_VOCAB)) for _ in range(rng.randint(1, 12))]
        assert ours.decode(ids) == auto.decode(ids), ids
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(
            ids, skip_special_tokens=True
        )


def test_a_dataset_with_new_characters_gets_a_tokenizer_that_covers_it(tmp_path: Path) -> None:
    config = _dataset(tmp_path)
    model_dir = ensure_model(config, tmp_path / "run")
    tokenizer = load_tokenizer(model_dir)
    vocab = tokenizer.get_vocab()
    assert AutoConfig.from_pretrained(model_dir).vocab_size == len(tokenizer) == len(vocab)
    # The default ids stay; the new characters (the system prompt's and the line break
    # included) follow them in sorted order.
    assert {t: vocab[t] for t in DEFAULT_VOCAB} == DEFAULT_VOCAB
    text = "".join(r["prompt"] + r["answer"] for r in ROWS) + "\n" + config.system_prompt
    new = sorted(set(text) - set(ALPHABET))
    assert [vocab[c] for c in new] == list(range(len(DEFAULT_VOCAB), len(vocab)))
    # The task's prompts (as the run streams them) and its answers have no `<unk>`, and
    # decode back to their text one token per character.
    task = make_task("dataset", tokenizer, **task_options(config, tmp_path))
    try:
        for sample in islice(task.prompts(0), len(ROWS)):
            assert tokenizer.unk_token_id not in sample.prompt_token_ids
            assert tokenizer.unk_token_id not in tokenizer.encode(sample.answer)
        sample = next(iter(task.prompts(0)))
        prompt = tokenizer.decode(sample.prompt_token_ids)
        assert prompt.startswith("Solve [it]\n") and len(prompt) == len(sample.prompt_token_ids)
    finally:
        task.close()


def test_the_vocabulary_is_deterministic_and_a_resume_reuses_the_saved_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _dataset(tmp_path)
    first, second = (ensure_model(config, tmp_path / name) for name in ("a", "b"))
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert _sha256(first / name) == _sha256(second / name), name

    def no_sampling(*_: object) -> str:
        raise AssertionError("a run dir with a model must not rebuild it")

    monkeypatch.setattr(vocabulary_module, "task_characters", no_sampling)
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    resumed = ensure_model(replace(config, resume=tmp_path / "a"), tmp_path / "a")
    assert resumed == first and (first / "tokenizer.json").stat().st_mtime_ns == stamp


def test_the_reasoning_gym_example_encodes_without_unk(tmp_path: Path) -> None:
    """The `examples/README.md` command `--env reasoning-gym:basic_arithmetic`: the questions
    (`Calculate ... / ( ) .`) and answers of each replica's stream."""
    config = TrainConfig(env="reasoning-gym:basic_arithmetic")
    tokenizer = load_tokenizer(ensure_model(config, tmp_path))
    default = build_char_tokenizer(tmp_path / "default")
    task = make_task("reasoning-gym", tokenizer, **task_options(config, tmp_path))
    for seed in (config.seed, config.seed + 1):
        for sample in islice(task.prompts(seed), 200):
            assert tokenizer.unk_token_id not in sample.prompt_token_ids
            assert tokenizer.unk_token_id not in tokenizer.encode(sample.answer)
    question = tokenizer.decode(next(iter(task.prompts(0))).prompt_token_ids)
    assert question.startswith("Calculate ")
    assert default.unk_token_id in default.encode(question)  # what the default makes of it


class _WordsTask:
    """A plugin-style task that shows its text (registered by the test, not installed)."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer

    def sample_texts(self, count: int):
        return iter(["Hello, World!", "Yes"][: 2 * count])


def test_a_plugin_task_with_sample_texts_gets_its_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import train_app.tasks as tasks

    monkeypatch.setitem(tasks.TASKS, "words", _WordsTask)
    config = TrainConfig(task="words")
    assert task_characters(config, tmp_path) == "".join(sorted(set("Hello, World!Yes")))
    tokenizer = load_tokenizer(ensure_model(config, tmp_path))
    assert tokenizer.unk_token_id not in tokenizer.encode("Hello, World! Yes")

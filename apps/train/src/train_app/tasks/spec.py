"""A run's configuration as one task: its name, its constructor options, its input checks.

`--task NAME`, `--dataset PATH` + `--reward`, and `--env LIBRARY:...` all end as a name for
`make_task` and the keyword options of its factory; the driver and the rollout actors handle
every source the same way. `check_task_inputs` rejects what cannot work with a one-line
message before Ray starts.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from train_app.config import TrainConfig

__all__ = [
    "ENV_LIBRARIES",
    "VERIFIERS_MAX_TOTAL_TOKENS",
    "check_task_inputs",
    "eval_task",
    "parse_env",
    "task_name",
    "task_options",
]

logger = logging.getLogger(__name__)

ENV_LIBRARIES = ("reasoning-gym", "verifiers")
"""Environment libraries `--env LIBRARY:NAMES` can use."""

VERIFIERS_MAX_TOTAL_TOKENS = 128
"""Tokens of one verifiers episode (prompt, turns, observations) without `--max-model-len`:
the default tiny model's context."""


def parse_env(spec: str, flag: str = "--env") -> tuple[str, tuple[str, ...]]:
    """`"reasoning-gym:leg_counting,gcd"` -> `("reasoning-gym", ("leg_counting", "gcd"))`;
    `"verifiers:path/to/env.py"` -> `("verifiers", ("path/to/env.py",))` (one target);
    `flag` names the option in the error."""
    library, _, rest = spec.partition(":")
    if library not in ENV_LIBRARIES:
        raise ValueError(
            f"{flag} {spec}: unknown library {library!r}; available: {', '.join(ENV_LIBRARIES)}"
        )
    if library == "verifiers":
        target = rest.strip()
        if not target:
            raise ValueError(f"{flag} {spec}: name the environment, verifiers:MODULE|FILE.py")
        return library, (target,)
    names = tuple(n.strip() for n in rest.split(",") if n.strip())
    if not names:
        raise ValueError(f"{flag} {spec}: name at least one dataset, {library}:NAME[,NAME...]")
    return library, names


def task_name(config: TrainConfig) -> str:
    """The `make_task` name of the run's task."""
    if config.dataset is not None:
        return "dataset"
    if config.env is not None:
        return parse_env(config.env)[0]
    return config.task


def task_options(
    config: TrainConfig, run_dir: Path, replica: int = 0, replicas: int = 1
) -> dict[str, Any]:
    """Keyword options of the run's task factory for rollout replica `replica` of `replicas`
    (finite sources shard their prompts by replica)."""
    from train_app.tasks import is_vision_task

    formatting = {"chat_template": _template(config), "system_prompt": config.system_prompt}
    if config.dataset is not None:
        options = _dataset_options(config, config.dataset, epochs=config.epochs)
        return {**options, "shard": replica, "shards": replicas}
    if config.env is not None:
        library, names = parse_env(config.env)
        if library == "verifiers":
            return {
                "target": _absolute_target(names[0]),
                "seed": config.seed,
                # An episode (every turn and observation) fits the model's context.
                "max_total_tokens": config.max_model_len or VERIFIERS_MAX_TOTAL_TOKENS,
                **formatting,
            }
        return {"names": names, "seed": config.seed, **formatting}
    if is_vision_task(config.task):
        return {"image_dir": str(run_dir / "images"), "corrupt_fraction": config.corrupt_images}
    return {}


def eval_task(config: TrainConfig) -> tuple[str, dict[str, Any]] | None:
    """The `make_task` name and options of the run's held-out set (`--eval-dataset`,
    `--eval-env`), read whole and in one order (no shards, one epoch); None without one."""
    formatting = {"chat_template": _template(config), "system_prompt": config.system_prompt}
    if config.eval_env is not None:
        names = parse_env(config.eval_env, flag="--eval-env")[1]
        return "reasoning-gym", {"names": names, "seed": config.seed, **formatting}
    if config.eval_dataset is None:
        return None
    return "dataset", _dataset_options(config, config.eval_dataset, epochs=1)


def _dataset_options(config: TrainConfig, path: str | Path, epochs: int | None) -> dict[str, Any]:
    """Options of a `dataset` task reading `path`, scored by the run's `--reward` functions."""
    return {
        "path": str(Path(path).resolve()),
        "rewards": tuple(_absolute_reward(r) for r in config.reward),
        "reward_weights": tuple(config.reward_weights),
        "reward_timeout": config.reward_timeout,
        # `MODULE:FUNCTION` imports as it would where the run was started.
        "reward_search_paths": (os.getcwd(),),
        "prompt_field": config.prompt_field,
        "answer_field": config.answer_field,
        "seed": config.seed,
        "epochs": epochs,
        "chat_template": _template(config),
        "system_prompt": config.system_prompt,
    }


def _template(config: TrainConfig) -> str:
    if config.chat_template in ("auto", "none"):
        return config.chat_template
    return str(Path(config.chat_template).resolve())


def _absolute_target(target: str) -> str:
    """A `.py` file target as an absolute path (the rollout actors run elsewhere)."""
    return str(Path(target).resolve()) if target.endswith(".py") else target


def _absolute_reward(spec: str) -> str:
    target, sep, function = spec.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{Path(target).resolve()}:{function}"
    return spec


def check_task_inputs(config: TrainConfig) -> None:
    """Raise `ValueError` (one line) for task inputs that cannot work; imports and reads
    what it must (the dataset, the reward modules), before any actor exists."""
    from train_app.tasks import UnknownTask, all_tasks

    if config.dataset is not None and config.env is not None:
        raise ValueError("--dataset and --env are two task sources: give one")
    if (config.dataset is not None or config.env is not None) and config.task != "repeat":
        raise ValueError(f"--task {config.task} with --dataset/--env: give one task source")
    if config.reward and config.env is not None:
        raise ValueError(
            "--reward with --env: the environment scores its own answers; drop --reward"
        )
    if config.chat_template not in ("auto", "none") and not Path(config.chat_template).is_file():
        raise ValueError(f"--chat-template {config.chat_template}: not auto, none or a file")
    if config.epochs is not None and config.epochs < 1:
        raise ValueError("--epochs must be at least 1")
    if config.reward_timeout <= 0:
        raise ValueError("--reward-timeout must be > 0")
    _check_eval_inputs(config)
    if config.dataset is not None:
        _check_dataset_run(config)
    elif config.reward and config.eval_dataset is None:
        raise ValueError("--reward scores a --dataset; give --dataset PATH")
    elif config.env is not None:
        _check_env(config.env)
    elif config.task not in all_tasks():
        raise UnknownTask(f"--task {config.task}: available: {', '.join(sorted(all_tasks()))}")


def _check_dataset_run(config: TrainConfig) -> None:
    from train_app.tasks.dataset import check_dataset
    from train_app.tasks.rewards import RewardSet

    if not config.reward:
        raise ValueError("--dataset needs at least one --reward MODULE:FUNCTION")
    # The default answer column may be absent (a reward that needs none); a named one may not.
    answer = None if config.answer_field == "answer" else config.answer_field
    rows = check_dataset(config.dataset, config.prompt_field, answer)
    if config.epochs is not None and config.steps * config.batch_size > rows * config.epochs:
        raise ValueError(
            f"--steps {config.steps} x --batch-size {config.batch_size} needs "
            f"{config.steps * config.batch_size} prompts; {config.epochs} epoch(s) of "
            f"{rows} rows give {rows * config.epochs}: lower --steps or raise --epochs"
        )
    specs = tuple(_absolute_reward(r) for r in config.reward)
    RewardSet(specs, config.reward_weights, search_paths=(os.getcwd(),)).close()


def _check_eval_inputs(config: TrainConfig) -> None:
    """The held-out set's file or environment, its rewards, and its overlap with training
    (a warning with the count)."""
    from train_app.evaluation import check_overlap
    from train_app.tasks.dataset import check_dataset
    from train_app.tasks.rewards import RewardSet

    if not config.evaluates:
        return
    try:
        if config.eval_env is not None:
            _check_env(config.eval_env)
        else:
            answer = None if config.answer_field == "answer" else config.answer_field
            check_dataset(config.eval_dataset, config.prompt_field, answer)  # type: ignore[arg-type]
    except ValueError as exc:  # their messages name the training flags
        text = str(exc)
        for flag in ("--dataset", "--env"):
            if text.startswith(flag):
                text = "--eval-" + text[2:]
        raise ValueError(text) from None
    if config.eval_dataset is not None and config.dataset is None:
        specs = tuple(_absolute_reward(r) for r in config.reward)
        RewardSet(specs, config.reward_weights, search_paths=(os.getcwd(),)).close()
    overlap = check_overlap(config)
    if overlap is not None and overlap[0]:
        found, checked, training = overlap
        logger.warning(
            "%s: %d of its %d held-out prompts are also training prompts (%s); "
            "its figures then include prompts the model trained on",
            f"--eval-dataset {config.eval_dataset}"
            if config.eval_dataset is not None
            else f"--eval-env {config.eval_env}",
            found,
            checked,
            training,
        )


def _check_env(spec: str) -> None:
    library, names = parse_env(spec)
    if library == "reasoning-gym":
        from train_app.tasks.gym import check_names

        check_names(names)
    elif library == "verifiers":
        from train_app.tasks.verifiers_env import check_target

        check_target(_absolute_target(names[0]))

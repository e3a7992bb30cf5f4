"""`plan(TrainConfig) -> RunPlan`: every package's configuration of a run, in one place.

The command line (`TrainConfig`) says what the user wants; this module turns it into the
exact configuration objects the packages take: the queue's size, one `RolloutConfig` and one
`VLLMEngineConfig` per rollout replica, the trainer's `PPOConfig`. Every hyperparameter a run
uses is either a `TrainConfig` field or a named constant below; the actors only read their
plan. `plan` is pure (no Ray, no torch, no file access): what it needs from the disk (the
model's directory and context length, the resume point) is passed in.

How the batch is split. The trainer consumes `batch_size` groups per step; replica `i`
admits `shares[i]` of them per weight version, where the shares differ by at most one and sum
to `batch_size` (the remainder goes to the first replicas). Each replica's admission budget
is `(k + 1 + v) * shares[i] - ...`, so the replicas together admit exactly
`(k + 1 + v) * batch_size`: the trainer is never short of a batch (a lost remainder made
`--rollout-replicas 3 --batch-size 16` stall) and never runs more than k versions ahead.

The trainer's ranks. `--trainer-workers N` gives N `TrainerPlan`s (`RunPlan.trainer_ranks`),
equal but for `rank` and `cpu`; rank 0 reads the queue, pushes weights and writes
checkpoints, and with N > 1 every rank joins one torch.distributed group whose address rank 0
chooses at run time (its node's IP and a free port: only the running cluster knows where
rank 0 landed). N = 1 is the one-process trainer, without torch.distributed.

Where the actors run. `--rollout-resources` / `--trainer-resources` (`NAME=AMOUNT,...`) become
each actor's Ray resource request (`actor_options`): `CPU` and `GPU` are its `num_cpus` /
`num_gpus` (default: one CPU, no GPU), any other name a custom resource that only the nodes
started with it have (`ray start --resources '{"node2": 1}'`), so Ray places the actor there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from ppo_trainer import PPOConfig
from rollout_engine import RolloutSnapshot, SamplingConfig, StalenessBound
from rollout_engine.rollouter import RolloutConfig
from rollout_engine.vllm_engine import VLLMEngineConfig

from train_app.config import TrainConfig, parse_resources
from train_app.evaluation import EvalPlan
from train_app.inflight import QueuedGroups, deal_count, redistribute, restored_prompt_ids
from train_app.tasks.spec import eval_task, task_name, task_options

__all__ = [
    "DP_STRATEGY",
    "DP_TIMEOUT_S",
    "MAX_MODEL_LEN_CAP",
    "MIN_CONSUMED_IDS_KEPT",
    "ReplicaPlan",
    "ResumePoint",
    "RunPlan",
    "StalenessBound",
    "TrainerPlan",
    "actor_options",
    "consumed_ids_kept",
    "eval_prompt_seed",
    "max_model_len",
    "plan",
    "queue_maxsize",
    "ray_num_cpus",
    "split_batch",
    "staleness_bound",
]

# Context length given to vLLM without --max-model-len: the model's own, capped (a tiny
# model's KV cache stays small).
MAX_MODEL_LEN_CAP = 2048
# Sequences vLLM schedules at once: at least every response of every group in flight.
MIN_ENGINE_SEQS = 64
# Queue head-room in batches beyond the k + 1 versions admission may fill: a put never
# blocks in the normal case, and a burst of deliveries after a push fits.
QUEUE_SPARE_BATCHES = 1
# Keep the last checkpoints on disk (older ones are deleted when a new one is written).
KEEP_CHECKPOINTS = 2
# Data-parallel strategy of a trainer of N > 1 ranks: `auto` is DDP on gloo (CPU ranks share
# the host's RAM, so sharding saves nothing, and FSDP2 would add collectives per layer) and
# FSDP2 on NCCL (GPU); see packages/ppo-trainer/README.md, "Data parallel".
DP_STRATEGY = "auto"
# Seconds a rank waits in torch.distributed (the rendezvous, any collective) before failing;
# the driver sees a dead rank at once and ends the run, so this is only a backstop.
DP_TIMEOUT_S = 600.0

# Where actors run when pinned (one replica, a core per actor): the engine on core 0, trainer
# rank r on TRAINER_CORE + r, so neither steals the other's core.
ENGINE_CORE = 0
TRAINER_CORE = 1
# Replica i's prompt stream is seeded `seed * PROMPT_SEED_STRIDE + i`: distinct per replica
# and per run seed for up to this many replicas.
PROMPT_SEED_STRIDE = 1000
# The trainer keeps the ids of this many recent groups (`PPOTrainer(consumed_ids_kept=)`, and
# its queue reader's duplicate guard): at least this many, more for large batches (see
# `consumed_ids_kept`). A constant, so memory and checkpoints do not grow with the run.
MIN_CONSUMED_IDS_KEPT = 1024
# Ray `max_concurrency` of a rollout actor: its rollout loop, weight pushes, metric polls and
# stop all wait on it at once; every call is async, so this only caps waiting calls.
ROLLOUT_ACTOR_MAX_CONCURRENCY = 64
# Ray `max_concurrency` of a trainer actor: train(), metric drains, hand-offs and stop at once.
TRAINER_ACTOR_MAX_CONCURRENCY = 16
# Token id padding batches when the tokenizer has none: padded positions are masked out of
# every loss term, so any valid id serves.
FALLBACK_PAD_TOKEN_ID = 0

# Sampling: plain temperature sampling over the whole vocabulary (on-policy log-probs need
# the unmodified distribution), stopping at EOS. Requests are unseeded unless
# `--deterministic` (then each group's seed derives from `--seed` and its prompt id):
# seeded requests cost vLLM a generator per request.
TOP_P = 1.0
TOP_K = -1
SAMPLING_SEED = None
IGNORE_EOS = False

# Evaluation: the held-out stream's seed is the last of the run's block of replica seeds
# (no training replica has it below PROMPT_SEED_STRIDE replicas), and each replica keeps
# this many held-out groups in flight: enough to batch in the engine, few enough to leave
# training's requests the larger share of it.
EVAL_SEED_IN_STRIDE = PROMPT_SEED_STRIDE - 1
EVAL_CONCURRENCY = 8

# Rollouter: fresh pacing's relative head-room on the measured batch generation latency
# (admit a bit early rather than leave the trainer waiting).
PACING_MARGIN = 0.25
# Drop vLLM's prefix cache at a weight load: cached KV of the old weights is wrong.
CLEAR_CACHE_ON_PAUSE = True
# Threads running the reward function off the event loop: the tasks' rewards are cheap.
REWARD_WORKERS = 1
# Seconds a rollouter's stop waits for its cancelled tasks to unwind.
ROLLOUT_STOP_TIMEOUT_S = 10.0
# Groups failing in a row before a rollouter gives up: a broken engine, not bad luck.
MAX_CONSECUTIVE_FAILURES = 32
# Failed groups a rollouter keeps in memory for failures.json (counts are kept for all).
RECENT_FAILURES_KEPT = 256

# A trainer consumes every group and advances the version: admission keeps its budget.
GENERATION_ONLY = False
# Seconds admission may wait on the budget with no new version before a rollouter warns
# (once per stall): far above a step on this app's CPU models, so only a stuck trainer.
STALL_WARNING_S = 120.0
# A group too stale to deliver gives its prompt back to the stream, so no prompt of an epoch
# is lost to staleness.
RETRY_STALE_GROUPS = True

# vLLM engine: float32 keeps behaviour log-probs comparable with the float32 trainer to ~1e-6.
ENGINE_DTYPE = "float32"
# KV cache of each engine (GiB): enough for a tiny model's groups on CPU.
KV_CACHE_GIB = 1.0
# No CUDA graphs / compilation: weights change every step and start-up time matters more.
ENFORCE_EAGER = True
# Prompts of a group share their prefix; the cache is cleared at every weight load.
PREFIX_CACHING = True
# Log-probs after temperature: what the trainer's importance ratios compare against.
LOGPROBS_MODE = "processed_logprobs"
# The vLLM worker extension that loads pushed weights in place.
WEIGHT_SYNC_EXTENSION = "rollout_engine.vllm_worker.WeightSyncWorkerExtension"
# Weights reach the engine as one flat file in SHM_DIR, mapped by the worker: fewest copies.
WEIGHT_TRANSPORT = "flat"
SHM_DIR = "/dev/shm"
# One warm-up generation at start-up, so the first real step does not pay for it.
ENGINE_WARMUP = True
# vLLM's torch.compile'd sampler helper runs eagerly: no tracing or kernel build at start.
COMPILE_VLLM_HELPERS = False
# Threads serializing weights off the engine host's event loop (one push at a time).
ENGINE_IO_THREADS = 1
# Tokens per streamed delta: fewer deltas cost less CPU per token, and version stamps stay
# exact either way.
STREAM_INTERVAL = 8
# The engine core ends with its actor however the actor dies (no orphaned engine core).
ENGINE_TIED_TO_HOST = True
# Seconds an engine's close lets its engine-core process exit before killing it. The core
# holds nothing to save, and its own teardown takes ~3 s after SIGTERM on CPU, so any grace
# under that ends in the kill anyway: a short one ends every run sooner.
ENGINE_SHUTDOWN_TIMEOUT_S = 0.5

# Trainer (PPO/GRPO): no weight decay, Adam's usual moments, no warm-up (tiny learning rates
# and one pass per batch: nothing to stabilise), one minibatch and one micro-batch per step.
WEIGHT_DECAY = 0.0
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
WARMUP_STEPS = 0
NUM_MINIBATCHES = 1
GRAD_ACCUM = 1
# No dual clip: the standard PPO objective (the upper clip is `--clip-eps-high`).
DUAL_CLIP = None
# Importance ratios against the behaviour policy's log-probs (what async staleness needs).
USE_BEHAVIOUR_LOGPROBS = True
# Loss averaged over every token of the batch.
LOSS_AGG = "token-mean"
# No KL penalty and no entropy bonus: GRPO as published (the clip bounds each step).
KL_COEF = 0.0
KL_ESTIMATOR = "k3"
KL_CLAMP = False
ENTROPY_COEF = 0.0
# GRPO: a group's rewards minus their mean, divided by their std (+ ADV_EPS against zero).
NORM_STD = True
ADV_EPS = 1e-6
# GAE: undiscounted Monte-Carlo returns (one reward at the end of a response), whitened.
GAE_GAMMA = 1.0
GAE_LAMBDA = 1.0
WHITEN_ADVANTAGES = True
# GAE: weight of the value loss and its clip range (the value head shares the trunk).
VF_COEF = 0.1
VALUE_CLIP = 0.2
# A new trainer starts at version 0; a resumed one takes its version from the checkpoint.
TRAINER_INITIAL_VERSION = 0
# Push weights in the background of the next step (the push overlaps compute).
BACKGROUND_PUSH = True


def staleness_bound(config: TrainConfig) -> StalenessBound:
    """THE one place a run's staleness bound is built (from `--max-staleness`; 0 in sync
    mode): the queue's size, every rollouter's admission, the trainer's queue reads and a
    resume's queued groups all take it from here."""
    return StalenessBound(config.effective_staleness)


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues (defaults: a new run): its checkpoint directory, step,
    policy version, the prompt ids it already trained on, the rollouters' in-flight
    groups saved with it (`train_app.inflight.load_inflight`; one snapshot per saved
    replica, dealt to the resumed run's replicas by `plan`) and the queue's groups the
    driver puts back (`train_app.inflight.load_queued`)."""

    checkpoint: str | None = None
    step: int | None = None
    version: int = 0
    consumed_prompt_ids: frozenset[str] = frozenset()
    inflight: tuple[RolloutSnapshot, ...] = ()
    queued: QueuedGroups = field(default_factory=QueuedGroups)
    prompt_states: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    """Each saved replica's prompt-stream state (`train_app.prompts`), by its prompt seed:
    where that stream continues. Empty for a checkpoint written before streams had a
    position: then every stream restarts and skips `consumed_prompt_ids`, every id the
    checkpoint trained on (with positions it holds only the most recent ones)."""


@dataclass(frozen=True)
class ReplicaPlan:
    """Everything one rollout actor needs: its engine, its rollouter and its prompts."""

    replica: int
    """Index of this replica (0-based)."""
    replicas: int
    """How many replicas share the queue (each takes its share of the queue's drops)."""
    model_dir: str
    task: str
    task_options: dict[str, Any]
    """Keyword arguments of the task's constructor (a vision task's image directory)."""
    prompt_seed: int
    """Seed of this replica's prompt stream (distinct per replica: no prompt twice)."""
    consumed_prompt_ids: frozenset[str]
    """Prompts this replica's `PromptSource` skips at a resume: those trained on before it,
    those continued from the checkpoint's in-flight groups and those of its queued groups put
    back on the queue (every replica's: ids never repeat across seeds)."""
    rollout: RolloutConfig
    engine: Any
    """The engine's configuration: a `VLLMEngineConfig` (tests may put a
    `rollout_engine.testing.FakeEngineConfig` here; the app never does)."""
    cpu: int | None
    """Pin the actor (and its in-process engine) to this core; None: no pinning."""
    log_dir: str | None
    """Write this actor's stdout and stderr (vLLM's logs) here; None: leave them to Ray."""
    failures_path: str | None = None
    """Append every failed group here (JSONL, see `train_app.failure_log`); None: not kept."""
    restore: RolloutSnapshot | None = None
    """In-flight groups of the resumed checkpoint this replica continues before any new
    prompt (`train_app.inflight`); None: nothing to continue."""
    prompt_position: int = 0
    """Where this replica's prompt stream starts (a resume: the checkpoint's position)."""
    redo_prompt_ids: tuple[str, ...] = ()
    """Prompts before `prompt_position` to generate again first (`PromptSource(redo=)`):
    the saved state's, and a resume's queued groups too stale to put back."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray resources of this actor beyond the default one CPU (`--rollout-resources`; see
    `actor_options`)."""
    requeued: int = 0
    """Groups of the resumed checkpoint's queue put back on the queue that count as this
    replica's deliveries in its admission budget (`Rollouter.count_requeued`; its share)."""
    staleness: StalenessBound = field(kw_only=True)
    """The run's staleness bound (`RunPlan.staleness`): this replica's admission budget and
    its delivery-time check (`Rollouter(staleness_bound=...)`)."""
    eval: EvalPlan | None = None
    """This replica's share of the held-out evaluations (`train_app.evaluation`); None: the
    run evaluates nothing."""


@dataclass(frozen=True)
class TrainerPlan:
    """Everything one trainer rank's actor needs."""

    model_dir: str
    run_dir: str
    ppo: PPOConfig
    vision: bool
    """Load the model as a Qwen2-VL policy and rebuild pixel inputs for the forward."""
    resume_from: str | None
    cpu: int | None
    log_dir: str | None
    rank: int = 0
    """This rank (0: reads the queue, pushes weights, writes checkpoints)."""
    world_size: int = 1
    """Trainer ranks (`--trainer-workers`); 1: no torch.distributed."""
    dp_strategy: str = DP_STRATEGY
    """`DataParallel` strategy with world_size > 1: auto, ddp or fsdp2."""
    dp_timeout_s: float = DP_TIMEOUT_S
    """torch.distributed timeout of the rendezvous and of every collective."""
    staleness: StalenessBound = field(kw_only=True)
    """The run's staleness bound (`RunPlan.staleness`): rank 0's queue reads drop groups
    staler than it."""
    fallback_pad_token_id: int = FALLBACK_PAD_TOKEN_ID
    """Token id that pads batches when neither `pad_token_id` nor the tokenizer names one."""
    pad_token_id: int | None = None
    """The model's pad id (`train_app.models.ModelFacts.pad_token_id`); None: the tokenizer's."""
    checkpoint_labels: Mapping[str, str] = field(default_factory=dict)
    """Written into every checkpoint's manifest: the model it is for (a resume checks them)."""
    consumed_ids_kept: int = MIN_CONSUMED_IDS_KEPT
    """Recent consumed ids the trainer keeps (a duplicate guard; `consumed_ids_kept`)."""

    @property
    def log_name(self) -> str:
        """Name of this rank's log file in `log_dir`: trainer.log, trainer1.log, ..."""
        return "trainer" if self.rank == 0 else f"trainer{self.rank}"

    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray resources of the trainer actor (`--trainer-resources`; see `actor_options`)."""


@dataclass(frozen=True)
class RunPlan:
    """The whole run: queue, rollout replicas, trainer, and the Ray cluster's size."""

    queue_maxsize: int
    replicas: tuple[ReplicaPlan, ...]
    trainer: TrainerPlan
    ray_num_cpus: int
    """CPUs of a local Ray cluster: one per rollout actor and one per trainer rank."""
    steps: int
    resume: ResumePoint = field(default_factory=ResumePoint)
    staleness: StalenessBound = field(kw_only=True)
    """The run's one staleness bound (`staleness_bound`), handed to the queue's reads,
    every rollouter and the trainer."""

    @property
    def trainer_ranks(self) -> tuple[TrainerPlan, ...]:
        """One plan per trainer rank: `trainer` (rank 0) with its rank and core (ranks are
        pinned to consecutive cores when rank 0 is pinned)."""
        return tuple(
            replace(
                self.trainer,
                rank=rank,
                cpu=None if self.trainer.cpu is None else self.trainer.cpu + rank,
            )
            for rank in range(self.trainer.world_size)
        )


def split_batch(batch_size: int, replicas: int) -> list[int]:
    """Groups per trainer batch each replica admits: shares differ by at most one and sum to
    `batch_size`; every share is at least 1 (so `replicas <= batch_size`)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if replicas > batch_size:
        raise ValueError(
            f"--rollout-replicas {replicas} is more than --batch-size {batch_size}: every "
            "replica must admit at least one group per trainer batch"
        )
    base, extra = divmod(batch_size, replicas)
    return [base + (1 if i < extra else 0) for i in range(replicas)]


def actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options of a resource request: `CPU` / `GPU` are `num_cpus` / `num_gpus`
    (default one CPU: each actor's event loop and its engine or torch step need a core), the
    rest go to `resources` (custom resources pin the actor to the nodes that have them)."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 1)}
    if "GPU" in resources:
        options["num_gpus"] = resources["GPU"]
    if custom:
        options["resources"] = custom
    return options


def eval_prompt_seed(config: TrainConfig) -> int:
    """Seed of the held-out stream of an `--eval-env` (apart from every replica's)."""
    return config.seed * PROMPT_SEED_STRIDE + EVAL_SEED_IN_STRIDE


def _eval_plan(
    config: TrainConfig, resume: ResumePoint, replica: int, replicas: int, eos: tuple[int, ...]
) -> EvalPlan | None:
    held_out = eval_task(config)
    if held_out is None:
        return None
    sampling = SamplingConfig(
        max_tokens=config.max_tokens,
        temperature=config.eval_temperature,
        top_p=TOP_P,
        top_k=TOP_K,
        seed=config.seed if config.deterministic else SAMPLING_SEED,
        stop_token_ids=eos,
        ignore_eos=IGNORE_EOS,
    )
    return EvalPlan(
        task=held_out[0],
        task_options=held_out[1],
        prompt_seed=eval_prompt_seed(config),
        samples=config.eval_samples,
        shard=replica,
        shards=replicas,
        n=config.eval_n,
        sampling=sampling,
        every=config.eval_every,
        sync_every=config.sync_every,
        base_step=resume.step or 0,
        base_version=resume.version,
        resumed=resume.checkpoint is not None,
        concurrency=EVAL_CONCURRENCY,
    )


def ray_num_cpus(config: TrainConfig) -> int:
    """CPUs of a local Ray cluster: one per rollout actor and one per trainer rank."""
    return max(2, config.rollout_replicas + config.trainer_workers)


def queue_maxsize(config: TrainConfig) -> int:
    """Admission keeps at most k + 1 batches ahead of the trainer; one more is head-room."""
    k = staleness_bound(config).max_staleness
    return (k + 1 + QUEUE_SPARE_BATCHES) * config.batch_size


def plan(
    config: TrainConfig,
    *,
    model_dir: Path | str = "model",
    run_dir: Path | str = "run",
    max_position_embeddings: int = MAX_MODEL_LEN_CAP,
    eos_token_id: int | None = None,
    resume: ResumePoint | None = None,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int | None = None,
    cpu_count: int = 2,
    capture_logs: bool = True,
    checkpoint_labels: Mapping[str, str] | None = None,
) -> RunPlan:
    """Every package configuration of `config` (validated first).

    `model_dir`, `max_position_embeddings`, `eos_token_id` / `eos_token_ids` (every id that
    ends a response) and `pad_token_id` describe the model (read from its files by the
    caller, `train_app.models.read_model_facts`), `resume` the checkpoint to continue from,
    `cpu_count` the machine (with exactly one replica on a local machine with a core for
    every actor, the engine is pinned to core 0 and trainer rank r to core 1 + r; otherwise
    nothing is pinned). `capture_logs=False` (`--verbose`) leaves every actor's output on
    the terminal instead of `run_dir/logs/`. `checkpoint_labels`: what
    the trainer writes into every checkpoint's manifest to name the model
    (`train_app.driver.resume.model_labels`)."""
    config.validate()
    resume = resume or ResumePoint()
    bound = staleness_bound(config)
    # Exactly one replica on a local machine with a core for every actor: pin them.
    pin = (
        config.rollout_replicas == 1
        and cpu_count >= 1 + config.trainer_workers
        and not config.ray_address
    )
    run_dir = Path(run_dir)
    log_dir = str(run_dir / "logs") if capture_logs else None
    eos = tuple(dict.fromkeys([*([] if eos_token_id is None else [eos_token_id]), *eos_token_ids]))
    model = _ModelFacts(str(model_dir), max_position_embeddings, eos)
    max_model_len(config, model)  # an impossible --max-model-len fails here, before Ray
    replicas = _replica_plans(config, bound, model, resume, run_dir, log_dir, pin)
    trainer = _trainer_plan(
        config,
        bound,
        model.path,
        run_dir,
        resume,
        log_dir=log_dir,
        pin=pin,
        pad_token_id=pad_token_id,
        checkpoint_labels=checkpoint_labels,
    )
    return RunPlan(
        queue_maxsize=queue_maxsize(config),
        replicas=replicas,
        trainer=trainer,
        ray_num_cpus=ray_num_cpus(config),
        steps=config.steps,
        resume=resume,
        staleness=bound,
    )


def _trainer_plan(
    config: TrainConfig,
    bound: StalenessBound,
    model_dir: str,
    run_dir: Path,
    resume: ResumePoint,
    *,
    log_dir: str | None,
    pin: bool,
    pad_token_id: int | None,
    checkpoint_labels: Mapping[str, str] | None,
) -> TrainerPlan:
    return TrainerPlan(
        model_dir=model_dir,
        run_dir=str(run_dir),
        ppo=_ppo_config(config, bound, run_dir),
        vision=_is_vision_task(config.task),
        resume_from=resume.checkpoint,
        cpu=TRAINER_CORE if pin else None,
        log_dir=log_dir,
        world_size=config.trainer_workers,
        dp_strategy=DP_STRATEGY,
        dp_timeout_s=DP_TIMEOUT_S,
        resources=parse_resources(config.trainer_resources),
        staleness=bound,
        fallback_pad_token_id=FALLBACK_PAD_TOKEN_ID,
        pad_token_id=pad_token_id,
        checkpoint_labels=dict(checkpoint_labels or {}),
        consumed_ids_kept=consumed_ids_kept(config),
    )


@dataclass(frozen=True)
class _ModelFacts:
    path: str
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


def max_model_len(config: TrainConfig, model: _ModelFacts) -> int:
    """`--max-model-len`, or the model's context length capped at `MAX_MODEL_LEN_CAP`."""
    if config.max_model_len is None:
        return min(MAX_MODEL_LEN_CAP, model.max_position_embeddings)
    if config.max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {config.max_model_len} is more than the model's "
            f"max_position_embeddings {model.max_position_embeddings}"
        )
    return config.max_model_len


def _replica_plans(
    config: TrainConfig,
    bound: StalenessBound,
    model: _ModelFacts,
    resume: ResumePoint,
    run_dir: Path,
    log_dir: str | None,
    pin: bool,
) -> tuple[ReplicaPlan, ...]:
    """One plan per rollout replica, each with its share of the batch and of a resume's
    in-flight and queued groups."""
    shares = split_batch(config.batch_size, config.rollout_replicas)
    restores = redistribute(resume.inflight, shares)
    carried = restored_prompt_ids(restores) | resume.queued.prompt_ids
    starts = [
        _stream_start(resume, config.seed * PROMPT_SEED_STRIDE + i, carried)
        for i in range(len(shares))
    ]
    requeued = deal_count(len(resume.queued.items), shares)
    return tuple(
        ReplicaPlan(
            replica=i,
            replicas=len(shares),
            model_dir=model.path,
            task=task_name(config),
            task_options=task_options(config, run_dir, i, len(shares)),
            prompt_seed=config.seed * PROMPT_SEED_STRIDE + i,
            consumed_prompt_ids=starts[i].skip,
            prompt_position=starts[i].position,
            redo_prompt_ids=starts[i].redo,
            rollout=_rollout_config(config, bound, share, model.eos_token_ids),
            engine=_engine_config(config, model, replica=i, version=resume.version),
            cpu=ENGINE_CORE if pin else None,
            log_dir=log_dir,
            failures_path=str((run_dir / "failures.jsonl").resolve()),
            restore=restores[i],
            resources=parse_resources(config.rollout_resources),
            requeued=requeued[i],
            staleness=bound,
            eval=_eval_plan(config, resume, i, len(shares), model.eos_token_ids),
        )
        for i, share in enumerate(shares)
    )


class _StreamStart(NamedTuple):
    position: int
    skip: frozenset[str]
    redo: tuple[str, ...]


def _stream_start(resume: ResumePoint, seed: int, carried: frozenset[str]) -> _StreamStart:
    """Where the stream of `seed` starts, what it skips and what it generates again: the
    saved position, the ids the saved state still skips and those the resume continues
    (restored or put back: `carried`), and the saved state's prompts to redo with the queued
    groups too stale to put back (the source keeps only its own). Without a saved position:
    the start, skipping every consumed id the checkpoint holds (those too-stale prompts are
    not skipped, so the walk generates them again)."""
    state = resume.prompt_states.get(seed)
    if state is None:
        return _StreamStart(0, resume.consumed_prompt_ids | carried, ())
    redo = (*state.get("redo", ()), *resume.queued.dropped_prompt_ids)
    return _StreamStart(int(state["position"]), frozenset(state.get("skip", ())) | carried, redo)


def consumed_ids_kept(config: TrainConfig) -> int:
    """How many recent consumed ids the trainer keeps: enough to cover every group that can
    be in flight or queued at once (k + 2 batches) and two checkpoint intervals (what a
    replaced rollouter may deliver again), four times over; never fewer than
    `MIN_CONSUMED_IDS_KEPT`. It depends on the configuration only, not on the run's length."""
    in_flight = (config.effective_staleness + 2) * config.batch_size
    between_checkpoints = 2 * config.checkpoint_every * config.batch_size
    return max(MIN_CONSUMED_IDS_KEPT, 4 * max(in_flight, between_checkpoints))


def _rollout_config(
    config: TrainConfig, bound: StalenessBound, share: int, eos_token_ids: tuple[int, ...]
) -> RolloutConfig:
    sampling = SamplingConfig(
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        top_p=TOP_P,
        top_k=TOP_K,
        seed=config.seed if config.deterministic else SAMPLING_SEED,
        stop_token_ids=eos_token_ids,
        ignore_eos=IGNORE_EOS,
    )
    return RolloutConfig(
        group_size=config.group_size,
        max_concurrency=config.max_concurrency,
        groups_per_step=share,
        sync_every=config.sync_every,
        max_staleness=bound.max_staleness,  # the plan's one bound (see `staleness_bound`)
        pacing=config.pacing,
        pacing_margin=PACING_MARGIN,
        partial_rollout=config.effective_partial_rollout,
        pause_mode=config.pause_mode,
        clear_cache=CLEAR_CACHE_ON_PAUSE,
        sampling=sampling,
        reward_workers=REWARD_WORKERS,
        stop_timeout_s=ROLLOUT_STOP_TIMEOUT_S,
        max_consecutive_failures=MAX_CONSECUTIVE_FAILURES,
        recent_failures=RECENT_FAILURES_KEPT,
        filter_groups=config.filter_groups,
        generation_only=GENERATION_ONLY,
        stall_warning_s=STALL_WARNING_S,
        retry_stale=RETRY_STALE_GROUPS,
    )


def _engine_config(
    config: TrainConfig, model: _ModelFacts, *, replica: int, version: int
) -> VLLMEngineConfig:
    return VLLMEngineConfig(
        model=model.path,
        tokenizer=None,  # the model's own
        dtype=ENGINE_DTYPE,
        max_model_len=max_model_len(config, model),
        kv_cache_gib=KV_CACHE_GIB,
        enforce_eager=ENFORCE_EAGER,
        compile_helpers=COMPILE_VLLM_HELPERS,
        seed=config.seed + replica,
        max_num_seqs=max(MIN_ENGINE_SEQS, config.max_concurrency * config.group_size),
        enable_prefix_caching=PREFIX_CACHING,
        logprobs_mode=LOGPROBS_MODE,
        worker_extension_cls=WEIGHT_SYNC_EXTENSION,
        weight_transport=WEIGHT_TRANSPORT,
        shm_dir=SHM_DIR,
        warmup=ENGINE_WARMUP,
        initial_version=version,
        cpu_affinity=None,  # the actor pins itself and its engine (`ReplicaPlan.cpu`)
        io_threads=ENGINE_IO_THREADS,
        stream_interval=STREAM_INTERVAL,
        shutdown_timeout_s=ENGINE_SHUTDOWN_TIMEOUT_S,
        tie_to_host=ENGINE_TIED_TO_HOST,
        extra_engine_args={},
        image_token_id=None,  # the actor sets a vision task's (its processor knows it)
    )


def _ppo_config(config: TrainConfig, bound: StalenessBound, run_dir: Path) -> PPOConfig:
    return PPOConfig(
        lr=config.lr,
        weight_decay=WEIGHT_DECAY,
        adam_betas=ADAM_BETAS,
        adam_eps=ADAM_EPS,
        max_grad_norm=config.max_grad_norm,
        lr_schedule=config.lr_schedule,
        warmup_steps=WARMUP_STEPS,
        total_steps=config.steps,
        min_lr_ratio=config.min_lr_ratio,
        batch_size=config.batch_size,
        ppo_epochs=config.ppo_epochs,
        num_minibatches=NUM_MINIBATCHES,
        grad_accum=GRAD_ACCUM,
        clip_eps=config.clip_eps,
        clip_eps_high=config.clip_eps_high,
        clip_staleness_scale=config.clip_staleness_scale,
        dual_clip=DUAL_CLIP,
        is_cap=config.is_cap,
        is_level=config.is_level,
        is_mode=config.is_mode,
        use_behaviour_logprobs=USE_BEHAVIOUR_LOGPROBS,
        temperature=config.temperature,
        loss_agg=LOSS_AGG,
        loss_agg_horizon=None,  # only the seq-mean-token-sum-norm aggregation uses it
        kl_coef=KL_COEF,
        kl_estimator=KL_ESTIMATOR,
        kl_clamp=KL_CLAMP,
        entropy_coef=ENTROPY_COEF,
        advantage=config.advantage,
        norm_std=NORM_STD,
        adv_eps=ADV_EPS,
        gamma=GAE_GAMMA,
        lam=GAE_LAMBDA,
        whiten_advantages=WHITEN_ADVANTAGES,
        vf_coef=VF_COEF,
        value_clip=VALUE_CLIP,
        value_lr=None,  # the value head learns at the policy's rate
        sync_every=config.sync_every,
        max_staleness=bound.max_staleness,  # the plan's one bound (see `staleness_bound`)
        initial_version=TRAINER_INITIAL_VERSION,
        background_push=BACKGROUND_PUSH,
        seed=config.seed,
        deterministic=config.deterministic,
        checkpoint_dir=str(run_dir / "checkpoints"),
        checkpoint_every=config.checkpoint_every,
        keep_checkpoints=KEEP_CHECKPOINTS,
    )


def _is_vision_task(name: str) -> bool:
    from train_app.tasks import is_vision_task

    return is_vision_task(name)

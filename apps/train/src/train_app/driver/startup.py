"""Getting a run going: its directory and model, the plan (with what it needs from the disk),
the actors created and started together, and their process ids in `actors.json`."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from train_app.config import TrainConfig, load_toml, to_toml
from train_app.driver.aio import await_ref
from train_app.driver.errors import RunFailed, first_line
from train_app.driver.resume import choose_checkpoint, model_labels
from train_app.inflight import load_inflight, load_queued, put_back
from train_app.models import UnsupportedModel, check_vllm_architectures
from train_app.models import read_model_facts as read_model_facts_full
from train_app.plan import (
    ResumePoint,
    RunPlan,
    StalenessBound,
    actor_options,
    plan,
    staleness_bound,
)
from train_app.tasks.spec import task_name

logger = logging.getLogger(__name__)

# The lock file of a run directory held while a run writes it (`run_dir_lock`).
LOCK_FILE = ".lock"

__all__ = [
    "Actors",
    "PutBack",
    "create_actors",
    "ensure_model",
    "make_plan",
    "prepare_run_dir",
    "read_model_facts",
    "record_config",
    "resume_point",
    "run_dir_lock",
    "start_actors",
    "write_pids",
]


def prepare_run_dir(config: TrainConfig) -> Path:
    """The run's directory: the resumed one (checked: its task is this run's), or a new one
    with its config.toml written. A name already in use is refused unless `--overwrite`
    (which deletes the old run). A resumed run's config.toml is rewritten only once its
    checkpoint has loaded (`record_config`), so a resume that fails leaves it as it was."""
    if config.resume is not None:
        run_dir = Path(config.resume)
        _check_resumed_task(config, run_dir)
        return run_dir
    run_dir = Path(config.runs_dir) / (config.name or _new_run_name(config))
    if run_dir.exists() and any(run_dir.iterdir()):
        if not config.overwrite:
            raise RunFailed(
                f"{run_dir} holds another run: continue it with --resume {run_dir}, choose "
                "another --name, or pass --overwrite to delete it and start again"
            )
        _refuse_if_locked(run_dir)
        logger.warning("--overwrite: deleting the earlier run in %s", run_dir)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record_config(config, run_dir)
    return run_dir


def _new_run_name(config: TrainConfig) -> str:
    """The task (`dataset` for a `--dataset` run, the library for `--env`), mode and time,
    with a suffix if a run of the same second has the name."""
    base = f"{task_name(config)}-{config.mode}-{datetime.now():%Y%m%d-%H%M%S}"
    name, count = base, 1
    while (Path(config.runs_dir) / name).exists():
        count += 1
        name = f"{base}-{count}"
    return name


def record_config(config: TrainConfig, run_dir: Path) -> None:
    """config.toml: what `--resume` reads back (written atomically)."""
    path = run_dir / "config.toml"
    path.with_suffix(".tmp").write_text(to_toml(replace(config, resume=None, overwrite=False)))
    path.with_suffix(".tmp").replace(path)


def _check_resumed_task(config: TrainConfig, run_dir: Path) -> None:
    saved = run_dir / "config.toml"
    if not saved.exists():
        return
    task = load_toml(saved).get("task", TrainConfig().task)
    if task != config.task:
        raise RunFailed(
            f"--task {config.task} does not match the run being resumed ({task}, in {saved}); "
            "a checkpoint continues the task it was trained on"
        )


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir/LOCK_FILE` for the run (an advisory lock the OS drops when the process
    dies): a second run on the same directory is refused instead of interleaving writes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / LOCK_FILE).open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            raise RunFailed(f"{run_dir} is in use by another run ({owner})") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _refuse_if_locked(run_dir: Path) -> None:
    if (run_dir / LOCK_FILE).exists():
        with run_dir_lock(run_dir):
            pass


def ensure_model(config: TrainConfig, run_dir: Path) -> Path:
    """`--model`, or a tiny random model of the task's kind built into the run dir (reused
    as saved there: a resume keeps its tokenizer). A task that shows its text gets a tiny
    tokenizer covering its characters (`train_app.tasks.vocabulary`); blocking (it may
    build the task), so never on an event loop."""
    if config.model is not None:
        return Path(config.model).resolve()
    from tiny_models import build_tiny_qwen2

    from train_app.tasks import is_vision_task
    from train_app.tasks.vocabulary import task_characters
    from train_app.vision_model import build_tiny_qwen2_vl

    directory = run_dir / "model"
    if is_vision_task(config.task):
        return build_tiny_qwen2_vl(directory, seed=config.seed).resolve()
    if (directory / "config.json").exists():
        return directory.resolve()
    extra = task_characters(config, run_dir)
    return build_tiny_qwen2(directory, seed=config.seed, extra_characters=extra).resolve()


def read_model_facts(model_dir: Path) -> tuple[int, int | None]:
    """(max_position_embeddings, tokenizer EOS id) of a local HF checkpoint."""
    facts = read_model_facts_full(model_dir)
    return facts.max_position_embeddings, next(iter(facts.eos_token_ids), None)


def make_plan(
    config: TrainConfig, run_dir: Path, model_dir: Path, resume: ResumePoint | None = None
) -> RunPlan:
    """`plan()` with what it needs from the disk: the model's facts (its architecture checked
    against vLLM's registry: `UnsupportedModel`), its checkpoint labels and the resume point
    (`resume`, if already read: `resume_point`)."""
    try:
        facts = read_model_facts_full(model_dir)
        check_vllm_architectures(model_dir, facts.architectures)
    except UnsupportedModel as exc:
        raise RunFailed(str(exc)) from None
    labels = model_labels(model_dir)
    return plan(
        config,
        model_dir=model_dir,
        run_dir=run_dir.resolve(),
        max_position_embeddings=facts.max_position_embeddings,
        eos_token_ids=facts.eos_token_ids,
        pad_token_id=facts.pad_token_id,
        resume=resume if resume is not None else resume_point(config, run_dir, labels=labels),
        cpu_count=os.cpu_count() or 1,
        capture_logs=not config.verbose,
        checkpoint_labels=labels,
    )


def resume_point(
    config: TrainConfig,
    run_dir: Path,
    bound: StalenessBound | None = None,
    *,
    labels: Mapping[str, str] | None = None,
) -> ResumePoint:
    """The checkpoint of a run to resume (the newest usable one for the model of `labels`,
    `choose_checkpoint`), the in-flight groups and the queue's groups saved with it
    (`train_app.inflight`), read without torch and before Ray starts. `bound`: the run's
    staleness bound (default: the plan's, `staleness_bound(config)`). A checkpoint that
    cannot be read back raises `RunFailed` in one line."""
    if config.resume is None:
        return ResumePoint()
    checkpoint = choose_checkpoint(run_dir, labels or {})
    try:
        return _read_resume_point(config, run_dir, checkpoint, bound)
    except (OSError, ValueError, KeyError, TypeError, msgspec.MsgspecError) as exc:
        # Only a checkpoint older than manifests gets here damaged: the manifest caught it.
        raise RunFailed(
            f"--resume {run_dir}: checkpoint {checkpoint.name} is damaged "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from exc


def _read_resume_point(
    config: TrainConfig, run_dir: Path, checkpoint: Path, bound: StalenessBound | None
) -> ResumePoint:
    from ppo_trainer import read_checkpoint_meta

    meta = read_checkpoint_meta(checkpoint)
    prompts = frozenset(meta.consumed_prompt_ids)
    queued = load_queued(
        checkpoint,
        version=meta.version,
        max_staleness=(bound or staleness_bound(config)).max_staleness,
        consumed_prompt_ids=prompts,
        group_size=config.group_size,
    )
    # A group delivered between its replica's snapshot and the queue's copy is in both: the
    # finished, queued one is put back and the in-flight one left out.
    inflight = load_inflight(
        checkpoint, consumed_prompt_ids=prompts | queued.prompt_ids, group_size=config.group_size
    )
    states = {
        int(s.prompt_state["seed"]): dict(s.prompt_state)
        for s in inflight
        if s.prompt_state is not None
    }
    if not states:
        _check_legacy(meta, run_dir)
    else:
        _warn_missing_positions(config, states, len(prompts))
    return ResumePoint(
        str(checkpoint.resolve()),
        meta.step,
        meta.version,
        prompts,
        inflight,
        queued,
        prompt_states=states,
    )


def _check_legacy(meta: Any, run_dir: Path) -> None:
    """A checkpoint without stream positions resumes by skipping every prompt id it trained
    on: it must hold them all."""
    if meta.consumed_group_ids and not meta.consumed_prompt_ids:
        raise RunFailed(
            f"--resume {run_dir}: its checkpoint predates trajectories carrying `prompt_id` "
            "(schema 3), so the prompts it trained on are unknown; start a new run"
        )
    if meta.consumed_ids_kept is not None and meta.step:
        logger.warning(
            "--resume %s: the checkpoint has no prompt-stream positions (no replica answered "
            "its snapshot); every stream restarts, skipping only the last %d prompts trained "
            "on",
            run_dir,
            len(meta.consumed_prompt_ids),
        )


def _warn_missing_positions(config: TrainConfig, states: dict[int, Any], kept: int) -> None:
    from train_app.plan import PROMPT_SEED_STRIDE

    for replica in range(config.rollout_replicas):
        seed = config.seed * PROMPT_SEED_STRIDE + replica
        if seed not in states:
            logger.warning(
                "replica %d: no prompt-stream position in the checkpoint; its stream restarts, "
                "skipping only the last %d prompts trained on",
                replica,
                kept,
            )


@dataclass
class Actors:
    """The run's actor handles, filled in as they are created (so that a stop half-way
    kills what exists)."""

    queue: Any = None
    rollouts: list[Any] = field(default_factory=list)
    trainers: list[Any] = field(default_factory=list)
    """One actor per rank; rank 0 reads the queue, pushes weights, keeps metrics."""
    starting: list[Any] = field(default_factory=list)
    """Replacement rollouters not yet in `rollouts`."""
    rollout_pids: list[Any] = field(default_factory=list)
    """Each replica's last known process ids (a dead one keeps its entry)."""

    @property
    def trainer(self) -> Any:
        return self.trainers[0] if self.trainers else None

    def kill(self) -> None:
        """Kill every actor at once (no graceful stop); a no-op for those already dead."""
        import ray

        handles = [*self.rollouts, *self.starting, *self.trainers]
        handles.append(getattr(self.queue, "handle", None))
        for actor in handles:
            if actor is not None:
                with contextlib.suppress(Exception):  # already dead is fine
                    ray.kill(actor)


class PutBack:
    """A resumed run's queued groups, put back on the new queue before any rollout loop
    begins, so the trainer takes them first (`train_app.inflight.put_back`)."""

    def __init__(self, run_plan: RunPlan) -> None:
        self.items = run_plan.resume.queued.items
        self.queue_maxsize = run_plan.queue_maxsize
        self.tail: asyncio.Task[None] | None = None
        """The groups still waiting for room on the queue."""

    async def start(self, queue: Any) -> None:
        if not self.items:
            return
        self.tail = await put_back(queue, self.items, self.queue_maxsize)
        logger.info("put %d queued groups of the checkpoint back on the queue", len(self.items))

    def done_so_far(self) -> int:
        """Groups put on the queue so far (the queue's `produced` counts them; no rollouter
        delivered them)."""
        tail = self.tail
        if tail is None or (tail.done() and not tail.cancelled() and tail.exception() is None):
            return len(self.items)
        return min(len(self.items), self.queue_maxsize)

    def cancel(self) -> None:
        if self.tail is not None:
            self.tail.cancel()


async def create_actors(run_plan: RunPlan, actors: Actors, put_back_queued: PutBack) -> None:
    """The queue (no CPU of its own; a resume's groups put back first), one rollout actor
    per replica plan, one trainer actor per rank; nothing starts until `start_actors`.
    Rank 0 reads the queue and pushes weights to every rollouter, the others get neither."""
    from async_queue import MessageQueueClient

    from train_app.actors import RolloutActor, TrainerActor

    actors.queue = MessageQueueClient.create(
        maxsize=run_plan.queue_maxsize, actor_options={"num_cpus": 0}
    )
    await put_back_queued.start(actors.queue)
    actors.rollouts = [
        RolloutActor.options(**actor_options(r.resources)).remote(r, actors.queue)
        for r in run_plan.replicas
    ]
    actors.trainers = [
        TrainerActor.options(**actor_options(rank.resources)).remote(
            rank, *((actors.queue, actors.rollouts) if rank.rank == 0 else (None, []))
        )
        for rank in run_plan.trainer_ranks
    ]


async def start_actors(
    run_plan: RunPlan, actors: Actors, console: Console, timings: dict[str, float]
) -> None:
    """Start every engine and load the trainer's model at the same time (they need nothing
    from each other); write the process ids to actors.json."""
    t0 = time.monotonic()
    with console.status("starting vLLM (tens of seconds on CPU)..."):
        engines, trainer_load_s = await asyncio.gather(
            _start_together(actors.rollouts, hold=_hold_new_prompts(run_plan)),
            _setup_trainers(actors.trainers),
        )
    timings.update(
        actors_s=time.monotonic() - t0, engine_s=max(engines), trainer_load_s=trainer_load_s
    )
    logger.info("actors up in %.1f s (engines %s s)", timings["actors_s"], engines)
    await write_pids(actors, Path(run_plan.trainer.run_dir))


def _hold_new_prompts(run_plan: RunPlan) -> bool:
    """Several replicas resuming in-flight groups: each holds its new prompts until every
    replica's restored groups are delivered (see `_start_together`)."""
    return len(run_plan.replicas) > 1 and any(r.restore for r in run_plan.replicas)


async def _setup_trainers(trainers: list[Any]) -> float:
    """Every trainer rank joins the group at rank 0's address (several ranks; on loopback
    when they share a node) and loads the model, all at once; returns the slowest rank's
    seconds."""
    init_method = None
    if len(trainers) > 1:
        nodes = await asyncio.gather(*(await_ref(t.node_id.remote()) for t in trainers))
        one_node = len(set(nodes)) == 1  # then the ranks meet on loopback
        init_method = await await_ref(trainers[0].rendezvous.remote(loopback=one_node))
        logger.info("trainer ranks meet at %s", init_method)
    loads = await asyncio.gather(*(await_ref(t.setup.remote(init_method)) for t in trainers))
    return max(loads)


async def _start_together(rollouts: list[Any], *, hold: bool = False) -> list[float]:
    """Start every replica's engine, then every rollout loop at once (`RolloutActor.start`):
    engines come up seconds apart, and a replica that began early would fill the first
    batches with new groups while another's restored partials wait.

    With `hold` (a resume with in-flight groups on several replicas) every replica also holds
    its new prompts until all of them have delivered their restored groups: a restored group
    whose oldest tokens are exactly k versions old must be in the resumed run's first batch,
    and another replica's new group could otherwise take its place. A replica that dies
    meanwhile (its replacement is not held) ends the hold for the others."""
    engines = await asyncio.gather(
        *(await_ref(r.start.remote(begin=False, hold=hold)) for r in rollouts)
    )
    await asyncio.gather(*(await_ref(r.begin.remote()) for r in rollouts))
    if hold:
        task = asyncio.create_task(_release_when_restored_delivered(rollouts))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
    return list(engines)


_BACKGROUND: set[asyncio.Task[None]] = set()  # referenced until done (asyncio keeps weak refs)


async def _release_when_restored_delivered(rollouts: list[Any]) -> None:
    waits = await asyncio.gather(
        *(await_ref(r.restored_delivered.remote()) for r in rollouts), return_exceptions=True
    )
    for rollout, outcome in zip(rollouts, waits, strict=True):
        if isinstance(outcome, BaseException):
            logger.info("restored-group hold: a replica ended first (%r)", outcome)
            continue
        with contextlib.suppress(Exception):  # died since: its replacement is not held
            await await_ref(rollout.release_new_prompts.remote())
    logger.info("restored groups delivered: new prompts admitted on every replica")


async def write_pids(actors: Actors, run_dir: Path) -> None:
    """actors.json: the process ids of the driver and of every live actor, the queue's
    included (rewritten atomically after a rollouter restart; a dead replica's entry is
    its last known)."""
    replies = await asyncio.gather(
        *(await_ref(r.pids.remote()) for r in actors.rollouts), return_exceptions=True
    )
    known = actors.rollout_pids or [[] for _ in actors.rollouts]
    rollout_pids = [known[i] if isinstance(p, BaseException) else p for i, p in enumerate(replies)]
    actors.rollout_pids = rollout_pids
    trainer_pids = await asyncio.gather(*(await_ref(t.pids.remote()) for t in actors.trainers))
    pids = {
        "driver": os.getpid(),
        "rollout": [p[0] for p in rollout_pids if p],
        "engine": [pid for p in rollout_pids for pid in p[1:]],
        "trainer": trainer_pids[0][0],
        "trainer_ranks": [p[0] for p in trainer_pids],
        "nodes": await _node_ids(actors),
        "queue": (await actors.queue.actor_memory())["pid"],
    }
    path = run_dir / "actors.json"
    path.with_suffix(".tmp").write_text(json.dumps(pids))
    path.with_suffix(".tmp").replace(path)


async def _node_ids(actors: Actors) -> dict[str, Any]:
    """The Ray node of each actor (hex ids): where `--rollout-resources` and
    `--trainer-resources` placed them."""
    rollout = await asyncio.gather(*(await_ref(r.node_id.remote()) for r in actors.rollouts))
    ranks = await asyncio.gather(*(await_ref(t.node_id.remote()) for t in actors.trainers))
    logger.info("rollouters on nodes %s, trainer ranks on %s", rollout, ranks)
    return {"rollout": list(rollout), "trainer": ranks[0], "trainer_ranks": list(ranks)}

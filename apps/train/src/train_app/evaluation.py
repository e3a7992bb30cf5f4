"""Evaluation while training: held-out prompts, decoded by the rollouters beside training.

`--eval-dataset PATH` or `--eval-env LIBRARY:NAMES` give a held-out set; the run evaluates
it at the start, every `--eval-every` trainer steps and at the end. Each rollout replica
evaluates its share of the `--eval-samples` prompts with `Rollouter.evaluate` (the same
engine and reward path as training, a separate admission class: nothing of it is trained on
or counts against the staleness budget), as an asyncio task beside its rollout loop
(`ReplicaEvaluator`). The driver merges the replicas' records of a step into one row of
metrics.jsonl (`EvalCollector`): `eval/reward/mean`, `eval/pass@N` (N = `--eval-n`),
`eval/samples`, `eval/failed`, `eval/version`, `eval/s` and `eval/step`, the step whose
weights were evaluated (0: the initial weights).

A response passes when its reward reaches `PASS_REWARD`; `eval/pass@N` is the fraction of
held-out prompts with at least one passing response among their N.

`check_overlap` counts the held-out prompts whose text is also a training prompt (a
`--dataset` file or an `--env` stream), for the warning the run prints before it starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_engine import PromptSample, SamplingConfig

from train_app.config import TrainConfig

__all__ = [
    "OVERLAP_CHECK_MAX",
    "PASS_REWARD",
    "EvalCollector",
    "EvalPlan",
    "ReplicaEvaluator",
    "check_overlap",
    "eval_metrics",
    "eval_prompts",
    "replica_record",
]

logger = logging.getLogger(__name__)

PASS_REWARD = 1.0
"""A response passes (for `eval/pass@N`) when its reward is at least this: the full score
of the built-in tasks, reasoning-gym's scorers and an exact-match reward."""
OVERLAP_CHECK_MAX = 20_000
"""Training prompts of an `--env` stream the overlap check generates at most (the run's
first ones: `--steps x --batch-size`, capped here)."""
EVAL_ID_PREFIX = "eval/"
"""Held-out prompt ids carry it: they can never be mistaken for a training prompt's id."""


@dataclass(frozen=True)
class EvalPlan:
    """What one rollout replica evaluates, and when."""

    task: str
    """`make_task` name of the held-out set (`dataset` or `reasoning-gym`)."""
    task_options: dict[str, Any]
    prompt_seed: int
    """Seed of the held-out stream (apart from every training replica's)."""
    samples: int
    """Held-out prompts of the whole run (all replicas); this replica takes every
    `shards`-th of them from position `shard`."""
    shard: int
    shards: int
    n: int
    sampling: SamplingConfig
    every: int
    """Trainer steps between evaluations (0: only the first and the last)."""
    sync_every: int
    base_step: int = 0
    """The step and version the run starts from (a resumed run's checkpoint)."""
    base_version: int = 0
    resumed: bool = False
    """A resumed run: the engines start from the initial weights and get the checkpoint's by
    the first push, so the first evaluation waits for it."""
    concurrency: int = 8
    """Held-out groups in flight at once on this replica."""

    def step_of(self, version: int) -> int:
        """The trainer step whose weights are `version`."""
        return self.base_step + (version - self.base_version) * self.sync_every


def eval_prompts(plan: EvalPlan, stream: Iterable[PromptSample]) -> list[PromptSample]:
    """This replica's held-out prompts: its shard of the first `plan.samples` of `stream`
    (fewer if the stream ends first), with ids prefixed `eval/`."""
    first: list[PromptSample] = []
    for sample in stream:
        if len(first) >= plan.samples:
            break
        first.append(sample)
    import msgspec

    return [
        msgspec.structs.replace(p, prompt_id=EVAL_ID_PREFIX + p.prompt_id)
        for p in first[plan.shard :: plan.shards]
    ]


def replica_record(step: int, replica: int, result: Any) -> dict[str, Any]:
    """One replica's evaluation (`rollout_engine.EvalResult`) as plain data for the driver."""
    scored = result.scored
    return {
        "step": step,
        "replica": replica,
        "version": result.version,
        "prompts": len(scored),
        "failed": result.failed,
        "responses": sum(len(g) for g in scored),
        "reward_sum": float(sum(t.reward for g in scored for t in g)),
        "passed": sum(any(t.reward >= PASS_REWARD for t in g) for g in scored),
        "seconds": result.seconds,
    }


def eval_metrics(records: Sequence[dict[str, Any]], n: int) -> dict[str, float]:
    """The row of one step from its replicas' records (see the module docstring)."""
    prompts = sum(r["prompts"] for r in records)
    responses = sum(r["responses"] for r in records)
    return {
        "eval/reward/mean": (
            sum(r["reward_sum"] for r in records) / responses if responses else math.nan
        ),
        f"eval/pass@{n}": sum(r["passed"] for r in records) / prompts if prompts else math.nan,
        "eval/samples": float(prompts),
        "eval/failed": float(sum(r["failed"] for r in records)),
        "eval/version": float(min(r["version"] for r in records)),
        "eval/s": float(max(r["seconds"] for r in records)),
        "eval/step": float(records[0]["step"]),
    }


class EvalCollector:
    """The driver's merge of the replicas' records: a step's row is complete when every
    replica reported it (`add` returns it); `flush` gives the rest at the end (a replica that
    died mid-evaluation leaves its step short: `eval/samples` says how many prompts)."""

    def __init__(self, replicas: int, n: int) -> None:
        self._replicas, self._n = replicas, n
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}
        self._written: set[int] = set()
        self.acked: dict[str, int] = {}
        """The last record `seq` taken from each evaluator (`ReplicaEvaluator.results`)."""

    def take(self, replies: Iterable[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
        """`add` the records of evaluators' `results()` replies and acknowledge them."""
        records = []
        for reply in replies:
            records.extend(reply["records"])
            seqs = [r["seq"] for r in reply["records"]]
            if seqs:
                self.acked[reply["source"]] = max(seqs)
        return self.add(records)

    def add(self, records: Iterable[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
        rows = []
        for record in records:
            step = int(record["step"])
            if step in self._written:
                continue  # a replacement replica's evaluation of a step already written
            parts = self._pending.setdefault(step, {})
            parts.setdefault(int(record["replica"]), record)
            if len(parts) >= self._replicas:
                rows.append(self._row(step))
        return rows

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        return [self._row(step) for step in sorted(self._pending)]

    def _row(self, step: int) -> tuple[int, dict[str, float]]:
        self._written.add(step)
        return step, eval_metrics(list(self._pending.pop(step).values()), self._n)


class ReplicaEvaluator:
    """A rollout replica's evaluations: one at a time, as a task beside the rollout loop.

    `on_version(version)` (every weight version the replica serves) starts one when a step
    of `plan.every` is reached; `first(version)` the one at the start; `last(step)` the one at
    the end (unless the current version was just evaluated) and waits for it. A request while
    one runs waits for it; only the newest such request is kept (an evaluation slower than
    `--eval-every` steps skips the steps it overlapped, and says so in the log)."""

    def __init__(
        self,
        plan: EvalPlan,
        replica: int,
        rollouter: Any,
        prompts: list[PromptSample],
        reward_fn: Any,
    ) -> None:
        self.plan, self.replica = plan, replica
        self._rollouter, self._prompts, self._reward_fn = rollouter, prompts, reward_fn
        self._next_step: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._queued: tuple[int, int] | None = None
        self._evaluated_version: int | None = None
        self._records: list[dict[str, Any]] = []
        self._id = uuid.uuid4().hex
        self._seq = 0

    def first(self, version: int) -> None:
        step, every = self.plan.step_of(version), self.plan.every
        if every > 0:
            self._next_step = (step // every + 1) * every
        self._request(step, version)

    def on_version(self, version: int) -> None:
        step, every = self.plan.step_of(version), self.plan.every
        if every <= 0:
            return
        if self._next_step is None:  # a replacement replica: no `first()`
            self._next_step = -(-step // every) * every
        if step >= self._next_step:
            self._next_step = (step // every + 1) * every
            self._request(step, version)

    async def last(self, step: int) -> None:
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
        if self._evaluated_version != self._rollouter.version:
            await self._run(step, self._rollouter.version)

    def results(self, acked: dict[str, int]) -> dict[str, Any]:
        """`{"source": id, "records": [...]}`: this evaluator's records the driver has not
        acknowledged (`acked[id]`: the last `seq` it wrote). A record stays until then, so
        a reply lost to the driver's timeout is sent again (the collector ignores repeats)."""
        done = acked.get(self._id, 0)
        self._records = [r for r in self._records if r["seq"] > done]
        return {"source": self._id, "records": list(self._records)}

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _request(self, step: int, version: int) -> None:
        if self._task is not None and not self._task.done():
            if self._queued is not None:
                logger.info("evaluation of step %d skipped: one is still running", self._queued[0])
            self._queued = (step, version)
            return
        self._task = asyncio.create_task(self._run_then_queued(step, version), name="evaluation")

    async def _run_then_queued(self, step: int, version: int) -> None:
        await self._run(step, version)
        while self._queued is not None:
            (step, version), self._queued = self._queued, None
            await self._run(step, version)

    async def _run(self, step: int, version: int) -> None:
        try:
            result = await self._rollouter.evaluate(
                self._prompts,
                self.plan.sampling,
                n=self.plan.n,
                reward_fn=self._reward_fn,
                max_concurrency=self.plan.concurrency,
            )
        except Exception:  # an evaluation must never take the replica down
            logger.exception("evaluation of step %d failed", step)
            return
        self._evaluated_version = result.version
        self._seq += 1
        self._records.append({**replica_record(step, self.replica, result), "seq": self._seq})
        logger.info(
            "evaluation of step %d (version %d): reward %.3f in %.1f s",
            step,
            result.version,
            result.mean_reward(),
            result.seconds,
        )


# ---------------------------------------------------------------------- overlap check


def _text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def _dataset_texts(path: Any, field: str) -> Iterator[str]:
    from train_app.tasks.dataset import load_rows

    rows = load_rows(path)
    return (_text(p) for p in rows[field])


def _gym_texts(names: Sequence[str], dataset_seed: int, streams: Sequence[int], count: int):
    import reasoning_gym

    from train_app.tasks.gym import DATASET_SIZE, item_index

    datasets = {
        n: reasoning_gym.create_dataset(n, size=DATASET_SIZE, seed=dataset_seed) for n in names
    }
    for stream in streams:
        for index in range(count):
            name = names[index % len(names)]
            yield _text(datasets[name][item_index(stream, index)]["question"])


def check_overlap(config: TrainConfig) -> tuple[int, int, str] | None:
    """(held-out prompts also in training, held-out prompts checked, what training was
    checked) for a run with a held-out set and a training set of known text (`--dataset`,
    `--env`); None otherwise (a `--task` generates its prompts in its own way)."""
    from train_app.plan import PROMPT_SEED_STRIDE, eval_prompt_seed
    from train_app.tasks.spec import parse_env

    if not config.evaluates or (config.dataset is None and config.env is None):
        return None
    if config.eval_dataset is not None:
        held_out = list(_dataset_texts(config.eval_dataset, config.prompt_field))
    else:
        names = parse_env(config.eval_env or "", flag="--eval-env")[1]
        held_out = list(
            _gym_texts(names, config.seed, [eval_prompt_seed(config)], config.eval_samples)
        )
    if config.dataset is not None:
        training = set(_dataset_texts(config.dataset, config.prompt_field))
        what = f"--dataset {config.dataset}"
    else:
        names = parse_env(config.env or "")[1]
        replicas = config.rollout_replicas
        each = min(-(-config.steps * config.batch_size // replicas), OVERLAP_CHECK_MAX // replicas)
        streams = [config.seed * PROMPT_SEED_STRIDE + r for r in range(replicas)]
        training = set(_gym_texts(names, config.seed, streams, each))
        what = f"the first {each * replicas} prompts of --env {config.env}"
    return sum(text in training for text in held_out), len(held_out), what

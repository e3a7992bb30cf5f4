"""The Ray actors of a run: a rollouter (vLLM) per replica and one trainer actor per rank.

Both are async actors: every Ray call inside them is awaited, CPU work (vLLM's engine core,
the trainer's torch step) runs off their event loop, and an `EventLoopLagMonitor` on each loop
proves it (`event_loop/lag_ms_*`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from train_app.plan import (
    ROLLOUT_ACTOR_MAX_CONCURRENCY,
    TRAINER_ACTOR_MAX_CONCURRENCY,
    ReplicaPlan,
    TrainerPlan,
)

logger = logging.getLogger(__name__)

__all__ = ["RolloutActor", "TrainerActor", "trainer_device"]


def _limit_threads(cpu: int | None) -> None:
    """One core per actor: the engine on one, the trainer on the other (2-core machines)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError:  # fewer cores than expected: leave the affinity alone
            logger.warning("could not pin to core %d", cpu)


def _capture_output(log_dir: str | None, name: str) -> None:
    """Send this process's stdout and stderr (vLLM's, torch's and transformers' logs, Python
    warnings, and any child process made later) to `log_dir/name.log` instead of Ray's
    worker logs, which the driver would echo on the terminal. At the file-descriptor level,
    so native code's output goes there too."""
    if log_dir is None:
        return
    import sys

    Path(log_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(log_dir) / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


async def _make_engine(config: Any) -> Any:
    """The engine of a replica plan: a `VLLMEngine`, or (tests only) a `FakeEngine`."""
    from rollout_engine.vllm_engine import VLLMEngine, VLLMEngineConfig

    if isinstance(config, VLLMEngineConfig):
        return await VLLMEngine.create(config)
    from rollout_engine.testing import FakeEngine, FakeEngineConfig

    if isinstance(config, FakeEngineConfig):
        return FakeEngine(config)
    raise TypeError(f"unknown engine config {type(config).__name__}")


PENDING_ROWS_FILE = "metrics_pending.json"
# Where the trainer ranks meet when they all share one node: loopback, never the network.
LOOPBACK_HOST = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"


def _write_pending_rows(checkpoint: Path, records: list[tuple[int, dict[str, Any]]]) -> None:
    import json

    path = Path(checkpoint) / PENDING_ROWS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([[step, metrics] for step, metrics in records], default=float))
    tmp.replace(path)


@ray.remote(max_concurrency=ROLLOUT_ACTOR_MAX_CONCURRENCY, max_restarts=0)
class RolloutActor:
    """One engine and the `Rollouter` that feeds the queue from it (see `ReplicaPlan`)."""

    def __init__(self, plan: ReplicaPlan, queue: Any) -> None:
        _capture_output(plan.log_dir, f"rollout{plan.replica}")
        _limit_threads(plan.cpu)
        self._plan = plan
        self._queue = queue
        self._run_task: asyncio.Task[Any] | None = None
        self._stale_drops_seen = 0
        self._stale_ids_seen = 0  # the queue's stale drops whose prompts were given back
        self._prompt_source: Any = None
        self._evaluator: Any = None  # train_app.evaluation.ReplicaEvaluator, with a held-out set
        self._first_eval_due = False
        # Failed with the error of a weight push this replica could not load (see wait()).
        self._broken: asyncio.Future[None] | None = None

    async def start(
        self,
        weights: dict[str, Any] | None = None,
        version: int | None = None,
        begin: bool = True,
        hold: bool = False,
    ) -> float:
        """Start the engine (tens of seconds on CPU) and, with `begin`, the rollout loop;
        returns the engine's start-up seconds.

        A replacement for a dead replica (the driver's restart) gets the trainer's last pushed
        `weights` and their `version`: they are loaded before the rollouter is built, so its
        admission budget counts from that version, and `begin=False` lets the driver attach
        it to the trainer's weight pushes before it generates (then `begin()`). The driver
        also starts every replica of a run with `begin=False`, then `begin()`s them together
        once every engine is up: a resumed run's restored partials (oldest tokens first) then
        reach the queue ahead of any replica's new groups, so they are trained on before their
        tokens grow too stale. With `hold` its new prompts wait for `release_new_prompts()`
        (the driver's hold across replicas, see `train_app.driver.startup`)."""
        from mm_preprocess import EventLoopLagMonitor

        self._broken = asyncio.get_running_loop().create_future()
        self._lag = EventLoopLagMonitor()
        await self._lag.start()
        task = await self._start_engine(weights, version)
        await self._build_rollouter(task, hold)
        if weights is not None:  # a replacement: the run's first evaluation is long done
            self._first_eval_due = False
        # Drops the queue counted before this replica existed are not its own (a replacement).
        self._stale_drops_seen = self._drop_share(await self._stale_drops())
        if begin:
            await self.begin()
        return float(getattr(self._engine, "startup_s", 0.0))

    async def _start_engine(self, weights: dict[str, Any] | None, version: int | None) -> Any:
        """The task (its tokenizer, its dataset) and the engine, loaded with `weights` at
        `version` if given (a replacement); returns the task."""
        from train_app.models import load_tokenizer
        from train_app.multimodal import make_vision_preprocessor
        from train_app.tasks import is_vision_task, make_task

        plan = self._plan
        tokenizer = await asyncio.to_thread(load_tokenizer, plan.model_dir)
        # A vision task writes its PNG dataset when built: file work, so off the loop.
        task = await asyncio.to_thread(make_task, plan.task, tokenizer, **plan.task_options)
        self._task_metrics = getattr(task, "metrics", dict)  # e.g. reward/<component>
        engine_config = plan.engine
        if is_vision_task(plan.task) and hasattr(engine_config, "image_token_id"):
            # The task's prompts carry expanded image placeholders; the engine collapses them.
            engine_config = dataclasses.replace(engine_config, image_token_id=task.image_token_id)
        self._engine = await _make_engine(engine_config)
        if weights is not None and version is not None:
            from train_app.weight_wire import unpack_weights

            await self._engine.pause(mode="keep", clear_cache=True)
            await self._engine.load_weights(unpack_weights(weights), version)
            await self._engine.resume()
        self._held_out = await self._held_out_set(tokenizer)
        self._preprocessor = None
        if is_vision_task(plan.task):
            # Images are decoded and resized in VisionPreprocessor's bounded thread pool.
            self._preprocessor = make_vision_preprocessor(task.settings)
            await self._preprocessor.warmup()
        return task

    async def _held_out_set(self, tokenizer: Any) -> tuple[list[Any], Any] | None:
        """This replica's held-out prompts and their reward function (None: no evaluation);
        the set is read and tokenized in a thread."""
        from train_app.evaluation import eval_prompts
        from train_app.tasks import make_task

        plan = self._plan.eval
        if plan is None:
            return None
        task = await asyncio.to_thread(make_task, plan.task, tokenizer, **plan.task_options)
        stream = task.prompts(plan.prompt_seed)
        return await asyncio.to_thread(eval_prompts, plan, stream), task.reward

    async def _build_rollouter(self, task: Any, hold: bool) -> None:
        """The `Rollouter` over the engine: its prompt stream, the queue, the failure journal,
        and a resumed run's restored groups and put-back count."""
        from rollout_engine import Rollouter

        from train_app.prompts import PromptSource
        from train_app.wiring import QueueTrajectorySink

        plan = self._plan
        self._journal = None
        if plan.failures_path is not None:
            from train_app.failure_log import FailureJournal

            self._journal = FailureJournal(plan.failures_path, replica=plan.replica)
        # The source itself (not an iterator): the rollouter's snapshots record its position
        # (`checkpoint_state`); it seeks there in the prompt thread.
        self._prompt_source = PromptSource(
            task,
            plan.prompt_seed,
            consumed=plan.consumed_prompt_ids,
            position=plan.prompt_position,
            redo=plan.redo_prompt_ids,
        )
        self._rollouter = Rollouter(
            self._engine,
            self._prompt_source,
            QueueTrajectorySink(self._queue),
            task.reward,
            plan.rollout,
            preprocessor=self._preprocessor,
            on_failure=self._journal,
            # Multi-turn tasks (`tool`) give an environment per episode and its limits.
            environment=getattr(task, "environment", None),
            episode=getattr(task, "episode", None),
            staleness_bound=plan.staleness,
        )
        if plan.restore is not None:  # a resumed run's in-flight groups (train_app.inflight)
            self._rollouter.restore(plan.restore)
        if plan.requeued:  # its share of the checkpoint's queued groups the driver put back
            self._rollouter.count_requeued(plan.requeued)
        if hold:
            self._rollouter.hold_new_prompts()
        if plan.eval is not None and self._held_out is not None:
            from train_app.evaluation import ReplicaEvaluator

            prompts, reward = self._held_out
            self._evaluator = ReplicaEvaluator(
                plan.eval, plan.replica, self._rollouter, prompts, reward
            )
            self._first_eval_due = True

    async def restored_delivered(self) -> None:
        """Returns once this replica's restored groups are delivered (or its loop ended)."""
        await self._rollouter.wait_restored_delivered()

    async def release_new_prompts(self) -> None:
        """End the hold of `start(hold=True)`."""
        self._rollouter.release_new_prompts()

    async def begin(self) -> None:
        """Start the rollout loop (once)."""
        if self._run_task is None:
            self._lag.reset()  # report the steady state, not the engine start-up
            self._run_task = asyncio.create_task(self._run())
            if self._evaluator is not None and not self._evaluator.plan.resumed:
                self._first_evaluation(self._rollouter.version)

    def _first_evaluation(self, version: int) -> None:
        """The evaluation at the start: once the engine holds the run's starting weights
        (a resumed run's come with the trainer's first push)."""
        if self._evaluator is not None and self._first_eval_due:
            self._first_eval_due = False
            self._evaluator.first(version)

    async def eval_results(self, acked: dict[str, int]) -> dict[str, Any] | None:
        """The finished evaluations the driver has not acknowledged (`acked`; see
        `train_app.evaluation.ReplicaEvaluator.results`); None without a held-out set."""
        return self._evaluator.results(acked) if self._evaluator is not None else None

    async def evaluate_last(self, step: int) -> None:
        """The evaluation at the end of training (labelled `step`); returns when it is done
        (at once without a held-out set, or when the last weights were just evaluated)."""
        if self._evaluator is not None:
            await self._evaluator.last(step)

    async def _run(self) -> dict[str, Any]:
        try:
            stats = await self._rollouter.run()
        except asyncio.CancelledError:
            raise
        except BaseException:
            # The driver sees it through `wait()` and restarts this replica or fails the
            # queue (and so the run) with the cause: the queue stays open for a replacement.
            logger.exception("rollouter failed")
            raise
        import msgspec

        return msgspec.to_builtins(stats)

    async def wait(self) -> dict[str, Any]:
        """Returns when the rollout loop ends; raises its error if it failed, or the error of
        a weight push this replica could not load (it is then of no use to the run: the
        driver restarts it)."""
        assert self._run_task is not None and self._broken is not None, "start() first"
        await asyncio.wait({self._run_task, self._broken}, return_when=asyncio.FIRST_COMPLETED)
        if self._broken.done():
            await self._broken  # done: raises the push's error at once
        return await asyncio.shield(self._run_task)

    async def update_weights(self, weights: Any, version: int) -> None:
        from train_app.weight_wire import unpack_weights

        try:
            # Tensors over the fetched object-store buffers (no copy); vLLM copies them in.
            await self._rollouter.update_weights(unpack_weights(weights), version)
        except Exception as exc:
            # E.g. a dead engine (EngineDeadError): report it through wait(), with its cause.
            logger.exception("weights v%d could not be loaded", version)
            if self._broken is not None and not self._broken.done():
                self._broken.set_exception(exc)
            raise
        if self._evaluator is not None:
            if self._evaluator.plan.resumed:
                self._first_evaluation(version)
            self._evaluator.on_version(version)
        await self._report_downstream_drops()

    async def _report_downstream_drops(self) -> None:
        """Groups the queue dropped as too stale free their admission slots (otherwise each
        drop shrinks generate-ahead for good). The queue counts drops for all replicas
        together; replica i takes drops i, i + n, i + 2n, ... so the shares sum to the total."""
        total = await self._stale_drops()
        if total is None:
            return
        share = self._drop_share(total)
        if share > self._stale_drops_seen:
            self._rollouter.on_downstream_drop(share - self._stale_drops_seen)
            self._stale_drops_seen = share
            await self._give_back_stale()

    async def _give_back_stale(self) -> None:
        """The prompts of this replica's stream whose groups the queue dropped as too stale
        are generated again (the source takes only its own stream's ids)."""
        try:
            total, ids = await self._queue.stale_item_ids(self._stale_ids_seen)
        except Exception:  # a failing queue is reported by the driver
            return
        self._stale_ids_seen = total
        if ids and self._prompt_source is not None:
            # The source keeps its own stream's and generates them again (in its thread).
            self._prompt_source.give_back(ids)
            logger.info("%d prompts dropped as too stale by the queue given back", len(ids))

    async def _stale_drops(self) -> int | None:
        try:
            stats = await self._queue.stats()
        except Exception:  # a failing queue is reported by the driver
            return None
        return stats.dropped.get("stale", 0)

    def _drop_share(self, total: int | None) -> int:
        n, i = self._plan.replicas, self._plan.replica
        return (total - i + n - 1) // n if total is not None and total > i else 0

    async def metrics(self) -> dict[str, Any]:
        metrics = dict(self._rollouter.metrics())
        metrics.update(self._lag.metrics(prefix="event_loop"))
        metrics.update(self._task_metrics())
        stats = self._rollouter.stats()
        metrics["rollout/failed"] = float(stats.failed)
        if self._plan.restore is not None:  # what this replica continued from the checkpoint
            metrics["rollout/resume_restored"] = float(stats.restored)
            metrics["rollout/resume_dropped_stale"] = float(stats.restore_dropped)
            metrics["rollout/resume_dropped_tokens"] = float(stats.restore_dropped_tokens)
        return metrics

    async def snapshot_in_flight(self) -> Any:
        """The rollouter's in-flight groups now (`Rollouter.snapshot_in_flight`; the run goes
        on), for the trainer to write into its checkpoint (`train_app.inflight`); None when
        the rollout loop is not running (not started yet, or ended)."""
        if self._run_task is None or self._run_task.done():
            return None
        return await self._rollouter.snapshot_in_flight()

    async def pids(self) -> list[int]:
        """This actor's process and its children (vLLM's engine core), for tests and ops."""
        return _process_tree()

    async def node_id(self) -> str:
        """The Ray node this actor runs on (hex id), for placement checks and ops."""
        return ray.get_runtime_context().get_node_id()

    async def stats(self) -> dict[str, Any]:
        """The rollouter's `RolloutStats` (group counts: admitted, delivered, failed, dropped,
        in flight) as plain data; the driver's end-of-run group accounting reads it."""
        import msgspec

        return msgspec.to_builtins(self._rollouter.stats())

    async def failures(self) -> list[dict[str, Any]]:
        """The most recent failed samples (id, error type and message; the last
        `RolloutConfig.recent_failures`), as plain data."""
        import msgspec

        return [msgspec.to_builtins(f) for f in self._rollouter.failures]

    async def stop(self) -> None:
        """Stop the rollout loop and close the engine; safe before `start()` has finished."""
        if self._evaluator is not None:
            await self._evaluator.aclose()
        if self._run_task is not None and not self._run_task.done():
            await self._rollouter.stop()
            self._run_task.cancel()
        if hasattr(self, "_engine"):
            await self._engine.close()
        if getattr(self, "_preprocessor", None) is not None:
            await self._preprocessor.aclose()
        if hasattr(self, "_lag"):
            await self._lag.stop()
        if getattr(self, "_journal", None) is not None:
            await asyncio.to_thread(self._journal.close)


def _pad_token_id(plan: TrainerPlan, tokenizer: Any) -> int:
    """The plan's pad id (read from the model's files), else the tokenizer's (0 is a real id,
    so not `or`), else the fallback."""
    for candidate in (plan.pad_token_id, tokenizer.pad_token_id):
        if candidate is not None:
            return int(candidate)
    return plan.fallback_pad_token_id


def trainer_device(gpu_ids: Sequence[Any], cuda_available: bool) -> str:
    """Where a trainer rank trains: its GPU when Ray gave it one (`--trainer-resources GPU=1`;
    Ray sets CUDA_VISIBLE_DEVICES so it is `cuda` device 0, and `DataParallel` then uses NCCL
    and FSDP2), else the CPU (gloo and DDP), even on a machine with GPUs it was not given."""
    return "cuda" if gpu_ids and cuda_available else "cpu"


def _process_tree() -> list[int]:
    import psutil

    me = psutil.Process()
    return [me.pid, *(child.pid for child in me.children(recursive=True))]


@ray.remote(max_concurrency=TRAINER_ACTOR_MAX_CONCURRENCY, max_restarts=0)
class TrainerActor:
    """One rank of the trainer: runs `PPOTrainer` on batches from the queue; rank 0 pushes
    weights to the rollouters.

    With `plan.world_size` N > 1 there is one actor per rank; they form a torch.distributed
    group (`ppo_trainer.DataParallel`) at `rendezvous()`'s address (asked of rank 0), and
    the driver makes every call that contains collectives (`setup`, `train`) on all of them
    at once. Rank 0 alone reads the queue (it sends each step's groups to the others),
    pushes weights, writes the checkpoint files and keeps metric records; ranks > 0 take
    `queue=None` and no rollouters. With N = 1 nothing of torch.distributed is used.
    """

    def __init__(self, plan: TrainerPlan, queue: Any, rollout_actors: list[Any]) -> None:
        _capture_output(plan.log_dir, plan.log_name)
        _limit_threads(plan.cpu)
        import torch

        torch.set_num_threads(1)
        self._plan = plan
        self._queue = queue
        self._rollout_actors = rollout_actors
        self._records: list[tuple[int, dict[str, Any]]] = []
        self._train_started: float | None = None
        self._stop_requested = False
        self._setup_lock = asyncio.Lock()
        self._source: Any = None  # train()'s QueueBatchSource
        # Each replica's snapshot at the last checkpoint (its in-flight groups and stream
        # position): what a replacement of a dead rollouter starts from (`rollout_handoff`).
        self._positioned: dict[int, Any] = {}
        self._dp: Any = None  # ppo_trainer.DataParallel when world_size > 1
        self._store_socket: Any = None  # rank 0's, from `rendezvous` to `setup`

    def log(self, metrics: dict[str, Any], step: int) -> None:  # MetricsSink
        if self._plan.rank != 0:
            return  # rank 0's records are the run's (its metrics are all-reduced)
        # `trainer/wall_s`: seconds since training began (after the model load), so time to
        # a target reward compares sync and async runs on the same footing.
        wall_s = time.monotonic() - self._train_started if self._train_started else 0.0
        extra = {"trainer/wall_s": wall_s}
        if self._source is not None:  # groups of a prompt already taken (elastic rollouters)
            extra["trainer/duplicates_dropped"] = float(self._source.duplicates)
        self._records.append((step, {**metrics, **extra}))

    async def rendezvous(self, loopback: bool = False) -> str:
        """The torch.distributed address of the group (ask rank 0): `tcp://` this node's IP
        and a port this actor listens on from now (`ppo_trainer.listen_for_ranks`; its store
        serves on that very socket in `setup`, so the port is never released and re-bound,
        and nothing listens on the other interfaces). `loopback` (every rank on this node):
        127.0.0.1, so the store, which authenticates no one and unpickles what it is sent,
        is not reachable from other machines."""
        from ppo_trainer import listen_for_ranks

        host = LOOPBACK_HOST if loopback else ray.util.get_node_ip_address()
        if self._store_socket is not None:
            self._store_socket.close()
        self._store_socket = listen_for_ranks(host)
        port = int(self._store_socket.getsockname()[1])
        return f"tcp://{host}:{port}"

    async def setup(self, init_method: str | None = None) -> float:
        """Join the rank group at `init_method` (world_size > 1; every rank at once), load the
        model (and the checkpoint of a resumed run) and build the trainer; returns the
        seconds it took. Needs no engine, so the driver runs it while the engines start;
        with one rank `train()` calls it if the driver did not."""
        async with self._setup_lock:
            if hasattr(self, "_trainer"):
                return 0.0
            if self._plan.world_size > 1 and init_method is None:
                raise RuntimeError("a trainer of several ranks needs setup(init_method) first")
            t0 = time.monotonic()
            await self._build_trainer(init_method)
            return time.monotonic() - t0

    async def _join_group(self, init_method: str) -> Any:
        """This rank's `DataParallel` (gloo on CPU, NCCL on GPU); blocks, in a thread, until
        every rank has joined."""
        from ppo_trainer import DataParallel

        plan = self._plan
        if init_method.startswith(f"tcp://{LOOPBACK_HOST}:"):
            # The ranks' own connections (gloo's, NCCL's bootstrap) on loopback too.
            for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(variable, LOOPBACK_INTERFACE)
        store_socket, self._store_socket = self._store_socket, None  # the store takes it
        return await asyncio.to_thread(
            DataParallel.init,
            plan.rank,
            plan.world_size,
            init_method=init_method,
            strategy=plan.dp_strategy,  # type: ignore[arg-type]
            timeout_s=plan.dp_timeout_s,
            store_socket=store_socket,
        )

    async def _build_trainer(self, init_method: str | None = None) -> None:
        from mm_preprocess import EventLoopLagMonitor
        from ppo_trainer import PPOTrainer
        from transformers import AutoModelForCausalLM

        from train_app.models import load_tokenizer
        from train_app.wiring import RolloutWeightSink

        plan = self._plan
        self._lag = EventLoopLagMonitor()
        await self._lag.start()
        mm_inputs_fn = None
        if plan.vision:
            from train_app.multimodal import VisionInputsFn
            from train_app.vision_model import load_vision_policy

            model = await asyncio.to_thread(load_vision_policy, plan.model_dir)
            mm_inputs_fn = VisionInputsFn(plan.model_dir)
        else:
            model = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, plan.model_dir)
        tokenizer = await asyncio.to_thread(load_tokenizer, plan.model_dir)
        import torch

        self._device = trainer_device(ray.get_gpu_ids(), torch.cuda.is_available())
        # PPOTrainer follows the model's device (batches, value head, checkpoint loads).
        model = await asyncio.to_thread(model.to, self._device)
        if plan.world_size > 1:
            assert init_method is not None
            self._dp = await self._join_group(init_method)
        self._sink = RolloutWeightSink(self._rollout_actors) if plan.rank == 0 else None
        # In a thread: with several ranks the constructor broadcasts rank 0's weights.
        self._trainer = await asyncio.to_thread(
            PPOTrainer,
            model,
            plan.ppo,
            weight_sink=self._sink,
            metrics_sink=self,
            mm_inputs_fn=mm_inputs_fn,
            pad_token_id=_pad_token_id(plan, tokenizer),
            data_parallel=self._dp,
            on_checkpoint=self._save_inflight,
            checkpoint_labels=plan.checkpoint_labels,
            staleness_bound=plan.staleness,
            consumed_ids_kept=plan.consumed_ids_kept,
        )
        if self._stop_requested:  # stop() came while the model was loading
            self._trainer.stop()
        if plan.resume_from:
            await self._trainer.load_checkpoint(plan.resume_from)

    async def train(self) -> dict[str, Any]:
        """Train to `steps` or until `stop()`; returns the summary, this `rank` and
        `checkpoint_step`: the step of the checkpoint this call saved last (None if none).

        A checkpoint is saved at the end (also after `stop()`) unless the last step already
        wrote one or no step was taken, so the last checkpoint is always at the last step.
        With several ranks: collective (call it on every rank at once); ranks > 0 follow
        rank 0's steps and return when it ends."""
        from async_queue import QueueClosed

        from train_app.wiring import QueueBatchSource

        await self.setup()
        plan = self._plan
        if plan.resume_from:
            await self._push_resumed_weights()
        source = None
        if plan.rank == 0:
            source = QueueBatchSource(
                self._queue,
                plan.staleness.max_staleness,
                taken=self._trainer.consumed_prompt_ids,
                kept=plan.consumed_ids_kept,
            )
        self._source = source
        self._train_started = time.monotonic()
        start_step = self._trainer.step
        summary = await self._trainer.train(source, end_of_stream=(QueueClosed,))
        step, every = self._trainer.step, plan.ppo.checkpoint_every
        checkpoint_step = (step // every) * every if every else None  # saved by the loop
        if checkpoint_step is not None and checkpoint_step <= start_step:
            checkpoint_step = None  # (before this call)
        if step > start_step and checkpoint_step != step:
            await self._save_final(Path(plan.run_dir) / "checkpoints")
            checkpoint_step = step
        await self._lag.stop()
        return {**summary.as_dict(), "checkpoint_step": checkpoint_step, "rank": plan.rank}

    async def _push_resumed_weights(self) -> None:
        """The engines started from the initial weights: give them the checkpoint's. With
        several ranks gathering the weights is collective; rank 0 pushes them."""
        from ppo_trainer import export_weights

        model = self._trainer.model
        if self._dp is not None:
            weights = await asyncio.to_thread(self._dp.full_state_dict, model)
        else:
            weights = await asyncio.to_thread(export_weights, model)
        if self._sink is not None:
            await self._sink.push_weights(weights, self._trainer.version)

    async def _save_inflight(self, checkpoint: Path) -> None:
        """`PPOTrainer`'s checkpoint hook: every replica's in-flight groups, then the groups
        queued for the trainer, go into the checkpoint directory, so `--resume` continues
        them (`train_app.inflight`; the order matters, see there)."""
        from train_app.inflight import snapshot_queue, snapshot_replicas

        # The sink knows each replica's current actor (a restarted one's replacement).
        actors = self._sink.actors if self._sink is not None else self._rollout_actors
        saved = await snapshot_replicas(actors, checkpoint)
        self._positioned.update(saved.positioned)
        if self._queue is not None:
            # This trainer is the queue's only reader and is inside its checkpoint: nothing
            # is taken from the queue until the copy is made.
            await snapshot_queue(self._queue, checkpoint, self._trainer.version)
        if self._records:
            # Rows the driver has not written yet (it may die before it does): a resume
            # writes those up to the checkpoint's step, so no step's row goes missing.
            await asyncio.to_thread(_write_pending_rows, checkpoint, list(self._records))

    async def _save_final(self, checkpoints: Path) -> None:
        from ppo_trainer.checkpoint import update_latest

        # Collective with several ranks; rank 0 wrote the files and moves `latest`.
        path = await self._trainer.save_checkpoint(checkpoints / f"step_{self._trainer.step:06d}")
        if self._plan.rank == 0:
            await asyncio.to_thread(update_latest, path, self._trainer.config.keep_checkpoints)

    async def drain_metrics(
        self, written_step: int | None = None
    ) -> list[tuple[int, dict[str, Any]]]:
        """Per-step records after `written_step` (the last step the driver has written; its
        records and those before are dropped here), with this loop's lag added. A record is
        kept until the driver says it was written: a reply lost to the driver's timeout
        (a loaded machine) is sent again, so no step's row goes missing."""
        if written_step is not None:
            self._records = [(step, m) for step, m in self._records if step > written_step]
        lag = self._lag.metrics(prefix="event_loop/trainer") if hasattr(self, "_lag") else {}
        return [(step, {**m, **lag}) for step, m in self._records]

    async def pids(self) -> list[int]:
        return _process_tree()

    async def node_id(self) -> str:
        """The Ray node this actor runs on (hex id)."""
        return ray.get_runtime_context().get_node_id()

    async def rollout_handoff(self) -> dict[str, Any]:
        """What a replacement rollout replica starts from (the driver's restart):
        `weights` (`[ref]` of the last pushed weights, or None before the first push, when
        the model's own files are current), their `version`, `taken`: the prompt ids handed
        to training most recently (consumed, in the step under way, or before a resume: the
        last `consumed_ids_kept`), which its prompt stream skips, and `snapshots`: each
        replica's in-flight snapshot at the last checkpoint with its stream position (by
        replica), where a replacement starts."""
        await self.setup()
        last = self._sink.last
        taken = set(self._trainer.consumed_prompt_ids)
        if self._source is not None:
            taken.update(self._source.taken)
        return {
            "weights": None if last is None else [last[0]],
            "version": None if last is None else last[1],
            "taken": sorted(taken),
            "snapshots": dict(self._positioned),
        }

    async def attach_rollout(self, index: int, actor: Any, version: int | None) -> None:
        """Replica `index` is now `actor`, which serves `version` (None: the model's own
        files): it gets the weights pushed since, then every later push."""
        await self.setup()
        await self._sink.attach(index, actor, -1 if version is None else version)

    async def stop(self) -> None:
        """Graceful stop: the step in progress finishes, then `train()` checkpoints and
        returns. Also works before `train()` has built its trainer. With several ranks, ask
        rank 0: the others follow it."""
        self._stop_requested = True
        if hasattr(self, "_trainer"):
            self._trainer.stop()

"""Resume state at a million prompts: checkpoint bytes, resume to the first admitted prompt,
and memory that does not grow with the prompts consumed.

In-process, without Ray or vLLM: the bench runs the code a resume runs, with the real
classes, and leaves out only the actors around them.

- Growth: one replica's `train_app.prompts.PromptSource` over the `repeat` task hands out
  N prompts (the rollouter's side), and the trainer's side records each as a consumed group
  (`ppo_trainer.ConsumedIds` with the plan's `consumed_ids_kept`, and the queue reader's
  duplicate guard `train_app.wiring.RecentIds`). Process RSS is read after 10k (quick: 1k)
  and after N. The checkpoint's prompt state is what the run would write then: the stream's
  `checkpoint_state()` (msgpack, inside `inflight-replica0.msgpack`) and `trainer_state.json`.
  The "before" figure is `trainer_state.json` holding every consumed prompt and group id (its
  response ids written as group sizes, as the old format did).
- Resume: a run directory with a real checkpoint (trainer state, an in-flight snapshot of 64
  groups, a manifest) of a run that consumed one whole epoch of an N-row dataset
  (`--dataset`, a JSONL file read by Hugging Face `datasets`). Timed from the driver's
  `resume_point` (checkpoint choice, manifest check, side files) through `plan`, the
  replica's `PromptSource` and a real `Rollouter` (over `rollout_engine.testing.FakeEngine`, a
  fake engine: generation is not what is measured) to its first admitted new prompt, with
  the event-loop lag of the loop the rollouter runs on (the driver's part runs in a thread,
  as it runs in another process) and the CPU seconds of every thread (wall time on a shared
  machine is mostly waiting for a core; the load average is reported with it). Once from a
  checkpoint with a stream position, once from an older-format one that lists every
  consumed prompt id (the compatibility path, which also is what every resume cost before
  positions existed). The dataset's loading (the rollout actor builds its task at any start)
  is reported apart.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import tempfile
import time
from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import psutil
from mm_preprocess import EventLoopLagMonitor
from ppo_trainer import ConsumedIds, TrainerState, write_manifest
from ppo_trainer.checkpoint_meta import STATE_FILE
from rollout_engine import GroupSnapshot, RolloutConfig, Rollouter, RolloutSnapshot, save_snapshot
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink
from tiny_models import build_char_tokenizer
from train_app.config import TrainConfig
from train_app.driver import resume_point
from train_app.inflight import inflight_path
from train_app.plan import consumed_ids_kept, plan
from train_app.prompts import PromptSource
from train_app.tasks import make_task
from train_app.tasks.dataset import DatasetTask
from train_app.wiring import RecentIds

from bench_app.report import BenchReport

__all__ = ["run"]

PROMPTS = 1_000_000
QUICK_PROMPTS = 20_000
EARLY = 10_000  # the RSS reading to compare with, after the id window has filled
QUICK_EARLY = 10_000  # after the trainer's id window has filled (5,120 by default)
GROUP_SIZE = 8  # the app's default
IN_FLIGHT = 64  # groups in the checkpoint's in-flight snapshot
TARGET_STATE_BYTES = 1 << 20
TARGET_RESUME_S = 1.0
# RSS may move by allocator noise; growth past this (or 5% of the early figure) is growth.
RSS_SLACK_MIB = 8.0
MIB = 1 << 20


def _rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / MIB


def _group(prompt_id: str, index: int) -> list[Any]:
    """The three ids the trainer's bookkeeping reads of each response (nothing else)."""
    group_id = f"{prompt_id}:{index}"
    return [
        SimpleNamespace(response_id=f"{group_id}:{k}", group_id=group_id, prompt_id=prompt_id)
        for k in range(GROUP_SIZE)
    ]


def _growth(count: int, early: int, tokenizer: Any) -> dict[str, Any]:
    kept = consumed_ids_kept(TrainConfig())
    source = PromptSource(make_task("repeat", tokenizer), seed=0)
    consumed, taken = ConsumedIds(limit=kept), RecentIds(kept)
    rss: dict[int, float] = {}
    t0 = time.perf_counter()
    for index, sample in enumerate(source, start=1):
        consumed.add_groups([_group(sample.prompt_id, index)])
        taken.add(sample.prompt_id)
        if index in (early, count):
            rss[index] = _rss_mib()
        if index == count:
            break
    stream = len(msgspec.msgpack.encode(source.checkpoint_state()))
    trainer = len(consumed.state(step=count // 16, version=count // 16).to_json())
    return {
        "kept": kept,
        "stream_state_bytes": stream,
        "trainer_state_bytes": trainer,
        "rss_early_mib": rss[early],
        "rss_mib": rss[count],
        "walk_s": time.perf_counter() - t0,
    }


def _legacy_state_bytes(count: int) -> int:
    """`trainer_state.json` as it was: every consumed prompt and group id."""
    prompts = tuple(f"s0-{i}" for i in range(count))
    groups = tuple(f"{p}:{i}" for i, p in enumerate(prompts))
    state = TrainerState(
        step=count // 16,
        version=count // 16,
        consumed_group_ids=groups,
        consumed_prompt_ids=prompts,
    )
    text = state.to_json().replace(
        '"consumed_response_ids": []', f'"consumed_group_sizes": [[{GROUP_SIZE}, {count}]]'
    )
    return len(text)


def _write_dataset(root: Path, rows: int) -> tuple[Path, str]:
    data = root / "rows.jsonl"
    with data.open("w") as file:
        for i in range(rows):
            file.write(json.dumps({"prompt": f"{i % 10}*{i % 6 + 1}=", "answer": str(i)}) + "\n")
    reward = root / "score.py"
    reward.write_text("def zero(completion):\n    return 0.0\n")
    return data, f"{reward}:zero"


def _write_checkpoint(run_dir: Path, task: DatasetTask, rows: int, legacy: bool) -> None:
    """A run that consumed epoch 0 but for its last `IN_FLIGHT` prompts, in flight."""
    checkpoint = run_dir / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    order = task.epoch_order(0)
    ids = [f"e0-r{int(row)}" for row in order]
    flying = list(islice(task.stream_from(0, rows - IN_FLIGHT), IN_FLIGHT))
    groups = [
        GroupSnapshot(group_id=f"{s.prompt_id}:0", sample=s, admitted_version=1) for _, s in flying
    ]
    position = {"seed": 0, "position": rows, "epoch": 1, "cursor": 0}
    snapshot = RolloutSnapshot(
        version=1, group_size=GROUP_SIZE, groups=groups, prompt_state=None if legacy else position
    )
    save_snapshot(snapshot, inflight_path(checkpoint, 0))
    consumed = ConsumedIds(limit=None if legacy else consumed_ids_kept(TrainConfig()))
    trained = ids[: rows - IN_FLIGHT]
    consumed.prompt_ids = dict.fromkeys(trained if legacy else trained[-consumed.limit :])
    (checkpoint / STATE_FILE).write_text(consumed.state(step=1, version=1).to_json())
    (run_dir / "checkpoints" / "latest").symlink_to("step_000001", target_is_directory=True)
    write_manifest(checkpoint)
    (run_dir / "config.toml").write_text("")  # a run directory, as `--resume` checks


async def _resume(config: TrainConfig, run_dir: Path, task: DatasetTask) -> dict[str, float]:
    """Seconds from the resume's start to the rollouter's first admitted new prompt, and the
    rollouter loop's lag meanwhile."""
    monitor = EventLoopLagMonitor(interval_s=0.005)
    await monitor.start()
    t0, cpu0 = time.perf_counter(), time.process_time()
    # The driver's part, before Ray starts (not on the rollouter's loop).
    replica = await asyncio.to_thread(_driver, config, run_dir)
    source = PromptSource(
        task,
        replica.prompt_seed,
        consumed=replica.consumed_prompt_ids,
        position=replica.prompt_position,
        redo=replica.redo_prompt_ids,
    )
    rollout = RolloutConfig(
        group_size=GROUP_SIZE, max_concurrency=IN_FLIGHT + 8, generation_only=True
    )
    rollouter = Rollouter(FakeEngine(FakeEngineConfig(seed=0)), source, ListSink(), _zero, rollout)
    restored = len(replica.restore.groups) if replica.restore is not None else 0
    if replica.restore is not None:
        rollouter.restore(replica.restore)
    run = asyncio.create_task(rollouter.run())
    while rollouter.stats().admitted <= restored:  # noqa: ASYNC110 - polling a counter
        await asyncio.sleep(0.001)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    await rollouter.stop()
    await run
    lag = monitor.metrics()
    await monitor.stop()
    return {"s": seconds, "cpu_s": cpu_s, "lag_max_ms": lag["event_loop/lag_ms_max"]}


def _driver(config: TrainConfig, run_dir: Path) -> Any:
    """The resume point and replica 0's plan, as the driver makes them."""
    return plan(config, resume=resume_point(config, run_dir)).replicas[0]


def _zero(sample: Any, trajectory: Any) -> float:
    return 0.0


def _resumes(root: Path, rows: int, tokenizer: Any) -> dict[str, Any]:
    data, reward = _write_dataset(root, rows)
    t0 = time.perf_counter()
    task = DatasetTask(tokenizer, str(data), [reward], seed=0)
    load_s = time.perf_counter() - t0
    out: dict[str, Any] = {"dataset_load_s": load_s}
    for mode in ("position", "legacy"):
        run_dir = root / f"run-{mode}"
        _write_checkpoint(run_dir, task, rows, legacy=mode == "legacy")
        config = TrainConfig(resume=run_dir, dataset=data, reward=(reward,), group_size=GROUP_SIZE)
        out[mode] = asyncio.run(_resume(config, run_dir, task))
        out[f"{mode}_state_bytes"] = (run_dir / "checkpoints/latest" / STATE_FILE).stat().st_size
    return out


def run(quick: bool = False) -> BenchReport:
    count = QUICK_PROMPTS if quick else PROMPTS
    early = QUICK_EARLY if quick else EARLY
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = build_char_tokenizer(root / "tokenizer")
        growth = _growth(count, early, tokenizer)
        legacy_bytes = _legacy_state_bytes(count)
        resumes = _resumes(root, count, tokenizer)
    return _report(count, early, growth, legacy_bytes, resumes)


def _row(what: str, positions: Any, before: Any) -> dict[str, Any]:
    return {"what": what, "with positions": positions, "before": before}


def _report(
    count: int, early: int, growth: dict[str, Any], legacy_bytes: int, resumes: dict[str, Any]
) -> BenchReport:
    state_bytes = growth["stream_state_bytes"] + growth["trainer_state_bytes"]
    rss_growth = growth["rss_mib"] - growth["rss_early_mib"]
    position, legacy = resumes["position"], resumes["legacy"]
    figures = {
        "prompts": count,
        "prompt_state_bytes": state_bytes,
        "stream_state_bytes": growth["stream_state_bytes"],
        "trainer_state_bytes": growth["trainer_state_bytes"],
        "legacy_state_bytes": legacy_bytes,
        "state_target_bytes": TARGET_STATE_BYTES,
        "resume_to_first_prompt_s": round(position["s"], 4),
        "resume_cpu_s": round(position["cpu_s"], 4),
        "resume_loop_lag_max_ms": round(position["lag_max_ms"], 2),
        "legacy_resume_to_first_prompt_s": round(legacy["s"], 4),
        "legacy_resume_cpu_s": round(legacy["cpu_s"], 4),
        "legacy_resume_loop_lag_max_ms": round(legacy["lag_max_ms"], 2),
        "load_average": round(os.getloadavg()[0], 1),
        "resume_target_s": TARGET_RESUME_S,
        "dataset_load_s": round(resumes["dataset_load_s"], 3),
        f"rss_at_{early}_mib": round(growth["rss_early_mib"], 1),
        f"rss_at_{count}_mib": round(growth["rss_mib"], 1),
        "rss_growth_mib": round(rss_growth, 1),
        "consumed_ids_kept": growth["kept"],
    }
    figures["met"] = bool(
        state_bytes < TARGET_STATE_BYTES
        and position["s"] < TARGET_RESUME_S
        and rss_growth < max(RSS_SLACK_MIB, 0.05 * growth["rss_early_mib"])
    )
    rss = f"{growth['rss_early_mib']:.1f} -> {growth['rss_mib']:.1f}"
    rows = [
        _row("prompt state in the checkpoint (bytes)", state_bytes, legacy_bytes),
        _row("resume to first admitted prompt (s)", position["s"], legacy["s"]),
        _row("  of which CPU, every thread (s)", position["cpu_s"], legacy["cpu_s"]),
        _row(
            "rollouter loop lag in the resume, max (ms)",
            position["lag_max_ms"],
            legacy["lag_max_ms"],
        ),
        _row(f"RSS after {early} -> {count} prompts (MiB)", rss, ""),
    ]
    notes = [
        "before: the checkpoint lists every consumed id (the compatibility path still reads it)",
        f"the trainer keeps the last {growth['kept']} consumed ids (a duplicate guard)",
    ]
    return BenchReport(f"resume state at {count} prompts", rows, figures, notes)

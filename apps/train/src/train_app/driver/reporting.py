"""What a run writes as it goes and at its end: one metrics row per trainer step (the
rollouters', the queue's and the trainer's figures), the progress bar, failures.json,
summary.json, the reward plot and the terminal summary."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from train_app.driver.aio import await_ref
from train_app.evaluation import EvalCollector
from train_app.failure_log import failure_summary
from train_app.outputs import (
    MetricsMirror,
    MetricsWriter,
    plot_metrics,
    print_summary,
    summarize_metrics,
)
from train_app.plan import RunPlan
from train_app.replica_metrics import aggregate_replica_metrics

__all__ = ["METRICS_TIMEOUT_S", "Reporter", "RunResult", "progress_bar"]

# Seconds each actor has to answer a metrics poll; a late answer is asked again next poll.
METRICS_TIMEOUT_S = 5.0
# The rollouters' failure journal in the run dir (`ReplicaPlan.failures_path`).
FAILURES_FILE = "failures.jsonl"


@dataclass
class RunResult:
    """A finished run: its directory and summary.json's content."""

    run_dir: Path
    summary: dict[str, Any]


class Reporter:
    """The run's metrics rows and outputs. `timings` are the seconds of each start-up phase
    (summary.json's `startup`): prepare (model, plan) and ray (start or join) side by side,
    prepare_and_ray (both); actors (engines and the trainer's model load side by side;
    engine and trainer_load are each one's own); to_training (all of that); first_step
    (from train() to the first metrics row) and first_push (its weight sync)."""

    def __init__(self, run_plan: RunPlan, console: Console) -> None:
        self.plan = run_plan
        self.console = console
        self.run_dir = Path(run_plan.trainer.run_dir)
        self.writer: MetricsWriter | None = None
        self.kept_rows = 0
        """Rows of a resumed run's earlier steps (not this run's), its recovered ones too."""
        self.first_row: dict[str, Any] | None = None
        """This run's first metrics row (the rows themselves live only in the file)."""
        self.rollout_metrics: dict[str, Any] = {}
        self._generated_seen: dict[str, tuple[float, float]] = {}
        """Each replica's generated reward sum and response count at the last row."""
        replicas = len(run_plan.replicas)
        # Where each replica's own figures are (`replica_metrics`: kept apart with 2+).
        self._prefixes = (
            [f"rollout/replica{i}/" for i in range(replicas)] if replicas > 1 else ["rollout/"]
        )
        self.timings: dict[str, float] = {}
        held_out = run_plan.replicas[0].eval if run_plan.replicas else None
        self.evals = EvalCollector(len(run_plan.replicas), held_out.n) if held_out else None
        """The held-out evaluations' rows (None: the run evaluates nothing)."""

    def open(self, mirrors: Sequence[MetricsMirror] = ()) -> None:
        """The metrics file; a resumed run continues from its checkpoint's step (later
        history is rewound) and first writes the rows its checkpoint holds. `mirrors`: where
        else every row goes (`train_app.mirrors.open_mirrors`)."""
        self.writer = MetricsWriter(
            self.run_dir, resume_step=self.plan.resume.step, mirrors=mirrors
        )
        self._write_pending_rows()
        self.kept_rows = self.writer.rows

    @property
    def rows(self) -> int:
        """Rows in metrics.jsonl (a resumed run's kept ones included)."""
        return self.writer.rows if self.writer is not None else 0

    @property
    def last_row(self) -> dict[str, Any] | None:
        return self.writer.last_row if self.writer is not None else None

    def _write_pending_rows(self) -> None:
        """A resumed run: the rows its checkpoint holds that the previous driver had not
        written (it died between the trainer's step and its next metrics poll)."""
        from train_app.actors import PENDING_ROWS_FILE

        if self.plan.resume.checkpoint is None:
            return
        path = Path(self.plan.resume.checkpoint) / PENDING_ROWS_FILE
        if not path.exists():
            return
        assert self.writer is not None
        last = self.writer.last_row["step"] if self.writer.last_row else 0
        for step, metrics in json.loads(path.read_text()):
            if last < step <= (self.plan.resume.step or 0):
                # The trainer's figures only: the rollout and queue ones of then are gone.
                row = {**metrics, "recovered_from_checkpoint": True}
                self.writer.log(row, step)
                last = step

    async def collect(self, rollouts: list[Any], queue: Any, trainer: Any, restarts: int) -> None:
        """Rollout metrics of every replica (aggregated), the queue's, and the trainer's new
        per-step records; one row per trainer step goes to the writer."""
        if trainer is None:
            return
        replies = await asyncio.gather(
            *(asyncio.wait_for(await_ref(r.metrics.remote()), METRICS_TIMEOUT_S) for r in rollouts),
            return_exceptions=True,
        )
        if not any(isinstance(r, BaseException) for r in replies):  # else keep the last ones
            self.rollout_metrics = aggregate_replica_metrics(replies)
        try:
            queue_metrics = (await asyncio.wait_for(queue.stats(), METRICS_TIMEOUT_S)).as_metrics()
        except Exception:
            queue_metrics = {}
        last = self.last_row
        written = last["step"] if last is not None and self.rows > self.kept_rows else None
        try:
            drain = trainer.drain_metrics.remote(written)
            records = await asyncio.wait_for(await_ref(drain), METRICS_TIMEOUT_S)
        except Exception:
            records = []  # sent again next time (kept by the trainer until written)
        for step, metrics in records:
            self._write_row(step, {**self.rollout_metrics, **queue_metrics, **metrics}, restarts)
        await self.collect_evals(rollouts)

    async def collect_evals(self, rollouts: list[Any], flush: bool = False) -> None:
        """Rows of the evaluations every replica finished (`flush`: the end of the run, also
        those some replica never finished, e.g. one that died)."""
        if self.evals is None:
            return
        acked = dict(self.evals.acked)
        replies = await asyncio.gather(
            *(
                asyncio.wait_for(await_ref(r.eval_results.remote(acked)), METRICS_TIMEOUT_S)
                for r in rollouts
            ),
            return_exceptions=True,
        )
        rows = self.evals.take(r for r in replies if isinstance(r, dict))
        rows += self.evals.flush() if flush else []
        assert self.writer is not None
        for step, metrics in rows:
            self.writer.log_eval(metrics, step)

    def _write_row(self, step: int, record: dict[str, Any], restarts: int) -> None:
        assert self.writer is not None
        record["rollout/restarts"] = float(restarts)
        queued = self.plan.resume.queued
        if queued.saved:  # what a resume did with its checkpoint's queued groups
            record["queue/resume_requeued"] = float(len(queued.items))
            record["queue/resume_dropped_stale"] = float(queued.dropped_stale)
            record["queue/resume_dropped_tokens"] = float(queued.dropped_tokens)
        mean = self._generated_reward_mean(record)
        if mean is not None:
            record["rollout/generated_reward/mean"] = mean
        self.writer.log(record, step)
        if self.first_row is None:
            self.first_row = self.writer.last_row

    def _generated_reward_mean(self, record: dict[str, Any]) -> float | None:
        """The mean reward of the responses the rollouters generated since the last row
        that had one, whatever became of their groups (a group filter leaves the trained
        batch's `reward/mean` biased; this is the policy's own). None when nothing new was
        generated. Counted per replica: a replica whose count fell was replaced, and its
        replacement's count starts from zero (what its predecessor generated after the last
        row is lost with it)."""
        seen, total_delta, count_delta = {}, 0.0, 0.0
        for replica, (total, count) in _generated_counts(record, self._prefixes).items():
            seen_total, seen_count = self._generated_seen.get(replica, (0.0, 0.0))
            if count < seen_count:  # replaced: the new actor counts from zero
                seen_total, seen_count = 0.0, 0.0
            total_delta += total - seen_total
            count_delta += count - seen_count
            seen[replica] = (total, count)
        if not seen:
            return None
        self._generated_seen = seen
        return total_delta / count_delta if count_delta > 0 else None

    async def write_failures(self, rollouts: list[Any]) -> None:
        failures = await asyncio.gather(
            *(await_ref(r.failures.remote()) for r in rollouts), return_exceptions=True
        )
        (self.run_dir / "failures.json").write_text(
            json.dumps(
                [f for replica in failures if isinstance(replica, list) for f in replica],
                indent=1,
            )
        )

    def progress_info(self) -> str:
        last = self.last_row
        if last is None:
            return "waiting for the first batch"
        return (
            f"reward {last.get('reward/mean', 0):.3f}  "
            f"staleness {last.get('staleness/mean', 0):.2f}/{last.get('staleness/max', 0):.0f}  "
            f"{last.get('tokens/s', 0):,.0f} tok/s  queue {last.get('queue/size', 0):.0f}"
        )

    def finish(
        self,
        trainer_summary: dict[str, Any],
        train_s: float,
        groups: dict[str, Any],
        signum: int | None,
    ) -> RunResult:
        """summary.json, the plot and the terminal summary; `signum`: the signal that
        stopped the run, if one did."""
        assert self.writer is not None
        summary = self._summary(train_s)
        self.writer.close()  # after the plot, which goes to the mirrors too
        if signum is not None:
            summary["interrupted_by"] = signal.Signals(signum).name
            summary["checkpoint_step"] = trainer_summary.get("checkpoint_step")
        full = {
            **summary,
            "groups": groups,
            "startup": {k: round(v, 2) for k, v in self.timings.items()},
        }
        full["trainer_rank_steps"] = trainer_summary.get("rank_steps", [])
        (self.run_dir / "summary.json").write_text(json.dumps(full, indent=2))
        print_summary(summary, self.console)
        return RunResult(self.run_dir, full)

    def _summary(self, train_s: float) -> dict[str, Any]:
        """Read back from metrics.jsonl (streamed: the driver keeps no rows)."""
        assert self.writer is not None
        path = self.writer.path
        plot = plot_metrics(path, self.run_dir / "reward.png", title=str(self.run_dir.name))
        self.writer.add_plot(plot)
        return {
            "run_dir": str(self.run_dir),
            **summarize_metrics(path),
            "startup_s": round(self.timings.get("to_training_s", 0.0), 1),
            "train_wall_s": round(train_s, 1),
            "event_loop_lag_p99_ms": self.rollout_metrics.get("event_loop/lag_ms_p99", ""),
            "rollout_failed": failure_summary(self.run_dir / FAILURES_FILE),
            "plot": str(plot),
            "metrics": str(path),
        }

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def progress_bar(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        disable=not enabled,
        transient=False,
    )


def _generated_counts(
    record: dict[str, Any], prefixes: list[str]
) -> dict[str, tuple[float, float]]:
    """(generated reward sum, responses) under each of `prefixes` that the row has."""
    counts = {}
    for prefix in prefixes:
        total = record.get(prefix + "generated_reward_sum")
        count = record.get(prefix + "generated_responses")
        if total is not None and count is not None:
            counts[prefix] = (float(total), float(count))
    return counts

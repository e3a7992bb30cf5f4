"""Where a run's metrics go: JSONL, TensorBoard events, a PNG plot and a summary table.

Nothing here holds a run's rows in memory: `MetricsWriter` keeps the count and the last row,
and the end-of-run figures (`summarize_metrics`) and plot (`plot_metrics`) stream
metrics.jsonl, so a run of a million steps costs the driver no more memory than one of ten.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.table import Table

__all__ = [
    "EVAL_PREFIX",
    "MAX_LOG_BYTES",
    "MAX_PLOT_POINTS",
    "PLOTTED_KEYS",
    "MetricsMirror",
    "MetricsWriter",
    "cap_log",
    "is_eval_row",
    "iter_metrics",
    "plot_metrics",
    "plot_run",
    "read_metrics",
    "rewind_metrics",
    "summarize_metrics",
    "summary_table",
]

# Points per curve of the plot: more than a 1500-pixel-wide figure can show, and a long
# run's plot is drawn from an evenly spaced subset of its steps.
MAX_PLOT_POINTS = 4000
# Size at which `cap_log` moves a log aside: ample for a day of an actor's warnings, small
# enough that a run that logs in a loop cannot fill the disk (at most twice this per log).
MAX_LOG_BYTES = 64 * 1024 * 1024
# Keys of a held-out evaluation's rows (`MetricsWriter.log_eval`).
EVAL_PREFIX = "eval/"
# The series `plot_run` draws (and the held-out evaluations' reward and pass@N).
PLOTTED_KEYS = (
    "reward/mean", "staleness/mean", "staleness/max", "rollout/idle_ratio", "trainer/idle_ratio",
)  # fmt: skip


class MetricsMirror(Protocol):
    """Another place a run's metrics go beside metrics.jsonl and TensorBoard (e.g. W&B)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def add_plot(self, path: Path) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """A `MetricsSink`: one JSON object per trainer step, mirrored to TensorBoard scalars.

    `resume_step` (a resumed run: the step of the checkpoint it continues from) rewinds the
    history first, so no step is shown twice: rows of metrics.jsonl with a larger step are
    removed (`rewind_metrics`, atomic; `kept` holds the rows that stay), and the TensorBoard
    writer starts with `purge_step=resume_step + 1`, which makes TensorBoard discard the
    events of later steps from the earlier event files.

    The writer keeps no rows: `rows` counts those in the file (the kept ones included) and
    `last_row` is the latest one (None before any).

    `mirrors` receive every row `log` writes, the plot (`add_plot`) and `close`.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool = True,
        resume_step: int | None = None,
        mirrors: Sequence[MetricsMirror] = (),
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._resume_step = resume_step
        self.rows = 0
        self.last_row: dict[str, Any] | None = None
        self.mirrors = tuple(mirrors)
        if resume_step is not None:
            self.rows, self.last_row = _rewind(self.path, resume_step)
        self.kept_rows = self.rows
        """Rows of earlier steps a resumed run kept (0 for a new run)."""
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                log_dir=str(Path(run_dir) / "tensorboard"),
                purge_step=None if resume_step is None else resume_step + 1,
            )

    @property
    def kept(self) -> list[dict[str, Any]]:
        """The rows a resumed run kept, read back from the file (prefer `kept_rows` and
        `last_row`: this list costs memory in proportion to the run)."""
        if self._resume_step is None:
            return []
        return [r for r in iter_metrics(self.path) if r["step"] <= self._resume_step]

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        self.rows += 1
        self.last_row = record
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        for mirror in self.mirrors:
            mirror.log(metrics, step)

    def log_eval(self, metrics: Mapping[str, Any], step: int) -> None:
        """A held-out evaluation's row (every key `eval/...`) for the weights of `step`: in
        metrics.jsonl beside the steps' rows (it is not one: `rows` and `last_row` count
        only those), in TensorBoard at `step`, and to the mirrors."""
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        for mirror in self.mirrors:
            mirror.log(metrics, step)

    def add_plot(self, path: Path) -> None:
        """The run's plot, for the mirrors (the file itself is already in the run dir)."""
        for mirror in self.mirrors:
            mirror.add_plot(path)

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for mirror in self.mirrors:
            mirror.close()


def cap_log(path: Path, max_bytes: int = MAX_LOG_BYTES) -> bool:
    """Copy-and-truncate rotation of a log that other processes append to through file
    descriptors of their own (an actor's stdout and stderr): past `max_bytes`, its content is
    copied to `NAME.1` (replacing the one before) and the file is truncated in place, so every
    writer's next `O_APPEND` write lands at its new start. Lines written between the copy and
    the truncation are lost: a few, once per `max_bytes`. True if it rotated. Call it from a
    thread (it copies up to `max_bytes`)."""
    path = Path(path)
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    previous = path.with_name(path.name + ".1")
    tmp = path.with_name(f".{path.name}.1.tmp")
    with path.open("rb") as source, tmp.open("wb") as copy:
        while chunk := source.read(1 << 20):
            copy.write(chunk)
    os.replace(tmp, previous)
    os.truncate(path, 0)
    return True


def is_eval_row(row: Mapping[str, Any]) -> bool:
    """A held-out evaluation's row (`MetricsWriter.log_eval`), not a trainer step's."""
    keys = [k for k in row if k != "step"]
    return bool(keys) and all(k.startswith(EVAL_PREFIX) for k in keys)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def rewind_metrics(path: Path, step: int) -> list[dict[str, Any]]:
    """Cut metrics.jsonl back to `step`: keep the rows with `step <= step`, one per step (the
    last written wins), in step order, and return them. The file is replaced atomically (a
    temporary file renamed over it), so a crash leaves the old or the new history, never half.
    A torn last line (a killed run) is dropped."""
    _rewind(Path(path), step)
    return list(iter_metrics(path)) if Path(path).exists() else []


def _rewind(path: Path, step: int) -> tuple[int, dict[str, Any] | None]:
    """`rewind_metrics` returning only the count of kept step rows and the last of them
    (evaluation rows are kept too, one per step, but are not step rows). Only the byte
    offset of each row is held while the file is rewritten."""
    if not path.exists():
        return 0, None
    offsets: dict[tuple[int, bool], int] = {}
    with path.open("rb") as source:
        for offset, at, evaluation in _row_steps(source):
            if at <= step:
                offsets[at, evaluation] = offset
        tmp = path.with_name(f".{path.name}.rewind")
        last = None
        with tmp.open("wb") as file:
            for at, evaluation in sorted(offsets):
                source.seek(offsets[at, evaluation])
                line = source.readline()
                file.write(line)
                if not evaluation:
                    last = line
            file.flush()
            os.fsync(file.fileno())
    os.replace(tmp, path)
    rows = sum(not evaluation for _, evaluation in offsets)
    return rows, None if last is None else json.loads(last)


def _row_steps(file: Any) -> Iterator[tuple[int, int, bool]]:
    """(byte offset, step, is an evaluation row) of every whole row of an open
    metrics.jsonl."""
    offset = 0
    for line in iter(file.readline, b""):
        start, offset = offset, offset + len(line)
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line (a killed run)
        at = record.get("step") if isinstance(record, dict) else None
        if isinstance(at, int) and line.endswith(b"\n"):
            yield start, at, is_eval_row(record)


def iter_metrics(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a metrics.jsonl, one at a time; a torn line (a killed run) is skipped."""
    with Path(path).open() as file:
        for line in file:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return list(iter_metrics(path))


def summarize_metrics(path: Path) -> dict[str, Any]:
    """The end-of-run figures of a metrics.jsonl, streamed: `steps` (rows), the mean reward
    of the first and last tenth of the steps, the largest staleness and the last weight
    version; with held-out evaluations, the first and last one's reward and pass@N. Holds
    one float per step, not the rows."""
    rewards = array("d")
    rows, staleness_max, version = 0, 0.0, ""
    evals: list[dict[str, Any]] = []  # the first and the last
    for row in iter_metrics(path):
        if is_eval_row(row):
            if evals:
                evals[1:] = [row]
            else:
                evals.append(row)
            continue
        rows += 1
        if isinstance(row.get("reward/mean"), int | float):
            rewards.append(row["reward/mean"])
        if isinstance(row.get("staleness/max"), int | float):
            staleness_max = max(staleness_max, row["staleness/max"])
        version = row.get("trainer/version", "")
    tenth = max(1, len(rewards) // 10)
    return {
        "steps": rows,
        "reward_first_tenth": statistics.fmean(rewards[:tenth]) if rewards else float("nan"),
        "reward_last_tenth": statistics.fmean(rewards[-tenth:]) if rewards else float("nan"),
        "staleness_max": staleness_max,
        "weight_version": version,
        **_eval_summary(evals),
    }


def _eval_summary(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """`eval_reward_first` / `_last`, `eval_pass@N_first` / `_last` and their steps (the
    first and the last evaluation); nothing for a run without one."""
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    summary: dict[str, Any] = {}
    for key in sorted(k for k in last if k == "eval/reward/mean" or k.startswith("eval/pass@")):
        name = "eval_reward" if key == "eval/reward/mean" else key.replace("/", "_")
        summary[f"{name}_first"] = first.get(key, float("nan"))
        summary[f"{name}_last"] = last[key]
    summary["eval_steps"] = f"{first['step']}..{last['step']}"
    return summary


def plot_metrics(path: Path, png: Path, title: str = "", max_points: int = MAX_PLOT_POINTS) -> Path:
    """`plot_run` of a metrics.jsonl, streamed: only the plotted keys are read, and a run of
    more than `max_points` steps is drawn from an evenly spaced subset of them (the last
    step always included)."""
    rows = sum(1 for _ in iter_metrics(path)) if Path(path).exists() else 0
    stride = max(1, math.ceil(rows / max_points))
    picked = (
        {"step": r["step"], **{k: r[k] for k in r if k in PLOTTED_KEYS or _plotted_eval(k)}}
        for i, r in enumerate(iter_metrics(path) if rows else ())
        if i % stride == 0 or i == rows - 1 or is_eval_row(r)
    )
    return plot_run(list(picked), png, title)


def _plotted_eval(key: str) -> bool:
    return key == "eval/reward/mean" or key.startswith("eval/pass@")


def _series(records: Iterable[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(records: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Reward, staleness and both idle ratios over trainer steps, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    axes[0].plot(*_series(records, "reward/mean"), label="reward/mean")
    for key in sorted({k for r in records for k in r if _plotted_eval(k)}):
        steps, values = _series(records, key)
        axes[0].plot(steps, values, marker="o", linestyle=":", label=f"{key} (held out)")
    axes[0].set_ylim(0, 1.05)
    axes[0].set_title("reward")
    axes[1].plot(*_series(records, "staleness/mean"), label="staleness/mean")
    axes[1].plot(*_series(records, "staleness/max"), label="staleness/max", linestyle="--")
    axes[1].set_title("staleness (versions)")
    axes[2].plot(*_series(records, "rollout/idle_ratio"), label="rollout/idle_ratio")
    axes[2].plot(*_series(records, "trainer/idle_ratio"), label="trainer/idle_ratio")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_title("idle ratios")
    for axis in axes:
        axis.set_xlabel("trainer step")
        axis.legend(loc="best")
        axis.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def summary_table(summary: Mapping[str, Any], title: str = "run summary") -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        table.add_row(key, text)
    return table


def print_summary(summary: Mapping[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(summary_table(summary))

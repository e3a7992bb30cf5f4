"""Where a run's metrics go: JSONL, TensorBoard events, a PNG plot and a summary table."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.table import Table

__all__ = [
    "MetricsMirror",
    "MetricsWriter",
    "plot_run",
    "read_metrics",
    "rewind_metrics",
    "summary_table",
]


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
        self.mirrors = tuple(mirrors)
        self.kept: list[dict[str, Any]] = []
        if resume_step is not None:
            self.kept = rewind_metrics(self.path, resume_step)
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                log_dir=str(Path(run_dir) / "tensorboard"),
                purge_step=None if resume_step is None else resume_step + 1,
            )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
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


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def rewind_metrics(path: Path, step: int) -> list[dict[str, Any]]:
    """Cut metrics.jsonl back to `step`: keep the rows with `step <= step`, one per step (the
    last written wins), in step order, and return them. The file is replaced atomically (a
    temporary file renamed over it), so a crash leaves the old or the new history, never half.
    A torn last line (a killed run) is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        at = record.get("step") if isinstance(record, dict) else None
        if isinstance(at, int) and at <= step:
            rows[at] = record
    kept = [rows[k] for k in sorted(rows)]
    tmp = path.with_name(f".{path.name}.rewind")
    with tmp.open("w") as file:
        file.writelines(json.dumps(r, default=_jsonable) + "\n" for r in kept)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    return kept


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with Path(path).open() as file:
        return [json.loads(line) for line in file if line.strip()]


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(records: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Reward, staleness and both idle ratios over trainer steps, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    axes[0].plot(*_series(records, "reward/mean"), label="reward/mean")
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

"""`runs/<name>/failures.jsonl`: the failed rollout groups, appended as they happen.

The rollouter keeps only the last `RolloutConfig.recent_failures` failures in memory (plus a
count per error type); it hands each one to `Rollouter(..., on_failure=...)`. That callback
runs on the rollouter's event loop, so `FailureJournal.append` only enqueues the record; a
writer thread appends the queued lines to the file and flushes after each batch, so the lines
are on disk (page cache) even if the actor process is killed a moment later.

Several rollout replicas append to the same file: each batch is one `write()` on an
`O_APPEND` descriptor, so lines of different replicas never interleave. Each line is a JSON
object: the `FailedGroup` fields plus `replica` and `time` (`time.time()` when it was
recorded). A resumed run appends to the same file.

The log is capped: when `failures.jsonl` would pass `max_bytes`, it is renamed to
`failures.1.jsonl` (replacing the one before) and a new one is started, so the two files hold
the most recent failures (together at least `max_bytes` of them) and never more than twice that (or
twice one write batch, if a batch is larger).
Every failure is still counted: `failures.counts.json` holds the total, the count per error
type and how many were rotated away, across replicas and resumes (`read_failure_counts`).
Rotation and the counts file are updated under an exclusive `flock` on a lock file beside
the log, so replicas in other processes never rotate twice or lose a count.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_FAILURE_LOG_BYTES",
    "FailureJournal",
    "failure_summary",
    "read_failure_counts",
    "read_failures",
    "rotated_path",
]

# One generation of failures.jsonl: a record is a few hundred bytes, so this keeps the last
# ~20,000 failures (plenty to diagnose a cause) while a run that fails for days stays bounded.
MAX_FAILURE_LOG_BYTES = 8 * 1024 * 1024

_STOP = object()


class FailureJournal:
    """Appends failure records to a JSONL file from a writer thread.

    `append(failure)` never blocks (an unbounded in-memory queue: a failure is a few hundred
    bytes and the writer drains the queue in batches, so it cannot fall behind for long;
    `max_consecutive_failures` also ends a run whose every group fails). `close()` writes
    what is queued and joins the thread; it blocks, so call it from a thread in async code.
    """

    def __init__(
        self, path: str | Path, replica: int = 0, *, max_bytes: int = MAX_FAILURE_LOG_BYTES
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._replica = replica
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._fd = self._open()
        self._lock_fd = os.open(_sibling(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        self._written = 0
        self._thread = threading.Thread(
            target=self._write_loop, name=f"failure-journal-{replica}", daemon=True
        )
        self._thread.start()

    @property
    def written(self) -> int:
        """Records written to the file so far."""
        return self._written

    def append(self, failure: Any) -> None:
        """Queue one failure (a `FailedGroup` or any msgspec struct / dict) for writing."""
        record = msgspec.to_builtins(failure)
        if not isinstance(record, dict):
            record = {"failure": record}
        record.update(replica=self._replica, time=time.time())
        self._queue.put(record)

    __call__ = append  # usable directly as `on_failure`

    def close(self) -> None:
        """Write what is queued, stop the thread and close the file (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._lock_fd)
            self._fd = -1

    def _write_loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while True:  # take whatever else is queued: one write per batch
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(record is _STOP for record in batch)
            lines = [json.dumps(r, default=str) for r in batch if r is not _STOP]
            if not lines:
                continue
            data = ("\n".join(lines) + "\n").encode()
            types = [str(r.get("error_type", "unknown")) for r in batch if r is not _STOP]
            try:
                self._write_batch(data, types)
                self._written += len(lines)
            except OSError:
                logger.exception("could not append %d failures to %s", len(lines), self.path)

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _write_batch(self, data: bytes, types: list[str]) -> None:
        """Under the lock: follow another journal's rotation, rotate if this batch would pass
        `max_bytes`, append, and add the batch to the counts."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            if not _same_file(self._fd, self.path):  # another journal rotated it
                os.close(self._fd)
                self._fd = self._open()
            size = os.fstat(self._fd).st_size
            rotated = 0
            if size and size + len(data) > self.max_bytes:
                rotated = _line_count(rotated_path(self.path))  # those are dropped now
                os.replace(self.path, rotated_path(self.path))
                os.close(self._fd)
                self._fd = self._open()
            _write_all(self._fd, data)
            _add_counts(_sibling(self.path, ".counts.json"), types, rotated)
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)


def rotated_path(path: str | Path) -> Path:
    """The previous generation of a capped failures log: `failures.1.jsonl`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.1{path.suffix}")


def _sibling(path: Path, suffix: str) -> Path:
    """`failures.jsonl` -> `failures.counts.json` (suffix `.counts.json`), `.failures.lock`."""
    if suffix == ".lock":
        return path.with_name(f".{path.stem}.lock")
    return path.with_name(f"{path.stem}{suffix}")


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _line_count(path: Path) -> int:
    try:
        with path.open("rb") as file:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: file.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def _add_counts(path: Path, types: list[str], rotated: int) -> None:
    """Add one batch to the counts file (replaced atomically: a kill leaves old or new)."""
    counts = read_failure_counts(path)
    counts["total"] += len(types)
    counts["dropped_by_rotation"] += rotated
    for name in types:
        counts["by_type"][name] = counts["by_type"].get(name, 0) + 1
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(counts, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_failure_counts(path: str | Path) -> dict[str, Any]:
    """Every failure ever journalled: `total`, `by_type` (error type -> count) and
    `dropped_by_rotation` (no longer in either log file). `path` is the counts file or the
    log it belongs to; zeros if there is none."""
    path = Path(path)
    if path.suffix == ".jsonl":
        path = _sibling(path, ".counts.json")
    counts: dict[str, Any] = {"total": 0, "by_type": {}, "dropped_by_rotation": 0}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        counts.update(json.loads(path.read_text()))
    return counts


def failure_summary(path: str | Path) -> str:
    """One line for a run's summary: how many failures there were and what the capped log
    still holds, e.g. `1204 (Timeout 1200, ValueError 4); 204 in failures.jsonl and
    failures.1.jsonl, 1000 older ones rotated out (counts: failures.counts.json)`."""
    counts = read_failure_counts(path)
    if not counts["total"]:
        return "0"
    by_type = ", ".join(f"{k} {v}" for k, v in sorted(counts["by_type"].items()))
    name, rotated = Path(path).name, rotated_path(path).name
    kept = counts["total"] - counts["dropped_by_rotation"]
    text = f"{counts['total']} ({by_type}); {kept} in {name}"
    if counts["dropped_by_rotation"]:
        text += (
            f" and {rotated}, {counts['dropped_by_rotation']} older ones rotated out "
            f"(counts: {_sibling(Path(path), '.counts.json').name})"
        )
    return text


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_failures(path: str | Path) -> list[dict[str, Any]]:
    """The records of a failures.jsonl and its rotated generation, oldest first ([] if
    neither exists); a torn line (a process killed mid-write) is skipped."""
    path = Path(path)
    records: list[dict[str, Any]] = []
    for part in (rotated_path(path), path):
        if part.exists():
            records.extend(_read_one(part))
    return records


def _read_one(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("skipping a torn line in %s", path)
    return records

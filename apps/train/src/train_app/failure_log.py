"""`runs/<name>/failures.jsonl`: every failed rollout group, appended as it happens.

The rollouter keeps only the last `RolloutConfig.recent_failures` failures in memory (plus a
count per error type); it hands each one to `Rollouter(..., on_failure=...)`. That callback
runs on the rollouter's event loop, so `FailureJournal.append` only enqueues the record; a
writer thread appends the queued lines to the file and flushes after each batch, so the lines
are on disk (page cache) even if the actor process is killed a moment later.

Several rollout replicas append to the same file: each batch is one `write()` on an
`O_APPEND` descriptor, so lines of different replicas never interleave. Each line is a JSON
object: the `FailedSample` fields plus `replica` and `time` (`time.time()` when it was
recorded). A resumed run appends to the same file.
"""

from __future__ import annotations

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

__all__ = ["FailureJournal", "read_failures"]

_STOP = object()


class FailureJournal:
    """Appends failure records to a JSONL file from a writer thread.

    `append(failure)` never blocks (an unbounded in-memory queue: a failure is a few hundred
    bytes and the writer drains the queue in batches, so it cannot fall behind for long;
    `max_consecutive_failures` also ends a run whose every group fails). `close()` writes
    what is queued and joins the thread; it blocks, so call it from a thread in async code.
    """

    def __init__(self, path: str | Path, replica: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._replica = replica
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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
        """Queue one failure (a `FailedSample` or any msgspec struct / dict) for writing."""
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
            try:
                _write_all(self._fd, data)
                self._written += len(lines)
            except OSError:
                logger.exception("could not append %d failures to %s", len(lines), self.path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_failures(path: str | Path) -> list[dict[str, Any]]:
    """The records of a failures.jsonl ([] if it does not exist); a torn last line (a process
    killed mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("skipping a torn line in %s", path)
    return records

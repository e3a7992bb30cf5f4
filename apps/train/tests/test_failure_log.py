"""Failures are bounded in memory (last N + counts per type) and on disk (capped log + counts);
the engine is rollout_engine's FakeEngine (seeded failures): this
tests the bookkeeping, not generation. Costs < 2 s."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from rollout_engine import RolloutConfig, Rollouter, SamplingConfig
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts
from train_app.failure_log import (
    FailureJournal,
    failure_summary,
    read_failure_counts,
    read_failures,
    rotated_path,
)


class _Flaky(RuntimeError):
    pass


def test_every_failure_reaches_the_journal_while_memory_keeps_the_last_n(tmp_path: Path) -> None:
    path = tmp_path / "failures.jsonl"
    journal = FailureJournal(path, replica=1)
    engine = FakeEngine(
        FakeEngineConfig(
            seed=3, failure_rate=0.4, failure_types=(_Flaky, ValueError), fixed_length=4
        )
    )
    config = RolloutConfig(
        group_size=2,
        max_concurrency=8,
        batch_size=4,
        max_staleness=1000,  # no weight pushes here: do not let the budget stop admission
        pacing="eager",
        recent_failures=5,
        sampling=SamplingConfig(max_tokens=8),
    )
    rollouter = Rollouter(
        engine, make_prompts(200), ListSink(), lambda s, t: 0.0, config, on_failure=journal
    )
    stats = asyncio.run(rollouter.run())
    journal.close()

    assert stats.failed >= 40, stats  # enough to overflow the in-memory window many times
    records = read_failures(path)
    assert len(records) == stats.failed == sum(stats.failure_counts.values())
    assert {r["replica"] for r in records} == {1}
    assert len(rollouter.failures) == 5  # bounded: only the most recent stay in memory
    assert [f.group_id for f in rollouter.failures] == [r["group_id"] for r in records[-5:]]
    by_type: dict[str, int] = {}
    for record in records:
        by_type[record["error_type"]] = by_type.get(record["error_type"], 0) + 1
    assert by_type == rollouter.failure_counts and set(by_type) == {"_Flaky", "ValueError"}
    assert len({r["group_id"] for r in records}) == len(records)


def test_replicas_appending_to_one_file_never_interleave_lines(tmp_path: Path) -> None:
    path = tmp_path / "failures.jsonl"
    journals = [FailureJournal(path, replica=i) for i in range(3)]
    message = "x" * 3000  # long lines: a torn write would show

    def produce(journal: FailureJournal) -> None:
        for i in range(300):
            journal.append({"group_id": f"g{i}", "message": message})

    threads = [threading.Thread(target=produce, args=(j,)) for j in journals]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for journal in journals:
        journal.close()
        journal.close()  # idempotent
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    assert len(records) == 900
    for replica in range(3):
        mine = [r["group_id"] for r in records if r["replica"] == replica]
        assert mine == [f"g{i}" for i in range(300)]  # in order, none lost


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "failures.jsonl"
    path.write_text('{"group_id": "a"}\n{"group_id": "b"}\n{"group_')
    assert [r["group_id"] for r in read_failures(path)] == ["a", "b"]
    assert read_failures(tmp_path / "missing.jsonl") == []


def test_the_log_is_capped_to_the_latest_failures_and_every_one_is_counted(
    tmp_path: Path,
) -> None:
    """Three journals (replicas) share a log capped at 20 kB: the two generations keep the
    most recent failures of each replica, never much more than twice the cap, and the counts
    file counts every failure, including those rotated away."""
    path = tmp_path / "failures.jsonl"
    cap = 20_000
    journals = [FailureJournal(path, replica=i, max_bytes=cap) for i in range(3)]
    kinds = ("Timeout", "ValueError")

    def produce(journal: FailureJournal) -> None:
        for i in range(400):
            journal.append({"group_id": f"g{i}", "error_type": kinds[i % 2], "pad": "x" * 100})

    threads = [threading.Thread(target=produce, args=(j,)) for j in journals]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for journal in journals:
        journal.close()

    sizes = path.stat().st_size + rotated_path(path).stat().st_size
    # A generation passes the cap only when it holds one write batch bigger than the cap.
    assert cap <= sizes <= 2 * max(cap, 400 * 200)
    records = read_failures(path)
    assert 0 < len(records) < 1200
    for replica in range(3):
        mine = [int(r["group_id"][1:]) for r in records if r["replica"] == replica]
        assert mine == list(range(400 - len(mine), 400))  # the latest ones, in order
    counts = read_failure_counts(path)
    assert counts["total"] == 1200
    assert counts["by_type"] == {"Timeout": 600, "ValueError": 600}
    assert counts["dropped_by_rotation"] == 1200 - len(records)
    assert failure_summary(path) == (
        f"1200 (Timeout 600, ValueError 600); {len(records)} in failures.jsonl and "
        f"failures.1.jsonl, {1200 - len(records)} older ones rotated out "
        "(counts: failures.counts.json)"
    )


def test_a_resumed_journal_continues_the_counts(tmp_path: Path) -> None:
    path = tmp_path / "failures.jsonl"
    for _ in range(2):  # the run, then its resume
        journal = FailureJournal(path, replica=0)
        journal.append({"group_id": "g", "error_type": "Timeout"})
        journal.close()
    assert read_failure_counts(path) == {
        "total": 2, "by_type": {"Timeout": 2}, "dropped_by_rotation": 0,
    }  # fmt: skip
    assert len(read_failures(path)) == 2 and not rotated_path(path).exists()
    assert failure_summary(path) == "2 (Timeout 2); 2 in failures.jsonl"
    assert failure_summary(tmp_path / "none.jsonl") == "0"

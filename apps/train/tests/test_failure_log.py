"""Issue 14 item 4: failures are bounded in memory (last N + counts per type) and every one is
appended to failures.jsonl. The engine is rollout_engine's FakeEngine (seeded failures): this
tests the bookkeeping, not generation. Costs < 2 s."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from rollout_engine import RolloutConfig, Rollouter, SamplingConfig
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts
from train_app.failure_log import FailureJournal, read_failures


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

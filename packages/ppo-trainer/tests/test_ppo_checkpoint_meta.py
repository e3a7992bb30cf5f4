"""`trainer_state.json`: consumed ids round-trip, compactly when they follow the rollouter's
`f"{group_id}:{i}"` naming (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

from ppo_trainer import TrainerState, read_checkpoint_meta
from ppo_trainer.checkpoint_meta import STATE_FILE


def _roundtrip(tmp_path: Path, state: TrainerState) -> tuple[TrainerState, dict]:
    (tmp_path / STATE_FILE).write_text(state.to_json())
    return read_checkpoint_meta(tmp_path), json.loads((tmp_path / STATE_FILE).read_text())


def test_rollouter_named_responses_are_stored_as_group_sizes(tmp_path: Path) -> None:
    groups = [f"p{i}:{i * 3}" for i in range(1000)]
    sizes = [8] * 600 + [4] * 400
    responses = tuple(f"{g}:{k}" for g, n in zip(groups, sizes, strict=True) for k in range(n))
    state = TrainerState(
        step=7,
        version=3,
        consumed_response_ids=responses,
        consumed_group_ids=tuple(groups),
        consumed_prompt_ids=tuple(g.split(":")[0] for g in groups),
    )
    read, raw = _roundtrip(tmp_path, state)
    assert read == state
    assert "consumed_response_ids" not in raw
    assert raw["consumed_group_sizes"] == [[8, 600], [4, 400]]
    full = len(json.dumps(list(responses)))
    assert len((tmp_path / STATE_FILE).read_text()) < full / 4


def test_other_response_ids_fall_back_to_the_full_list(tmp_path: Path) -> None:
    for responses, group_ids in [
        (("a/0", "a/1", "b/0"), ("a", "b")),  # another naming
        (("a:0", "a:1", "b:1"), ("a", "b")),  # a gap
        (("a:0", "b:0", "a:1"), ("a", "b")),  # interleaved groups
        (("a:0", "a:1", "x"), ("a",)),  # a stray response
    ]:
        state = TrainerState(
            step=1, version=1, consumed_response_ids=responses, consumed_group_ids=group_ids
        )
        read, raw = _roundtrip(tmp_path, state)
        assert read == state
        assert raw["consumed_response_ids"] == list(responses)


def test_empty_and_old_format_files_read_back(tmp_path: Path) -> None:
    read, _ = _roundtrip(tmp_path, TrainerState(step=0, version=0))
    assert read == TrainerState(step=0, version=0)
    old = {
        "format": 1,
        "step": 2,
        "version": 1,
        "consumed_sample_ids": ["g:0", "g:1"],
        "consumed_group_ids": ["g"],
    }
    (tmp_path / STATE_FILE).write_text(json.dumps(old))
    # Written before the key was named for what it holds, and before prompt ids were kept.
    old_read = read_checkpoint_meta(tmp_path)
    assert old_read.consumed_response_ids == ("g:0", "g:1")
    assert old_read.consumed_prompt_ids == ()


def _group(prompt: str, index: int, size: int = 4) -> list:
    """The three ids `ConsumedIds.add_groups` reads of each response (nothing else)."""
    from types import SimpleNamespace

    group_id = f"{prompt}:{index}"
    return [
        SimpleNamespace(response_id=f"{group_id}:{k}", group_id=group_id, prompt_id=prompt)
        for k in range(size)
    ]


def test_a_kept_window_stays_the_same_size_however_many_groups_are_consumed(
    tmp_path: Path,
) -> None:
    """With `limit`, the ids (and the checkpoint) do not grow with the run: 100 or 20,000
    groups consumed give the same number of ids, the most recent ones, still compact."""
    from ppo_trainer import ConsumedIds

    sizes = []
    for count in (100, 20_000):
        ids = ConsumedIds(limit=64)
        for i in range(count):
            ids.add_groups([_group(f"s0-{i}", i)])
        state = ids.state(step=1, version=1)
        assert len(state.consumed_prompt_ids) == len(state.consumed_group_ids) == 64
        assert len(state.consumed_response_ids) == 64 * 4
        assert state.consumed_prompt_ids[-1] == f"s0-{count - 1}"
        read, raw = _roundtrip(tmp_path, state)
        assert read == state and raw["consumed_ids_kept"] == 64
        assert raw["consumed_group_sizes"] == [[4, 64]]
        sizes.append(len((tmp_path / STATE_FILE).read_text()))
    assert abs(sizes[1] - sizes[0]) <= 64 * 9  # only the ids' digits differ (3 per id)


def test_a_full_older_state_loads_into_a_window_at_once() -> None:
    """An older checkpoint's every id (here 200,000 groups) cut to the window on load, in well
    under a second (deleting a dict's head id by id would take minutes at a million)."""
    import time

    from ppo_trainer import ConsumedIds

    groups = tuple(f"s0-{i}:{i}" for i in range(200_000))
    state = TrainerState(
        step=1,
        version=1,
        consumed_response_ids=tuple(f"{g}:{k}" for g in groups for k in range(2)),
        consumed_group_ids=groups,
        consumed_prompt_ids=tuple(g.split(":")[0] for g in groups),
    )
    t0 = time.perf_counter()
    ids = ConsumedIds.of_state(state, limit=100)
    assert time.perf_counter() - t0 < 5.0  # generous: a loaded 2-core machine
    assert list(ids.group_ids) == list(groups[-100:])
    assert list(ids.response_ids) == [f"{g}:{k}" for g in groups[-100:] for k in range(2)]
    assert next(iter(ids.prompt_ids)) == "s0-199900"

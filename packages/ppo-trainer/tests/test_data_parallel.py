"""Data-parallel trainer: 2 gloo ranks (spawned processes) compute what 1 process computes.

One module-scoped spawn of 2 ranks runs every case of `dp_testkit.CASES` (every loss
aggregation mode, RLOO, GAE with the value head, KL + entropy) under both strategies (ddp,
fsdp2), plus a checkpoint/resume run, on the same batches as the single-process runs here;
the tests below compare the results. Real torch.distributed (gloo on CPU), no fakes.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from dp_testkit import (
    CASES,
    CHECKPOINT_CASE,
    FSDP2_CASES,
    STEPS,
    STRATEGIES,
    groups,
    rank_main,
    run_case,
)
from ppo_testkit import tiny_qwen2
from ppo_trainer import shard_groups

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results. Costs ~40 s on 2 shared cores (two spawned interpreters
    importing torch + transformers, then 16 short runs of 4 steps each)."""
    out = tmp_path_factory.mktemp("dp")
    mp.spawn(rank_main, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    logging.getLogger(__name__).info("rank 0 timings (s): %s", results[0]["timings"])
    return results


@pytest.fixture(scope="module")
def single() -> dict[str, dict[str, Any]]:
    """The same cases in this one process (the reference)."""
    data = groups()
    return {name: run_case(name, data) for name in CASES}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize(
    ("case", "strategy"),
    [(case, "ddp") for case in CASES] + [(case, "fsdp2") for case in FSDP2_CASES],
)
def test_two_ranks_equal_one_process(
    ranks: list[dict[str, Any]], single: dict[str, dict[str, Any]], case: str, strategy: str
) -> None:
    ref = single[case]
    got = ranks[0][f"{strategy}/{case}"]
    assert got["step"] == ref["step"] == STEPS
    assert got["version"] == ref["version"]
    assert _max_diff(got["params"], ref["params"]) < 1e-5
    # The weights moved (the comparison is not between two untouched models).
    initial = tiny_qwen2(seed=0).state_dict()
    assert _max_diff({k: got["params"][k] for k in initial}, initial) > 1e-4
    # The logged metrics are the global ones, not rank 0's share.
    for key in ("ppo/loss", "ppo/entropy", "ppo/approx_kl", "reward/mean"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6)
    if "value_head.weight" in ref["params"]:
        assert float(ref["params"]["value_head.weight"].abs().max()) > 0  # the head trained
    # The other rank follows the same step and version counters and has no weights.
    other = ranks[1][f"{strategy}/{case}"]
    assert other["step"] == STEPS and other["version"] == ref["version"]
    assert other["params"] is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weight_push_gathers_full_weights_on_rank_zero(
    ranks: list[dict[str, Any]], single: dict[str, dict[str, Any]], strategy: str
) -> None:
    ref = single["token-mean"]
    got = ranks[0][f"{strategy}/token-mean"]
    # Rank 0 pushed each version once with the full (unsharded) weights; rank 1 pushed none.
    assert [v for v, _ in got["pushes"]] == [v for v, _ in ref["pushes"]] == [1, 2]
    for (_, weights), (_, ref_weights) in zip(got["pushes"], ref["pushes"], strict=True):
        assert weights.keys() == ref_weights.keys()  # tied tensors once, like one process
        for name, tensor in weights.items():
            assert tensor.shape == ref_weights[name].shape and tensor.device.type == "cpu"
        assert _max_diff(weights, ref_weights) < 1e-5
    assert ranks[1][f"{strategy}/token-mean"]["pushes"] == []
    # full_state_dict: the full weights on rank 0, None on the others.
    full = got["full_state_dict"]
    assert full is not None and full.keys() == ref["pushes"][-1][1].keys()
    assert _max_diff(full, ref["pushes"][-1][1]) < 1e-5
    assert ranks[1][f"{strategy}/token-mean"]["full_state_dict"] is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_resume_with_two_ranks_equals_straight_run(
    ranks: list[dict[str, Any]], single: dict[str, dict[str, Any]], strategy: str
) -> None:
    result = ranks[0][f"{strategy}/checkpoint"]
    straight, resumed = result["straight"], result["resumed"]
    assert resumed["step"] == straight["step"] == STEPS
    assert resumed["version"] == straight["version"]
    assert _max_diff(resumed["params"], straight["params"]) < 1e-6
    # ... and the straight 2-rank run is the 1-process run.
    assert _max_diff(straight["params"], single[CHECKPOINT_CASE]["params"]) < 1e-5


def test_checkpoint_of_two_ranks_resumes_in_one_process(
    ranks: list[dict[str, Any]], single: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A 2-rank fsdp2 checkpoint is in the format of one process (full tensors)."""
    ckpt = Path(ranks[0]["out_dir"]) / "ckpt-fsdp2" / "step_000002"
    resumed = run_case(CHECKPOINT_CASE, groups()[6:], resume_from=ckpt)
    assert resumed["step"] == STEPS
    assert _max_diff(resumed["params"], single[CHECKPOINT_CASE]["params"]) < 1e-5


def test_shards_are_group_aligned_contiguous_and_balanced() -> None:
    batch = [[f"{g}/{i}" for i in range(n)] for g, n in enumerate([4, 2, 3, 1, 5, 3, 2])]
    for world in (1, 2, 3, 4, 8):
        shards = [shard_groups(batch, r, world) for r in range(world)]
        # groups are whole, in order, each on exactly one rank
        assert [g for s in shards for g in s.groups] == batch
        rows = shards[0].rank_rows
        assert all(s.rank_rows == rows for s in shards)
        assert [sum(len(g) for g in s.groups) for s in shards] == list(rows)
        assert sum(rows) == 20 and shards[-1].row_offset + rows[-1] == 20
        # balanced to within the largest group
        assert max(rows) - min(rows) <= 5 or world > len(batch)
    # fewer groups than ranks: some shards are empty
    shards = [shard_groups([["a", "b"]], r, 3) for r in range(3)]
    assert sorted(s.rows for s in shards) == [0, 0, 2]
    assert [s.total_rows for s in shards] == [2, 2, 2]
    with pytest.raises(ValueError):
        shard_groups(batch, 2, 2)


def test_ranks_meeting_on_loopback_listen_on_loopback_only(tmp_path: Path) -> None:
    """Rank 0's store serves on the socket `listen_for_ranks` opened on 127.0.0.1 (torch's
    own store listens on every interface, and the port was picked, released and bound
    again): after the group is up, rank 0 listens on no other address, at the port it
    picked. Costs ~15 s on 2 shared cores (two spawned interpreters importing torch)."""
    import json

    from dp_testkit import loopback_rank

    mp.spawn(loopback_rank, args=(WORLD, str(tmp_path)), nprocs=WORLD, join=True)
    seen = json.loads((tmp_path / "listening.json").read_text())
    assert seen["sum"] == 3.0 and seen["got"] == {"from": "rank 0"}
    assert seen["listening"], seen
    assert {ip for ip, _ in seen["listening"]} == {"127.0.0.1"}, seen
    port = int(seen["address"].rsplit(":", 1)[1])
    assert port in {p for _, p in seen["listening"]}

"""Damaged checkpoints are named, not loaded: `verify_checkpoint` (torch-free, reads no
tensors), the fallback to the previous kept checkpoint, the manifest written last, and the
leftovers of interrupted saves."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ppo_testkit import ListSource, make_group, tiny_qwen2
from ppo_trainer import PPOConfig, PPOTrainer
from ppo_trainer.checkpoint_files import (
    CheckpointError,
    find_usable_checkpoint,
    remove_leftovers,
    verify_checkpoint,
)

GROUPS = [make_group(f"g{i}", n=2, seed=1) for i in range(4)]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One short run's checkpoint directory (each test damages its own copy)."""
    return asyncio.run(_run(tmp_path_factory.mktemp("run"), model="tiny-a"))


def _copy(saved_run: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    shutil.copytree(saved_run, root, symlinks=True)
    return root


async def _run(tmp_path: Path, **labels: str) -> Path:
    """Checkpoints step_000002 (kept) and step_000004 (latest), with an app side file."""

    async def add_side_files(path: Path) -> None:
        (path / "queued.msgpack").write_bytes(b"\x92\x01\x02" * 50)

    cfg = PPOConfig(
        batch_size=1, checkpoint_dir=str(tmp_path), checkpoint_every=2, max_staleness=100
    )
    trainer = PPOTrainer(tiny_qwen2(), cfg, on_checkpoint=add_side_files, checkpoint_labels=labels)
    await trainer.train(ListSource(GROUPS))
    return tmp_path


def _truncate(name: str) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        data = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(data[: len(data) // 2])

    return damage


def _empty(name: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / name).write_bytes(b"")


def _remove(name: str) -> Callable[[Path], None]:
    return lambda ckpt: (ckpt / name).unlink()


def _no_step(ckpt: Path) -> None:
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    del meta["step"]
    (ckpt / "trainer_state.json").write_text(json.dumps(meta))


def _flip_byte(name: str) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        data = bytearray((ckpt / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (ckpt / name).write_bytes(bytes(data))

    return damage


DAMAGE = {
    "truncated trainer_state.json": (_truncate("trainer_state.json"), "trainer_state.json"),
    "empty trainer_state.json": (_empty("trainer_state.json"), "trainer_state.json"),
    "missing trainer_state.json": (_remove("trainer_state.json"), "trainer_state.json"),
    "no step": (_no_step, "trainer_state.json"),
    "corrupt model.pt": (_flip_byte("model.pt"), "model.pt"),
    "truncated model.pt": (_truncate("model.pt"), "model.pt"),
    "missing optimizer.pt": (_remove("optimizer.pt"), "optimizer.pt"),
    "truncated side file": (_truncate("queued.msgpack"), "queued.msgpack"),
    "garbled side file": (_flip_byte("queued.msgpack"), "queued.msgpack"),
    "missing manifest": (_remove("manifest.json"), "manifest.json"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
async def test_each_damage_is_named_and_the_previous_checkpoint_is_used(
    saved_run: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = _copy(saved_run, tmp_path)
    latest = (root / "latest").resolve()
    assert verify_checkpoint(latest) is None
    damage, named = DAMAGE[kind]
    damage(latest)
    problem = verify_checkpoint(latest)
    assert problem is not None and named in problem
    found = find_usable_checkpoint(root)
    assert found.path == (root / "step_000002").resolve()
    assert found.rejected == ((latest, problem),)
    assert problem in caplog.text  # the warning names what was wrong
    with pytest.raises(CheckpointError, match="step_000004"):
        await PPOTrainer.resume(root / "latest", tiny_qwen2(), PPOConfig(max_staleness=100))
    resumed = await PPOTrainer.resume(found.path, tiny_qwen2(), PPOConfig(max_staleness=100))
    assert resumed.step == 2


async def test_no_usable_checkpoint(saved_run: Path, tmp_path: Path) -> None:
    root = _copy(saved_run, tmp_path)
    for step in ("step_000002", "step_000004"):
        _flip_byte("model.pt")(root / step)
    found = find_usable_checkpoint(root)
    assert found.path is None
    assert [p.name for p, _ in found.rejected] == ["step_000004", "step_000002"]


async def test_another_models_checkpoint(saved_run: Path) -> None:
    root = saved_run
    assert verify_checkpoint(root / "latest", expect_labels={"model": "tiny-a"}) is None
    problem = verify_checkpoint(root / "latest", expect_labels={"model": "tiny-b"})
    assert problem is not None and "tiny-a" in problem and "tiny-b" in problem
    from transformers import Qwen2Config, Qwen2ForCausalLM

    other = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=32,
        )
    )
    with pytest.raises(CheckpointError, match="another model"):
        await PPOTrainer.resume(root / "latest", other, PPOConfig(max_staleness=100))


async def test_checkpoint_before_manifests_still_verifies(saved_run: Path, tmp_path: Path) -> None:
    root = _copy(saved_run, tmp_path)
    legacy = (root / "latest").resolve()
    (legacy / "manifest.json").unlink()
    (legacy / "queued.msgpack").unlink()
    state = json.loads((legacy / "trainer_state.json").read_text())
    del state["has_manifest"]
    (legacy / "trainer_state.json").write_text(json.dumps(state))
    assert verify_checkpoint(legacy) is None
    _truncate("rng.pt")(legacy)
    assert "rng.pt" in (verify_checkpoint(legacy) or "")


async def test_newer_unfinished_checkpoint_is_not_preferred_to_latest(
    saved_run: Path, tmp_path: Path
) -> None:
    """A `step_*` newer than `latest` is a save that never finished (latest moves last)."""
    root = _copy(saved_run, tmp_path)
    shutil.copytree(root / "step_000004", root / "step_000006")
    assert find_usable_checkpoint(root).path == (root / "step_000004").resolve()


async def test_leftovers_of_interrupted_saves_are_deleted(saved_run: Path, tmp_path: Path) -> None:
    root = _copy(saved_run, tmp_path)
    tmp_dir = root / ".step_000006.tmp-0123abcd"
    shutil.copytree(root / "step_000004", tmp_dir)
    (root / ".latest.tmp-89abcdef").symlink_to("step_000004")
    keep = root / ".hidden-user-file"
    keep.write_text("mine")
    removed = remove_leftovers(root)
    assert sorted(p.name for p in removed) == [".latest.tmp-89abcdef", ".step_000006.tmp-0123abcd"]
    assert keep.exists() and not tmp_dir.exists()
    # and a load does it by itself
    shutil.copytree(root / "step_000004", tmp_dir)
    await PPOTrainer.resume(root / "latest", tiny_qwen2(), PPOConfig(max_staleness=100))
    assert not tmp_dir.exists()


def test_verify_needs_no_torch_and_is_fast(tmp_path: Path) -> None:
    """The check a driver runs before Ray starts: no torch import, well under a second."""
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"format": 1, "step": 3, "version": 3}))
    (ckpt / "model.pt").write_bytes(os.urandom(200 << 20))  # sampled, not hashed whole
    code = (
        "import sys, time; from ppo_trainer.checkpoint_files import write_manifest, "
        "verify_checkpoint; write_manifest(sys.argv[1]); t = time.perf_counter(); "
        "p = verify_checkpoint(sys.argv[1]); dt = time.perf_counter() - t; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(p, dt)"
    )
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, check=True
    )
    problem, seconds = out.stdout.split()
    assert problem == "None"
    assert float(seconds) < 1.0, out.stdout
    assert time.perf_counter() - started < 30


# A short training run with two saves: 24 s measured on the shared 2-core machine under load
# (a vLLM test alongside).
@pytest.mark.slow
async def test_a_save_is_durable_files_then_directory_then_parent_then_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power loss keeps only what was fsynced: every file of a checkpoint (the caller's side
    file too), then its directory, then (after the rename into place) the checkpoints
    directory, and again after `latest` is swapped. Recorded by wrapping `os.fsync` (the
    real one still runs), in the order the calls came."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    root = await _run(tmp_path / "ckpts", model="tiny-a")
    final = (root / "step_000004").resolve()
    temporary = [p for p in synced if Path(p).parent.name.startswith(".step_000004.tmp-")]
    assert temporary, synced
    tmp_dir = str(Path(temporary[0]).parent)
    expected = {p.name for p in final.iterdir()} - {"queued.msgpack"}  # (added after)
    # (the manifest is fsynced under its temporary name, then renamed over the final one)
    names = {Path(p).name.replace(".manifest.json.tmp", "manifest.json") for p in temporary}
    assert names == expected
    assert tmp_dir in synced  # the directory, after its files
    assert synced.index(tmp_dir) > max(synced.index(p) for p in temporary)
    after_rename = synced[synced.index(tmp_dir) + 1 :]
    assert str(root.resolve()) in after_rename  # the rename into place
    # The side file the caller added, the manifest rewritten after it, the directory again.
    assert str(final / "queued.msgpack") in after_rename
    assert after_rename.index(str(final / ".manifest.json.tmp")) > after_rename.index(
        str(final / "queued.msgpack")
    )
    # `latest` moves last, and its directory is fsynced after the swap.
    assert after_rename[-1] == str(root.resolve())
    assert (root / "latest").resolve() == final

"""Checkpoints: model, optimizer, scheduler, RNG states and the trainer's progress.

Layout of a checkpoint directory:

    model.pt          model.state_dict() (the policy only: the HF model's own state dict)
    value_head.pt     the GAE value head's state_dict (only with advantage="gae")
    optimizer.pt      optimizer.state_dict()
    scheduler.pt      LR scheduler state_dict()
    rng.pt            torch (CPU + CUDA), numpy, python and the shuffling generator states
    trainer_state.json  step, version, consumed response/group/prompt ids, the config
    manifest.json     every other file's size and checksum, written last (see
                      `checkpoint_files`); the caller's own side files are listed too

Everything loads with `torch.load(weights_only=True)` (no pickle of arbitrary objects). The
directory is written under a temporary name, every file fsynced, then renamed (and the
parent fsynced), so neither a crash nor a power loss leaves a half checkpoint under the
final name; what an interrupted save leaves behind is deleted by the next save or load.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppo_trainer.checkpoint_files import (
    CheckpointError,
    fsync_dir,
    remove_leftovers,
    write_manifest,
)
from ppo_trainer.checkpoint_meta import (
    STATE_FILE,
    TrainerState,
    read_checkpoint_meta,
    read_saved_config,
)
from ppo_trainer.config import PPOConfig
from ppo_trainer.update import PolicyUpdater

__all__ = ["load_checkpoint", "save_checkpoint", "update_latest"]

logger = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.pt"


def save_checkpoint(
    path: str | Path,
    updater: PolicyUpdater,
    state: TrainerState,
    *,
    labels: Mapping[str, str] | None = None,
) -> Path:
    """Write a checkpoint of `updater` and `state` to directory `path` (replaced if present),
    durably, with its manifest (carrying `labels`, see `verify_checkpoint`). A caller that
    adds files to it afterwards calls `checkpoint_files.write_manifest` again.

    Data parallel: collective; the full (gathered) state is written by rank 0 alone, in the
    format of one process, so a checkpoint resumes with any number of ranks."""
    dp = updater.data_parallel
    if dp is not None:
        model_state = dp.full_model_state(updater.model)
        optimizer_state = dp.full_optimizer_state(updater.optimizer)
        if dp.is_leader:
            assert model_state is not None and optimizer_state is not None
            _write(Path(path), updater, state, model_state, optimizer_state, labels)
        dp.all_reduce(torch.zeros(1))  # barrier: nobody reads it before it is written
        return Path(path)
    model_state = updater.model.state_dict()
    return _write(Path(path), updater, state, model_state, updater.optimizer.state_dict(), labels)


def _write(
    final: Path,
    updater: PolicyUpdater,
    state: TrainerState,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    labels: Mapping[str, str] | None,
) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final.parent)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        torch.save(model_state, tmp / "model.pt")
        if updater.value_head is not None:
            torch.save(updater.value_head.state_dict(), tmp / VALUE_HEAD_FILE)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(updater.scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(_rng_state(updater), tmp / "rng.pt")
        (tmp / STATE_FILE).write_text(state.to_json(dataclasses.asdict(updater.config)))
        write_manifest(tmp, labels)  # fsyncs every file, the manifest and `tmp`
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_checkpoint(path: str | Path, updater: PolicyUpdater) -> TrainerState:
    """Restore `updater` (in place) and every RNG from `path`; returns the trainer state.

    Raises `CheckpointError` (one line naming the file) for a damaged file or a checkpoint
    of another model; check with `verify_checkpoint` first to fall back instead."""
    root = Path(path)
    dp = updater.data_parallel
    if dp is None or dp.is_leader:
        remove_leftovers(root.resolve().parent)
    try:
        state = read_checkpoint_meta(root)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{root}: {STATE_FILE} is unreadable: {exc!r}") from exc
    device = updater.device
    has_head = (root / VALUE_HEAD_FILE).exists()
    if updater.value_head is not None and not has_head:
        raise ValueError(
            f"{root}: no {VALUE_HEAD_FILE}: the checkpoint was not written with "
            "advantage='gae', so it cannot resume a GAE trainer (its value head is missing)"
        )
    if updater.value_head is None and has_head:
        raise ValueError(
            f"{root}: has a {VALUE_HEAD_FILE} (written with advantage='gae'); resume it with "
            f"advantage='gae', not {updater.config.advantage!r}"
        )
    model_state = _load(root / "model.pt", device)
    _check_same_model(root, model_state, updater.model)
    if dp is not None:  # every rank reads the directory: it must be visible to all
        dp.load_model_state(updater.model, model_state)
    else:
        updater.model.load_state_dict(model_state)
    if updater.value_head is not None:
        head = _load(root / VALUE_HEAD_FILE, device)
        updater.value_head.load_state_dict(head)
    optimizer_state = _load(root / "optimizer.pt", device)
    if dp is not None:
        dp.load_optimizer_state(updater.optimizer, optimizer_state)
    else:
        updater.optimizer.load_state_dict(optimizer_state)
    updater.scheduler.load_state_dict(_load(root / "scheduler.pt", None))
    _restore_rng(_load(root / "rng.pt", None), updater)
    _warn_config_changes(read_saved_config(root), updater.config)
    return state


def update_latest(checkpoint: Path, keep: int) -> None:
    """Point `<parent>/latest` at `checkpoint` (a relative symlink, swapped atomically) and
    delete all but the newest `keep` `step_*` siblings (keep = 0: delete none)."""
    parent = checkpoint.parent
    tmp_link = parent / f".latest.tmp-{uuid.uuid4().hex[:8]}"
    tmp_link.symlink_to(checkpoint.name, target_is_directory=True)
    tmp_link.replace(parent / "latest")
    fsync_dir(parent)
    if keep > 0:
        steps = sorted(p for p in parent.glob("step_*") if p.is_dir())
        for old in steps[:-keep]:
            if old != checkpoint:
                shutil.rmtree(old, ignore_errors=True)


def _load(file: Path, device: torch.device | None) -> Any:
    """`torch.load` of tensors and plain containers only (no arbitrary pickles)."""
    try:
        return torch.load(file, map_location=device, weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{file} is missing") from exc
    except (RuntimeError, ValueError, EOFError, OSError) as exc:
        raise CheckpointError(f"{file} is damaged: {exc}") from exc
    except Exception as exc:  # unpickling errors come in many types
        raise CheckpointError(f"{file} is damaged: {exc!r}") from exc


def _check_same_model(root: Path, saved: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Fail in one line if `saved` is another architecture's state dict."""
    own = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    theirs = {name: tuple(t.shape) for name, t in saved.items()}
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    reshaped = sorted(n for n in set(own) & set(theirs) if own[n] != theirs[n])
    if missing or unexpected or reshaped:
        first = (missing or unexpected or reshaped)[0]
        raise CheckpointError(
            f"{root}: a checkpoint of another model ({len(missing)} weights missing, "
            f"{len(unexpected)} unexpected, {len(reshaped)} of another shape, e.g. {first!r})"
        )


def _rng_state(updater: PolicyUpdater) -> dict[str, Any]:
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "generator": updater.generator.get_state(),
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "python": {
            "version": py_version,
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss": py_gauss,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any], updater: PolicyUpdater) -> None:
    torch.set_rng_state(state["torch"])
    updater.generator.set_state(state["generator"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["gauss"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _warn_config_changes(saved: dict[str, Any], current: PPOConfig) -> None:
    now = dataclasses.asdict(current)
    changed = {k: (saved[k], now[k]) for k in saved if k in now and _norm(saved[k]) != now[k]}
    if changed:
        logger.warning("resuming with a changed config (saved, now): %s", changed)


def _norm(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value

"""Durable checkpoint files: fsync, a manifest written last, verification, leftovers.

Torch-free, so a driver can check a checkpoint (and pick the newest usable one) before it
starts anything heavy. A checkpoint directory is usable when its `manifest.json` (written
after every other file, the caller's side files included) lists exactly the files present,
each with its size and checksum, and `trainer_state.json` parses with a step and version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_trainer.checkpoint_meta import STATE_FILE, read_checkpoint_meta

__all__ = [
    "MANIFEST_FILE",
    "TENSOR_FILES",
    "CheckpointError",
    "CheckpointSearch",
    "find_usable_checkpoint",
    "fsync_dir",
    "remove_leftovers",
    "verify_checkpoint",
    "write_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
# The tensor files every checkpoint has (`value_head.pt` only with GAE).
TENSOR_FILES = ("model.pt", "optimizer.pt", "scheduler.pt", "rng.pt")
# Files up to this size are hashed whole; larger ones (the model and optimizer of a real
# LM, gigabytes) by sampled blocks, so verifying stays well under a second per file while
# truncation (size) and damage to any sampled block are still caught.
FULL_HASH_MAX_BYTES = 64 << 20
SAMPLE_BLOCKS = 32
SAMPLE_BLOCK_BYTES = 1 << 20
# What an interrupted save leaves next to the checkpoints: the directory being written,
# the one being replaced, and a `latest` link not yet swapped in.
_LEFTOVER = re.compile(r"^\.(step_.*\.(tmp|old)-[0-9a-f]+|latest\.tmp-[0-9a-f]+)$")
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (damaged, or of another model or setup)."""


@dataclass(frozen=True, slots=True)
class CheckpointSearch:
    """What `find_usable_checkpoint` found: the checkpoint to resume from (None: none is
    usable) and every newer one it passed over, with what was wrong with it."""

    path: Path | None
    rejected: tuple[tuple[Path, str], ...] = ()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in directory `path` survive power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(root: str | Path, labels: Mapping[str, str] | None = None) -> Path:
    """fsync every file in checkpoint directory `root`, then write (atomically, fsynced)
    `manifest.json` with each file's size and checksum, then fsync `root`. Call it last."""
    root = Path(root)
    files: dict[str, dict[str, Any]] = {}
    for file in sorted(p for p in root.iterdir() if p.is_file() and p.name != MANIFEST_FILE):
        if file.name.startswith("."):
            continue
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
        files[file.name] = _describe(file)
    body = {"format": MANIFEST_FORMAT, "labels": dict(labels or {}), "files": files}
    tmp = root / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as handle:
        json.dump(body, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, root / MANIFEST_FILE)
    fsync_dir(root)
    return root / MANIFEST_FILE


def verify_checkpoint(
    path: str | Path, *, expect_labels: Mapping[str, str] | None = None
) -> str | None:
    """What is wrong with checkpoint directory `path`, in one line, or None if it is usable.

    Reads no tensors: checks the manifest (every listed file present with its size and
    checksum, no file it does not list), `trainer_state.json` (parses, has step and
    version) and, if given, that the manifest's labels match `expect_labels` (e.g. the
    model a run was started with). A checkpoint written before manifests existed is checked
    for its files being present, non-empty and (tensors) readable archives.
    """
    root = Path(path)
    if not root.is_dir():
        return f"{root} is not a checkpoint directory"
    try:
        read_checkpoint_meta(root)
    except FileNotFoundError:
        return f"{STATE_FILE} is missing"
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{STATE_FILE} is unreadable ({_short(exc)})"
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.exists():
        if json.loads((root / STATE_FILE).read_text()).get("has_manifest"):
            return f"{MANIFEST_FILE} is missing"
        return _verify_without_manifest(root)
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        labels: dict[str, str] = manifest.get("labels", {})
    except (ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({_short(exc)})"
    for name, expected in files.items():
        problem = _check_file(root / name, expected)
        if problem is not None:
            return problem
    present = {p.name for p in root.iterdir() if not p.name.startswith(".")}
    unlisted = sorted(present - set(files) - {MANIFEST_FILE})
    if unlisted:
        return f"{', '.join(unlisted)} not in the manifest (the save did not finish)"
    for key, want in (expect_labels or {}).items():
        if labels.get(key) != want:
            return f"written for {key}={labels.get(key)!r}, not {want!r}"
    return None


def find_usable_checkpoint(
    checkpoint_dir: str | Path, *, expect_labels: Mapping[str, str] | None = None
) -> CheckpointSearch:
    """The newest usable checkpoint in `checkpoint_dir`: `latest`'s target if it verifies,
    else the newest `step_*` that does (older than the damaged ones), with a warning that
    names what was wrong with each one passed over."""
    root = Path(checkpoint_dir)
    candidates: list[Path] = []
    latest = root / "latest"
    if latest.exists():
        candidates.append(latest.resolve())
    steps = [p for p in root.iterdir() if _STEP_DIR.match(p.name)] if root.is_dir() else []
    for step_dir in sorted(steps, key=lambda p: int(_STEP_DIR.match(p.name)[1]), reverse=True):
        if step_dir.resolve() not in candidates:
            candidates.append(step_dir.resolve())
    if candidates and latest.exists():  # nothing newer than `latest`: it was never finished
        newest = _step_number(candidates[0])
        candidates = [candidates[0]] + [c for c in candidates[1:] if _step_number(c) < newest]
    rejected: list[tuple[Path, str]] = []
    for candidate in candidates:
        problem = verify_checkpoint(candidate, expect_labels=expect_labels)
        if problem is None:
            return CheckpointSearch(candidate, tuple(rejected))
        logger.warning("checkpoint %s is not usable: %s", candidate, problem)
        rejected.append((candidate, problem))
    return CheckpointSearch(None, tuple(rejected))


def remove_leftovers(checkpoint_dir: str | Path) -> list[Path]:
    """Delete what interrupted saves left in `checkpoint_dir` (`.step_*.tmp-*` directories,
    each a whole model plus optimizer, their `.old-*` twins, `.latest.tmp-*` links);
    returns them. Call only while no save into `checkpoint_dir` runs."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    removed = []
    for entry in root.iterdir():
        if not _LEFTOVER.match(entry.name):
            continue
        if entry.is_symlink() or entry.is_file():
            entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    if removed:
        logger.info("removed %d leftovers of interrupted saves in %s", len(removed), root)
    return removed


def _describe(file: Path) -> dict[str, Any]:
    size = file.stat().st_size
    if size <= FULL_HASH_MAX_BYTES:
        return {"size": size, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}
    return {"size": size, "sampled_sha256": _sampled_digest(file, size)}


def _sampled_digest(file: Path, size: int) -> str:
    """sha256 over `SAMPLE_BLOCKS` evenly spaced blocks (the first and last included)."""
    digest = hashlib.sha256()
    last = size - SAMPLE_BLOCK_BYTES
    with open(file, "rb") as handle:
        for i in range(SAMPLE_BLOCKS):
            handle.seek(last * i // (SAMPLE_BLOCKS - 1))
            digest.update(handle.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def _check_file(file: Path, expected: dict[str, Any]) -> str | None:
    if not file.is_file():
        return f"{file.name} is missing"
    size = file.stat().st_size
    if size != expected.get("size"):
        return f"{file.name} has {size} bytes, the manifest says {expected.get('size')}"
    if "sha256" in expected:
        matches = hashlib.sha256(file.read_bytes()).hexdigest() == expected["sha256"]
    else:
        matches = _sampled_digest(file, size) == expected.get("sampled_sha256")
    return None if matches else f"{file.name} is damaged (checksum mismatch)"


def _verify_without_manifest(root: Path) -> str | None:
    for name in TENSOR_FILES:
        file = root / name
        if not file.is_file():
            return f"{name} is missing (and there is no {MANIFEST_FILE})"
        if not zipfile.is_zipfile(file):
            return f"{name} is damaged (not a torch archive; there is no {MANIFEST_FILE})"
    return None


def _step_number(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    return int(match[1]) if match else -1


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 120 else text[:117] + "..."

"""In-flight partial trajectories that survive a checkpoint and a resume.

`Rollouter.snapshot_in_flight()` takes a `RolloutSnapshot`: every group the rollouter has
admitted and not yet handed to the sink, with each response's tokens so far, their per-token
versions and behaviour log-probs. To see tokens that are still inside the engine it pauses
the engine with mode "abort" (every running request returns its tokens so far, as at a weight
push in abort mode), waits until no engine call is outstanding, copies the state, then
resumes: the run goes on, and the aborted responses continue as continuation prompts
(`rollout_engine.continuation`) exactly as after an abort-mode push.

`Rollouter.restore(snapshot)` (before `run()`) queues the snapshot's groups ahead of the
prompt source. Each is admitted like any prompt (same budget, same concurrency limit), and its
unfinished responses continue from `prompt + tokens so far` with the remaining token budget,
so every token generated before the snapshot reaches the sink with its original version and
log-prob. Staleness still holds: a group whose oldest token is already more than
`max_staleness` versions behind the rollouter's version at restore can never be delivered, so
its partial responses are dropped at once and counted (`RolloutStats.restore_dropped`,
`restore_dropped_tokens`) and its prompt restarts from scratch (the prompt is not lost); every
other restored group is checked at delivery like every group.

The app must not also regenerate a restored prompt: skip `snapshot.prompt_ids()` in the prompt
stream it gives the new rollouter, as it skips the prompts already consumed.

The sampling seed is recorded (`sampling_seed`); a continuation re-seeds the engine's sampler
with it, so a continued response is a valid sample of the policy but not the very tokens the
interrupted request would have produced.

Structs cross process boundaries and live in checkpoint directories: msgpack with a
`schema_version`; `save_snapshot` / `load_snapshot` do the (blocking) file work.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from rollout_engine.continuation import PartialResponse
from rollout_engine.types import PromptSample

__all__ = [
    "SNAPSHOT_SCHEMA_VERSION",
    "GroupSnapshot",
    "ResponseSnapshot",
    "RolloutSnapshot",
    "load_snapshot",
    "save_snapshot",
]

SNAPSHOT_SCHEMA_VERSION = 1


class ResponseSnapshot(msgspec.Struct, kw_only=True):
    """One response of an in-flight group: what was generated so far.

    `finish_reason` "abort" means unfinished (it is continued on restore); any other value
    means the response is complete."""

    token_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []  # the weight version of each token
    finish_reason: str = "abort"
    resumes: int = 0  # continuation requests it took so far

    @classmethod
    def of(cls, response: PartialResponse) -> ResponseSnapshot:
        return cls(
            token_ids=list(response.token_ids),
            logprobs=list(response.logprobs),
            versions=list(response.versions),
            finish_reason=response.finish_reason,
            resumes=response.resumes,
        )

    def to_partial(self) -> PartialResponse:
        return PartialResponse(
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason,
            resumes=self.resumes,
        )


class GroupSnapshot(msgspec.Struct, kw_only=True):
    """An admitted group not yet delivered. `responses` is empty when no response had come
    back from the engine yet (nothing generated that could be lost): it restarts from the
    prompt."""

    group_id: str
    sample: PromptSample
    admitted_version: int  # rollouter version when it was first admitted
    sampling_seed: int | None = None
    responses: list[ResponseSnapshot] = []

    @property
    def min_version(self) -> int | None:
        """The version of its oldest generated token (None: no token yet)."""
        versions = [min(r.versions) for r in self.responses if r.versions]
        return min(versions) if versions else None

    @property
    def generated_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.responses)


class RolloutSnapshot(msgspec.Struct, kw_only=True):
    """A rollouter's in-flight groups at one moment (`Rollouter.snapshot_in_flight`)."""

    schema_version: int = SNAPSHOT_SCHEMA_VERSION
    version: int  # the rollouter's weight version when it was taken
    group_size: int
    taken_at: float = 0.0  # time.time()
    groups: list[GroupSnapshot] = []
    # The prompt stream's own `checkpoint_state()`, read at the same moment as `groups` (None:
    # the stream has none). With it, `groups` also holds the prompts taken from the stream
    # and not admitted yet (no responses: they start from the prompt), so every prompt the
    # stream handed out before that state is in `groups` or was delivered, failed or dropped.
    prompt_state: dict[str, Any] | None = None

    def prompt_ids(self) -> frozenset[str]:
        """Prompt ids of its groups: skip them in a resumed run's prompt stream."""
        return frozenset(group.sample.prompt_id for group in self.groups)

    @property
    def generated_tokens(self) -> int:
        return sum(group.generated_tokens for group in self.groups)

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> RolloutSnapshot:
        snapshot = msgspec.msgpack.decode(data, type=cls)
        if snapshot.schema_version != SNAPSHOT_SCHEMA_VERSION:
            raise ValueError(
                f"rollout snapshot schema {snapshot.schema_version} "
                f"(this version reads {SNAPSHOT_SCHEMA_VERSION})"
            )
        return snapshot


def save_snapshot(snapshot: RolloutSnapshot, path: str | Path) -> Path:
    """Write atomically (temporary file, fsync, `os.replace`); blocking file I/O: from async
    code call it in a thread."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(snapshot.encode())
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_snapshot(path: str | Path) -> RolloutSnapshot:
    """Read a snapshot written by `save_snapshot`; blocking file I/O."""
    return RolloutSnapshot.decode(Path(path).read_bytes())

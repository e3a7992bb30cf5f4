"""`PromptSource`: one replica's prompt stream and the only owner of its resume state.

A task's `prompts(seed)` is a seeded (so reproducible) stream; a finite dataset is
epoch-ordered, shuffled per epoch by the seed. The state a checkpoint keeps of it is its
**position**: how many prompts of the stream were handed to the rollouter (with the epoch and
the cursor inside it, for people). The rollouter records it in its in-flight snapshot at the
same moment as the groups it has admitted and not delivered, and the prompts it took and has
not admitted yet (`rollout_engine.RolloutSnapshot.prompt_state`); the queue's groups are
saved beside them (`train_app.inflight`). So every prompt before the position was trained
on, failed, filtered, or is in one of those two files, and a resume seeks the stream to the
position: the state is O(groups in flight), never O(prompts consumed). A group dropped as too
stale is admitted again (`RolloutConfig.retry_stale`) and, until it is, is in the snapshot.

Seeking: a task with `stream_from(seed, position, skip)` (the built-in `repeat` and the
dataset task) starts there at once and builds no prompt it passes over; any other task's
stream is walked from its start in the rollouter's prompt thread (never on an event loop).

`skip`: prompt ids not to generate again even though they lie at or after the position. A
resume skips the groups it puts back on the queue (a group admitted after its replica's
snapshot may be in the queue's copy). A checkpoint written before positions existed has no
position: it resumes from the start of every stream skipping every id it trained on
(`consumed_prompt_ids`, the compatibility path), and the state carries the skipped ids not
yet passed (only those of this stream when the task can tell, `position_of`).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, Protocol

from rollout_engine import PromptSample

__all__ = ["PromptSource", "PromptStream", "StreamPosition"]


class PromptStream(Protocol):
    """What `PromptSource` needs of a task: a stream per seed whose `prompt_id`s never
    repeat, within a stream or across seeds (each replica has its own seed, `plan.py`).

    Optional, for a cheap resume: `stream_from(seed, position, skip)` yielding
    `(position, sample)` from `position` on, without building the samples of `skip`;
    `position_of(seed, prompt_id)` (None: not this stream's); `epoch_length(seed)`
    (prompts per epoch of this stream; None: endless)."""

    def prompts(self, seed: int) -> Iterator[PromptSample]: ...


class StreamPosition:
    """Where a stream is: `position` (prompts handed out), and `epoch` / `cursor` in it."""

    __slots__ = ("cursor", "epoch", "position")

    def __init__(self, position: int, epoch_length: int | None) -> None:
        self.position = position
        if epoch_length:
            self.epoch, self.cursor = divmod(position, epoch_length)
        else:
            self.epoch, self.cursor = 0, position


class PromptSource:
    """Iterates the task's stream of `seed` from `position`, leaving out `skip`.

    `checkpoint_state()` is read by the rollouter (on its loop, while its prompt thread is
    idle) and `load_state_dict` takes it back; load before iterating."""

    def __init__(
        self,
        task: PromptStream,
        seed: int,
        consumed: Iterable[str] = (),
        *,
        position: int = 0,
    ) -> None:
        self._task = task
        self._seed = seed
        self._skip = frozenset(consumed)
        self._position = position
        self._lock = threading.Lock()
        # Skipped ids not passed yet, by position (filled in the prompt thread).
        self._ahead: list[tuple[int, str]] | None = None
        self._unplaced: list[str] = []  # skipped ids whose position the task cannot tell

    @property
    def position(self) -> int:
        return self._position

    def checkpoint_state(self) -> dict[str, Any]:
        """`{"seed", "position", "epoch", "cursor"}`, plus `"skip"` while skipped ids lie
        ahead. Cheap: no walk over anything consumed."""
        with self._lock:
            at = StreamPosition(self._position, self._epoch_length())
            state: dict[str, Any] = {
                "seed": self._seed,
                "position": at.position,
                "epoch": at.epoch,
                "cursor": at.cursor,
            }
            if self._ahead is None:  # not started: every skipped id is still ahead
                skip = sorted(self._skip)
            else:
                skip = [*self._unplaced, *(i for _, i in self._ahead)]
        if skip:
            state["skip"] = skip
        return state

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a `checkpoint_state()` (or the older `{"seed", "consumed_prompt_ids"}`)."""
        unknown = set(state) - {"seed", "position", "epoch", "cursor", "skip"}
        unknown -= {"consumed_prompt_ids"}
        if unknown:
            raise ValueError(f"unknown PromptSource state keys {sorted(unknown)}")
        self._seed = int(state["seed"])
        self._position = int(state.get("position", 0))
        self._skip = frozenset(state.get("skip", ())) | frozenset(
            state.get("consumed_prompt_ids", ())
        )
        self._ahead = None

    def __iter__(self) -> Iterator[PromptSample]:
        return self._generate()

    def _generate(self) -> Iterator[PromptSample]:
        # The body runs in the rollouter's prompt thread: the seek happens there.
        self._place_skipped()
        for position, sample in self._stream(self._position):
            with self._lock:
                self._position = position + 1
                self._pass(position + 1)
            yield sample

    def _stream(self, start: int) -> Iterator[tuple[int, PromptSample]]:
        seek = getattr(self._task, "stream_from", None)
        if seek is not None:
            return iter(seek(self._seed, start, self._skip))
        walked = islice(enumerate(self._task.prompts(self._seed)), start, None)
        return ((i, p) for i, p in walked if p.prompt_id not in self._skip)

    def _place_skipped(self) -> None:
        """Order the skipped ids by position (those this stream passed are dropped), so the
        state carries only those still ahead."""
        locate = getattr(self._task, "position_of", None)
        ahead: list[tuple[int, str]] = []
        unplaced: list[str] = []
        for prompt_id in self._skip:
            where = locate(self._seed, prompt_id) if locate is not None else -1
            if where is None or (where is not None and 0 <= where < self._position):
                continue  # another stream's, or already passed
            if where is not None and where >= 0:
                ahead.append((where, prompt_id))
            else:
                unplaced.append(prompt_id)
        ahead.sort()
        with self._lock:
            self._ahead, self._unplaced = ahead, sorted(unplaced)

    def _pass(self, position: int) -> None:
        ahead = self._ahead
        if ahead and ahead[0][0] < position:
            del ahead[: bisect.bisect_left(ahead, (position, ""))]

    def _epoch_length(self) -> int | None:
        length = getattr(self._task, "epoch_length", None)
        return length(self._seed) if length is not None else None

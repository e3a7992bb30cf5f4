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

`redo`: prompt ids before the position to generate again first, because their group was
dropped as too stale after it left the rollouter (put back on the queue at a resume, too old
to train on); `give_back` adds more while the run goes on. Each is rebuilt from its position
(`position_of`), so this needs a seekable task; ids of other streams are ignored.

`skip`: prompt ids not to generate again even though they lie at or after the position. A
resume skips the groups it puts back on the queue (a group admitted after its replica's
snapshot may be in the queue's copy). A checkpoint written before positions existed has no
position: it resumes from the start of every stream skipping every id it trained on
(`consumed_prompt_ids`, the compatibility path), and the state carries the skipped ids not
yet passed (only those of this stream when the task can tell, `position_of`).
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, Protocol

from rollout_engine import PromptSample

__all__ = ["PromptSource", "PromptStream", "StreamPosition"]

logger = logging.getLogger(__name__)


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
        redo: Iterable[str] = (),
    ) -> None:
        self._task = task
        self._seed = seed
        self._skip = frozenset(consumed)
        self._position = position
        self._lock = threading.Lock()
        self._redo: deque[tuple[str, int]] = deque()  # (id, the position when given back)
        self.give_back(redo)
        # Skipped ids not passed yet, by position (filled in the prompt thread).
        self._ahead: list[tuple[int, str]] | None = None
        self._unplaced: list[str] = []  # skipped ids whose position the task cannot tell

    @property
    def position(self) -> int:
        return self._position

    def give_back(self, prompt_ids: Iterable[str]) -> None:
        """Generate these prompts of this stream again, before any new one. Cheap and safe
        from any thread: they are placed in the prompt thread, when the stream is next read,
        and left out there if they are another stream's, the task cannot place them, or they
        lie at or after the position of now (the stream hands them out anyway)."""
        with self._lock:
            self._redo.extend((i, self._position) for i in prompt_ids)

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
                skip = list(self._skip)
            else:
                skip = [*self._unplaced, *(i for _, i in self._ahead)]
            redo = [prompt_id for prompt_id, _ in self._redo]
        if skip:
            state["skip"] = skip
        if redo:
            state["redo"] = redo
        return state

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a `checkpoint_state()` (or the older `{"seed", "consumed_prompt_ids"}`)."""
        unknown = set(state) - {"seed", "position", "epoch", "cursor", "skip", "redo"}
        unknown -= {"consumed_prompt_ids"}
        if unknown:
            raise ValueError(f"unknown PromptSource state keys {sorted(unknown)}")
        self._seed = int(state["seed"])
        self._position = int(state.get("position", 0))
        self._skip = frozenset(state.get("skip", ())) | frozenset(
            state.get("consumed_prompt_ids", ())
        )
        self._ahead = None
        self._redo.clear()
        self.give_back(state.get("redo", ()))

    def __iter__(self) -> Iterator[PromptSample]:
        return self._generate()

    def _generate(self) -> Iterator[PromptSample]:
        # The body runs in the rollouter's prompt thread: the seek happens there.
        self._place_skipped()
        stream = self._stream(self._position)
        while True:
            redo = self._take_redo()
            if redo is not None:
                yield redo
                continue
            step = next(stream, None)
            if step is None:
                return
            position, sample = step
            with self._lock:
                self._position = position + 1
                self._pass(position + 1)
            yield sample

    def _take_redo(self) -> PromptSample | None:
        """The next prompt of this stream to generate again, rebuilt from its position (it
        leaves the state once handed out: the rollouter holds it then)."""
        locate = getattr(self._task, "position_of", None)
        seek = getattr(self._task, "stream_from", None)
        while True:
            with self._lock:
                if not self._redo:
                    return None
                prompt_id, before = self._redo[0]
            where = locate(self._seed, prompt_id) if locate and seek else None
            found = None
            if where is not None and where < before:
                found = next(iter(seek(self._seed, where)), None)  # type: ignore[misc]
            with self._lock:
                self._redo.popleft()
            if found is not None and found[1].prompt_id == prompt_id:
                return found[1]
            logger.debug("prompt %s: not one of this stream's to generate again", prompt_id)

    def _stream(self, start: int) -> Iterator[tuple[int, PromptSample]]:
        seek = getattr(self._task, "stream_from", None)
        if seek is not None:
            return iter(seek(self._seed, start, self._skip))
        walked = islice(enumerate(self._task.prompts(self._seed)), start, None)
        return ((i, p) for i, p in walked if p.prompt_id not in self._skip)

    def _place_skipped(self) -> None:
        """Place the skipped ids by position in a heap (those this stream passed, or of
        another stream, are dropped), so the state carries only those still ahead. A heap,
        not a sort: an older checkpoint's million ids are placed without holding the
        interpreter for seconds in one call."""
        locate = getattr(self._task, "position_of", None)
        ahead: list[tuple[int, str]] = []
        unplaced: list[str] = []
        for prompt_id in self._skip:
            if locate is None:
                unplaced.append(prompt_id)
                continue
            where = locate(self._seed, prompt_id)
            if where is not None and where >= self._position:
                ahead.append((where, prompt_id))
        heapq.heapify(ahead)
        with self._lock:
            self._ahead, self._unplaced = ahead, unplaced

    def _pass(self, position: int) -> None:
        ahead = self._ahead
        while ahead and ahead[0][0] < position:
            heapq.heappop(ahead)

    def _epoch_length(self) -> int | None:
        length = getattr(self._task, "epoch_length", None)
        return length(self._seed) if length is not None else None

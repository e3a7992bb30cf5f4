"""VisionPreprocessor: run the vision pipeline in a bounded thread pool, off the event loop.

Two bounds:
- `max_workers` threads do the CPU work (PIL decode and resize release the GIL, so threads
  overlap on several cores);
- `max_inflight` jobs at most are queued or running; a burst of trajectories beyond that waits
  on an asyncio.Semaphore (without blocking the loop), so decoded images in memory stay
  bounded by about max_inflight conversations.

A job's slot is released when its thread work is over, even if the awaiting coroutine was
cancelled earlier, so the bound holds for the threads too, not only for the coroutines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from mm_preprocess.config import DEFAULT_MAX_ENCODED_BYTES, DEFAULT_MAX_IMAGE_PIXELS, VisionConfig
from mm_preprocess.errors import PreprocessorClosed
from mm_preprocess.pipeline import Conversation, run_multi_modal_info, run_vision_info
from mm_preprocess.results import ItemResult, MultiModalInfo, VisionInputs

__all__ = ["PreprocessorStats", "VisionPreprocessor"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class PreprocessorStats:
    """Counters of the async entry points (the `*_sync` methods are not counted).

    inflight: jobs holding a slot (queued in the pool or running), <= max_inflight.
    max_inflight_observed: highest `inflight` seen since construction.
    waiting: callers waiting for a slot.
    completed / failed / cancelled: finished jobs by outcome (failed includes bad input).
    """

    inflight: int
    max_inflight_observed: int
    waiting: int
    completed: int
    failed: int
    cancelled: int
    max_inflight: int
    max_workers: int
    closed: bool


class VisionPreprocessor:
    """Bounded, threaded qwen-vl-utils preprocessing for asyncio agent loops.

    Use one per process (or per event loop) and share it between trajectory coroutines:

        async with VisionPreprocessor(max_workers=2) as pre:
            info = await pre.process_multi_modal_info(messages, processor)

    Args:
        max_workers: threads in the pool (default: min(4, CPU count)).
        max_inflight: jobs queued or running at most (default: 2 * max_workers, enough to
            keep every thread busy while the next job is handed over).
        image_patch_size, min_pixels, max_pixels, allow_remote, remote_timeout_s,
        max_image_pixels, max_encoded_bytes, verify: see `VisionConfig`.
        config: a ready VisionConfig instead of the individual fields.
    """

    def __init__(
        self,
        *,
        max_workers: int | None = None,
        max_inflight: int | None = None,
        image_patch_size: int = 14,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        allow_remote: bool = False,
        remote_timeout_s: float = 10.0,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_encoded_bytes: int = DEFAULT_MAX_ENCODED_BYTES,
        verify: bool = True,
        config: VisionConfig | None = None,
    ) -> None:
        workers = max_workers if max_workers is not None else min(4, os.cpu_count() or 1)
        if workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {workers}")
        inflight = max_inflight if max_inflight is not None else 2 * workers
        if inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {inflight}")
        self.config = config or VisionConfig(
            image_patch_size=image_patch_size,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            allow_remote=allow_remote,
            remote_timeout_s=remote_timeout_s,
            max_image_pixels=max_image_pixels,
            max_encoded_bytes=max_encoded_bytes,
            verify=verify,
        )
        self.max_workers = workers
        self.max_inflight = inflight
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="mm-preprocess"
        )
        self._slots = asyncio.Semaphore(inflight)
        self._jobs: set[concurrent.futures.Future[Any]] = set()
        self._closed = False
        self._inflight = 0
        self._max_inflight_observed = 0
        self._waiting = 0
        self._completed = 0
        self._failed = 0
        self._cancelled = 0

    # -- async API -------------------------------------------------------------------------

    async def process_vision_info(self, messages: Conversation) -> VisionInputs:
        """Images, videos and video metadata, as qwen-vl-utils' `process_vision_info` gives
        them (pixel for pixel), computed in the pool. Raises VisionDecodeError on bad input."""
        return await self._run(run_vision_info, messages, self.config)

    async def process_multi_modal_info(
        self,
        messages: Conversation,
        processor: Any = None,
        *,
        add_generation_prompt: bool = True,
        processor_kwargs: Mapping[str, Any] | None = None,
    ) -> MultiModalInfo:
        """Vision inputs plus, with a Hugging Face processor, its model inputs (`input_ids`,
        `pixel_values`, `image_grid_thw`, ...). Chat templating and the processor run in the
        pool too. Raises VisionDecodeError on bad input.

        One processor may be shared by all worker threads as long as `processor_kwargs` stay
        the same between calls: HF fast tokenizers raise "Already borrowed" when padding or
        truncation settings change while another thread is tokenizing."""
        return await self._run(
            _multi_modal_job,
            messages,
            self.config,
            processor,
            add_generation_prompt,
            processor_kwargs,
        )

    async def process_many(
        self,
        conversations: Sequence[Conversation],
        processor: Any = None,
        *,
        add_generation_prompt: bool = True,
        processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[ItemResult[MultiModalInfo]]:
        """`process_multi_modal_info` for each conversation; one result or error per item, in
        order, so one bad image does not lose the others. A preprocessor that is already
        closed refuses the whole batch with PreprocessorClosed."""
        self._ensure_open()

        async def one(messages: Conversation) -> ItemResult[MultiModalInfo]:
            try:
                value = await self.process_multi_modal_info(
                    messages,
                    processor,
                    add_generation_prompt=add_generation_prompt,
                    processor_kwargs=processor_kwargs,
                )
            except Exception as exc:
                return ItemResult(error=exc)
            return ItemResult(value=value)

        return list(await asyncio.gather(*(one(messages) for messages in conversations)))

    async def warmup(self) -> None:
        """Import qwen-vl-utils (and torch) in the pool now, not during the first job."""
        await self._run(_import_backend)

    # -- sync API (no event loop) ----------------------------------------------------------

    def process_vision_info_sync(self, messages: Conversation) -> VisionInputs:
        """Same result as `process_vision_info`, computed in the calling thread."""
        return run_vision_info(messages, self.config)

    def process_multi_modal_info_sync(
        self,
        messages: Conversation,
        processor: Any = None,
        *,
        add_generation_prompt: bool = True,
        processor_kwargs: Mapping[str, Any] | None = None,
    ) -> MultiModalInfo:
        """Same result as `process_multi_modal_info`, computed in the calling thread."""
        return _multi_modal_job(
            messages, self.config, processor, add_generation_prompt, processor_kwargs
        )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> PreprocessorStats:
        return PreprocessorStats(
            inflight=self._inflight,
            max_inflight_observed=self._max_inflight_observed,
            waiting=self._waiting,
            completed=self._completed,
            failed=self._failed,
            cancelled=self._cancelled,
            max_inflight=self.max_inflight,
            max_workers=self.max_workers,
            closed=self._closed,
        )

    def close(self, *, wait: bool = False) -> None:
        """Refuse new jobs, drop queued ones (their callers get PreprocessorClosed), let
        running ones finish. `wait=True` blocks until the threads exit: only outside a loop."""
        if not self._closed:
            self._closed = True
            self._executor.shutdown(wait=False, cancel_futures=True)
            logger.debug("VisionPreprocessor closed with %d job(s) in flight", self._inflight)
        if wait:
            self._executor.shutdown(wait=True)

    async def aclose(self) -> None:
        """`close()`, then wait (without blocking the loop) for running jobs to finish."""
        self.close()
        running = [asyncio.wrap_future(job) for job in list(self._jobs) if not job.done()]
        if running:
            await asyncio.wait(running)

    async def __aenter__(self) -> VisionPreprocessor:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __enter__(self) -> VisionPreprocessor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(wait=True)

    # -- internals -------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise PreprocessorClosed("VisionPreprocessor is closed")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        self._ensure_open()
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        if self._closed:
            self._slots.release()
            raise PreprocessorClosed("VisionPreprocessor was closed while the job waited")
        self._inflight += 1
        self._max_inflight_observed = max(self._max_inflight_observed, self._inflight)
        try:
            job = self._executor.submit(fn, *args)
        except RuntimeError as exc:  # the pool was shut down under us
            self._release_slot()
            raise PreprocessorClosed("VisionPreprocessor is closed") from exc
        self._jobs.add(job)
        # Runs in the worker thread; set.discard and list(set) are atomic under the GIL.
        job.add_done_callback(self._jobs.discard)
        try:
            # wrap_future == what loop.run_in_executor returns, but keeps the thread-side
            # future so a cancelled caller can hand its slot over to the running thread.
            result = await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            self._on_cancelled(job)
            if self._dropped_by_close(job):
                self._failed += 1
                raise PreprocessorClosed(
                    "VisionPreprocessor was closed before the job started"
                ) from None
            self._cancelled += 1
            raise
        except BaseException:
            self._failed += 1
            self._release_slot()
            raise
        self._completed += 1
        self._release_slot()
        return result

    def _on_cancelled(self, job: concurrent.futures.Future[Any]) -> None:
        if job.done():
            self._release_slot()
        else:
            # Still running in a thread: the slot stays taken until the thread is done.
            loop = asyncio.get_running_loop()
            job.add_done_callback(lambda _: _call_soon_threadsafe(loop, self._release_slot))

    def _dropped_by_close(self, job: concurrent.futures.Future[Any]) -> bool:
        """True when close() dropped the queued job and the caller itself was not cancelled."""
        task = asyncio.current_task()
        caller_cancelled = task is not None and task.cancelling() > 0
        return self._closed and job.cancelled() and not caller_cancelled

    def _release_slot(self) -> None:
        self._inflight -= 1
        self._slots.release()


def _multi_modal_job(
    messages: Conversation,
    config: VisionConfig,
    processor: Any,
    add_generation_prompt: bool,
    processor_kwargs: Mapping[str, Any] | None,
) -> MultiModalInfo:
    return run_multi_modal_info(
        messages,
        config,
        processor,
        add_generation_prompt=add_generation_prompt,
        processor_kwargs=processor_kwargs,
    )


def _import_backend() -> None:
    import qwen_vl_utils  # noqa: F401


def _call_soon_threadsafe(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    # A closed loop raises RuntimeError: then nobody is left to wait for the slot.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)

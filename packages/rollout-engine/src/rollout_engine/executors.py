"""The rollouter's thread pools: made on first use, shut down once at the end of the run."""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor

__all__ = ["RolloutExecutors"]


class RolloutExecutors:
    """One thread for the prompt source (iterators are not thread-safe, and one fetch runs
    at a time) and `reward_workers` threads for reward functions. Neither exists until it
    is first asked for, so a rollouter fed a list with cheap rewards starts no thread."""

    def __init__(self, reward_workers: int) -> None:
        self._reward_workers = reward_workers
        self._prompts: ThreadPoolExecutor | None = None
        self._rewards: ThreadPoolExecutor | None = None

    def prompts(self) -> Executor:
        if self._prompts is None:
            self._prompts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-prompts")
        return self._prompts

    def rewards(self) -> Executor:
        if self._rewards is None:
            self._rewards = ThreadPoolExecutor(
                max_workers=self._reward_workers, thread_name_prefix="rollout-reward"
            )
        return self._rewards

    def shutdown(self) -> None:
        """Without waiting: a thread still in a prompt iterator or a reward ends on its own."""
        for pool in (self._rewards, self._prompts):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

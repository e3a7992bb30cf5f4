"""User reward functions: `--reward MODULE:FUNCTION` or `--reward path/to/file.py:FUNCTION`.

A reward function is called with keyword arguments, only those it names (or all of them if
it takes `**kwargs`):

    def reward(completion: str, prompt, answer: str, metadata: dict, finished: bool,
               completion_ids: list[int]) -> float | dict[str, float]: ...

- `completion`: the response text (special tokens and the final EOS removed);
- `prompt`: the dataset's prompt value (a string, or a chat `messages` list);
- `answer`: the answer column ("" when the dataset has none);
- `metadata`: every other column of the row, as the dataset has it;
- `finished`: True when the response ended with EOS (not cut by `--max-tokens`);
- `completion_ids`: the response token ids.

It may be `async def`. It returns a number, or a dict of named numbers (its components, summed
to its value). Each function's value is weighted (`--reward-weights`) and the weighted values
are summed into the sample's reward. Components are reported as `reward/<name>` (a function
that returns a number as `reward/<function name>`).

Every call runs off the event loop: sync functions in this module's bounded thread pool,
async ones on its own event-loop thread, each under `--reward-timeout`. A call that raises,
times out, or returns NaN, inf or a non-number raises `RewardFailed` naming the function: the
rollouter counts the group as failed (cause in failures.jsonl) and ends the run with
`RolloutFailed` after its consecutive-failure limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "REWARD_ARGUMENTS",
    "RewardFailed",
    "RewardSet",
    "RewardSpecError",
    "load_reward",
]

REWARD_ARGUMENTS = ("completion", "prompt", "answer", "metadata", "finished", "completion_ids")
"""The keyword arguments a reward function may take (see the module docstring)."""


class RewardSpecError(ValueError):
    """A `--reward` that cannot be used: not importable, not callable, wrong signature."""


class RewardFailed(RuntimeError):
    """One reward call raised, timed out or returned a value that is not a finite number."""


@dataclass(frozen=True)
class _Reward:
    spec: str
    name: str
    function: Callable[..., Any]
    arguments: frozenset[str]
    is_async: bool


def _import_target(target: str, search_paths: Sequence[str]) -> Any:
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise RewardSpecError(f"--reward {target}: no such file")
        name = f"_asyncrl_reward_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    for entry in reversed(search_paths):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    return importlib.import_module(target)


def _arguments(function: Callable[..., Any], spec: str) -> frozenset[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        raise RewardSpecError(f"--reward {spec}: cannot read its signature ({exc})") from None
    names: set[str] = set()
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            names.update(REWARD_ARGUMENTS)
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        elif parameter.name in REWARD_ARGUMENTS:
            if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
                raise RewardSpecError(
                    f"--reward {spec}: {parameter.name!r} is positional-only; rewards are "
                    "called with keyword arguments"
                )
            names.add(parameter.name)
        elif parameter.default is inspect.Parameter.empty:
            raise RewardSpecError(
                f"--reward {spec}: parameter {parameter.name!r} is not one a reward gets; "
                f"a reward function takes some of {', '.join(REWARD_ARGUMENTS)}"
            )
    if "completion" not in names:
        raise RewardSpecError(f"--reward {spec}: it must take a `completion` argument")
    return frozenset(names)


def load_reward(spec: str, search_paths: Sequence[str] = ()) -> _Reward:
    """Import and check `MODULE:FUNCTION` or `FILE.py:FUNCTION`; raises `RewardSpecError`.
    `search_paths` go on `sys.path` first (the directory the run was started from)."""
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target or not attribute:
        raise RewardSpecError(f"--reward {spec}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    try:
        module = _import_target(target, search_paths)
    except RewardSpecError:
        raise
    except Exception as exc:
        raise RewardSpecError(
            f"--reward {spec}: cannot import {target} ({type(exc).__name__}: {exc})"
        ) from None
    function = getattr(module, attribute, None)
    if function is None:
        raise RewardSpecError(f"--reward {spec}: {target} has no {attribute!r}")
    if not callable(function):
        raise RewardSpecError(f"--reward {spec}: {attribute!r} is not callable")
    is_async = inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004 - an object with `async def __call__`
    )
    return _Reward(spec, attribute, function, _arguments(function, spec), is_async)


RESERVED_METRICS = frozenset({"reward/mean"})
"""Names the run already reports (the trainer's batch mean): a component never overwrites one."""


def _metric_name(component: str) -> str:
    name = f"reward/{component}"
    return f"reward/component/{component}" if name in RESERVED_METRICS else name


def _components(reward: _Reward, value: Any) -> dict[str, float]:
    items = value.items() if isinstance(value, Mapping) else [(reward.name, value)]
    out: dict[str, float] = {}
    for name, item in items:
        if not isinstance(item, numbers.Real):
            raise RewardFailed(
                f"reward {reward.spec} returned a non-number ({type(item).__name__} for {name!r})"
            )
        if not math.isfinite(item):
            raise RewardFailed(f"reward {reward.spec} returned {item} for {name!r}")
        out[str(name)] = float(item)
    return out


class RewardSet:
    """The weighted sum of several reward functions, each call bounded by `timeout_s`.

    `score(**arguments)` blocks (the rollouter runs it in its reward executor); `metrics()`
    returns each component's mean since the last call as `reward/<name>`."""

    def __init__(
        self,
        specs: Sequence[str],
        weights: Sequence[float] = (),
        timeout_s: float = 30.0,
        workers: int = 2,
        search_paths: Sequence[str] = (),
    ) -> None:
        if not specs:
            raise RewardSpecError("no reward function given (--reward MODULE:FUNCTION)")
        if weights and len(weights) != len(specs):
            raise RewardSpecError(
                f"--reward-weights has {len(weights)} values for {len(specs)} --reward functions"
            )
        self._rewards = [load_reward(spec, search_paths) for spec in specs]
        self._weights = [float(w) for w in weights] or [1.0] * len(specs)
        self._timeout_s = timeout_s
        # Sync calls: a hung function holds one worker; later calls then time out too, fail,
        # and the rollouter's consecutive-failure limit ends the run.
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reward")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def _async_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="reward-async", daemon=True
                ).start()
            return self._loop

    def _call(self, reward: _Reward, arguments: Mapping[str, Any]) -> Any:
        kwargs = {k: v for k, v in arguments.items() if k in reward.arguments}
        if reward.is_async:
            future = asyncio.run_coroutine_threadsafe(reward.function(**kwargs), self._async_loop())
        else:
            future = self._pool.submit(reward.function, **kwargs)
        try:
            return future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RewardFailed(
                f"reward {reward.spec} timed out after {self._timeout_s:g} s"
            ) from None
        except Exception as exc:
            raise RewardFailed(f"reward {reward.spec} raised {type(exc).__name__}: {exc}") from exc

    def score(self, **arguments: Any) -> float:
        """The weighted sum for one response (`arguments`: see `REWARD_ARGUMENTS`)."""
        total = 0.0
        seen: dict[str, float] = {}
        for reward, weight in zip(self._rewards, self._weights, strict=True):
            components = _components(reward, self._call(reward, arguments))
            total += weight * sum(components.values())
            seen.update(components)
        with self._lock:
            for name, value in seen.items():
                self._sums[name] = self._sums.get(name, 0.0) + value
                self._counts[name] = self._counts.get(name, 0) + 1
        return total

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {_metric_name(k): self._sums[k] / self._counts[k] for k in self._sums}
            self._sums.clear()
            self._counts.clear()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(_stop_loop(), self._loop)


async def _stop_loop() -> None:
    """Cancel the async rewards still running (timed out), let them end, stop the loop."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.get_running_loop().stop()

"""Partial rollout: continue responses that a weight push aborted.

When the engine is paused with mode "abort", each unfinished response comes back with
`finish_reason="abort"` and the tokens generated so far. After the engine resumes (with new
weights), the rollouter resubmits `prompt_ids + tokens_so_far` as a fresh request with `n=1`
and `max_tokens = max_tokens - len(tokens_so_far)`, and appends what comes back. Every token
keeps the version stamp of the weights that produced it, so a continued response carries
old-version tokens followed by new-version ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_engine.types import Completion, SamplingConfig

__all__ = ["PartialResponse", "SupportsGenerate", "continue_aborted"]


class SupportsGenerate(Protocol):
    """The one `GenerationEngine` method a continuation uses."""

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        n: int = 1,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> list[Completion]: ...


@dataclass
class PartialResponse:
    """One response of a group, accumulated over its original request and continuations."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "abort"
    resumes: int = 0

    @classmethod
    def from_completion(cls, completion: Completion) -> PartialResponse:
        response = cls()
        response.append(completion)
        return response

    def append(self, completion: Completion) -> None:
        if not len(completion.token_ids) == len(completion.logprobs) == len(completion.versions):
            raise ValueError(
                "engine returned mismatched lengths: "
                f"{len(completion.token_ids)} tokens, {len(completion.logprobs)} logprobs, "
                f"{len(completion.versions)} versions"
            )
        self.token_ids.extend(completion.token_ids)
        self.logprobs.extend(completion.logprobs)
        self.versions.extend(completion.versions)
        self.finish_reason = completion.finish_reason

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"


async def continue_aborted(
    engine: SupportsGenerate,
    response: PartialResponse,
    *,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    multi_modal_data: dict[str, Any] | None,
    wait_until_resumed: Callable[[], Awaitable[Any]],
    on_resubmit: Callable[[], Awaitable[None]],
) -> PartialResponse:
    """Resubmit `response` until it finishes; it may be aborted again by a later push.

    Each continuation waits for `wait_until_resumed()` (the weight push is over) so it is
    never sent into a paused engine.
    """
    while response.aborted:
        remaining = sampling.max_tokens - len(response.token_ids)
        if remaining <= 0:
            response.finish_reason = "length"
            break
        await wait_until_resumed()
        await on_resubmit()
        response.resumes += 1
        [completion] = await engine.generate(
            f"{request_id}:r{response.resumes}",
            [*prompt_ids, *response.token_ids],
            dataclasses.replace(sampling, max_tokens=remaining),
            n=1,
            multi_modal_data=multi_modal_data,
        )
        response.append(completion)
    return response

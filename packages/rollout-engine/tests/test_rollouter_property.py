"""Seeded property tests of the rollouter's staleness bound and bookkeeping.

The engine is `rollout_engine.testing.FakeEngine`, a fake used because these are scheduling
tests; with `time_per_token_s=0` each decoding step is one event-loop turn, so 200 random
schedules run in a few seconds.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from rollout_engine import PromptSample, RolloutConfig, Rollouter, SamplingConfig, Trajectory
from rollout_engine.testing import FakeEngine, FakeEngineConfig, ListSink, make_prompts

SCHEDULES = 200
CHUNKS = 4


class TaskCancelledError(Exception):
    """Mimics Ray's TaskCancelledError."""


def _reward(sample: PromptSample, trajectory: Trajectory) -> float:
    return float(len(trajectory.response_ids))


def _random_setup(rng: random.Random, seed: int) -> tuple[RolloutConfig, FakeEngineConfig, int]:
    config = RolloutConfig(
        group_size=rng.randint(1, 3),
        max_concurrency=rng.randint(1, 6),
        groups_per_step=rng.randint(1, 4),
        sync_every=rng.randint(1, 2),
        max_staleness=rng.randint(0, 2),
        partial_rollout=rng.random() < 0.8,
        pause_mode=rng.choice(["keep", "abort"]),
        sampling=SamplingConfig(max_tokens=rng.randint(4, 16)),
    )
    engine_config = FakeEngineConfig(
        seed=seed,
        tokens_per_step=rng.randint(1, 3),
        median_length=rng.uniform(2, 8),
        long_tail_fraction=rng.choice([0.0, 0.1, 0.3]),
        failure_rate=rng.choice([0.0, 0.05, 0.2]),
        failure_types=(RuntimeError, asyncio.CancelledError, TaskCancelledError),
        fail_after_steps=rng.randint(1, 3),
    )
    return config, engine_config, rng.randint(5, 25)


class _Schedule:
    """Drives one rollouter through random pauses, weight pushes, aborts and checkpoints."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.config, engine_config, self.prompt_count = _random_setup(self.rng, seed)
        self.engine = FakeEngine(engine_config)
        self.sink = ListSink(on_put=self._on_put)
        self.rollouter = Rollouter(
            self.engine, make_prompts(self.prompt_count), self.sink, _reward, self.config
        )
        self.version = 0
        self.checkpoints = 0

    def check_books(self) -> None:
        s = self.rollouter.stats()
        assert s.admitted == s.delivered + s.failed + s.dropped + s.in_flight, (self.seed, s)
        self.checkpoints += 1

    def _on_put(self, group: list[Trajectory]) -> None:
        version = self.rollouter.version
        for trajectory in group:
            staleness = version - min(trajectory.token_versions)
            assert staleness <= self.config.max_staleness, (self.seed, trajectory)
        assert len(group) == self.config.group_size
        self.check_books()

    async def _turns(self, low: int = 1, high: int = 5) -> None:
        for _ in range(self.rng.randint(low, high)):
            await asyncio.sleep(0)

    async def _manual_push(self) -> None:
        """Pause, wait a few turns, load and resume the engine, then on_weights()."""
        self.rollouter.pause()
        await self.engine.pause(self.config.push_pause_mode)
        await self._turns()
        self.version += 1
        await self.engine.load_weights(None, self.version)
        await self.engine.resume()
        self.rollouter.on_weights(self.version)

    async def step(self) -> None:
        action = self.rng.random()
        if action < 0.45:
            await self._turns()
        elif action < 0.7:
            self.version += 1
            await self.rollouter.update_weights(None, self.version)
        elif action < 0.8:
            await self._manual_push()
        elif action < 0.9 and self.engine.running_request_ids:
            await self.engine.abort([self.rng.choice(self.engine.running_request_ids)])
        self.check_books()

    async def run(self) -> None:
        run = asyncio.create_task(self.rollouter.run())
        async with asyncio.timeout(20):
            while not run.done():
                await self.step()
            stats = await run
        assert stats.in_flight == 0
        assert stats.admitted == self.prompt_count
        assert stats.admitted == stats.delivered + stats.failed + stats.dropped
        assert len(self.sink.groups) == stats.delivered
        assert sum(self.rollouter.failure_counts.values()) == stats.failed
        assert len(self.rollouter.failures) == min(stats.failed, self.config.recent_failures)


@pytest.mark.parametrize("chunk", range(CHUNKS))
async def test_random_schedules_never_deliver_stale_groups_and_keep_the_books(chunk: int) -> None:
    per_chunk = SCHEDULES // CHUNKS
    totals = {"failed": 0, "dropped": 0, "partial": 0, "checkpoints": 0}
    for seed in range(chunk * per_chunk, (chunk + 1) * per_chunk):
        schedule = _Schedule(seed)
        await schedule.run()
        stats = schedule.rollouter.stats()
        totals["failed"] += stats.failed
        totals["dropped"] += stats.dropped
        totals["partial"] += stats.partial
        totals["checkpoints"] += schedule.checkpoints
    # The schedules exercise what they claim to: failures, drops and partial responses.
    assert totals["failed"] > 0
    assert totals["dropped"] > 0
    assert totals["partial"] > 0
    assert totals["checkpoints"] > 10 * per_chunk


@pytest.mark.parametrize("seed", range(8))
async def test_in_order_completion_with_a_trainer_consumes_nothing_staler_than_k(seed: int) -> None:
    """The normal case of admission.py: groups finish in admission order, a trainer consumes
    them FIFO (batch_size per step) and pushes every sync_every steps. Nothing is dropped and
    the staleness at consumption never exceeds k."""
    rng = random.Random(seed)
    config = RolloutConfig(
        group_size=2,
        max_concurrency=rng.randint(4, 12),
        groups_per_step=rng.randint(1, 3),
        sync_every=rng.randint(1, 2),
        max_staleness=rng.randint(0, 2),
        sampling=SamplingConfig(max_tokens=32),
    )
    engine = FakeEngine(FakeEngineConfig(seed=seed, fixed_length=rng.randint(3, 12)))
    queue: asyncio.Queue[list[Trajectory]] = asyncio.Queue()

    class QueueSink:
        async def put(self, group: list[Trajectory]) -> None:
            queue.put_nowait(group)

    prompt_count = 60
    rollouter = Rollouter(engine, make_prompts(prompt_count), QueueSink(), _reward, config)
    run = asyncio.create_task(rollouter.run())
    trainer_version, consumed, worst = 0, 0, 0
    async with asyncio.timeout(20):
        while consumed < prompt_count:
            for _ in range(config.groups_per_version):
                group = await queue.get()
                consumed += 1
                worst = max(worst, trainer_version - min(min(t.token_versions) for t in group))
                if consumed == prompt_count:
                    break
            trainer_version += 1
            await rollouter.update_weights(None, trainer_version)
        stats = await run
    assert worst <= config.max_staleness
    assert stats.dropped == 0
    assert stats.delivered == prompt_count

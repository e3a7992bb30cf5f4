"""Multi-turn episodes: observation tokens (`loss_mask` 0) are in the sequence but in no loss,
metric, token count or GAE step. Real tiny Qwen2 on the CPU."""

from __future__ import annotations

import msgspec
import pytest
import torch
from ppo_testkit import make_group, tiny_qwen2
from ppo_trainer import PackedBatch, PolicyUpdater, PPOConfig, Trajectory, pack_batch
from ppo_trainer.staleness import group_staleness


def _episodes(seed: int = 0, observation_logprob: float = 0.0) -> list[Trajectory]:
    """Two groups of 4 episodes of 9 response tokens: turn 1 (3 generated), an observation
    (2 tokens), turn 2 (3 or 4 generated), and for odd rows a trailing 1-token observation
    cut by the token limit. Observation log-probs are `observation_logprob` (the wire
    format says 0.0; anything else must change nothing)."""
    out = []
    for g in range(2):
        group = make_group(f"g{g}", n=4, prompt_len=4, response_lens=[9] * 4, seed=seed)
        for row, t in enumerate(group):
            mask = [1, 1, 1, 0, 0, 1, 1, 1, 1] if row % 2 == 0 else [1, 1, 1, 0, 0, 1, 1, 1, 0]
            t.loss_mask = mask
            t.turn_starts = [0, 5]
            logprobs = zip(t.behaviour_logprobs, mask, strict=True)
            t.behaviour_logprobs = [lp if m else observation_logprob for lp, m in logprobs]
            # observation tokens carry the version when they were appended: never older
            t.token_versions = [0, 0, 0, 1, 1, 1, 1, 1, 1]
        out.extend(group)
    return out


def _batch(trajectories: list[Trajectory], current_version: int | None = None) -> PackedBatch:
    advantages = [float(i % 3) - 1.0 for i in range(len(trajectories))]
    return pack_batch(trajectories, advantages, current_version=current_version)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_pack_masks_observation_tokens_token_by_token() -> None:
    episodes = _episodes()
    batch = _batch(episodes)
    for row, t in enumerate(episodes):
        n_prompt = len(t.prompt_token_ids)
        window = batch.response_mask[row, n_prompt - 1 : n_prompt - 1 + len(t.response_ids)]
        assert window.tolist() == [float(m) for m in t.loss_mask]
        assert batch.response_mask[row, : n_prompt - 1].sum() == 0  # the prompt
        # the observation tokens are still in the sequence the model reads
        assert batch.input_ids[row, n_prompt : n_prompt + 9].tolist() == t.response_ids
    assert batch.num_response_tokens == sum(sum(t.loss_mask) for t in episodes)
    # the reward sits on the last *generated* token, not on a trailing observation
    rewards = batch.token_rewards()
    for row, t in enumerate(episodes):
        last = len(t.prompt_token_ids) - 1 + max(i for i, m in enumerate(t.loss_mask) if m)
        assert rewards[row, last] == pytest.approx(t.reward)
        assert rewards[row].sum() == pytest.approx(t.reward)


def test_staleness_and_on_policy_count_generated_tokens_only() -> None:
    episodes = _episodes()
    for t in episodes:
        # an (impossible) older observation must still not count
        t.token_versions = [3 if m else 2 for m in t.loss_mask]
    assert all(t.min_version == 3 for t in episodes)
    assert group_staleness(episodes[:4], 5) == 2
    assert bool(_batch(episodes, current_version=3).on_policy.all())  # type: ignore[union-attr]


def test_a_mask_of_the_wrong_length_is_rejected() -> None:
    (t,) = make_group("g", n=1, response_lens=[3])
    t.loss_mask = [1, 0]
    with pytest.raises(ValueError, match="loss_mask"):
        pack_batch([t], [0.0])


@pytest.mark.parametrize(
    "cfg",
    [
        PPOConfig(lr=1e-2),
        PPOConfig(lr=1e-2, ppo_epochs=2, num_minibatches=2, entropy_coef=0.01),
        PPOConfig(lr=1e-2, advantage="gae"),
    ],
    ids=["single-update", "prox-pass+entropy", "gae"],
)
def test_observation_tokens_change_nothing_in_the_update(cfg: PPOConfig) -> None:
    """Garbage behaviour log-probs on observation tokens: same metrics, same weights."""
    results = []
    for observation_logprob in (0.0, -40.0):
        model = tiny_qwen2(seed=3)
        batch = _batch(_episodes(observation_logprob=observation_logprob), current_version=0)
        metrics = PolicyUpdater(model, cfg).step(batch)
        results.append((metrics, _params(model)))
    (m0, p0), (m1, p1) = results
    assert m0 == pytest.approx(m1, abs=1e-6)
    for name in p0:
        torch.testing.assert_close(p0[name], p1[name], atol=1e-6, rtol=0)


def test_single_update_loss_counts_generated_tokens_only() -> None:
    batch = _batch(_episodes())
    metrics = PolicyUpdater(tiny_qwen2(seed=1), PPOConfig(use_behaviour_logprobs=False)).step(batch)
    mask = batch.response_mask
    adv = batch.advantages.unsqueeze(-1) * mask
    # ratio 1 on every generated token: loss = -sum(A) / (generated tokens)
    assert metrics["ppo/loss"] == pytest.approx(float(-adv.sum() / mask.sum()), abs=1e-5)


def test_gae_carries_values_across_observations() -> None:
    """V = 0.25 everywhere, gamma = lam = 1: every generated token's advantage is r - 0.25 and
    its return r; observation tokens have neither. The loss counts generated tokens only."""
    batch = _batch(_episodes())
    cfg = PPOConfig(
        advantage="gae",
        whiten_advantages=False,
        use_behaviour_logprobs=False,
        gamma=1.0,
        lam=1.0,
        vf_coef=0.5,
    )
    updater = PolicyUpdater(tiny_qwen2(seed=7), cfg)
    assert updater.value_head is not None
    with torch.no_grad():
        updater.value_head.bias.fill_(0.25)
    values = torch.full_like(batch.behav_logp, 0.25)
    gae_batch = updater._with_gae(batch, values)  # the GAE step itself
    r = batch.rewards
    assert r is not None and gae_batch.returns is not None
    mask = batch.response_mask.bool()
    expected_adv = torch.where(mask, (r - 0.25).unsqueeze(-1).expand_as(mask), 0.0)
    torch.testing.assert_close(gae_batch.advantages, expected_adv)
    torch.testing.assert_close(
        gae_batch.returns, torch.where(mask, r.unsqueeze(-1).expand_as(mask), 0.0)
    )
    metrics = updater.step(batch)
    n_tok = batch.response_mask.sum(dim=1)
    total = n_tok.sum()
    pg = float(-(n_tok * (r - 0.25)).sum() / total)
    vf = float(0.5 * (n_tok * (0.25 - r) ** 2).sum() / total)
    assert metrics["ppo/value_loss"] == pytest.approx(vf, abs=1e-6)
    assert metrics["ppo/loss"] == pytest.approx(pg + 0.5 * vf, abs=1e-6)


def test_single_turn_trajectories_pack_as_before() -> None:
    group = make_group("g", n=2, prompt_len=3, response_lens=[2, 4])
    plain = pack_batch(group, [0.5, -0.5])
    explicit = pack_batch(
        [msgspec.structs.replace(t, loss_mask=[1] * len(t.response_ids)) for t in group],
        [0.5, -0.5],
    )
    assert torch.equal(plain.response_mask, explicit.response_mask)

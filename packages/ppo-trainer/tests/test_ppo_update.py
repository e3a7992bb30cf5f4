"""The synchronous update step on a real tiny Qwen2 (CPU)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from ppo_testkit import make_group, tiny_qwen2
from ppo_trainer import PackedBatch, PolicyUpdater, PPOConfig, export_weights, pack_batch
from ppo_trainer.losses import token_logprobs


def _batch(n_groups: int = 3, seed: int = 0, current_version: int | None = None) -> PackedBatch:
    trajectories = [
        t for g in range(n_groups) for t in make_group(f"g{g}", n=4, prompt_len=4, seed=seed)
    ]
    advantages = [float(i % 3) - 1.0 for i in range(len(trajectories))]
    return pack_batch(trajectories, advantages, current_version=current_version)


def _own_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Each sequence's response log-probs under `model`, computed one sequence at a time."""
    out = torch.zeros_like(batch.behav_logp)
    with torch.no_grad():
        for row in range(batch.size):
            n = int(batch.seq_lens[row])
            ids = batch.input_ids[row : row + 1, :n]
            logits = model(input_ids=ids).logits[:, :-1]
            out[row, : n - 1] = token_logprobs(logits, ids[:, 1:])[0]
    return out * batch.response_mask


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradient_accumulation_gives_the_same_update(loss_agg: str) -> None:
    batch = _batch()
    results = []
    for grad_accum in (1, 4):
        model = tiny_qwen2(seed=0)
        cfg = PPOConfig(lr=1e-2, num_minibatches=2, grad_accum=grad_accum, loss_agg=loss_agg)  # type: ignore[arg-type]
        # SGD: the update is the gradient itself (Adam would amplify float rounding noise)
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        updater = PolicyUpdater(model, cfg, optimizer=sgd)
        metrics = updater.step(batch)
        results.append((_params(model), metrics["ppo/loss"]))
    (p1, loss1), (p4, loss4) = results
    assert loss1 == pytest.approx(loss4, abs=1e-6)
    for name in p1:
        torch.testing.assert_close(p1[name], p4[name], atol=1e-6, rtol=0)


def test_single_update_is_the_plain_policy_gradient() -> None:
    """With one update per batch the ratio is 1: the step is a REINFORCE step with baseline."""
    batch = _batch()
    model = tiny_qwen2(seed=1)
    reference = copy.deepcopy(model)
    behav = _own_logprobs(model, batch)
    batch = PackedBatch(**{**batch.__dict__, "behav_logp": behav})
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = PolicyUpdater(model, PPOConfig(lr=0.5, max_grad_norm=None), optimizer=sgd).step(batch)
    assert metrics["ppo/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["ppo/clipfrac"] == 0.0
    mask = batch.response_mask
    adv = batch.advantages.unsqueeze(-1) * mask
    assert metrics["ppo/loss"] == pytest.approx(float(-adv.sum() / mask.sum()), abs=1e-5)

    # hand-written REINFORCE: -sum(A * logp) / N_tokens, one SGD step
    ref_sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss = torch.zeros(())
    for row in range(batch.size):
        n = int(batch.seq_lens[row])
        ids = batch.input_ids[row : row + 1, :n]
        logp = token_logprobs(reference(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
        loss = loss - (adv[row, : n - 1] * logp).sum()
    (loss / mask.sum()).backward()
    ref_sgd.step()
    for name, value in _params(reference).items():
        torch.testing.assert_close(
            dict(model.named_parameters())[name].detach(), value, atol=1e-6, rtol=0
        )


def test_proximal_logprobs_are_recomputed_and_on_policy_weights_are_one() -> None:
    batch = _batch()
    model = tiny_qwen2(seed=2)
    batch = PackedBatch(**{**batch.__dict__, "behav_logp": _own_logprobs(model, batch)})
    cfg = PPOConfig(lr=1e-3, ppo_epochs=2, num_minibatches=2, is_cap=2.0)
    metrics = PolicyUpdater(model, cfg).step(batch)
    # prox_logp (recomputed before the updates) equals the behaviour log-probs: w = 1
    assert metrics["ppo/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["ppo/is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["ppo/approx_kl"] > 0.0  # later minibatches see moved weights


def test_kl_against_a_reference_model() -> None:
    batch = _batch()
    model = tiny_qwen2(seed=3)
    same = PolicyUpdater(
        copy.deepcopy(model), PPOConfig(kl_coef=0.1), ref_model=copy.deepcopy(model)
    ).step(batch)
    assert same["ppo/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    other = PolicyUpdater(model, PPOConfig(kl_coef=0.1), ref_model=tiny_qwen2(seed=4)).step(batch)
    assert other["ppo/kl_ref"] > 0.01
    assert other["ppo/loss"] == pytest.approx(
        same["ppo/loss"] + 0.1 * other["ppo/kl_ref"], abs=1e-4
    )


def test_entropy_bonus_changes_the_update() -> None:
    batch = _batch()
    plain, bonus = tiny_qwen2(seed=5), tiny_qwen2(seed=5)
    m_plain = PolicyUpdater(plain, PPOConfig(lr=1e-2)).step(batch)
    m_bonus = PolicyUpdater(bonus, PPOConfig(lr=1e-2, entropy_coef=0.5)).step(batch)
    assert m_plain["ppo/entropy"] == pytest.approx(m_bonus["ppo/entropy"], abs=1e-6)
    assert m_bonus["ppo/loss"] == pytest.approx(
        m_plain["ppo/loss"] - 0.5 * m_plain["ppo/entropy"], abs=1e-5
    )
    assert not torch.equal(plain.lm_head.weight, bonus.lm_head.weight)


def test_export_weights_are_detached_cpu_clones_without_tied_duplicates() -> None:
    model = tiny_qwen2()
    weights = export_weights(model)
    assert "model.embed_tokens.weight" in weights
    assert "lm_head.weight" not in weights  # tied to the embedding: sent once
    assert all(w.device.type == "cpu" and not w.requires_grad for w in weights.values())
    before = weights["model.embed_tokens.weight"].clone()
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    assert torch.equal(weights["model.embed_tokens.weight"], before)
    fresh = tiny_qwen2(seed=9)
    missing, unexpected = fresh.load_state_dict(weights, strict=False)
    assert unexpected == []
    assert set(missing) <= {"lm_head.weight"}
    torch.testing.assert_close(fresh.lm_head.weight, before)  # still tied


# -- ppo/behav_logprob_diff -------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        PPOConfig(lr=1e-2),  # one update: measured in the (only) forward before the update
        PPOConfig(lr=1e-2, ppo_epochs=2, num_minibatches=2),  # the proximal pre-pass
        PPOConfig(lr=1e-2, advantage="gae"),  # the GAE pre-pass
    ],
    ids=["single-update", "prox-pass", "gae"],
)
def test_behav_logprob_diff_is_zero_on_policy_and_measures_a_shift(cfg: PPOConfig) -> None:
    batch = _batch(current_version=0)  # make_group's tokens are version 0: all on-policy
    assert bool(batch.on_policy.all())  # type: ignore[union-attr]
    own = _own_logprobs(tiny_qwen2(seed=6), batch)
    same = replace(batch, behav_logp=own)
    m = PolicyUpdater(tiny_qwen2(seed=6), cfg).step(same)
    assert m["ppo/behav_logprob_diff"] == pytest.approx(0.0, abs=1e-5)
    # behaviour log-probs off by 0.3 on every response token (either sign): |diff| = 0.3
    shift = torch.where(torch.arange(own.shape[1]) % 2 == 0, 0.3, -0.3) * batch.response_mask
    shifted = replace(batch, behav_logp=own + shift)
    m = PolicyUpdater(tiny_qwen2(seed=6), cfg).step(shifted)
    assert m["ppo/behav_logprob_diff"] == pytest.approx(0.3, abs=1e-5)


def test_behav_logprob_diff_counts_only_on_policy_rows_and_is_omitted_without_them() -> None:
    batch = _batch(current_version=0)
    own = _own_logprobs(tiny_qwen2(seed=6), batch)
    on_policy = torch.arange(batch.size) < 4  # rows 4.. are of another version: ignored
    shifted = own + 5.0 * (~on_policy).float().unsqueeze(-1) * batch.response_mask
    mixed = replace(batch, behav_logp=shifted, on_policy=on_policy)
    m = PolicyUpdater(tiny_qwen2(seed=6), PPOConfig()).step(mixed)
    assert m["ppo/behav_logprob_diff"] == pytest.approx(0.0, abs=1e-5)
    # not the trainer's version (or weights moved since the push): no metric at all
    for stale in (_batch(current_version=1), _batch(current_version=None)):
        assert not bool(stale.on_policy.any())  # type: ignore[union-attr]
        m = PolicyUpdater(tiny_qwen2(seed=6), PPOConfig(ppo_epochs=2)).step(stale)
        assert "ppo/behav_logprob_diff" not in m


# -- GAE and the value head -------------------------------------------------------------------


def test_gae_step_by_hand_with_a_constant_value_head() -> None:
    """V = 0.25 everywhere (head weight 0, bias 0.25), gamma = lam = 1: every token's return is
    its sequence's reward r and its advantage r - 0.25. With ratio 1 and w = 1, the step's loss
    is -mean_tok(r - 0.25) + vf_coef * 0.5 * mean_tok((0.25 - r)^2)."""
    batch = _batch()
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
    metrics = updater.step(batch)
    n_tok = batch.response_mask.sum(dim=1)  # response tokens per row
    r = batch.rewards
    assert r is not None
    total = n_tok.sum()
    pg = float(-(n_tok * (r - 0.25)).sum() / total)
    vf = float(0.5 * (n_tok * (0.25 - r) ** 2).sum() / total)
    assert metrics["ppo/value_loss"] == pytest.approx(vf, abs=1e-6)
    assert metrics["ppo/loss"] == pytest.approx(pg + 0.5 * vf, abs=1e-6)
    assert metrics["ppo/value_mean"] == pytest.approx(0.25, abs=1e-6)
    assert metrics["ppo/vf_clipfrac"] == 0.0
    assert updater.value_head.bias.item() != 0.25  # the head learned


def test_gae_advantages_reach_the_loss_whitened() -> None:
    """Zero-initialised head, whitening on: the token advantages have masked mean 0, so with
    ratio 1 and w = 1 the policy part of the loss is 0 and the loss is the value term."""
    batch = _batch()
    cfg = PPOConfig(advantage="gae", use_behaviour_logprobs=False, vf_coef=0.3)
    metrics = PolicyUpdater(tiny_qwen2(seed=7), cfg).step(batch)
    n_tok = batch.response_mask.sum(dim=1)
    r = batch.rewards
    assert r is not None
    vf = float(0.5 * (n_tok * r**2).sum() / n_tok.sum())  # V = 0: returns = r
    assert metrics["ppo/value_mean"] == 0.0
    assert metrics["ppo/value_loss"] == pytest.approx(vf, abs=1e-6)
    assert metrics["ppo/loss"] == pytest.approx(0.3 * vf, abs=1e-6)


def test_value_head_is_trained_but_never_exported() -> None:
    model = tiny_qwen2(seed=8)
    policy_keys = set(export_weights(tiny_qwen2(seed=8)))
    updater = PolicyUpdater(model, PPOConfig(advantage="gae", lr=1e-3, value_lr=5e-3))
    assert updater.value_head is not None
    assert [g["lr"] for g in updater.optimizer.param_groups] == [1e-3, 5e-3]
    head_before = updater.value_head.weight.detach().clone()
    updater.step(_batch())
    assert not torch.equal(updater.value_head.weight, head_before)
    exported = updater.export_weights()
    assert set(exported) == policy_keys  # exactly the HF policy's state dict, no head
    assert set(model.state_dict()) == set(tiny_qwen2().state_dict())
    # a caller's optimizer gets the head as an extra param group
    sgd = torch.optim.SGD(tiny_qwen2().parameters(), lr=0.1)
    PolicyUpdater(tiny_qwen2(), PPOConfig(advantage="gae"), optimizer=sgd)
    assert len(sgd.param_groups) == 2


@pytest.mark.parametrize("loss_agg", ["token-sum", "seq-mean-token-sum-norm"])
def test_new_aggregations_accumulate_exactly(loss_agg: str) -> None:
    batch = _batch()
    results = []
    for grad_accum in (1, 3):
        model = tiny_qwen2(seed=0)
        cfg = PPOConfig(grad_accum=grad_accum, loss_agg=loss_agg, loss_agg_horizon=16)  # type: ignore[arg-type]
        sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
        metrics = PolicyUpdater(model, cfg, optimizer=sgd).step(batch)
        results.append((_params(model), metrics["ppo/loss"]))
    (p1, loss1), (p3, loss3) = results
    assert loss1 == pytest.approx(loss3, abs=1e-5)
    for name in p1:
        torch.testing.assert_close(p1[name], p3[name], atol=1e-6, rtol=0)

"""The synchronous torch part of a trainer step: proximal log-probs, then minibatch updates.

`PolicyUpdater` knows nothing about asyncio; `PPOTrainer` runs its methods in a dedicated
worker thread so the event loop stays responsive while it computes.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ppo_trainer.advantages import gae_advantages, masked_whiten
from ppo_trainer.batch import PackedBatch
from ppo_trainer.config import PPOConfig
from ppo_trainer.losses import (
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss,
    token_logprobs,
    value_loss,
)
from ppo_trainer.schedule import make_scheduler

if TYPE_CHECKING:
    from ppo_trainer.distributed import DataParallel, GroupShard

__all__ = ["PolicyUpdater", "export_weights", "use_deterministic_torch"]

logger = logging.getLogger(__name__)

# Metrics averaged over response tokens across all micro-batches of a step.
_TOKEN_METRICS = (
    "clipfrac",
    "dual_clipfrac",
    "approx_kl",
    "ppo_kl",
    "is_weight_mean",
    "is_capped_frac",
    "is_masked_frac",
    "ratio_mean",
    "entropy",
    "kl_ref",
    "vf_clipfrac",
    "value_mean",
)


class PolicyUpdater:
    """Owns the model, optimizer, LR scheduler and shuffling generator of a trainer.

    Works with any causal LM whose `forward(input_ids=, attention_mask=, **mm)` returns an
    object with `.logits` of shape [B, L, V] (transformers `AutoModelForCausalLM`, Qwen2-VL).

    With `config.advantage == "gae"` it also owns `value_head`, a `Linear(hidden, 1)` on the
    policy's last hidden state (after the final norm), zero-initialised, trained in its own
    AdamW param group. It is not part of `model`: `export_weights` sends the policy only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: PPOConfig,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        ref_model: torch.nn.Module | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        self.data_parallel = data_parallel
        if data_parallel is not None:
            model = data_parallel.wrap(model)  # before the optimizer sees its parameters
        self.model = model
        self.config = config
        self.ref_model = ref_model
        self.device = next(model.parameters()).device
        params = [p for p in model.parameters() if p.requires_grad]
        self.value_head: torch.nn.Linear | None = None
        groups: list[dict] = [{"params": params}]
        if config.advantage == "gae":
            self.value_head = _make_value_head(model, self.device)
            head_lr = config.value_lr if config.value_lr is not None else config.lr
            groups.append({"params": list(self.value_head.parameters()), "lr": head_lr})
            params = params + list(self.value_head.parameters())
        self.params = params
        if optimizer is None:
            optimizer = torch.optim.AdamW(
                groups,
                lr=config.lr,
                betas=config.adam_betas,
                eps=config.adam_eps,
                weight_decay=config.weight_decay,
            )
        elif len(groups) > 1:
            optimizer.add_param_group(groups[1])
        self.optimizer = optimizer
        self.scheduler = make_scheduler(
            self.optimizer,
            schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            total_steps=config.total_steps,
            min_ratio=config.min_lr_ratio,
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        if config.deterministic:
            use_deterministic_torch(config.seed)
        if ref_model is not None:
            ref_model.requires_grad_(False)

    # -- public -------------------------------------------------------------------------

    def step(self, batch: PackedBatch | None, shard: GroupShard | None = None) -> dict[str, float]:
        """One trainer step on `batch`: `ppo_epochs` x `num_minibatches` optimizer steps.

        One process is the world-size-1 case of data parallel: `batch` is the whole batch.
        With `data_parallel`, `batch` is this rank's shard (None if it holds no rows) and
        `shard` says where it sits in the global batch; every rank must call `step` (it is
        collective) and all compute the update one process would on the whole batch.
        """
        if self.data_parallel is None:
            if batch is None:
                raise ValueError("step() needs a batch")
            return self._step(batch, _RowLayout(rank=0, rank_rows=(batch.size,)))
        if shard is None:
            raise ValueError("a data-parallel step needs the GroupShard of its batch")
        local_rows = 0 if batch is None else batch.size
        if local_rows != shard.rows:
            raise ValueError(f"batch has {local_rows} rows, shard says {shard.rows}")
        return self._step(batch, _RowLayout(rank=shard.rank, rank_rows=shard.rank_rows))

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's weights (never the value head): what the inference engine loads.

        Data parallel: the full weights on rank 0, None on the others (collective)."""
        if self.data_parallel is not None:
            return self.data_parallel.full_state_dict(self.model)
        return export_weights(self.model)

    # -- the step -----------------------------------------------------------------------

    @property
    def _collectives(self) -> _Collectives:
        return self.data_parallel if self.data_parallel is not None else _ONE_PROCESS

    def _step(self, batch: PackedBatch | None, layout: _RowLayout) -> dict[str, float]:
        """`step` on this rank's rows; collectives make it equal one process's step.

        The minibatch permutation is drawn over the global rows with the shared seeded
        generator, so every optimizer step covers the same sequences as in one process;
        each rank takes the rows of each minibatch that it holds, divides its loss by the
        minibatch's global token / sequence counts, and the gradients are summed.
        """
        self.model.train()
        totals = _StepTotals()
        batch, row_tokens = self._prepare(batch, layout, totals)
        lr = self.optimizer.param_groups[0]["lr"]
        for epoch in range(self.config.ppo_epochs):
            order = torch.randperm(layout.total_rows, generator=self.generator)
            for rows in _chunks(order, self.config.num_minibatches):
                self._minibatch_update(batch, layout, rows, row_tokens, epoch, totals)
        self.scheduler.step()
        out = self._reduce_metrics(totals)
        out["trainer/lr"] = float(lr)
        return out

    def _prepare(
        self, batch: PackedBatch | None, layout: _RowLayout, totals: _StepTotals
    ) -> tuple[PackedBatch | None, torch.Tensor]:
        """Proximal and reference log-probs, GAE advantages, and every global row's
        response-token count (the minibatch loss denominators are global)."""
        cfg = self.config
        gae = self.value_head is not None
        # With a single update per batch the current weights *are* the proximal policy, so
        # the extra no-grad forward is skipped and logp.detach() is used instead. GAE needs
        # the values before any update, so it always makes that pass (logits come free).
        recompute_prox = cfg.updates_per_step > 1
        prox = values = None
        if recompute_prox or gae:
            first_logp, values = self._pre_pass(batch, layout)
            prox = first_logp if recompute_prox else None
            if batch is not None and first_logp is not None:
                totals.add_behav_diff(*_behav_diff_sums(first_logp, batch))
        if batch is not None:
            use_ref = self.ref_model is not None and cfg.kl_coef != 0.0
            ref = self._logprobs(self.ref_model, batch) if use_ref and self.ref_model else None
            batch = batch.with_logprobs(prox_logp=prox, ref_logp=ref)
        if gae:
            batch = self._with_gae(batch, values)
        row_tokens = torch.zeros(layout.total_rows, dtype=torch.float64)
        if batch is not None:
            row_tokens[layout.lo : layout.hi] = batch.response_mask.sum(dim=1).to(torch.float64)
        self._collectives.all_reduce(row_tokens)
        return batch, row_tokens

    def _minibatch_update(
        self,
        batch: PackedBatch | None,
        layout: _RowLayout,
        rows: torch.Tensor,
        row_tokens: torch.Tensor,
        epoch: int,
        totals: _StepTotals,
    ) -> None:
        """Forward/backward this rank's rows of one minibatch, then one optimizer step."""
        cfg = self.config
        n_tok = float(row_tokens[rows].sum().item())
        n_seq = float(len(rows))
        mine = rows[(rows >= layout.lo) & (rows < layout.hi)] - layout.lo
        micro_rows = list(_chunks(torch.arange(len(mine)), cfg.grad_accum))
        passes = len(micro_rows)
        if self._collectives.strategy == "fsdp2":  # every rank runs as many passes as the busiest
            passes = max(
                min(cfg.grad_accum, int(((rows >= a) & (rows < b)).sum())) for a, b in layout.bounds
            )
        minibatch = batch.select(mine) if batch is not None and len(mine) else None
        # Single update without GAE: these forwards all precede the optimizer step, so they
        # measure the behaviour / trainer log-prob gap.
        measure_diff = cfg.updates_per_step == 1 and self.value_head is None and epoch == 0
        mb_loss = mb_vf_loss = 0.0
        for i in range(passes):
            if minibatch is None or i >= len(micro_rows):
                self._dummy_pass(batch, grad=True)
                continue
            micro = minibatch.select(micro_rows[i])
            loss, metrics, tokens, logp = self._micro_loss(micro, n_tok, n_seq)
            loss.backward()
            mb_loss += float(loss.item())
            mb_vf_loss += metrics.pop("value_loss", 0.0)
            totals.add_micro(metrics, tokens)
            if measure_diff:
                totals.add_behav_diff(*_behav_diff_sums(logp, micro))
        collectives = self._collectives
        collectives.sync_grads(self.params)
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
        totals.grad_norms.append(collectives.clip_grad_norm(self.params, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals.losses.append(mb_loss)
        totals.vf_losses.append(mb_vf_loss)

    def _reduce_metrics(self, totals: _StepTotals) -> dict[str, float]:
        """The step's metrics over every rank: one all-reduce for every summed metric
        (presence flags say which were measured) and one for the peak IS weight."""
        collectives = self._collectives
        keys = list(_TOKEN_METRICS)
        n_keys, n_mb = len(keys), len(totals.losses)
        packed = torch.tensor(
            [
                totals.token_total,
                totals.diff_sum,
                totals.diff_count,
                *(totals.sums.get(k, 0.0) for k in keys),
                *(1.0 if k in totals.sums else 0.0 for k in keys),
                *totals.losses,
                *totals.vf_losses,
            ],
            dtype=torch.float64,
        )
        values = collectives.all_reduce(packed).tolist()
        peak = collectives.all_reduce(
            torch.tensor([totals.is_weight_max], dtype=torch.float64), op="max"
        )
        token_total, diff_sum, diff_count = values[:3]
        key_sums = values[3 : 3 + n_keys]
        present = values[3 + n_keys : 3 + 2 * n_keys]
        losses = values[3 + 2 * n_keys : 3 + 2 * n_keys + n_mb]
        vf_losses = values[3 + 2 * n_keys + n_mb :]
        out = _behav_diff(diff_sum, diff_count)
        out.update(
            {
                f"ppo/{k}": total_k / max(token_total, 1.0)
                for k, total_k, seen in zip(keys, key_sums, present, strict=True)
                if seen > 0
            }
        )
        out["ppo/loss"] = sum(losses) / len(losses)
        if self.value_head is not None:
            out["ppo/value_loss"] = sum(vf_losses) / len(vf_losses)
        out["ppo/grad_norm"] = sum(totals.grad_norms) / len(totals.grad_norms)
        out["ppo/is_weight_max"] = float(peak[0])
        return out

    @torch.no_grad()
    def _pre_pass(
        self, batch: PackedBatch | None, layout: _RowLayout
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The policy's log-probs (and values, with a value head) of this rank's rows before
        any update, no grad; [B, L-1] each, on the CPU. With fsdp2 padded with dummy
        forwards so every rank runs as many (each forward all-gathers the parameters)."""
        micro_batches = self.config.num_minibatches * self.config.grad_accum
        micro_size = max(1, -(-max(layout.rank_rows) // micro_batches))
        own = -(-layout.rows // micro_size)
        passes = own
        if self._collectives.strategy == "fsdp2":
            passes = max(-(-n // micro_size) for n in layout.rank_rows)
        result: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if batch is not None:
            result = self._no_grad_pass(
                self.model, batch, values=self.value_head is not None, micro_size=micro_size
            )
        for _ in range(passes - own):
            self._dummy_pass(batch, grad=False)
        return result

    def _with_gae(self, batch: PackedBatch | None, values: torch.Tensor | None) -> PackedBatch:
        """Token-level advantages, returns and old values from the pre-update values; the
        whitening statistics are taken over every rank's tokens."""
        cfg = self.config
        whiten = self._whiten
        if batch is None:
            if cfg.whiten_advantages:  # take part in the collective with no tokens
                empty = torch.zeros(0, 1)
                whiten(empty, empty)
            return batch  # type: ignore[return-value]
        assert values is not None
        mask = batch.response_mask
        values = torch.where(mask.bool(), values, 0.0)
        advantages, returns = gae_advantages(
            batch.token_rewards(), values, mask, gamma=cfg.gamma, lam=cfg.lam
        )
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
        return replace(batch, advantages=advantages, returns=returns, old_values=values)

    def _whiten(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.data_parallel is None:
            return masked_whiten(values, mask)
        from ppo_trainer.distributed import masked_whiten_global

        return masked_whiten_global(values, mask, self.data_parallel)

    def _dummy_pass(self, batch: PackedBatch | None, *, grad: bool) -> None:
        """A forward (and zero-weighted backward) that changes nothing: keeps an fsdp2 rank
        that has no rows left in step with the others' all-gathers and reduce-scatters."""
        if batch is not None and batch.size:
            inputs = batch.select(torch.arange(1)).model_inputs()
        else:
            ids = torch.zeros((1, 2), dtype=torch.long)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        with torch.set_grad_enabled(grad):
            logits = self.model(**inputs).logits
            if grad:
                (logits.sum() * 0.0).backward()

    # -- internals ----------------------------------------------------------------------

    def _clip_range(
        self, micro: PackedBatch
    ) -> tuple[float | torch.Tensor, float | torch.Tensor | None]:
        """`clip_eps` and `clip_eps_high`, each divided per token by 1 + scale * staleness
        when `clip_staleness_scale` is set (and the batch carries token staleness)."""
        cfg = self.config
        if cfg.clip_staleness_scale == 0.0 or micro.token_staleness is None:
            return cfg.clip_eps, cfg.clip_eps_high
        factor = 1.0 / (1.0 + cfg.clip_staleness_scale * micro.token_staleness.to(self.device))
        high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        return cfg.clip_eps * factor, high * factor

    def _micro_loss(
        self, micro: PackedBatch, n_tok: float, n_seq: float
    ) -> tuple[torch.Tensor, dict[str, float], float, torch.Tensor]:
        cfg = self.config
        logits, hidden = self._forward(self.model, micro, hidden=self.value_head is not None)
        logits = logits[:, :-1]
        if cfg.temperature != 1.0:
            logits = logits / cfg.temperature
        targets = micro.input_ids[:, 1:].to(self.device)
        mask = micro.response_mask.to(self.device)
        logp = token_logprobs(logits, targets)
        prox = micro.prox_logp.to(self.device) if micro.prox_logp is not None else logp.detach()
        behav = micro.behav_logp.to(self.device) if cfg.use_behaviour_logprobs else None
        advantages = micro.token_advantages().to(self.device)
        agg = {"num_tokens": n_tok, "num_seqs": n_seq, "horizon": cfg.loss_agg_horizon}
        clip_low, clip_high = self._clip_range(micro)
        loss, pg_metrics = policy_loss(
            logp,
            prox,
            advantages,
            mask,
            behav_logp=behav,
            clip_eps=clip_low,
            clip_eps_high=clip_high,
            dual_clip=cfg.dual_clip,
            is_cap=cfg.is_cap,
            is_level=cfg.is_level,
            is_mode=cfg.is_mode,
            loss_agg=cfg.loss_agg,
            **agg,
        )
        metrics = {k: float(v) for k, v in pg_metrics.items()}
        if self.value_head is not None:
            vf_loss, vf_metrics = self._value_loss(micro, hidden, mask, agg)
            loss = loss + cfg.vf_coef * vf_loss
            metrics.update(vf_metrics)
        if cfg.entropy_coef != 0.0:
            entropy = entropy_from_logits(logits)
            loss = loss - cfg.entropy_coef * aggregate_loss(entropy, mask, cfg.loss_agg, **agg)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach())
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if micro.ref_logp is not None:
            kl = kl_penalty(
                logp, micro.ref_logp.to(self.device), cfg.kl_estimator, clamp=cfg.kl_clamp
            )
            loss = loss + cfg.kl_coef * aggregate_loss(kl, mask, cfg.loss_agg, **agg)
            metrics["kl_ref"] = float(masked_mean(kl.detach(), mask))
        return loss, metrics, float(mask.sum().item()), logp.detach()

    def _value_loss(
        self,
        micro: PackedBatch,
        hidden: torch.Tensor | None,
        mask: torch.Tensor,
        agg: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The value head's clipped loss on `micro` and its metrics (`value_loss` first)."""
        assert hidden is not None and micro.returns is not None
        assert micro.old_values is not None
        vf_loss, vf_metrics = value_loss(
            self._values(hidden),
            micro.old_values.to(self.device),
            micro.returns.to(self.device),
            mask,
            clip_eps=self.config.value_clip,
            loss_agg=self.config.loss_agg,
            **agg,
        )
        metrics = {"value_loss": float(vf_loss.detach())}
        metrics.update({k: float(v) for k, v in vf_metrics.items()})
        return vf_loss, metrics

    def _values(self, hidden: torch.Tensor) -> torch.Tensor:
        """V for each per-token position: the head on the hidden state that predicts it."""
        assert self.value_head is not None
        return self.value_head(hidden[:, :-1].to(torch.float32)).squeeze(-1)

    def _logprobs(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        """Token log-probs of `batch` under `model` (no grad), [B, L-1] on the CPU."""
        return self._no_grad_pass(model, batch, values=False)[0]

    @torch.no_grad()
    def _no_grad_pass(
        self,
        model: torch.nn.Module,
        batch: PackedBatch,
        *,
        values: bool,
        micro_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logps = torch.zeros_like(batch.behav_logp)
        vals = torch.zeros_like(batch.behav_logp) if values else None
        if micro_size is None:
            micro_batches = self.config.num_minibatches * self.config.grad_accum
            micro_size = max(1, -(-batch.size // micro_batches))
        for start in range(0, batch.size, micro_size):
            rows = torch.arange(start, min(start + micro_size, batch.size))
            micro = batch.select(rows)
            logits, hidden = self._forward(model, micro, hidden=values)
            logits = logits[:, :-1]
            targets = micro.input_ids[:, 1:].to(logits.device)
            logp = token_logprobs(logits, targets, self.config.temperature)
            logps[rows, : logp.shape[1]] = logp.to("cpu", torch.float32)
            if vals is not None:
                assert hidden is not None
                v = self._values(hidden)
                vals[rows, : v.shape[1]] = v.to("cpu", torch.float32)
        return logps, vals

    def _forward(
        self, model: torch.nn.Module, micro: PackedBatch, *, hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [B, L, V], last hidden state [B, L, H] if `hidden` else None)."""
        device = next(model.parameters()).device
        inputs = {k: v.to(device) for k, v in micro.model_inputs().items()}
        if not hidden:
            return model(**inputs).logits, None
        out = model(**inputs, output_hidden_states=True)
        return out.logits, out.hidden_states[-1]


class _Collectives(Protocol):
    """What a step needs from its ranks: `DataParallel`, or `_OneProcess` for one process."""

    @property
    def strategy(self) -> str: ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def sync_grads(self, params: Sequence[torch.nn.Parameter]) -> None: ...

    def clip_grad_norm(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> float: ...


class _OneProcess:
    """The collectives of a world of one: every reduction is the identity."""

    strategy = "single"

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def sync_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        return None

    def clip_grad_norm(self, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


_ONE_PROCESS = _OneProcess()


@dataclass(frozen=True, slots=True)
class _RowLayout:
    """Where this rank's rows sit among the step's global rows (see `GroupShard`)."""

    rank: int
    rank_rows: tuple[int, ...]

    @property
    def total_rows(self) -> int:
        return sum(self.rank_rows)

    @property
    def rows(self) -> int:
        return self.rank_rows[self.rank]

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) of every rank's rows."""
        starts = [sum(self.rank_rows[:r]) for r in range(len(self.rank_rows))]
        return [(a, a + n) for a, n in zip(starts, self.rank_rows, strict=True)]

    @property
    def lo(self) -> int:
        return sum(self.rank_rows[: self.rank])

    @property
    def hi(self) -> int:
        return self.lo + self.rows


@dataclass(slots=True)
class _StepTotals:
    """This rank's running sums over a step's micro-batches (reduced at the end)."""

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    token_total: float = 0.0
    losses: list[float] = field(default_factory=list)
    vf_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    is_weight_max: float = 0.0
    diff_sum: float = 0.0
    diff_count: float = 0.0

    def add_behav_diff(self, total: float, count: float) -> None:
        self.diff_sum += total
        self.diff_count += count

    def add_micro(self, metrics: dict[str, float], tokens: float) -> None:
        """Token-weighted sums of a micro-batch's metrics (the peak IS weight as a max)."""
        self.token_total += tokens
        for key, value in metrics.items():
            if key == "is_weight_max":
                self.is_weight_max = max(self.is_weight_max, value)
            else:
                self.sums[key] += value * tokens


def _make_value_head(model: torch.nn.Module, device: torch.device) -> torch.nn.Linear:
    """Zero-initialised Linear(hidden, 1) in float32: V = 0 everywhere at the start."""
    size = _hidden_size(model)
    head = torch.nn.Linear(size, 1, device=device, dtype=torch.float32)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


def _hidden_size(model: torch.nn.Module) -> int:
    embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[1])
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    size = getattr(config, "hidden_size", None)
    if size is None:
        raise ValueError("cannot tell the model's hidden size for the value head")
    return int(size)


def _behav_diff_sums(logp: torch.Tensor, batch: PackedBatch) -> tuple[float, float]:
    """(sum, count) of |behaviour - trainer log-prob| over the on-policy rows' tokens."""
    if batch.on_policy is None or not bool(batch.on_policy.any()):
        return 0.0, 0.0
    mask = batch.response_mask.bool() & batch.on_policy.unsqueeze(-1)
    mask = mask.to(logp.device)
    diff = (batch.behav_logp.to(logp.device) - logp[:, : mask.shape[1]]).abs()
    return float(masked_sum(diff, mask)), float(mask.sum())


def _behav_diff(total: float, count: float) -> dict[str, float]:
    """`ppo/behav_logprob_diff`, omitted when no on-policy token was seen."""
    return {"ppo/behav_logprob_diff": total / count} if count > 0 else {}


def export_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> detached CPU copy of every parameter and persistent buffer.

    Tied tensors appear once (under their first name, like `save_pretrained`), so a tied LM
    head is not sent twice; load with `load_state_dict(strict=False)` or vLLM `load_weights`.
    """
    weights: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key in seen and tensor.numel() > 0:
            continue
        seen.add(key)
        weights[name] = tensor.detach().to("cpu", copy=True)
    return weights


def use_deterministic_torch(seed: int) -> None:
    """Deterministic torch kernels where they exist (a warning where not) and a seeded
    global RNG: with the same data, two runs of a step give the same numbers. Process-wide."""
    if torch.cuda.is_available():  # cuBLAS needs a fixed workspace to be deterministic
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(seed)


def _chunks(index: torch.Tensor, parts: int) -> Iterator[torch.Tensor]:
    """Split a 1-D index tensor into `parts` near-equal non-empty chunks (none if empty)."""
    if not len(index):
        return
    for chunk in torch.tensor_split(index, min(parts, len(index))):
        if len(chunk):
            yield chunk

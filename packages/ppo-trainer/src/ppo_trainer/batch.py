"""Turning groups of trajectories into padded tensors.

Layout: each sequence is prompt + response, right-padded to the longest sequence. The model
sees `input_ids[:, :-1]`-aligned logits; position j of every per-token tensor refers to the
prediction of token j + 1, so a response token at absolute position p lives at j = p - 1.
Right padding keeps the real tokens at positions 0..len-1, which is what causal LMs (and
Qwen2-VL's M-RoPE, which reads the attention mask) expect without explicit position ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ppo_trainer.protocols import MultiModalInputsFn
from ppo_trainer.types import MultiModalRef, Trajectory

__all__ = ["PackedBatch", "pack_batch"]


@dataclass(frozen=True)
class PackedBatch:
    """A padded batch of B sequences of (at most) L tokens.

    Per-token tensors have shape [B, L - 1] (aligned to the predicted token), per-sequence
    ones [B]. `prox_logp` / `ref_logp` (and, for GAE, token-level `advantages`, `returns`
    and `old_values`) are filled by the updater before the updates.
    """

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64
    # [B, L-1] float32, 1 where the target is a generated response token: 0 on the prompt,
    # the padding and a multi-turn episode's observation tokens (`Trajectory.loss_mask`), so
    # every loss, metric, token count and GAE sees generated tokens only.
    response_mask: torch.Tensor
    behav_logp: torch.Tensor  # [B, L-1] float32, engine log-probs (0 off the response)
    advantages: torch.Tensor  # [B] float32 (one per sequence) or [B, L-1] (per token, GAE)
    seq_lens: torch.Tensor  # [B] int64, prompt + response length
    mm_inputs: tuple[Mapping[str, torch.Tensor] | None, ...] | None = None
    prox_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    rewards: torch.Tensor | None = None  # [B] float32, the trajectory's scalar reward
    on_policy: torch.Tensor | None = None  # [B] bool, see `pack_batch(current_version=)`
    returns: torch.Tensor | None = None  # [B, L-1] float32, GAE value targets
    old_values: torch.Tensor | None = None  # [B, L-1] float32, values before the updates
    # [B, L-1] float32: the step's version minus the version that generated each response
    # token (0 elsewhere); see `pack_batch(version=)`.
    token_staleness: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens (prompt + response): what a forward pass processes."""
        return int(self.seq_lens.sum().item())

    def select(self, rows: torch.Tensor) -> PackedBatch:
        """Rows `rows` (1-D index tensor), trimmed to their own longest sequence."""
        length = int(self.seq_lens[rows].max().item())
        length = max(length, 2)

        def pick(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
            return None if t is None else t[rows, :width]

        def pick_rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        mm = None
        if self.mm_inputs is not None:
            mm = tuple(self.mm_inputs[i] for i in rows.tolist())
        return PackedBatch(
            input_ids=self.input_ids[rows, :length],
            attention_mask=self.attention_mask[rows, :length],
            response_mask=self.response_mask[rows, : length - 1],
            behav_logp=self.behav_logp[rows, : length - 1],
            advantages=(
                self.advantages[rows]
                if self.advantages.dim() == 1
                else self.advantages[rows, : length - 1]
            ),
            seq_lens=self.seq_lens[rows],
            mm_inputs=mm,
            prox_logp=pick(self.prox_logp, length - 1),
            ref_logp=pick(self.ref_logp, length - 1),
            rewards=pick_rows(self.rewards),
            on_policy=pick_rows(self.on_policy),
            returns=pick(self.returns, length - 1),
            old_values=pick(self.old_values, length - 1),
            token_staleness=pick(self.token_staleness, length - 1),
        )

    def with_logprobs(
        self, *, prox_logp: torch.Tensor | None, ref_logp: torch.Tensor | None
    ) -> PackedBatch:
        return replace(self, prox_logp=prox_logp, ref_logp=ref_logp)

    def token_advantages(self) -> torch.Tensor:
        """Advantages as [B, L-1]: per-sequence ones broadcast over the positions."""
        if self.advantages.dim() == 2:
            return self.advantages
        return self.advantages.unsqueeze(-1).expand_as(self.response_mask)

    def token_rewards(self) -> torch.Tensor:
        """[B, L-1]: each sequence's scalar reward on its last response token, 0 elsewhere
        (the token-level reward that GAE consumes)."""
        if self.rewards is None:
            raise ValueError("this batch carries no rewards (pack it with pack_batch)")
        out = torch.zeros_like(self.response_mask)
        positions = torch.arange(out.shape[1]).expand_as(out)
        last = torch.where(self.response_mask.bool(), positions, -1).max(dim=1).values
        rows = torch.nonzero(last >= 0).squeeze(-1)
        out[rows, last[rows]] = self.rewards[rows].to(out.dtype)
        return out

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask and the concatenated multimodal tensors of these rows."""
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.mm_inputs is not None:
            present = [mm for mm in self.mm_inputs if mm is not None]
            for key in present[0].keys() if present else ():
                inputs[key] = torch.cat([mm[key] for mm in present], dim=0)
        return inputs


def pack_batch(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float] | None = None,
    *,
    pad_token_id: int = 0,
    mm_inputs_fn: MultiModalInputsFn | None = None,
    current_version: int | None = None,
    version: int | None = None,
) -> PackedBatch:
    """Pad `trajectories` (with one advantage each) into a `PackedBatch` on the CPU.

    `advantages` None: zeros (for GAE, whose token advantages the updater computes).
    `current_version`: the policy version of the trainer's *current* weights, if they are
    exactly the weights of that version (None: they are not, or unknown). A row is
    `on_policy` when all its response tokens carry that version: the trainer's log-probs of
    it must then equal the engine's (metric `ppo/behav_logprob_diff`).
    `mm_inputs_fn` is called once per distinct `MultiModalRef` (a GRPO group shares one).
    `version`: the trainer's version for this step; each response token's staleness is
    `version` minus its `token_versions` entry (`token_staleness`; None: not computed).
    """
    if advantages is None:
        advantages = [0.0] * len(trajectories)
    if len(trajectories) != len(advantages):
        raise ValueError("need exactly one advantage per trajectory")
    if not trajectories:
        raise ValueError("cannot pack an empty batch")
    seq_lens = [len(t.prompt_token_ids) + len(t.response_ids) for t in trajectories]
    length = max(max(seq_lens), 2)
    batch = len(trajectories)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    response_mask = torch.zeros((batch, length - 1), dtype=torch.float32)
    behav_logp = torch.zeros((batch, length - 1), dtype=torch.float32)
    for row, traj in enumerate(trajectories):
        _check_trajectory(traj)
        n_prompt, n_resp = len(traj.prompt_token_ids), len(traj.response_ids)
        input_ids[row, : n_prompt + n_resp] = torch.tensor(
            [*traj.prompt_token_ids, *traj.response_ids], dtype=torch.long
        )
        attention_mask[row, : n_prompt + n_resp] = 1
        response_mask[row, n_prompt - 1 : n_prompt - 1 + n_resp] = _loss_mask(traj)
        if n_resp:
            behav_logp[row, n_prompt - 1 : n_prompt - 1 + n_resp] = torch.tensor(
                traj.behaviour_logprobs, dtype=torch.float32
            )
    mm = _multimodal_inputs(trajectories, mm_inputs_fn)
    staleness = None if version is None else _token_staleness(trajectories, version, length)
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behav_logp=behav_logp,
        advantages=torch.tensor(list(advantages), dtype=torch.float32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        mm_inputs=mm,
        rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),
        on_policy=_on_policy(trajectories, current_version),
        token_staleness=staleness,
    )


def _token_staleness(trajectories: Sequence[Trajectory], version: int, length: int) -> torch.Tensor:
    """[B, length - 1]: `version` minus each response token's version, at its target position
    (0 on the prompt, the padding and tokens without a version; never negative)."""
    out = torch.zeros((len(trajectories), length - 1), dtype=torch.float32)
    for row, traj in enumerate(trajectories):
        if not traj.token_versions:
            continue
        start = len(traj.prompt_token_ids) - 1
        versions = torch.tensor(traj.token_versions, dtype=torch.float32)
        out[row, start : start + len(versions)] = (version - versions).clamp(min=0)
    return out


def _check_trajectory(traj: Trajectory) -> None:
    n_resp = len(traj.response_ids)
    if len(traj.prompt_token_ids) < 1:
        raise ValueError(f"trajectory {traj.response_id}: empty prompt")
    if len(traj.behaviour_logprobs) != n_resp:
        raise ValueError(
            f"trajectory {traj.response_id}: {len(traj.behaviour_logprobs)} behaviour "
            f"log-probs for {n_resp} response tokens"
        )


def _on_policy(trajectories: Sequence[Trajectory], current_version: int | None) -> torch.Tensor:
    """Per row: every response token carries `current_version` (None: no row is)."""
    return torch.tensor(
        [
            current_version is not None
            and bool(t.generated_versions)
            and all(v == current_version for v in t.generated_versions)
            for t in trajectories
        ],
        dtype=torch.bool,
    )


def _loss_mask(traj: Trajectory) -> torch.Tensor | float:
    """1.0 on generated response tokens, 0.0 on observation tokens (multi-turn episodes)."""
    if not traj.loss_mask:
        return 1.0
    if len(traj.loss_mask) != len(traj.response_ids):
        raise ValueError(
            f"trajectory {traj.response_id}: loss_mask has {len(traj.loss_mask)} entries for "
            f"{len(traj.response_ids)} response tokens"
        )
    return torch.tensor(traj.loss_mask, dtype=torch.float32)


def _multimodal_inputs(
    trajectories: Sequence[Trajectory], mm_inputs_fn: MultiModalInputsFn | None
) -> tuple[Mapping[str, torch.Tensor] | None, ...] | None:
    if not any(t.multimodal is not None for t in trajectories):
        return None
    if mm_inputs_fn is None:
        raise ValueError("multimodal trajectories need a mm_inputs_fn")
    cache: dict[tuple[str, tuple[str, ...]], Mapping[str, torch.Tensor]] = {}
    out: list[Mapping[str, torch.Tensor] | None] = []
    for traj in trajectories:
        ref: MultiModalRef | None = traj.multimodal
        if ref is None:
            out.append(None)
            continue
        key = (ref.messages_json, tuple(ref.image_sources))
        if key not in cache:
            cache[key] = dict(mm_inputs_fn(ref))
        out.append(cache[key])
    return tuple(out)

"""The algorithm API: what a researcher's algorithm is given and what it returns.

An algorithm may replace two things, and only these: the advantage computation (rank 0, once per step,
on the whole batch of groups) and the per-token policy loss (every rank, on each of its mini-batch
pieces, with gradients). Everything else stays the trainer's: collecting groups under the staleness
budget, reward shaping and KL-in-reward (applied before `advantages`), the proximal and reference
log-probs, the split into mini-batches and ranks, aggregation of the per-token loss (`ppo.loss_agg`,
with global token and sequence counts so the result does not depend on the world size), the entropy
bonus and KL-in-loss terms, ZeRO, checkpoints, resume and weight publishing.

Shapes: N samples (rows), T token positions. Per-token arrays are aligned with `input_ids`:
`logp[:, t]` is the log-prob of token t given the tokens before it; `loss_mask[:, t]` marks the
generated tokens the loss sees. The contract of this module (field names, shapes, meanings) is
promised stable; new fields may be added with defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from services.trainer.settings import PPOSettings


@dataclass(frozen=True)
class AdvantageInput:
    """One step's batch of whole groups, as the advantage computation sees it (CPU tensors)."""

    rewards: torch.Tensor
    """(N,) float32: each sample's reward after shaping (scale, bias, clip, overlong) and, with
    `ppo.kl_in=reward`, minus its summed KL penalty; equals `token_rewards.sum(-1)`."""
    token_rewards: torch.Tensor
    """(N, T) float32: the same reward per token: minus kl_coef x KL on each loss token (with
    kl_in=reward, else 0), plus the shaped sample reward on the sample's last loss token."""
    raw_rewards: torch.Tensor
    """(N,) float32: the rewards as the workflow returned them."""
    group_index: torch.Tensor
    """(N,) int64: the group (prompt) of each sample, 0..G-1."""
    loss_mask: torch.Tensor
    """(N, T) bool: the tokens the loss sees."""
    logprobs: torch.Tensor
    """(N, T) float32: behaviour log-probs (of the policy version that generated each token)."""
    ref_logprobs: torch.Tensor | None
    """(N, T) float32: the reference model's log-probs with kl_in=reward and kl_coef > 0, else None."""
    columns: Mapping[str, torch.Tensor]
    """Extra columns the workflow returned: per-sample (N,) or per-token (N, T), by name."""
    settings: PPOSettings


@dataclass(frozen=True)
class LossInput:
    """One mini-batch piece on one rank (tensors on the engine's device)."""

    logp: torch.Tensor
    """(N, T) float32, with gradients: log-probs under the policy being trained."""
    proximal_logp: torch.Tensor | None
    """(N, T): log-probs under the policy before this update's first optimizer step (decoupled PPO),
    or None with `ppo.decoupled=false`. Without gradients; on the first mini-batch they are `logp`'s
    own values, detached (that forward's policy is the proximal one), unless the forward has dropout."""
    behaviour_logp: torch.Tensor
    """(N, T): log-probs of the policy versions that generated the tokens."""
    advantages: torch.Tensor
    """(N, T): per-token advantages (0 outside the loss mask)."""
    loss_mask: torch.Tensor
    """(N, T) bool."""
    ref_logp: torch.Tensor | None
    """(N, T): reference log-probs with kl_in=loss and kl_coef > 0, else None."""
    columns: Mapping[str, torch.Tensor]
    """Extra per-sample (N,) and per-token (N, T) columns the workflow returned, by name."""
    settings: PPOSettings


@dataclass
class LossOutput:
    """The per-token loss to minimise (before aggregation) and what the trainer reports about it."""

    loss: torch.Tensor
    """(N, T) with gradients; only loss-mask tokens count (the trainer masks the rest)."""
    clipped: torch.Tensor | None = None
    """(N, T) bool: tokens where a clip was active (reported as `clip_fraction`)."""
    capped: torch.Tensor | None = None
    """(N, T) bool: loss tokens masked by an importance-weight cap (`imp_weight_capped_fraction`)."""
    imp_weight: torch.Tensor | None = None
    """(N, T): the behaviour importance weight applied per token (`imp_weight_mean`, `imp_weight_max`)."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token (N, T) quantities to report: each is averaged over the loss tokens of the whole step
    and emitted as metric `algo_<name>`."""


@runtime_checkable
class Algorithm(Protocol):
    """An RL algorithm as the trainer calls it. Subclass `services.trainer.algorithms.Standard` to
    replace one of the two methods and keep the settings-driven other one."""

    def advantages(self, batch: AdvantageInput) -> torch.Tensor:
        """Per-sample (N,) or per-token (N, T) advantages; the trainer zeroes them outside the loss mask."""
        ...

    def loss(self, mb: LossInput) -> LossOutput:
        """The per-token policy loss of a mini-batch piece (differentiable in `mb.logp`)."""
        ...

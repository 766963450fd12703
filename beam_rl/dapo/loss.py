"""Policy losses (registry, one signature, SkyRL style): each returns (loss, metrics).

All inputs are [B, T] per response token: `logprobs` (trainer, with grad), `old_logprobs` (trainer
before the update, R3 on), `rollout_logprobs` (vLLM), `advantages` (per response, broadcast), and
`mask` (response tokens that carry loss). The DAPO loss (Yu et al. 2025):

    ratio = exp(logprobs - old_logprobs)
    per-token = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

aggregated over tokens ('token_mean': sum over every token of the batch / number of tokens).
Optional truncated importance sampling (TIS) multiplies each token by
min(exp(old_logprobs - rollout_logprobs), tis_cap) (no gradient), correcting the rollout /
trainer mismatch; optional KL (k3 estimator) against the rollout log-probs, off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict]]] = {}


def register_loss(name: str):
    def deco(fn):
        POLICY_LOSSES[name] = fn
        return fn

    return deco


@dataclass(frozen=True)
class LossSettings:
    eps_low: float = 0.2
    eps_high: float = 0.28
    loss_agg: str = "token_mean"
    tis_cap: float | None = None
    kl_coef: float = 0.0


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: str, normalizer: float | None = None) -> torch.Tensor:
    """'token_mean': sum(values * mask) / (normalizer or mask.sum()); 'seq_mean_token_mean':
    mean over sequences of each sequence's token mean."""
    m = mask.float()
    if how == "token_mean":
        denom = normalizer if normalizer is not None else m.sum().clamp_min(1.0)
        return (values * m).sum() / denom
    if how == "seq_mean_token_mean":
        per_seq = (values * m).sum(-1) / m.sum(-1).clamp_min(1.0)
        rows = (m.sum(-1) > 0).float()
        return (per_seq * rows).sum() / (normalizer if normalizer is not None else rows.sum().clamp_min(1.0))
    raise ValueError(f"dapo.loss_agg={how!r}; use 'token_mean' or 'seq_mean_token_mean'")


@register_loss("dapo")
def dapo_loss(logprobs, old_logprobs, advantages, mask, settings: LossSettings, rollout_logprobs=None, normalizer=None):
    """Clip-higher PPO surrogate, token-level aggregation; see the module docstring."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logprobs)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - settings.eps_low, 1.0 + settings.eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    m = mask.bool()
    if settings.tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("dapo.tis_cap is set but no rollout log-probs were given")
        weight = torch.exp(old_logprobs - rollout_logprobs).clamp(max=settings.tis_cap).detach()
        per_token = per_token * weight
    if settings.kl_coef:
        if rollout_logprobs is None:
            raise ValueError("dapo.kl_coef > 0 needs the rollout log-probs")
        d = rollout_logprobs - logprobs
        per_token = per_token + settings.kl_coef * (torch.exp(d) - d - 1.0)  # k3 estimator, >= 0
    loss = aggregate(per_token, m, settings.loss_agg, normalizer)
    with torch.no_grad():
        n = m.sum().clamp_min(1)
        low = (ratio < 1.0 - settings.eps_low) & (adv < 0) & m
        high = (ratio > 1.0 + settings.eps_high) & (adv > 0) & m
        metrics = {
            "clip_frac_low": (low.sum() / n).item(),
            "clip_frac_high": (high.sum() / n).item(),
            "ratio_mean": (ratio * m).sum().item() / n.item(),
        }
    return loss, metrics


@register_loss("vanilla_pg")
def vanilla_pg_loss(logprobs, old_logprobs, advantages, mask, settings: LossSettings, rollout_logprobs=None, normalizer=None):
    """-A * logprob (REINFORCE with the group baseline), same aggregation."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logprobs)
    return aggregate(-adv * logprobs, mask.bool(), settings.loss_agg, normalizer), {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "ratio_mean": 1.0}


def policy_loss(name: str, *args, **kwargs):
    if name not in POLICY_LOSSES:
        raise ValueError(f"dapo.loss={name!r}; choose from {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name](*args, **kwargs)

"""Advantage estimators (registry). Shared signature: rewards [groups, G] -> advantages [groups, G],
one scalar per response, broadcast over its tokens by the loss."""

from __future__ import annotations

from typing import Callable

import torch

ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {}


def register_advantage(name: str):
    def deco(fn):
        ADVANTAGES[name] = fn
        return fn

    return deco


@register_advantage("grpo")
def group_normalized(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps), std unbiased (as GRPO / DAPO); a constant group -> 0."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, G >= 2]; got shape {tuple(rewards.shape)}")
    r = rewards.float()
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)


@register_advantage("rloo")
def leave_one_out(rewards: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """r_i - mean of the other G-1 rewards of the group."""
    r = rewards.float()
    G = r.shape[1]
    return (r - (r.sum(dim=1, keepdim=True) - r) / (G - 1))


def compute_advantages(name: str, rewards: torch.Tensor) -> torch.Tensor:
    if name not in ADVANTAGES:
        raise ValueError(f"dapo.advantage={name!r}; choose from {sorted(ADVANTAGES)}")
    return ADVANTAGES[name](rewards)

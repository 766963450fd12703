"""`beam_grpo` advantage estimator for SkyRL: SkyRL's estimator signature around
`beam_rl.dapo.advantages.group_normalized`.

SkyRL 0.3.0 calls `fn(token_level_rewards=[B, T], response_mask=[B, T], index=[B] prompt ids,
epsilon=, grpo_norm_by_std=, ...)` and expects `(advantages, returns)`, both [B, T]. Each
response's reward is the sum of its token rewards (SkyRL puts an outcome reward on the last
token); the responses sharing an `index` form one group, in any order; the group's rewards go
through beam-rl's own `group_normalized` ((r - mean) / (std + eps), unbiased std) and the
scalar is broadcast over the response's tokens (masked).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from beam_rl.dapo.advantages import group_normalized

NAME = "beam_grpo"
"""`trainer.algorithm.advantage_estimator` that selects this estimator."""


def _groups(index) -> list[list[int]]:
    """Row indices of each prompt group, groups in order of first appearance."""
    rows: dict = defaultdict(list)
    for i, key in enumerate(list(index)):
        rows[key].append(i)
    return list(rows.values())


def beam_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    grpo_norm_by_std: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SkyRL advantage-estimator signature -> `beam_rl.dapo.advantages.group_normalized`."""
    if not grpo_norm_by_std:
        raise ValueError(f"trainer.algorithm.grpo_norm_by_std=false: advantage_estimator={NAME!r} always divides by the "
                         "group std (DAPO); set it to true")
    scores = token_level_rewards.sum(dim=-1)  # (B,) one outcome reward per response
    groups = _groups(index)
    sizes = {len(g) for g in groups}
    if min(sizes) < 2:
        raise ValueError(f"advantage_estimator={NAME!r} needs >= 2 responses per prompt; set generator.n_samples_per_prompt >= 2")
    adv = torch.empty_like(scores, dtype=torch.float32)
    with torch.no_grad():
        if len(sizes) == 1:  # the usual case: one call on [groups, G]
            rows = torch.tensor(groups, device=scores.device)
            adv[rows.reshape(-1)] = group_normalized(scores[rows], eps=epsilon).reshape(-1)
        else:  # dynamic sampling can leave groups of different sizes
            for g in groups:
                rows = torch.tensor(g, device=scores.device)
                adv[rows] = group_normalized(scores[rows][None, :], eps=epsilon)[0]
        adv = adv.to(token_level_rewards.dtype)[:, None] * response_mask
    return adv, adv

"""Beam's MoE router (DeepSeek-V3 style grouped sigmoid top-k) and its replay (R3) variant.

Contract, all FP32: logits = x @ W^T with FP32 W; scores = sigmoid(logits); selection uses
scores + e_score_correction_bias: each of `n_group` equal groups is scored by the sum of its two
largest biased scores, the `topk_group` best groups are kept and the `top_k` best experts inside
them are picked. Ties break towards the lower group / expert id. Gate weights are the unbiased
scores of the picked experts, renormalised to sum 1 (if `norm_topk_prob`) and multiplied by
`routed_scaling_factor`. Ids come in descending biased-score order.

Replay takes ids chosen elsewhere (the rollout engine) and recomputes the gate weights from this
model's own scores, so the router keeps its gradient while the expert choice is replayed.
"""

from __future__ import annotations

import torch


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """FP32 router logits [T, E] of activations x [T, hidden] with an FP32 weight [E, hidden].

    The reference accumulates in FP64 and rounds once to FP32: the correctly rounded dot
    product, independent of how many tokens are batched (an FP32 BLAS GEMM is not: its blocking
    depends on the token count). FP32-accumulating engines differ from it by reduction order only.
    """
    return (x.double() @ weight.double().t()).float()


def _stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim; equal values keep the lower index first."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def select_experts(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped sigmoid top-k: returns (FP32 gate weights [T, top_k], int64 expert ids [T, top_k])."""
    num_tokens, num_experts = logits.shape
    scores = torch.sigmoid(logits.float())
    biased = scores + correction_bias.float()
    grouped = biased.view(num_tokens, n_group, num_experts // n_group)
    top2 = torch.sort(grouped, dim=-1, descending=True).values[..., :2]
    group_scores = top2[..., 0] + top2[..., 1]  # (T, n_group)
    kept_groups = _stable_topk(group_scores, topk_group)
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    ids = _stable_topk(biased.masked_fill(~expert_mask, float("-inf")), top_k)
    return gate_weights(scores, ids, routed_scaling_factor, norm_topk_prob), ids


def gate_weights(
    scores: torch.Tensor, ids: torch.Tensor, routed_scaling_factor: float, norm_topk_prob: bool = True
) -> torch.Tensor:
    """FP32 gate weights of the experts `ids` [T, K] from unbiased sigmoid scores [T, E]."""
    w = scores.gather(1, ids.long())
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * routed_scaling_factor


def replay_experts(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """R3: keep the given ids [T, K]; weights from this router's own scores. Returns (weights, ids)."""
    num_tokens, num_experts = logits.shape
    if ids.dim() != 2 or ids.shape[0] != num_tokens:
        raise ValueError(f"replayed expert ids have shape {tuple(ids.shape)}; expected [{num_tokens}, top_k]")
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"replayed expert ids must be in [0, {num_experts}); got [{int(ids.min())}, {int(ids.max())}]")
    if ids.shape[1] > 1:
        sorted_ids = ids.sort(dim=-1).values
        dup_rows = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(dim=-1).nonzero().flatten()
        if dup_rows.numel():
            raise ValueError(f"replayed expert ids repeat an expert within a token (first at token {int(dup_rows[0])})")
    scores = torch.sigmoid(logits.float())
    return gate_weights(scores, ids, routed_scaling_factor, norm_topk_prob), ids

"""The router against a plain Python loop over groups and experts."""

import math

import pytest
import torch

from beam_rl.model.routing import gate_weights, replay_experts, router_logits, select_experts


def loop_route(logits, bias, top_k, n_group, topk_group, scale):
    """Brute force, one token at a time, in Python floats."""
    ids_out, w_out = [], []
    for row, in zip(logits.tolist()):
        scores = [1 / (1 + math.exp(-v)) for v in row]
        biased = [s + b for s, b in zip(scores, bias.tolist())]
        size = len(row) // n_group
        group_score = []
        for g in range(n_group):
            members = sorted(biased[g * size : (g + 1) * size], reverse=True)
            group_score.append(members[0] + members[1])
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda e: (-biased[e], e))[:top_k]
        total = sum(scores[e] for e in chosen)
        ids_out.append(chosen)
        w_out.append([scores[e] / total * scale for e in chosen])
    return torch.tensor(w_out, dtype=torch.float64), torch.tensor(ids_out)


@pytest.mark.parametrize(
    "experts,n_group,topk_group,top_k",
    [(16, 4, 2, 4), (64, 8, 4, 8), (256, 8, 4, 8), (8, 1, 1, 2)],
)
def test_grouped_topk_matches_loop(experts, n_group, topk_group, top_k):
    g = torch.Generator().manual_seed(experts)
    logits = torch.randn(33, experts, generator=g) * 2
    bias = torch.randn(experts, generator=g) * 0.1
    w, ids = select_experts(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    w_ref, ids_ref = loop_route(logits, bias, top_k, n_group, topk_group, 2.5)
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w.double(), w_ref, rtol=1e-6)
    assert torch.allclose(w.sum(-1), torch.full((33,), 2.5))


def test_bias_steers_selection_but_not_weights():
    logits = torch.zeros(1, 16)
    logits[0, :4] = 1.0  # experts 0-3 score highest
    bias = torch.zeros(16)
    bias[12:] = 10.0  # group 3 wins selection through the bias alone
    w, ids = select_experts(logits, bias, top_k=4, n_group=4, topk_group=1, routed_scaling_factor=1.0)
    assert sorted(ids[0].tolist()) == [12, 13, 14, 15]
    assert torch.allclose(w, torch.full((1, 4), 0.25))  # unbiased scores, all sigmoid(0)


def test_ties_break_to_lower_ids():
    w, ids = select_experts(torch.zeros(1, 16), torch.zeros(16), top_k=4, n_group=4, topk_group=2, routed_scaling_factor=1.0)
    assert ids[0].tolist() == [0, 1, 2, 3]


def test_replay_recomputes_weights_from_own_scores_with_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    weight = torch.randn(16, 32, generator=g, requires_grad=True)
    forced = torch.tensor([[15, 3, 7, 0]] * 5)
    w, ids = replay_experts(router_logits(x, weight), forced, routed_scaling_factor=2.5)
    assert torch.equal(ids, forced)
    scores = torch.sigmoid(x.double() @ weight.double().t())
    expect = scores.gather(1, forced) / scores.gather(1, forced).sum(-1, keepdim=True) * 2.5
    assert torch.allclose(w.double(), expect, rtol=1e-6)
    (w * torch.arange(4.0)).sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_replay_rejects_bad_ids():
    logits = torch.zeros(3, 16)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        replay_experts(logits, torch.tensor([[0, 16]] * 3), routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="expected \\[3, top_k\\]"):
        replay_experts(logits, torch.tensor([[0, 1]] * 2), routed_scaling_factor=1.0)


def test_router_logits_do_not_depend_on_batch_size():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(80, 512, generator=g).to(torch.bfloat16), torch.randn(64, 512, generator=g)
    full = router_logits(x, w)
    assert all(torch.equal(router_logits(x[:m], w), full[:m]) for m in (1, 3, 7, 16))


def test_gate_weights_without_renorm():
    scores = torch.tensor([[0.5, 0.25, 0.125]])
    assert torch.allclose(gate_weights(scores, torch.tensor([[0, 2]]), 2.0, norm_topk_prob=False), torch.tensor([[1.0, 0.25]]))


def test_replay_rejects_repeated_expert():
    with pytest.raises(ValueError, match="repeat an expert.*token 1"):
        replay_experts(torch.zeros(2, 16), torch.tensor([[0, 1], [4, 4]]), routed_scaling_factor=1.0)

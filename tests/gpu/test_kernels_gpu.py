"""Triton kernels vs the PyTorch references on the GPU: fresh random inputs, outputs poisoned with NaN
first, BF16 outputs compared bit for bit, router ids compared exactly. Skips without CUDA/Triton."""

import pytest
import torch

from beam_rl import numerics, routing

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from beam_rl.kernels import boundary_ops, gate_ops, qk_norm_rope_ops, router_ops, swiglu_ops  # noqa: E402
from beam_rl.kernels.reduce_order import cuda_order_sum, mean_factor  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
EPS = 1e-6


def poisoned(shape, dtype=BF16):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def assert_bits(out, ref, what=""):
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{what}: {out.shape}/{out.dtype} vs {ref.shape}/{ref.dtype}"
    same = out.view(torch.int16) == ref.view(torch.int16) if out.element_size() == 2 else out == ref
    if not bool(same.all()):
        bad = (~same).sum().item()
        diff = (out.float() - ref.float()).abs().max().item()
        raise AssertionError(f"{what}: {bad}/{out.numel()} elements differ (max |diff| {diff})")


def weight(n, dtype=BF16):
    return (1.0 + 0.2 * torch.randn(n, device=DEV)).to(dtype)


# ATen's summation order, checked directly: the Python emulation vs torch's own CUDA mean.
@pytest.mark.parametrize("rows,n", [(1, 5120), (2, 5120), (5, 5120), (9, 5120), (16, 5120), (333, 5120),
                                    (1, 6144), (64, 6144), (1, 1024), (7, 1024), (4096, 1024), (1, 128),
                                    (8, 128), (48, 128), (16384, 128), (3, 64), (40, 32), (1, 8), (64, 8), (5, 4)])
def test_aten_sum_order(rows, n):
    x = torch.randn(rows, n, device=DEV) * torch.rand(rows, 1, device=DEV) * 4
    sq = x.pow(2)
    assert_bits(cuda_order_sum(sq) * mean_factor(n), sq.mean(dim=-1), f"mean order {rows}x{n}")


SHAPES = [(1, 5120), (7, 5120), (333, 5120), ((8, 2048), 5120), (1, 6144), (64, 6144), (1, 1024), (333, 1024),
          (5, 128)]


def _shape(t, n):
    return (*t, n) if isinstance(t, tuple) else (t, n)


@pytest.mark.parametrize("tokens,n", SHAPES)
def test_rms_norm(tokens, n):
    x = torch.randn(_shape(tokens, n), device=DEV).to(BF16)
    w = weight(n)
    out = poisoned(x.shape)
    boundary_ops.rms_norm_triton(x, w, EPS, out=out)
    assert_bits(out, numerics.rms_norm(x, w, EPS), "rms_norm")


@pytest.mark.parametrize("tokens,n", SHAPES)
@pytest.mark.parametrize("has_next", [True, False])
def test_sublayer_boundary(tokens, n, has_next):
    shape = _shape(tokens, n)
    x = (3 * torch.randn(shape, device=DEV)).to(BF16)
    h = torch.randn(shape, device=DEV).to(BF16)
    wp, wn = weight(n), (weight(n) if has_next else None)
    add_index = int(torch.randint(2, 105, ()).item())
    out = (poisoned(shape), poisoned(shape) if has_next else None)
    boundary_ops.sublayer_boundary_triton(x, h, wp, wn, add_index, EPS, out=out)
    ref_h, ref_n = numerics.sublayer_boundary(x, h, wp, wn, add_index, EPS)
    assert_bits(out[0], ref_h, "residual'")
    if has_next:
        assert_bits(out[1], ref_n, "next input")


QK_SHAPES = [(1, 48, 8, 128), (7, 48, 8, 128), (333, 16, 4, 128), (16384, 48, 8, 128), (5, 6, 2, 32),
             (9, 8, 2, 64), (3, 4, 1, 96)]


def _packed_qkvg(tokens, heads, kv, d):
    width = (2 * heads + 2 * kv) * d
    packed = torch.randn(tokens, width, device=DEV).to(BF16) * 2
    q = packed[:, : heads * d].view(tokens, heads, d)
    k = packed[:, heads * d : (heads + kv) * d].view(tokens, kv, d)
    v = packed[:, (heads + kv) * d : (heads + 2 * kv) * d].view(tokens, kv, d)
    g = packed[:, (heads + 2 * kv) * d :].view(tokens, heads, d)
    return q, k, v, g


@pytest.mark.parametrize("tokens,heads,kv,d", QK_SHAPES)
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("cache", [False, True])
def test_qk_norm_rope_ssmax(tokens, heads, kv, d, rope, cache):
    q, k, v, _ = _packed_qkvg(tokens, heads, kv, d)
    qw, kw = weight(d), weight(d)
    max_pos = 40000
    positions = torch.randint(0, max_pos, (tokens,), device=DEV)
    tables = dict(cos_sin_cache=numerics.rope_cos_sin_cache(max_pos, d, 10000.0).to(DEV), ssmax_cache=None) if rope \
        else dict(cos_sin_cache=None, ssmax_cache=numerics.ssmax_scale_cache(max_pos).to(DEV))
    q_out, k_out = poisoned((tokens, heads, d)), poisoned((tokens, kv, d))
    extra = {}
    if cache:
        block_size, blocks = 16, tokens // 8 + 4
        kv_cache = poisoned((2, blocks, block_size, kv, d))
        ref_cache = kv_cache.clone()
        slots = torch.randperm(blocks * block_size, device=DEV)[:tokens]
        slots[::3] = -1
        extra = dict(v=v, kv_cache=kv_cache, slot_mapping=slots)
    qk_norm_rope_ops.qk_norm_rope_ssmax_triton(q, k, qw, kw, positions, EPS, **tables, q_out=q_out, k_out=k_out,
                                               **extra)
    ref_q, ref_k = numerics.qk_norm_rope_ssmax(q, k, qw, kw, positions, EPS, **tables)
    assert_bits(q_out, ref_q, "q")
    assert_bits(k_out, ref_k, "k")
    if cache:
        qk_norm_rope_ops.write_kv_cache_reference(ref_cache, slots, ref_k, v)
        assert_bits(kv_cache, ref_cache, "kv cache")


@pytest.mark.parametrize("tokens,heads,d", [(1, 48, 128), (7, 48, 128), (333, 16, 128), (16384, 48, 128),
                                             (5, 6, 32), (9, 8, 64)])
def test_output_gate(tokens, heads, d):
    q, k, v, g = _packed_qkvg(tokens, heads, 2, d)
    attn = torch.randn(tokens, heads, d, device=DEV).to(BF16)
    bias = torch.randn(heads, device=DEV).to(BF16)
    out = poisoned(attn.shape)
    gate_ops.output_gate_triton(attn, g, bias, out=out)
    assert_bits(out, numerics.output_gate(attn, g, bias), "output gate")


@pytest.mark.parametrize("tokens,f", [(1, 20480), (7, 2560), (333, 4096), ((8, 2048), 2560), (5, 256), (3, 100)])
@pytest.mark.parametrize("packed", [True, False])
def test_silu_and_mul(tokens, f, packed):
    gu = (3 * torch.randn(_shape(tokens, 2 * f), device=DEV)).to(BF16)
    gate, up = gu[..., :f], gu[..., f:]
    out = poisoned(gate.shape)
    if packed:
        swiglu_ops.silu_and_mul_triton(gu, out=out)
    else:
        gate, up = gate.contiguous(), up.contiguous()
        swiglu_ops.silu_and_mul_triton(gate, up, out=out)
    assert_bits(out, numerics.silu_and_mul(gate, up), "silu_and_mul")


ROUTERS = [  # hidden, experts, n_group, topk_group, top_k
    (5120, 256, 8, 4, 8),
    (1024, 64, 8, 4, 8),
    (128, 16, 4, 2, 4),
]


def _router_inputs(tokens, hidden, experts):
    x = torch.randn(tokens, hidden, device=DEV).to(BF16)
    w = torch.randn(experts, hidden, device=DEV) / hidden**0.5
    bias = 0.05 * torch.randn(experts, device=DEV)
    return x, w, bias


def _near_tie(logits, bias, ids, kw):
    """Tokens whose reference selection has a margin under 1e-5 somewhere (allowed to differ)."""
    scores = torch.sigmoid(logits) + bias
    srt = scores.sort(dim=-1, descending=True).values
    gaps = (srt[:, :-1] - srt[:, 1:]).abs()
    return (gaps < 1e-5).any(dim=-1)


@pytest.mark.parametrize("tokens", [1, 7, 64, 333])
@pytest.mark.parametrize("hidden,experts,n_group,topk_group,top_k", ROUTERS)
def test_router(tokens, hidden, experts, n_group, topk_group, top_k):
    x, w, bias = _router_inputs(tokens, hidden, experts)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    logits = routing.router_logits(x, w)
    ref_w, ref_ids = routing.select_experts(logits, bias, **kw)
    # the epilogue alone, on cuBLAS's logits: bit-exact
    out = (poisoned((tokens, top_k), torch.float32), torch.full((tokens, top_k), -7, dtype=torch.int64, device=DEV))
    router_ops.select_experts_triton(logits, bias, **kw, out=out)
    assert torch.equal(out[1], ref_ids)
    assert_bits(out[0], ref_w, "router epilogue weights")
    rw, _ = router_ops.replay_experts_triton(logits, ref_ids, routed_scaling_factor=2.5)
    assert_bits(rw, routing.replay_experts(logits, ref_ids, routed_scaling_factor=2.5)[0], "replay epilogue")
    # GEMM + epilogue: ids identical except at reference near-ties; weights within reduction-order rounding
    out = (poisoned((tokens, top_k), torch.float32), torch.full((tokens, top_k), -7, dtype=torch.int64, device=DEV))
    router_ops.route_triton(x, w, bias, **kw, out=out)
    same = (out[1] == ref_ids).all(dim=-1)
    assert bool((same | _near_tie(logits, bias, ref_ids, kw)).all()), "router ids differ away from a near-tie"
    assert same.float().mean() > 0.97
    torch.testing.assert_close(out[0][same], ref_w[same], rtol=2e-5, atol=2e-6)
    pw, pids = router_ops.replay_triton(x, w, ref_ids, routed_scaling_factor=2.5)
    assert torch.equal(pids, ref_ids)
    torch.testing.assert_close(pw, routing.replay_experts(logits, ref_ids, routed_scaling_factor=2.5)[0],
                               rtol=2e-5, atol=2e-6)


def test_router_logits_error_bound():
    """Split-K FP32 logits vs cuBLAS: report the reduction-order difference (documented bound)."""
    x, w, bias = _router_inputs(64, 5120, 256)
    part, split = router_ops._logit_partials(x, w, None)
    ours = part.sum(0) if split > 1 else part[0]
    ref = routing.router_logits(x, w)
    exact = x.double() @ w.double().t()
    scale = (x.double().abs() @ w.double().abs().t())
    err_ours = ((ours.double() - exact).abs() / scale).max().item()
    err_ref = ((ref.double() - exact).abs() / scale).max().item()
    print(f"router logits: max |err| / (|x|.|w|): split-K {err_ours:.2e}, cuBLAS {err_ref:.2e}")
    assert err_ours < 5120 * 2**-24


def test_empty_inputs():
    x = torch.empty(0, 5120, device=DEV, dtype=BF16)
    assert boundary_ops.rms_norm_triton(x, weight(5120), EPS).shape == (0, 5120)
    h, n = boundary_ops.sublayer_boundary_triton(x, x, weight(5120), weight(5120), 2, EPS)
    assert h.shape == n.shape == (0, 5120)
    assert swiglu_ops.silu_and_mul_triton(torch.empty(0, 64, device=DEV, dtype=BF16)).shape == (0, 32)
    e = torch.empty(0, 4, 32, device=DEV, dtype=BF16)
    assert gate_ops.output_gate_triton(e, e, torch.zeros(4, device=DEV)).shape == e.shape

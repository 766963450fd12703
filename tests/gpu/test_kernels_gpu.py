"""Triton kernels vs the PyTorch references on the GPU: fresh random inputs, outputs poisoned with NaN
first, BF16 outputs compared bit for bit, router ids compared exactly. Skips without CUDA/Triton."""

import pytest
import torch

from beam_rl.model import numerics, routing

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from beam_rl.kernels import boundary_ops, gate_ops, qk_norm_rope_ops, router_ops, swiglu_ops  # noqa: E402
from beam_rl.kernels.reduce_order import cuda_order_sum  # noqa: E402

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


# ATen's summation order (the router's renormalisation follows it), checked directly: the Python
# emulation vs torch's own CUDA mean.
@pytest.mark.parametrize("rows,n", [(1, 5120), (2, 5120), (5, 5120), (9, 5120), (16, 5120), (333, 5120),
                                    (1, 6144), (64, 6144), (1, 1024), (7, 1024), (4096, 1024), (1, 128),
                                    (8, 128), (48, 128), (16384, 128), (3, 64), (40, 32), (1, 8), (64, 8), (5, 4)])
def test_aten_sum_order(rows, n):
    x = torch.randn(rows, n, device=DEV) * torch.rand(rows, 1, device=DEV) * 4
    sq = x.pow(2)
    assert_bits(cuda_order_sum(sq) * numerics.mean_factor(n), sq.mean(dim=-1), f"mean order {rows}x{n}")


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


# 72 and 128 heads: wider blocks (3 x 32, 4 x 32), at most MAX_Q_BLOCKS a token
QK_SHAPES = [(1, 48, 8, 128), (7, 48, 8, 128), (333, 16, 4, 128), (16384, 48, 8, 128), (9, 40, 8, 128), (5, 6, 2, 32),
             (9, 8, 2, 64), (3, 4, 1, 96), (65, 72, 8, 128), (5, 128, 16, 128)]


LAUNCHES = [(1, 4, 1024, 0), (1, 8, 1024, 0), (1, 8, 2048, 0), (1, 8, 8192, 0), (1, 16, 8192, 0), (1, 4, 4096, 1024),
            (1, 8, 4096, 1024), (2, 8, 4096, 1024), (2, 8, 1024, 0), (4, 16, 512, 0)]  # (rows, warps, chunk, tail)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_boundary_launch_shapes_agree(launch):
    """Every launch shape the benchmark tunes over gives the reference bits (the FP64 sum is order-free)."""
    x = (3 * torch.randn(333, 5120, device=DEV)).to(BF16)
    h = torch.randn(333, 5120, device=DEV).to(BF16)
    wp, wn = weight(5120), weight(5120)
    out = (poisoned(x.shape), poisoned(x.shape))
    boundary_ops.sublayer_boundary_triton(x, h, wp, wn, 9, EPS, out=out, launch=launch)
    ref_h, ref_n = numerics.sublayer_boundary(x, h, wp, wn, 9, EPS)
    assert_bits(out[0], ref_h, f"residual' {launch}")
    assert_bits(out[1], ref_n, f"next input {launch}")
    got = poisoned(x.shape)
    boundary_ops.rms_norm_triton(x, wp, EPS, out=got, launch=launch)
    assert_bits(got, numerics.rms_norm(x, wp, EPS), f"rms_norm {launch}")


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


# 65537 rows: more than one launch (swiglu_ops.MAX_GRID_ROWS)
@pytest.mark.parametrize("tokens,f", [(1, 20480), (7, 2560), (333, 4096), ((8, 2048), 2560), (5, 256), (3, 100),
                                      (65537, 48)])
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


def every_bf16(rows=64):
    """All 65536 bf16 bit patterns (NaNs, infinities, zeros and subnormals included) as [rows, 65536 / rows]."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32, device=DEV).to(torch.int16)
    return bits.view(BF16).reshape(rows, -1)


def test_silu_and_mul_every_bf16_gate():
    """silu(g) depends on g alone, so an exact FP32 silu for each of the 65536 gates makes every product exact;
    up = 1 + 2^-7 and a random up expose the FP32 quotient's low bits through the product's rounding."""
    gate = every_bf16()
    for up in (torch.full_like(gate, 1.0078125), torch.randn(gate.shape, device=DEV).to(BF16)):
        out = poisoned(gate.shape)
        swiglu_ops.silu_and_mul_triton(gate, up, out=out)
        assert_bits(out, numerics.silu_and_mul(gate, up), "silu_and_mul, every bf16 gate")


def test_output_gate_every_bf16_gate():
    """sigmoid(round(gate + bias)) for each of the 65536 bf16 values (bias 0), times attn = 1 (the rounded
    sigmoid itself) and times a random attn."""
    gate = every_bf16().reshape(64, 8, 128)
    bias = torch.zeros(8, device=DEV, dtype=BF16)
    for attn in (torch.ones_like(gate), torch.randn(gate.shape, device=DEV).to(BF16)):
        out = poisoned(gate.shape)
        gate_ops.output_gate_triton(attn, gate, bias, out=out)
        assert_bits(out, numerics.output_gate(attn, gate, bias), "output gate, every bf16 gate")


def _router_inputs(tokens, hidden, experts):
    x = torch.randn(tokens, hidden, device=DEV).to(BF16)
    w = torch.randn(experts, hidden, device=DEV) / hidden**0.5
    bias = 0.05 * torch.randn(experts, device=DEV)
    return x, w, bias


_DOT_FAILURE: list[str] = []  # [] untried, [""] compiles, [reason] does not


def _gemm_variant(use_dot):
    """Pin the FP64 GEMM variant (None: the module's default); skip if this Triton cannot compile it."""
    if use_dot:
        if not _DOT_FAILURE:
            x, w, _ = _router_inputs(1, 128, 16)
            try:
                router_ops._logit_partials(x, w, None, use_dot=True)
                _DOT_FAILURE.append("")
            except Exception as err:  # noqa: BLE001 - a compile failure of the FP64 tl.dot (e.g. Triton 3.6)
                _DOT_FAILURE.append(f"{type(err).__name__}: {str(err)[:200]}")
        if _DOT_FAILURE[0]:
            pytest.skip(f"FP64 tl.dot does not compile with this Triton: {_DOT_FAILURE[0]}")
    return use_dot


@pytest.fixture(params=[None, True, False], ids=["auto", "dot", "broadcast"])
def gemm_variant(request, monkeypatch):
    use_dot = _gemm_variant(request.param)
    if use_dot is not None:
        monkeypatch.setattr(router_ops, "_FP64_DOT", use_dot)
    return use_dot


@pytest.mark.parametrize("tokens", [1, 7, 64, 65, 256, 333])  # both sides of TRITON_GEMM_MAX_TOKENS (64)
@pytest.mark.parametrize("hidden,experts,n_group,topk_group,top_k", ROUTERS)
def test_router(tokens, hidden, experts, n_group, topk_group, top_k, gemm_variant):
    """Logits bit-identical to `routing.router_logits` (FP64 accumulation, one rounding; cuBLAS DGEMM here),
    ids and weights bit-identical to the reference, for route and replay (up to TRITON_GEMM_MAX_TOKENS: the
    Triton FP64 GEMM; above: the reference's own GEMM)."""
    x, w, bias = _router_inputs(tokens, hidden, experts)
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    logits = routing.router_logits(x, w)
    ref_w, ref_ids = routing.select_experts(logits, bias, **kw)
    # the epilogue alone, on the reference logits: bit-exact
    out = (poisoned((tokens, top_k), torch.float32), torch.full((tokens, top_k), -7, dtype=torch.int64, device=DEV))
    router_ops.select_experts_triton(logits, bias, **kw, out=out)
    assert torch.equal(out[1], ref_ids)
    assert_bits(out[0], ref_w, "router epilogue weights")
    rw, _ = router_ops.replay_experts_triton(logits, ref_ids, routed_scaling_factor=2.5)
    assert_bits(rw, routing.replay_experts(logits, ref_ids, routed_scaling_factor=2.5)[0], "replay epilogue")
    # GEMM + epilogue: the same logits, hence the same ids and weights
    out = (poisoned((tokens, top_k), torch.float32), torch.full((tokens, top_k), -7, dtype=torch.int64, device=DEV))
    got_logits = poisoned((tokens, experts), torch.float32)
    router_ops.route_triton(x, w, bias, **kw, out=out, logits_out=got_logits)
    assert_bits(got_logits, logits, "router logits")
    assert torch.equal(out[1], ref_ids), "router ids"
    assert_bits(out[0], ref_w, "router weights")
    got_logits = poisoned((tokens, experts), torch.float32)
    pw, pids = router_ops.replay_triton(x, w, ref_ids, routed_scaling_factor=2.5, logits_out=got_logits)
    assert_bits(got_logits, logits, "replay logits")
    assert torch.equal(pids, ref_ids)
    assert_bits(pw, routing.replay_experts(logits, ref_ids, routed_scaling_factor=2.5)[0], "replay weights")


def test_router_prefill():
    """A prefill batch (8 x 2048 tokens, Beam-1.0's router): the reference's own FP64 GEMM, bit-exact end to end."""
    tokens = 8 * 2048
    x, w, bias = _router_inputs(tokens, 5120, 256)
    kw = dict(top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    logits = routing.router_logits(x, w)
    ref_w, ref_ids = routing.select_experts(logits, bias, **kw)
    got_logits = poisoned((tokens, 256), torch.float32)
    got_w, got_ids = router_ops.route_triton(x, w, bias, **kw, logits_out=got_logits)
    assert_bits(got_logits, logits, "prefill router logits")
    assert torch.equal(got_ids, ref_ids)
    assert_bits(got_w, ref_w, "prefill router weights")
    pw, _ = router_ops.replay_triton(x, w, ref_ids, routed_scaling_factor=2.5)
    assert_bits(pw, routing.replay_experts(logits, ref_ids, routed_scaling_factor=2.5)[0], "prefill replay weights")


@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "broadcast"])
def test_router_logits_fp64_sweep(use_dot):
    """Every token count the Triton GEMM serves (1-256, split-K and not) at Beam-1.0's 5120 x 256: logits
    bit-identical to cuBLAS DGEMM's. Prints how far the FP64 sums of the two orders are apart (bound
    K * 2^-53 = 5.7e-13 of sum|terms|; a last-bit FP32 difference needs an FP32 rounding boundary in
    between, ~1e-9 per logit) and, for contrast, the share of logits an FP32 GEMM gets wrong."""
    _gemm_variant(use_dot)
    worst, fp32_wrong, n = 0.0, 0, 0
    for tokens in [1, 2, 3, 5, 8, 13, 16, 17, 31, 64, 65, 100, 128, 200, 255, 256]:
        x, w, _ = _router_inputs(tokens, 5120, 256)
        ref = routing.router_logits(x, w)
        for split_k in (None, 1, 7):
            part, split = router_ops._logit_partials(x, w, split_k, use_dot=use_dot)
            assert part.dtype == torch.float64 and (split_k != 1 or split == 1)
            got = torch.empty_like(ref)
            router_ops._topk(part, split, tokens, 256, torch.zeros(256, device=DEV), None, 8, 8, 4, 1.0, True,
                             torch.int64, logits_out=got)
            assert_bits(got, ref, f"logits {tokens} tokens split_k={split_k}")
            scale = x.double().abs() @ w.double().abs().t()
            worst = max(worst, ((part.sum(0) - x.double() @ w.double().t()).abs() / scale).max().item())
        fp32_wrong += int(((x.float() @ w.t()) != ref).sum())
        n += ref.numel()
    print(f"router FP64 logits: max |ours - DGEMM| / (|x|.|w|) before rounding {worst:.1e}; "
          f"an FP32 cuBLAS GEMM differs in {fp32_wrong / n:.0%} of the logits")
    assert worst < 5120 * 2**-53


def test_empty_inputs():
    x = torch.empty(0, 5120, device=DEV, dtype=BF16)
    assert boundary_ops.rms_norm_triton(x, weight(5120), EPS).shape == (0, 5120)
    h, n = boundary_ops.sublayer_boundary_triton(x, x, weight(5120), weight(5120), 2, EPS)
    assert h.shape == n.shape == (0, 5120)
    assert swiglu_ops.silu_and_mul_triton(torch.empty(0, 64, device=DEV, dtype=BF16)).shape == (0, 32)
    e = torch.empty(0, 4, 32, device=DEV, dtype=BF16)
    assert gate_ops.output_gate_triton(e, e, torch.zeros(4, device=DEV)).shape == e.shape


@pytest.mark.parametrize("batch,seeded,vocab", [(512, 512, 32768), (64, 37, 32768), (9, 3, 1000), (1, 1, 151936)])
def test_seeded_noise_kernel_is_the_reference(batch, seeded, vocab):
    """The counter-based noise kernel writes exactly its rows, each bit for bit the reference's noise run on
    the same GPU (integer hash, then FP32 -log of the same u)."""
    from beam_rl.kernels import seeded_noise

    g = torch.Generator().manual_seed(batch)
    rows = torch.randperm(batch, generator=g)[:seeded].to(DEV)
    seeds = torch.randint(-2**62, 2**62, (seeded,), generator=g).to(DEV)
    indices = torch.randint(0, 4096, (seeded,), generator=g).to(DEV)
    q = poisoned((batch, vocab), torch.float32)
    seeded_noise.fill_exponential_noise_(q, rows, seeds, indices)
    assert_bits(q[rows], seeded_noise.exponential_noise_reference(seeds, indices, vocab), "seeded noise")
    untouched = torch.ones(batch, dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert bool(q[untouched].isnan().all())
    u = poisoned((batch, vocab), torch.float32)
    seeded_noise.fill_uniform_noise_(u, rows, seeds, indices)
    assert_bits(u[rows], seeded_noise.uniform_noise_reference(seeds, indices, vocab), "seeded uniform noise")
    assert bool(u[untouched].isnan().all())


def test_fingerprint_kernel_sums_what_the_definition_sums():
    """The fused fingerprint kernel (`beam_rl.kernels.fingerprint`) gives `tensor_checksums`'s
    fingerprints on the GPU: beam-mini's tensor shapes (a 32768 x 1024 embedding, per-expert slices
    taken from a stacked weight as the trainer's export does), odd byte counts, views at offsets; one
    changed bit changes its tensor's fingerprint and no other."""
    from beam_rl.kernels import fingerprint
    from beam_rl.model.weights import hashed_word_sums, tensor_checksums

    g = torch.Generator(device=DEV).manual_seed(0)
    stacked = torch.randn(8, 1024, 1024, device=DEV, generator=g).to(BF16)
    named = [("embed", torch.randn(32768, 1024, device=DEV, generator=g).to(BF16)),
             *[(f"expert.{e}", stacked[e, 256:768]) for e in range(8)],
             ("norm", torch.randn(1024, device=DEV, generator=g)),
             ("odd", torch.randn(3, device=DEV, generator=g).to(BF16)),
             ("bytes", torch.arange(5, device=DEV, dtype=torch.uint8)),
             ("empty", torch.empty(0, device=DEV)),
             ("offset", stacked.view(-1)[1:4097])]  # a view 2 bytes into its storage: not int32-aligned
    fast = fingerprint.tensor_checksums(named)
    assert fast == tensor_checksums(named)
    changed = dict(named)
    changed["expert.3"] = changed["expert.3"].clone()
    changed["expert.3"].view(torch.int16)[100, 7] ^= 1
    again = fingerprint.tensor_checksums(list(changed.items()))
    assert [k for k in fast if fast[k] != again[k]] == ["expert.3"]
    from beam_rl.model.weights import _words

    items = [(n, _words(t)) for n, t in named if t.numel() * t.element_size() % 4 == 0]
    assert fingerprint.word_sums(items) == hashed_word_sums(items)

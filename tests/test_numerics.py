"""Each numerics primitive against an independent brute-force computation.

BF16 rounding is re-implemented here with integer bit arithmetic on NumPy FP32 (round to nearest
even), so these tests do not trust torch's casts to define the rounding points they check.
"""

import math

import numpy as np
import pytest
import torch

from beam_rl.model import numerics


def bf16(x: np.ndarray) -> np.ndarray:
    """Round FP32 values to BF16 (nearest even), returned as FP32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def f32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().astype(np.float32)


def np_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = (x.astype(np.float32) ** 2).mean(axis=-1, keepdims=True, dtype=np.float32)
    return bf16(x * (np.float32(1) / np.sqrt(ms + np.float32(eps))) * w)


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def test_bf16_helper_matches_torch_cast():
    x = torch.randn(4096) * 100
    assert np.array_equal(bf16(x.numpy()), x.to(torch.bfloat16).float().numpy())


def test_rms_norm_rounds_once_after_weight():
    x, w = randn(7, 96), randn(96, seed=1)
    ours = numerics.rms_norm(x, w, 1e-6)
    ref = np_rms_norm(f32(x), f32(w), 1e-6)
    # rsqrt vs 1/sqrt may differ by an FP32 ulp before the single rounding
    assert np.mean(f32(ours) == ref) > 0.99
    assert np.allclose(f32(ours), ref, rtol=2**-7)


@pytest.mark.parametrize("rows,n", [(2048, 5120), (4096, 128), (64, 6144)])
def test_sum_of_squares_is_order_free(rows, n):
    """numerics.sum_of_squares gives the same FP32 bits whatever order its FP64 sum runs in (columns
    reversed, permuted, summed in 40 partial sums as a split kernel would); an FP32 sum does not."""
    torch.manual_seed(rows + n)
    x = (torch.randn(rows, n) * torch.rand(rows, 1) * 4).to(torch.bfloat16).float()
    ref = numerics.sum_of_squares(x)
    perm = torch.randperm(n)
    assert torch.equal(numerics.sum_of_squares(x.flip(-1)), ref)
    assert torch.equal(numerics.sum_of_squares(x[:, perm]), ref)
    sq = (x * x).double()
    split = torch.stack([c.sum(-1) for c in sq.tensor_split(40, dim=-1)], -1).sum(-1, keepdim=True).float()
    assert torch.equal(split, ref)
    fp32_orders = (x * x).sum(-1, keepdim=True) != (x[:, perm] * x[:, perm]).sum(-1, keepdim=True)
    assert bool(fp32_orders.any()), "an FP32 sum should depend on the order (else this test shows nothing)"


def test_sum_of_squares_is_the_correctly_rounded_sum():
    """FP32 squares summed in FP64 and rounded once: equal to the exact sum (math.fsum) rounded to FP32."""
    x = randn(64, 5120, seed=4).float() * 3
    ours = numerics.sum_of_squares(x)[:, 0].numpy()
    squares = (x * x).double().numpy()
    exact = np.array([math.fsum(row) for row in squares], dtype=np.float64).astype(np.float32)
    assert np.array_equal(ours, exact)


@pytest.mark.parametrize("n", [2, 3, 8, 105])
def test_boundary_rounding_points(n):
    x, h, wp, wn = randn(5, 64), randn(5, 64, seed=1), randn(64, seed=2), randn(64, seed=3)
    new_h, nxt = numerics.sublayer_boundary(x, h, wp, wn, n, 1e-6)
    r_scale, x_scale = np.float32(math.sqrt((n - 1) / n)), np.float32(1 / math.sqrt(n))
    y = f32(numerics.rms_norm(x, wp, 1e-6))
    expect_h = bf16(bf16(y * x_scale) + bf16(f32(h) * r_scale))
    assert np.array_equal(f32(new_h), expect_h)
    assert torch.equal(nxt, numerics.rms_norm(new_h, wn, 1e-6))
    # rounding the three products once at the end instead would give different bits somewhere
    unrounded = bf16(y * x_scale + f32(h) * r_scale)
    assert not np.array_equal(unrounded, expect_h)


def test_boundary_without_next_norm():
    h, nxt = numerics.sublayer_boundary(randn(3, 32), randn(3, 32, seed=1), randn(32, seed=2), None, 4, 1e-6)
    assert nxt is None and h.dtype == torch.bfloat16


@pytest.mark.parametrize("depth", [1, 8, 104])
def test_depth_scaled_residual_keeps_unit_variance(depth):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(200_000, generator=g, dtype=torch.float64)  # the embedding, add 1
    for n in range(2, depth + 2):
        r_scale, x_scale = numerics.residual_scales(n)
        assert math.isclose(r_scale**2 + x_scale**2, 1.0)
        h = r_scale * h + x_scale * torch.randn(200_000, generator=g, dtype=torch.float64)
    assert abs(h.var().item() - 1.0) < 0.02


def test_rope_matches_complex_rotation():
    T, H, D, theta = 9, 3, 32, 10000.0
    x, pos = randn(T, H, D), torch.tensor([0, 1, 2, 5, 17, 100, 511, 512, 2047])
    cache = numerics.rope_cos_sin_cache(2048, D, theta)
    ours = f32(numerics.apply_rope(x, pos, cache))
    xf = f32(x).astype(np.float64)
    half = D // 2
    freqs = pos.numpy()[:, None].astype(np.float64) / theta ** (np.arange(0, D, 2) / D)
    z = (xf[..., :half] + 1j * xf[..., half:]) * np.exp(1j * freqs)[:, None, :]
    ref = np.concatenate([z.real, z.imag], axis=-1)
    assert np.allclose(ours, ref, rtol=2**-7, atol=1e-2)
    # exactly: FP32 products of the cached cos/sin, one rounding
    cos, sin = f32(cache[pos][:, :half])[:, None], f32(cache[pos][:, half:])[:, None]
    x1, x2 = f32(x)[..., :half], f32(x)[..., half:]
    exact = bf16(np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1))
    assert np.array_equal(ours, exact)


def test_ssmax_factor():
    table = numerics.ssmax_scale_cache(10_000)
    for i in [0, 1, 511, 2047, 9999]:
        assert math.isclose(table[i].item(), (1 + (i + 1) / 2048) ** 0.1, rel_tol=2e-7)


def test_qk_norm_then_ssmax_on_q_only():
    T, D = 6, 32
    q, k, wq, wk = randn(T, 4, D), randn(T, 2, D, seed=1), randn(D, seed=2), randn(D, seed=3)
    pos = torch.arange(100, 100 + T)
    qo, ko = numerics.qk_norm_rope_ssmax(q, k, wq, wk, pos, 1e-6, None, numerics.ssmax_scale_cache(200))
    qn = np_rms_norm(f32(q), f32(wq), 1e-6)
    factor = ((1 + (pos.numpy() + 1) / 2048) ** 0.1).astype(np.float32)[:, None, None]
    assert np.allclose(f32(qo), bf16(qn * factor), rtol=2**-8)
    assert torch.equal(ko, numerics.rms_norm(k, wk, 1e-6))
    with pytest.raises(ValueError, match="exactly one"):
        numerics.qk_norm_rope_ssmax(q, k, wq, wk, pos, 1e-6, None, None)


def test_output_gate_rounding_points():
    a, g, b = randn(5, 4, 32), randn(5, 4, 32, seed=1), randn(4, seed=2)
    out = numerics.output_gate(a, g, b)
    gg = bf16(f32(g) + f32(b)[:, None])
    s = bf16((1 / (1 + np.exp(-gg.astype(np.float64)))).astype(np.float32))
    assert np.array_equal(f32(out), bf16(f32(a) * s))


def test_silu_and_mul_rounds_only_the_product():
    g, u = randn(7, 64), randn(7, 64, seed=1)
    gf, uf = f32(g).astype(np.float64), f32(u).astype(np.float64)
    ref = bf16((gf / (1 + np.exp(-gf)) * uf).astype(np.float32))
    assert np.mean(f32(numerics.silu_and_mul(g, u)) == ref) > 0.99


def test_attention_window_against_loop():
    Tq, H, KV, D, W = 20, 4, 2, 32, 5
    q, k, v = randn(Tq, H, D), randn(Tq, KV, D, seed=1), randn(Tq, KV, D, seed=2)
    pos = torch.arange(Tq)
    for window in (None, W):
        out = f32(numerics.attention(q, k, v, pos, pos, window))
        for i in range(Tq):
            lo = 0 if window is None else max(0, i - window + 1)
            for h in range(H):
                kh = f32(k)[lo : i + 1, h // (H // KV)].astype(np.float64)
                vh = f32(v)[lo : i + 1, h // (H // KV)].astype(np.float64)
                s = kh @ f32(q)[i, h].astype(np.float64) / math.sqrt(D)
                p = np.exp(s - s.max())
                ref = bf16(((p / p.sum()) @ vh).astype(np.float32))
                assert np.allclose(out[i, h], ref, rtol=2**-7, atol=1e-6), (window, i, h)


def test_round_toward_zero_drops_the_low_bits():
    """FP32 -> BF16 toward zero: the BF16 neighbour nearer zero (|result| <= |x|, less than one BF16
    ulp away), exact on BF16 values, and a cast for FP32 outputs; other rounding modes and dtypes
    are refused by name."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 10
    x[:4] = torch.tensor([0.0, -0.0, 1.0 + 2**-7, -(1.0 + 2**-7)])  # BF16 values: unchanged
    t = numerics.round_to(x, torch.bfloat16, "toward_zero").float()
    nearest = numerics.round_to(x, torch.bfloat16, "nearest").float()
    assert t.dtype == torch.float32 and torch.equal(t[:4], x[:4])
    assert bool((t.abs() <= x.abs()).all()) and bool((torch.sign(t) * torch.sign(x) >= 0).all())
    assert bool(((x - t).abs() < x.abs() * 2**-7 + 1e-30).all())  # within one ulp (7 stored mantissa bits)
    assert np.array_equal(f32(t), (f32(x).view(np.uint32) & 0xFFFF0000).view(np.float32))
    assert 0.3 < (t != nearest).float().mean().item() < 0.7  # about half of random values round up
    assert torch.equal(numerics.round_to(x, torch.float32, "toward_zero"), x)
    with pytest.raises(ValueError, match="rounding='up'"):
        numerics.round_to(x, torch.bfloat16, "up")
    with pytest.raises(ValueError, match="rounding='up'"):
        numerics.round_to(x, torch.float32, "up")  # named even where the cast would be a no-op
    with pytest.raises(ValueError, match="BF16 outputs"):
        numerics.round_to(x, torch.float16, "toward_zero")


def test_attention_numerics_names_the_bad_field():
    with pytest.raises(ValueError, match="output_rounding='truncate'"):
        numerics.AttentionNumerics(output_rounding="truncate")
    with pytest.raises(ValueError, match="probs='fp8'"):
        numerics.AttentionNumerics(probs="fp8")
    assert str(numerics.AttentionNumerics()) == "probs=exact, output_rounding=nearest"


def test_attention_output_toward_zero_is_the_truncated_fp64_result():
    Tq, H, KV, D = 12, 4, 2, 32
    q, k, v = randn(Tq, H, D), randn(Tq, KV, D, seed=1), randn(Tq, KV, D, seed=2)
    pos = torch.arange(Tq)
    scores = numerics.attention_scores(q, k, pos, pos, None)
    exact = numerics.attention_values(torch.softmax(scores, -1), v.double()).float()  # FP64 sum, FP32 value
    out = numerics.attention(q, k, v, pos, pos, None, numerics.AttentionNumerics(output_rounding="toward_zero"))
    assert out.dtype == torch.bfloat16
    assert np.array_equal(f32(out), (f32(exact).view(np.uint32) & 0xFFFF0000).view(np.float32))


def test_moe_combine_in_fp32():
    y, w = randn(4, 3, 16), torch.rand(4, 3)
    ref = bf16(sum(f32(w)[:, j, None] * f32(y)[:, j] for j in range(3)).astype(np.float32))
    assert np.allclose(f32(numerics.moe_combine(y, w)), ref, rtol=2**-8)


def test_softcap():
    x = torch.tensor([-1000.0, -3.0, 0.0, 3.0, 1000.0])
    assert torch.allclose(numerics.softcap(x, 30.0), 30.0 * torch.tanh(x / 30.0))
    assert torch.equal(numerics.softcap(x, None), x)

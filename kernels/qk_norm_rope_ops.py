"""Q/K per-head RMSNorm + RoPE (sliding layers) or SSMax (NoPE layers), optionally writing K and V into
vLLM's paged KV cache, in one Triton kernel (one program per token).

Rounding as `numerics.qk_norm_rope_ssmax`: norm rounded after the weight multiply, then RoPE (neox) or
the SSMax factor in FP32 (cos/sin and the factor read from the FP32 tables, never recomputed), rounded
once. q/k/v may be strided views of the packed projection output (unit stride inside a head).
"""

import torch

from beam_rl.model import numerics

from ._triton_compat import LAUNCH_OPTS, tl, triton, use_triton
from .boundary_ops import inv_rms, sumsq

_NORM, _ROPE, _SSMAX = 0, 1, 2
# Q heads per block: a head count that is not a power of two (Beam-1.0's 48) is covered by blocks of 16 rather
# than padded to 64, whose idle lanes would still issue their share of the loads, conversions and arithmetic.
Q_HEAD_BLOCK = 16
# A token's Q heads come in at most this many blocks (wider blocks for more heads): the kernel issues every
# block's loads before the first block's reduction (`_qk_norm_rope_kernel`), so all of them are held at once.
MAX_Q_BLOCKS = 4


@triton.jit
def _load_heads(src, stride_h, nh, half, NP: tl.constexpr, HALF_P: tl.constexpr):
    """NP heads' two halves as stored (heads from nh on masked to 0)."""
    h = tl.arange(0, NP)[:, None]
    d = tl.arange(0, HALF_P)[None, :]
    m = (h < nh) & (d < half)
    return tl.load(src + h * stride_h + d, mask=m, other=0.0), tl.load(src + h * stride_h + half + d, mask=m, other=0.0)


@triton.jit
def _normalize_rotate(x1, x2, nh, w_ptr, cs_row, scale, dst, dst_stride_h, half, factor, eps,
                      NP: tl.constexpr, HALF_P: tl.constexpr, MODE: tl.constexpr):
    """RMSNorm NP heads (their halves x1, x2 from `_load_heads`) and apply MODE (0 norm, 1 RoPE, 2 SSMax);
    store; return both halves. Sum of squares as `numerics.sum_of_squares` (FP64)."""
    h = tl.arange(0, NP)[:, None]
    d = tl.arange(0, HALF_P)[None, :]
    dm = d < half
    m = (h < nh) & dm
    dt = dst.dtype.element_ty
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    ss = sumsq(x1) + sumsq(x2)
    inv2 = inv_rms(ss, factor, eps)
    w1 = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + d, mask=dm, other=0.0).to(tl.float32)
    y1 = ((x1 * inv2) * w1).to(dt)
    y2 = ((x2 * inv2) * w2).to(dt)
    if MODE == 1:
        c = tl.load(cs_row + d, mask=dm, other=0.0)
        s = tl.load(cs_row + half + d, mask=dm, other=0.0)
        f1 = y1.to(tl.float32)
        f2 = y2.to(tl.float32)
        o1 = (f1 * c - f2 * s).to(dt)
        o2 = (f2 * c + f1 * s).to(dt)
    elif MODE == 2:
        o1 = (y1.to(tl.float32) * scale).to(dt)
        o2 = (y2.to(tl.float32) * scale).to(dt)
    else:
        o1 = y1
        o2 = y2
    tl.store(dst + h * dst_stride_h + d, o1, mask=m)
    tl.store(dst + h * dst_stride_h + half + d, o2, mask=m)
    return o1, o2


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, ssmax_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_kot,
    stride_koh, stride_cs, stride_cb, stride_co, stride_ch, block_size, H, KV, D, eps, factor,
    ROPE: tl.constexpr, QMODE: tl.constexpr, KMODE: tl.constexpr, WRITE_CACHE: tl.constexpr, QB: tl.constexpr,
    NQB: tl.constexpr, KVP: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    half = D // 2
    cs_row = cs_ptr + pos * stride_cs
    if ROPE:
        scale = 1.0
    else:
        scale = tl.load(ssmax_ptr + pos)
    q_src = q_ptr + t * stride_qt
    q_dst = qo_ptr + t * stride_qot
    # Every block's loads (and V's) are issued before the first reduction, so the token's whole 14 KiB
    # (Beam-1.0) is in flight at once (the kernel is latency-bound: loads issued after a block's reduction
    # would wait for it).
    q_blocks = ()
    for b in tl.static_range(NQB):
        q_blocks = q_blocks + (_load_heads(q_src + b * QB * stride_qh, stride_qh, H - b * QB, half, QB, HALF_P),)
    kx1, kx2 = _load_heads(k_ptr + t * stride_kt, stride_kh, KV, half, KVP, HALF_P)
    if WRITE_CACHE:
        hv = tl.arange(0, KVP)[:, None]
        dv = tl.arange(0, D_P)[None, :]
        mv = (hv < KV) & (dv < D)
        v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + dv, mask=mv, other=0.0)

    for b in tl.static_range(NQB):
        _normalize_rotate(q_blocks[b][0], q_blocks[b][1], H - b * QB, qw_ptr, cs_row, scale, q_dst + b * QB * stride_qoh,
                          stride_qoh, half, factor, eps, QB, HALF_P, QMODE)
    k1, k2 = _normalize_rotate(kx1, kx2, KV, kw_ptr, cs_row, scale, ko_ptr + t * stride_kot, stride_koh, half, factor,
                               eps, KVP, HALF_P, KMODE)

    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t)
        safe = tl.maximum(slot, 0)
        base = (safe // block_size) * stride_cb + (safe % block_size) * stride_co
        h = tl.arange(0, KVP)[:, None]
        d = tl.arange(0, HALF_P)[None, :]
        ok = (h * 0 + slot) >= 0  # [KVP, 1]; slot -1 skips the token
        m = (h < KV) & (d < half) & ok
        tl.store(kc_ptr + base + h * stride_ch + d, k1, mask=m)
        tl.store(kc_ptr + base + h * stride_ch + half + d, k2, mask=m)
        tl.store(vc_ptr + base + hv * stride_ch + dv, v, mask=mv & ok)


def q_head_block(num_heads: int) -> int:
    """Q heads per block: Q_HEAD_BLOCK, or wider so a token needs at most MAX_Q_BLOCKS blocks."""
    return min(triton.next_power_of_2(num_heads),
               max(Q_HEAD_BLOCK, triton.next_power_of_2(triton.cdiv(num_heads, MAX_Q_BLOCKS))))


def _check_heads(x: torch.Tensor, name: str, tokens: int, head_dim: int) -> None:
    assert x.dim() == 3 and x.shape[0] == tokens and x.shape[2] == head_dim, f"{name} must be [T, heads, {head_dim}]"
    assert x.stride(2) == 1, f"{name} must have unit stride inside a head"


def qk_norm_rope_ssmax_triton(q, k, q_norm_weight, k_norm_weight, positions, eps, cos_sin_cache=None,
                              ssmax_cache=None, *, v=None, kv_cache=None, slot_mapping=None, q_out=None, k_out=None,
                              num_warps=None):
    """Q/K RMSNorm (FP64 sum of squares) then RoPE or SSMax in FP32, rounded once; bit-exact to the reference.

    With `kv_cache` [2, blocks, block_size, KV, D] and `slot_mapping` [T] (slot = block * block_size +
    offset, -1 = skip) also writes the rotated K and the given V there."""
    if (cos_sin_cache is None) == (ssmax_cache is None):
        raise ValueError("pass exactly one of cos_sin_cache (RoPE layer) or ssmax_cache (NoPE layer)")
    tokens, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    _check_heads(q, "q", tokens, head_dim)
    _check_heads(k, "k", tokens, head_dim)
    assert k.dtype == q.dtype and head_dim % 2 == 0
    assert q_norm_weight.shape == (head_dim,) and k_norm_weight.shape == (head_dim,)
    assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    assert positions.shape == (tokens,) and positions.is_contiguous()
    rope = cos_sin_cache is not None
    if rope:
        assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == head_dim
        assert cos_sin_cache.stride(1) == 1
    else:
        assert ssmax_cache.dtype == torch.float32 and ssmax_cache.dim() == 1 and ssmax_cache.is_contiguous()
    write_cache = kv_cache is not None
    if write_cache:
        assert v is not None and slot_mapping is not None, "writing the KV cache needs v and slot_mapping"
        _check_heads(v, "v", tokens, head_dim)
        assert v.shape[1] == num_kv and kv_cache.dtype == k.dtype, "kv_cache must have k's dtype (no FP8 path)"
        assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (num_kv, head_dim)
        assert kv_cache.stride(4) == 1 and slot_mapping.shape == (tokens,) and slot_mapping.is_contiguous()
    if q_out is None:
        q_out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty((tokens, num_kv, head_dim), dtype=k.dtype, device=k.device)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.stride(2) == 1 and k_out.stride(2) == 1
    if tokens == 0:
        return q_out, k_out
    table = cos_sin_cache if rope else ssmax_cache
    kc = kv_cache[0] if write_cache else k_out
    vc = kv_cache[1] if write_cache else k_out
    cstr = kc.stride() if write_cache else (0, 0, 0, 0)
    vv = v if write_cache else k
    qb = q_head_block(num_heads)
    if num_warps is None:  # `bench_kernels.py --tune`: latency-bound up to 64 tokens, 4 warps a token above
        num_warps = (4 if triton.next_power_of_2(num_heads) * head_dim <= 4096 else 8) if tokens <= 64 else 4
    _qk_norm_rope_kernel[(tokens,)](
        q, k, vv, q_norm_weight, k_norm_weight, positions, table, table, q_out, k_out, kc, vc,
        slot_mapping if write_cache else positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0) if rope else 0, cstr[0], cstr[1], cstr[2],
        kv_cache.shape[2] if write_cache else 1, num_heads, num_kv, head_dim, eps, numerics.mean_factor(head_dim),
        ROPE=rope, QMODE=_ROPE if rope else _SSMAX, KMODE=_ROPE if rope else _NORM, WRITE_CACHE=write_cache, QB=qb, NQB=triton.cdiv(num_heads, qb), KVP=triton.next_power_of_2(num_kv),
        HALF_P=triton.next_power_of_2(head_dim // 2), D_P=triton.next_power_of_2(head_dim),
        num_warps=num_warps, **LAUNCH_OPTS)
    return q_out, k_out


def write_kv_cache_reference(kv_cache, slot_mapping, k, v) -> None:
    """Plain index assignment of k, v [T, KV, D] into kv_cache [2, blocks, block_size, KV, D]; slot -1 skips."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = kv_cache.shape[2]
    blk, off = slots // block_size, slots % block_size
    kv_cache[0][blk, off] = k[valid]
    kv_cache[1][blk, off] = v[valid]


def qk_norm_rope_ssmax(q, k, q_norm_weight, k_norm_weight, positions, eps, cos_sin_cache=None, ssmax_cache=None,
                       *, v=None, kv_cache=None, slot_mapping=None):
    """Dispatch: Triton on CUDA, `numerics.qk_norm_rope_ssmax` (+ index-assignment cache write) elsewhere."""
    if use_triton(q, k):
        return qk_norm_rope_ssmax_triton(q, k, q_norm_weight, k_norm_weight, positions, eps, cos_sin_cache,
                                         ssmax_cache, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    q_out, k_out = numerics.qk_norm_rope_ssmax(q, k, q_norm_weight, k_norm_weight, positions, eps, cos_sin_cache,
                                               ssmax_cache)
    if kv_cache is not None:
        write_kv_cache_reference(kv_cache, slot_mapping, k_out, v)
    return q_out, k_out

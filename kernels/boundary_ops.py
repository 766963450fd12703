"""Sublayer boundary: post-norm -> depth-scaled residual add -> next pre-norm, one Triton kernel per call.

The first boundary (the embedding's pre-norm) is `rms_norm`; the last passes the final norm's weight
as `next_norm_weight`; `next_norm_weight=None` stops after the residual add. All FP32 sums of squares
follow ATen's CUDA order (`reduce_order`), so the BF16 outputs equal `beam_rl.numerics` bit for bit.
"""


import torch

from beam_rl import numerics

from ._triton_compat import LAUNCH_OPTS, libdevice, tl, triton, use_triton
from .reduce_order import _block_x_tree, _combine4, _sumsq_cuda_order, _tile_offsets, cuda_sum_config, mean_factor


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, num_rows, n, stride_x, stride_o, eps, factor,
                     ROWS: tl.constexpr, BW: tl.constexpr, VEC: tl.constexpr, ITERS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    row_ok = r < num_rows
    ss = _sumsq_cuda_order(x_ptr, r * stride_x, row_ok, n, ROWS, BW, VEC, ITERS)
    inv = libdevice.rsqrt(ss * factor + eps)[:, None, None]
    off = _tile_offsets(BW, VEC)
    for i in range(ITERS):
        e = i * 4 * BW + off
        m = row_ok & (e < n)
        x = tl.load(x_ptr + r * stride_x + e, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e, mask=e < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * stride_o + e, ((x * inv) * w).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _boundary_kernel(x_ptr, h_ptr, wpost_ptr, wnext_ptr, hout_ptr, nout_ptr, num_rows, n,
                     stride_x, stride_h, stride_ho, stride_no, eps, factor, x_scale, r_scale,
                     HAS_NEXT: tl.constexpr, ROWS: tl.constexpr, BW: tl.constexpr, VEC: tl.constexpr,
                     ITERS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    row_ok = r < num_rows
    dt = hout_ptr.dtype.element_ty
    ss = _sumsq_cuda_order(x_ptr, r * stride_x, row_ok, n, ROWS, BW, VEC, ITERS)
    inv = libdevice.rsqrt(ss * factor + eps)[:, None, None]
    off = _tile_offsets(BW, VEC)
    acc = tl.zeros([ROWS, BW, 4], dtype=tl.float32)
    for i in range(ITERS):
        e = i * 4 * BW + off
        m = row_ok & (e < n)
        x = tl.load(x_ptr + r * stride_x + e, mask=m, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + r * stride_h + e, mask=m, other=0.0).to(tl.float32)
        w = tl.load(wpost_ptr + e, mask=e < n, other=0.0).to(tl.float32)
        y = ((x * inv) * w).to(dt).to(tl.float32)
        a = (y * x_scale).to(dt).to(tl.float32)
        b = (h * r_scale).to(dt).to(tl.float32)
        hn = (a + b).to(dt)
        tl.store(hout_ptr + r * stride_ho + e, hn, mask=m)
        if HAS_NEXT:
            hf = hn.to(tl.float32)
            acc += hf * hf
    if HAS_NEXT:
        # The same tile walk is ATen's thread loop, so acc already holds its per-thread accumulators.
        ss2 = _block_x_tree(_combine4(acc, ROWS, BW), ROWS, BW)
        inv2 = libdevice.rsqrt(ss2 * factor + eps)[:, None, None]
        tl.debug_barrier()  # h' rows written above are read back by other threads of this program
        for i in range(ITERS):
            e = i * 4 * BW + off
            m = row_ok & (e < n)
            h = tl.load(hout_ptr + r * stride_ho + e, mask=m, other=0.0).to(tl.float32)
            w = tl.load(wnext_ptr + e, mask=e < n, other=0.0).to(tl.float32)
            tl.store(nout_ptr + r * stride_no + e, ((h * inv2) * w).to(nout_ptr.dtype.element_ty), mask=m)


def _rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    assert t.shape[-1] == n, f"last dim {t.shape[-1]} != {n}"
    assert t.stride(-1) == 1, "the hidden dim must be contiguous"
    if t.dim() == 2:
        return t
    assert t.is_contiguous(), "tensors with more than 2 dims must be contiguous"
    return t.view(-1, n)


def _launch_shape(num_rows: int, bw: int) -> tuple[int, int]:
    """(rows per program, warps): one warp row per reduction like ATen; pack rows when there are many."""
    if bw >= 64:
        return 1, min(16, bw // 32)
    return (4, 4) if num_rows >= 4096 else (1, 1)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out=None, launch=None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w in FP32 (ATen's CUDA sum order), rounded once to x.dtype."""
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), f"weight must be [{n}] contiguous"
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    if x.numel() == 0:
        return out
    x2, o2 = _rows_view(x, n), out.view(-1, n)
    num_rows = x2.shape[0]
    vec, bw, iters = cuda_sum_config(n, num_rows)
    rows, warps = launch or _launch_shape(num_rows, bw)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x2, weight, o2, num_rows, n, x2.stride(0), o2.stride(0), eps, mean_factor(n),
        ROWS=rows, BW=bw, VEC=vec, ITERS=iters, num_warps=warps, **LAUNCH_OPTS)
    return out


def sublayer_boundary_triton(sublayer_out, residual, post_norm_weight, next_norm_weight, add_index, eps, *,
                             out=None, launch=None):
    """Post-norm, depth-scaled residual add, next pre-norm (numerics.sublayer_boundary's rounding, bit-exact)."""
    n = residual.shape[-1]
    assert sublayer_out.shape == residual.shape, f"{tuple(sublayer_out.shape)} vs {tuple(residual.shape)}"
    assert sublayer_out.dtype == residual.dtype, "sublayer output and residual must share a dtype"
    assert post_norm_weight.shape == (n,) and post_norm_weight.is_contiguous()
    has_next = next_norm_weight is not None
    if has_next:
        assert next_norm_weight.shape == (n,) and next_norm_weight.is_contiguous()
    r_scale, x_scale = numerics.residual_scales(add_index)
    if out is None:
        h_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
        nxt = torch.empty_like(h_out) if has_next else None
    else:  # preallocated (residual', next_input)
        h_out, nxt = out
        assert h_out.shape == residual.shape and h_out.dtype == residual.dtype and h_out.is_contiguous()
        assert (nxt is not None) == has_next and (nxt is None or (nxt.shape == h_out.shape and nxt.is_contiguous()))
    if residual.numel() == 0:
        return h_out, nxt
    x2, h2, ho2 = _rows_view(sublayer_out, n), _rows_view(residual, n), h_out.view(-1, n)
    no2 = nxt.view(-1, n) if has_next else ho2
    num_rows = x2.shape[0]
    vec, bw, iters = cuda_sum_config(n, num_rows)
    rows, warps = launch or _launch_shape(num_rows, bw)
    _boundary_kernel[(triton.cdiv(num_rows, rows),)](
        x2, h2, post_norm_weight, next_norm_weight if has_next else post_norm_weight, ho2, no2, num_rows, n,
        x2.stride(0), h2.stride(0), ho2.stride(0), no2.stride(0), eps, mean_factor(n), x_scale, r_scale,
        HAS_NEXT=has_next, ROWS=rows, BW=bw, VEC=vec, ITERS=iters, num_warps=warps, **LAUNCH_OPTS)
    return h_out, nxt


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch: Triton on CUDA, `numerics.rms_norm` elsewhere (also the first boundary: the embedding's norm)."""
    if use_triton(x, weight):
        return rms_norm_triton(x, weight, eps)
    return numerics.rms_norm(x, weight, eps)


def sublayer_boundary(sublayer_out, residual, post_norm_weight, next_norm_weight, add_index, eps):
    """Dispatch: Triton on CUDA, `numerics.sublayer_boundary` elsewhere; returns (residual', next_input)."""
    if use_triton(sublayer_out, residual, post_norm_weight, next_norm_weight):
        return sublayer_boundary_triton(sublayer_out, residual, post_norm_weight, next_norm_weight, add_index, eps)
    return numerics.sublayer_boundary(sublayer_out, residual, post_norm_weight, next_norm_weight, add_index, eps)

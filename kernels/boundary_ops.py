"""Sublayer boundary: post-norm -> depth-scaled residual add -> next pre-norm, one Triton kernel per call.

The first boundary (the embedding's pre-norm) is `rms_norm`; the last passes the final norm's weight
as `next_norm_weight`; `next_norm_weight=None` stops after the residual add. Each program holds its
rows in registers or walks them in chunks (see `launch_shape`); every output is written once. Sums of squares follow
`numerics.sum_of_squares` (FP32 squares, FP64 sum in any order, rounded once), so the BF16 outputs
equal `beam_rl.model.numerics` bit for bit.
"""


import torch

from beam_rl.model import numerics

from ._triton_compat import LAUNCH_OPTS, libdevice, tl, triton, use_triton


@triton.jit
def inv_rms(ss, factor, eps):
    """rsqrt(fl32(ss) * factor + eps): `numerics.rms_norm`'s scale from an FP64 sum of squares ss."""
    return libdevice.rsqrt(ss.to(tl.float32) * factor + eps)


@triton.jit
def sumsq(x):
    """FP64 sum of each row's squares of FP32 x [ROWS, C] -> [ROWS, 1] (`numerics.sum_of_squares`: FP32
    squares, exact for BF16 x, converted to FP64)."""
    return tl.sum((x * x).to(tl.float64), axis=1, keep_dims=True)


@triton.jit
def _inv_rms_walk(ptr, r, row_ok, stride, n, factor, eps, ROWS: tl.constexpr, NCHUNK: tl.constexpr,
                  CHUNK: tl.constexpr):
    """`inv_rms` of rows r [ROWS, 1] of ptr, walked in NCHUNK chunks (FP64 lane sums, then a tree)."""
    acc = tl.zeros([ROWS, CHUNK], dtype=tl.float64)
    for ci in tl.static_range(NCHUNK):
        c = ci * CHUNK + tl.arange(0, CHUNK)[None, :]
        x = tl.load(ptr + r * stride + c, mask=row_ok & (c < n), other=0.0).to(tl.float32)
        acc += (x * x).to(tl.float64)
    return inv_rms(tl.sum(acc, axis=1, keep_dims=True), factor, eps)


@triton.jit
def _load_f32(ptr, off, m):
    return tl.load(ptr + off, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _whole_row(ptr, r, row_ok, stride, n, CHUNK: tl.constexpr, TAIL: tl.constexpr):
    """Loads of rows r of ptr, as stored, for holding them in registers: columns c [0, CHUNK) and, if TAIL,
    ct [CHUNK, CHUNK + TAIL) (without a tail, ct/mt/xt repeat the head and go unused): (c, m, x, ct, mt, xt).
    Callers issue every load they need before their first reduction (see `_boundary_kernel`)."""
    c = tl.arange(0, CHUNK)[None, :]
    m = row_ok & (c < n)
    x = tl.load(ptr + r * stride + c, mask=m, other=0.0)
    if TAIL > 0:
        ct = CHUNK + tl.arange(0, TAIL)[None, :]
        mt = row_ok & (ct < n)
        xt = tl.load(ptr + r * stride + ct, mask=mt, other=0.0)
    else:
        ct, mt, xt = c, m, x
    return c, m, x, ct, mt, xt


@triton.jit
def _row_sumsq(x, xt, TAIL: tl.constexpr):
    """FP64 sum of squares of a row held as head x and (if TAIL) tail xt."""
    if TAIL > 0:
        return sumsq(x) + sumsq(xt)
    else:
        return sumsq(x)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, num_rows, n, stride_x, stride_o, eps, factor,
                     ROWS: tl.constexpr, NCHUNK: tl.constexpr, CHUNK: tl.constexpr, TAIL: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]).to(tl.int64)
    row_ok = r < num_rows
    dt = out_ptr.dtype.element_ty
    if NCHUNK == 1:  # the whole row in registers
        c, m, x, ct, mt, xt = _whole_row(x_ptr, r, row_ok, stride_x, n, CHUNK, TAIL)
        x = x.to(tl.float32)
        xt = xt.to(tl.float32)
        inv = inv_rms(_row_sumsq(x, xt, TAIL), factor, eps)
        tl.store(out_ptr + r * stride_o + c, ((x * inv) * _load_f32(w_ptr, c, c < n)).to(dt), mask=m)
        if TAIL > 0:
            tl.store(out_ptr + r * stride_o + ct, ((xt * inv) * _load_f32(w_ptr, ct, ct < n)).to(dt), mask=mt)
    else:
        inv = _inv_rms_walk(x_ptr, r, row_ok, stride_x, n, factor, eps, ROWS, NCHUNK, CHUNK)
        for ci in tl.static_range(NCHUNK):  # second walk: the row comes from L1/L2, not HBM
            c = ci * CHUNK + tl.arange(0, CHUNK)[None, :]
            m = row_ok & (c < n)
            x = _load_f32(x_ptr, r * stride_x + c, m)
            tl.store(out_ptr + r * stride_o + c, ((x * inv) * _load_f32(w_ptr, c, c < n)).to(dt), mask=m)


@triton.jit
def _residual_add(x, h, w, inv, x_scale, r_scale, dt):
    """h' = round(round(round(postnorm(x)) * x_scale) + round(h * r_scale)) in dt (stored as is; its FP32
    value is an exact unpack, so the kernel never rounds it a second time)."""
    y = ((x * inv) * w).to(dt).to(tl.float32)
    a = (y * x_scale).to(dt).to(tl.float32)
    b = (h * r_scale).to(dt).to(tl.float32)
    return (a + b).to(dt)


@triton.jit
def _boundary_kernel(x_ptr, h_ptr, wpost_ptr, wnext_ptr, hout_ptr, nout_ptr, num_rows, n,
                     stride_x, stride_h, stride_ho, stride_no, eps, factor, x_scale, r_scale,
                     HAS_NEXT: tl.constexpr, ROWS: tl.constexpr, NCHUNK: tl.constexpr, CHUNK: tl.constexpr,
                     TAIL: tl.constexpr):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]).to(tl.int64)
    row_ok = r < num_rows
    dt = hout_ptr.dtype.element_ty
    if NCHUNK == 1:  # the whole row in registers: each input read once
        # all four input loads (h and x, head and tail) are issued before the first reduction and its barrier, so
        # the row's bytes are in flight together (the kernel is latency-bound: a load issued after a reduction
        # waits for it)
        c, m, h, ct, mt, ht = _whole_row(h_ptr, r, row_ok, stride_h, n, CHUNK, TAIL)
        _, _, x, _, _, xt = _whole_row(x_ptr, r, row_ok, stride_x, n, CHUNK, TAIL)
        x = x.to(tl.float32)
        xt = xt.to(tl.float32)
        ss = _row_sumsq(x, xt, TAIL)
        inv = inv_rms(ss, factor, eps)
        hn = _residual_add(x, h.to(tl.float32), _load_f32(wpost_ptr, c, c < n), inv, x_scale, r_scale, dt)
        tl.store(hout_ptr + r * stride_ho + c, hn, mask=m)
        hn = hn.to(tl.float32)
        if TAIL > 0:
            hnt = _residual_add(xt, ht.to(tl.float32), _load_f32(wpost_ptr, ct, ct < n), inv, x_scale, r_scale, dt)
            tl.store(hout_ptr + r * stride_ho + ct, hnt, mask=mt)
            hnt = hnt.to(tl.float32)
        else:
            hnt = hn
        if HAS_NEXT:
            inv2 = inv_rms(_row_sumsq(hn, hnt, TAIL), factor, eps)
            tl.store(nout_ptr + r * stride_no + c, ((hn * inv2) * _load_f32(wnext_ptr, c, c < n)).to(dt), mask=m)
            if TAIL > 0:
                tl.store(nout_ptr + r * stride_no + ct, ((hnt * inv2) * _load_f32(wnext_ptr, ct, ct < n)).to(dt),
                         mask=mt)
    else:  # three walks over the row; the second and third read it from L1/L2
        inv = _inv_rms_walk(x_ptr, r, row_ok, stride_x, n, factor, eps, ROWS, NCHUNK, CHUNK)
        acc = tl.zeros([ROWS, CHUNK], dtype=tl.float64)
        for ci in tl.static_range(NCHUNK):
            c = ci * CHUNK + tl.arange(0, CHUNK)[None, :]
            m = row_ok & (c < n)
            hn = _residual_add(_load_f32(x_ptr, r * stride_x + c, m), _load_f32(h_ptr, r * stride_h + c, m),
                               _load_f32(wpost_ptr, c, c < n), inv, x_scale, r_scale, dt)
            tl.store(hout_ptr + r * stride_ho + c, hn, mask=m)
            hn = hn.to(tl.float32)
            acc += (hn * hn).to(tl.float64)
        if HAS_NEXT:
            inv2 = inv_rms(tl.sum(acc, axis=1, keep_dims=True), factor, eps)
            for ci in tl.static_range(NCHUNK):  # h' recomputed from the cached inputs: same bits, no barrier
                c = ci * CHUNK + tl.arange(0, CHUNK)[None, :]
                m = row_ok & (c < n)
                hn = _residual_add(_load_f32(x_ptr, r * stride_x + c, m), _load_f32(h_ptr, r * stride_h + c, m),
                                   _load_f32(wpost_ptr, c, c < n), inv, x_scale, r_scale, dt).to(tl.float32)
                out = (hn * inv2) * _load_f32(wnext_ptr, c, c < n)
                tl.store(nout_ptr + r * stride_no + c, out.to(dt), mask=m)


def _rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    assert t.shape[-1] == n, f"last dim {t.shape[-1]} != {n}"
    assert t.stride(-1) == 1, "the hidden dim must be contiguous"
    if t.dim() == 2:
        return t
    assert t.is_contiguous(), "tensors with more than 2 dims must be contiguous"
    return t.view(-1, n)


def launch_shape(num_rows: int, n: int, kind: str = "boundary") -> tuple[int, int, int, int]:
    """(rows per program, warps, chunk, tail) for rows of n elements, from `bench_kernels.py --tune` (H200).

    chunk + tail >= n holds whole rows in registers (each input read once): one masked power-of-two block
    (tail 0), or a power-of-two head and tail (5120 = 4096 + 1024: no idle lanes, but each norm reduces
    twice). chunk < n walks the row in chunks (later walks read L1/L2; the boundary recomputes its add).
    - decode sizes (<= 64 rows): latency-bound; one masked block over 16 warps;
    - prefill, boundary: head + tail over 4 warps (no spills at 5120): fewer instructions per element
      than the walk, and faster than the walk, than 8 warps and than a persistent loop over the rows;
    - prefill, rms_norm: 1024-element walks over 8 warps (its second walk only re-reads x);
    - rows under 2048 (beam-mini, beam-tiny): several rows per program so each moves a few KiB."""
    block = triton.next_power_of_2(n)
    if block < 2048:
        rows = min(triton.next_power_of_2(num_rows), 2048 // block)
        return rows, max(1, min(8, rows * block // 256)), block, 0
    if num_rows <= 64:
        return 1, 16, block, 0
    if kind == "rms_norm":
        return 1, 8, 1024, 0
    if block > 8192:
        return 1, 4, 1024, 0
    return (1, 4, block, 0) if block == n else (1, 4, block // 2, triton.next_power_of_2(n - block // 2))


def _launch(launch, num_rows: int, n: int, kind: str) -> tuple[int, int, int, int, int]:
    """(rows, warps, chunks, chunk, tail) of a `launch_shape` tuple (or the default)."""
    rows, warps, chunk, tail = launch or launch_shape(num_rows, n, kind)
    assert tail == 0 or (chunk >= n // 2 and chunk + tail >= n), f"a tail completes a whole row: {launch} for {n}"
    if chunk + tail >= n:
        return rows, warps, 1, chunk, tail
    return rows, warps, triton.cdiv(n, chunk), chunk, 0


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out=None, launch=None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w in FP32 (`numerics.rms_norm`'s sum), rounded once to x.dtype."""
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), f"weight must be [{n}] contiguous"
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    if x.numel() == 0:
        return out
    x2, o2 = _rows_view(x, n), out.view(-1, n)
    num_rows = x2.shape[0]
    rows, warps, nchunk, chunk, tail = _launch(launch, num_rows, n, "rms_norm")
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x2, weight, o2, num_rows, n, x2.stride(0), o2.stride(0), eps, numerics.mean_factor(n),
        ROWS=rows, NCHUNK=nchunk, CHUNK=chunk, TAIL=tail, num_warps=warps, **LAUNCH_OPTS)
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
    rows, warps, nchunk, chunk, tail = _launch(launch, num_rows, n, "boundary")
    _boundary_kernel[(triton.cdiv(num_rows, rows),)](
        x2, h2, post_norm_weight, next_norm_weight if has_next else post_norm_weight, ho2, no2, num_rows, n,
        x2.stride(0), h2.stride(0), ho2.stride(0), no2.stride(0), eps, numerics.mean_factor(n), x_scale, r_scale,
        HAS_NEXT=has_next, ROWS=rows, NCHUNK=nchunk, CHUNK=chunk, TAIL=tail, num_warps=warps,
        **LAUNCH_OPTS)
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

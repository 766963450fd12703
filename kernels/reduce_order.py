"""PyTorch's CUDA summation order for an FP32 reduction over a contiguous last dim, emulated.

Used by the router's top-k renormalisation (`w / w.sum(-1)` over the top_k gate weights in
`routing.gate_weights`), which is summed by ATen's `Reduce.cuh` kernel, whose order depends on the
row length N and the number of rows R (the launch configuration is picked from both). A kernel that
sums in any other order can differ from the reference in the last FP32 bit. (The norms do not
need this: `numerics.sum_of_squares` sums in FP64, which is order-free.) The emulated order:

- config (`setReduceConfig`): rows of 128 or more are read as 4-wide vectors (vec=4, dim0 = N/4),
  else element by element (vec=1, dim0 = N); block width bw = min(p2(dim0), 512 / min(p2(R), 512/32))
  (p2 = largest power of two <= x, capped at 512), one warp row per output;
- thread t keeps four accumulators j = 0..3, summing sequentially over i the elements
  vec=4: 4t + 4bw*i + j, vec=1: t + bw*(4i + j); then ((a0 + a1) + a2) + a3;
- block_x_reduce: halving, c[t] += c[t + off] for off = bw/2, bw/4, ..., 1 (shared memory above a
  warp, shuffles inside it); lane 0 holds the sum;
This is torch 2.11's order on an H200 (found by checking candidate orders against `x.pow(2).mean(-1)`
bit for bit; other torch releases may order differently).
Configurations the emulation does not model (a warp split, when N / bw >= 256 or >= 16 * block
height, e.g. N >= 8192; a vector tail, N >= 128 with N % 4 != 0) raise.
"""


import torch

from ._triton_compat import tl, triton

MAX_THREADS = 512
WARP = 32


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def cuda_sum_config(n: int, rows: int) -> tuple[int, int, int]:
    """(vec, block_width, iters) of ATen's CUDA sum over the contiguous last dim of an FP32 [rows, n]."""
    if n <= 0 or rows <= 0:
        raise ValueError(f"empty reduction (n={n}, rows={rows})")
    vec = 4 if n >= 128 else 1
    if vec == 4 and n % 4:
        raise NotImplementedError(f"row length {n} >= 128 is not a multiple of 4: ATen's vector tail is not emulated")
    dim0 = n // vec
    dim0_p2 = _last_pow2(dim0) if dim0 < MAX_THREADS else MAX_THREADS
    dim1_p2 = _last_pow2(rows) if rows < MAX_THREADS else MAX_THREADS
    bw = min(dim0_p2, WARP)
    bh = min(dim1_p2, MAX_THREADS // bw)
    bw = min(dim0_p2, MAX_THREADS // bh)
    values_per_thread = -(-n // bw)
    if values_per_thread >= bh * 16 or values_per_thread >= 256:
        raise NotImplementedError(f"row length {n} with {rows} rows makes ATen split rows across warps; not emulated")
    iters = -(-n // (4 * bw))
    return vec, bw, iters


def cuda_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of FP32 x [R, N] over the last dim in ATen's CUDA order, with plain FP32 adds (any device)."""
    rows, n = x.shape
    vec, bw, iters = cuda_sum_config(n, rows)
    padded = torch.zeros(rows, iters * 4 * bw, dtype=torch.float32, device=x.device)
    padded[:, :n] = x
    if vec == 4:
        tile = padded.view(rows, iters, bw, 4)  # element 4bw*i + 4t + j
    else:
        tile = padded.view(rows, iters, 4, bw).transpose(2, 3)  # element 4bw*i + bw*j + t
    acc = tile[:, 0]
    for i in range(1, iters):
        acc = acc + tile[:, i]
    c = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]  # (R, bw)
    while c.shape[1] > 1:
        half = c.shape[1] // 2
        c = c[:, :half] + c[:, half:]
    return c[:, 0]


@triton.jit
def _combine4(acc, ROWS: tl.constexpr, BW: tl.constexpr):
    """((a0 + a1) + a2) + a3 over the last axis of acc [ROWS, BW, 4] -> [ROWS, BW]."""
    a02, a13 = tl.split(tl.reshape(acc, [ROWS, BW, 2, 2]))  # j = 2a + b: b=0 -> j in {0, 2}
    a0, a2 = tl.split(a02)
    a1, a3 = tl.split(a13)
    return ((a0 + a1) + a2) + a3


@triton.jit
def _block_x_tree(c, ROWS: tl.constexpr, BW: tl.constexpr):
    """ATen's block_x_reduce of c [ROWS, BW] -> [ROWS]: c[t] += c[t + BW/2], halving down to one.

    Each step sums an axis of size 2, which is a single (order-free) FP32 add."""
    if BW >= 512:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 256]), axis=1)
    if BW >= 256:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 128]), axis=1)
    if BW >= 128:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 64]), axis=1)
    if BW >= 64:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 32]), axis=1)
    if BW >= 32:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 16]), axis=1)
    if BW >= 16:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 8]), axis=1)
    if BW >= 8:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 4]), axis=1)
    if BW >= 4:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 2]), axis=1)
    if BW >= 2:
        c = tl.sum(tl.reshape(c, [ROWS, 2, 1]), axis=1)
    return tl.reshape(c, [ROWS])

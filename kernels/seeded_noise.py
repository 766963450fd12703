"""Counter-based exponential noise for seeded sampling: one launch for every seeded row of a batch.

vLLM samples a token as argmax(probs / q) with q ~ Exp(1) per vocabulary entry, and fills q for a
request with its own seed by one `exponential_(generator=...)` call per row per step: at 512
seeded rows that is 512 kernel launches from the host on every decode step. Here a row's noise
is a pure function of (seed, draw index, vocabulary id), so every seeded row is filled by one
launch and the same (seed, index) always gives the same noise, whatever the batch around it.

The generator is SplitMix64: a row's key is mix64(mix64(seed + G) + index + 1), its entry j is
mix64(key + (j + 1) * G) (G the golden-ratio increment, mix64 SplitMix64's finaliser). The top 23
bits b give u = (2b + 1) * 2^-24, exact in FP32 and inside (0, 1), and q = -log(u) in FP32: never
0 or infinite, so no entry is certain to win or lose.

Contract: the integer part (the 23 bits) is identical in the Triton kernel and the PyTorch
reference; q is FP32 `log` of the same u, which the reference run on the same GPU computes
identically (libdevice's logf on both).
"""

from __future__ import annotations

import torch

from ._triton_compat import libdevice, tl, triton, use_triton

GOLDEN = 0x9E3779B97F4A7C15
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
MASK_64 = (1 << 64) - 1
U_BITS = 23


def as_int64(c: int) -> int:
    """c (an unsigned 64-bit integer: a constant, a generator's seed) as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


# --- PyTorch reference ------------------------------------------------------------------------------
# int64 tensors, whose additions and multiplications wrap like uint64 ones; right shifts are masked to
# be logical

def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * as_int64(MIX_1)
    z = (z ^ _shr(z, 27)) * as_int64(MIX_2)
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Each row's stream key, int64 [n], from its seed and draw index (int64 [n] each)."""
    return _mix64(_mix64(seeds + as_int64(GOLDEN)) + indices + 1)


def uniform_bits_reference(seeds: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """The 23 random bits of every (row, vocabulary id), int32 [n, vocab]."""
    keys = row_keys(seeds.long(), indices.long())
    cols = torch.arange(1, vocab + 1, dtype=torch.int64, device=seeds.device) * as_int64(GOLDEN)
    z = _mix64(keys[:, None] + cols[None, :])
    return _shr(z, 64 - U_BITS).int()


def uniform_noise_reference(seeds: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) noise, FP32 [n, vocab]: (2b + 1) * 2^-24 of `uniform_bits_reference`'s b (exact)."""
    bits = uniform_bits_reference(seeds, indices, vocab)
    return (2 * bits + 1).float() * 2.0 ** -(U_BITS + 1)


def exponential_noise_reference(seeds: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise, FP32 [n, vocab]: -log(u) of `uniform_noise_reference`'s u."""
    return -torch.log(uniform_noise_reference(seeds, indices, vocab))


# --- Triton ----------------------------------------------------------------------------------------

@triton.jit
def _mix64_u(z, M1: tl.constexpr, M2: tl.constexpr):
    z = (z ^ (z >> 30)) * M1
    z = (z ^ (z >> 27)) * M2
    return z ^ (z >> 31)


@triton.jit
def _counter_noise_kernel(q_ptr, rows_ptr, seeds_ptr, indices_ptr, V, stride_q, BLOCK: tl.constexpr,
                          G: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, BITS: tl.constexpr,
                          EXPONENTIAL: tl.constexpr):
    # grid (vocabulary blocks, seeded rows); the constants arrive as constexprs above 2^63, so Triton types
    # them uint64, and uint64 arithmetic wraps and shifts logically
    r = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    seed = tl.load(seeds_ptr + r).to(tl.uint64, bitcast=True)
    index = tl.load(indices_ptr + r).to(tl.uint64, bitcast=True)
    key = _mix64_u(_mix64_u(seed + G, M1, M2) + index + 1, M1, M2)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < V
    z = _mix64_u(key + (j.to(tl.uint64) + 1) * G, M1, M2)
    bits = (z >> (64 - BITS)).to(tl.int32)
    u = (2 * bits + 1).to(tl.float32) * (0.5 ** (BITS + 1))
    if EXPONENTIAL:
        u = -libdevice.log(u)
    tl.store(q_ptr + row * stride_q + j, u, mask=m)


def fill_exponential_noise_(q: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor,
                            indices: torch.Tensor) -> torch.Tensor:
    """Overwrite q[rows[i]] (FP32 [batch, vocab], rows contiguous) with the Exp(1) noise of (seeds[i],
    indices[i]) (int64 [n] each, on q's device): one Triton launch on CUDA, the reference elsewhere."""
    return _fill(q, rows, seeds, indices, exponential=True)


def fill_uniform_noise_(u: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor,
                        indices: torch.Tensor) -> torch.Tensor:
    """`fill_exponential_noise_`'s u before the log: U(0, 1) noise, never 0 or 1, into u[rows[i]]."""
    return _fill(u, rows, seeds, indices, exponential=False)


def _fill(q: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, indices: torch.Tensor, *,
          exponential: bool) -> torch.Tensor:
    if q.dtype != torch.float32 or q.dim() != 2 or q.stride(1) != 1:
        raise ValueError(f"q: a [batch, vocab] FP32 tensor with contiguous rows expected, got {q.dtype} {tuple(q.shape)}")
    if not (rows.shape == seeds.shape == indices.shape) or rows.dim() != 1:
        raise ValueError(f"rows, seeds, indices: one entry per seeded row each, got {tuple(rows.shape)}, "
                         f"{tuple(seeds.shape)}, {tuple(indices.shape)}")
    n, vocab = rows.numel(), q.shape[1]
    if n == 0:
        return q
    if use_triton(q, rows, seeds, indices):
        block = min(2048, triton.next_power_of_2(vocab))
        _counter_noise_kernel[(triton.cdiv(vocab, block), n)](
            q, rows, seeds, indices, vocab, q.stride(0), BLOCK=block, G=GOLDEN, M1=MIX_1, M2=MIX_2, BITS=U_BITS,
            EXPONENTIAL=exponential, num_warps=4)
        return q
    reference = exponential_noise_reference if exponential else uniform_noise_reference
    q[rows] = reference(seeds, indices, vocab)
    return q

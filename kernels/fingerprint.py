"""Tensor fingerprints for weight syncs, every tensor of a sync in one launch on CUDA.

`beam_rl.model.weights.tensor_checksums` defines the fingerprint: per tensor, the sum mod 2**64 of
splitmix64(word_i xor i * golden) over its bytes read as int32 words (int16 or bytes where the size
needs it). Its PyTorch definition (`hashed_word_sums`) runs some fifteen int64 passes over
batch-sized temporaries and one copy per tensor: ~0.14 s for beam-mini's 2.2 GiB in 2093 tensors
on the H200, on each side of every sync. `word_sums` reads each word once: one program per (tensor,
slice) walks its tensor through a table of data pointers and writes one partial sum, and the
partials add up on the host.

Contract: the same integers as `hashed_word_sums` (integer arithmetic wraps mod 2**64 in both, and a
sum mod 2**64 does not depend on the order of its terms). Tensors whose words are not int32 go to
the definition.
"""

from __future__ import annotations

import torch

from beam_rl.model.weights import hashed_word_sums
from beam_rl.model.weights import tensor_checksums as _tensor_checksums

from ._triton_compat import tl, triton, use_triton
from .seeded_noise import GOLDEN, MIX_1, MIX_2, _mix64_u

SLICES = 64
"""Programs per tensor: a slice of BLOCK-word blocks each, strided (the largest beam-mini tensor,
the embedding, has 16M words: 128 blocks a program)."""
BLOCK = 2048


@triton.jit
def _word_sums_kernel(pointers_ptr, counts_ptr, out_ptr, SLICES: tl.constexpr, BLOCK: tl.constexpr,
                      G: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr):
    # grid (tensors, SLICES); the constants arrive as constexprs above 2^63, so Triton types them
    # uint64: products wrap and shifts are logical, as the definition's masked int64 ones
    t = tl.program_id(0)
    s = tl.program_id(1)
    words_ptr = tl.load(pointers_ptr + t).to(tl.pointer_type(tl.int32))
    n = tl.load(counts_ptr + t)
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    for start in range(s * BLOCK, n, SLICES * BLOCK):
        i = start + tl.arange(0, BLOCK)
        m = i < n
        # sign-extended, as the definition's copy of int32 words into int64
        w = tl.load(words_ptr + i, mask=m, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
        z = _mix64_u(w ^ (i.to(tl.uint64) * G), M1, M2)
        acc += tl.where(m, z, 0)
    tl.store(out_ptr + t * SLICES + s, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def word_sums(items: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """`beam_rl.model.weights.hashed_word_sums` of (name, words) pairs on one device: int32 words on
    CUDA in one launch, the rest by the definition."""
    fast, rest = [], []
    for name, w in items:
        (fast if w.dtype == torch.int32 and use_triton(w) else rest).append((name, w))
    sums = hashed_word_sums(rest)
    if not fast:
        return sums
    device = fast[0][1].device
    table = torch.tensor([[w.data_ptr() for _, w in fast], [w.numel() for _, w in fast]], dtype=torch.int64)
    table = table.pin_memory().to(device, non_blocking=True)
    partial = torch.empty(len(fast), SLICES, dtype=torch.int64, device=device)
    with torch.cuda.device(device):
        _word_sums_kernel[(len(fast), SLICES)](table[0], table[1], partial, SLICES=SLICES, BLOCK=BLOCK, G=GOLDEN,
                                               M1=MIX_1, M2=MIX_2, num_warps=8)
    # int64 sums wrap mod 2**64; the words stay referenced by `fast` until the kernel is done (tolist syncs)
    for (name, _), total in zip(fast, partial.sum(dim=1).tolist()):
        sums[name] = total % 2**64
    return sums


def tensor_checksums(named) -> dict[str, str]:
    """`beam_rl.model.weights.tensor_checksums` with `word_sums`: the same fingerprints."""
    return _tensor_checksums(named, word_sums=word_sums)

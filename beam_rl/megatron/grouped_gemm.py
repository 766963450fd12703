"""Grouped GEMM for routed experts on `torch._grouped_mm` (CUTLASS on Hopper, a loop elsewhere).

One launch multiplies every expert's token block by that expert's weight: x [M, K] (tokens sorted by
expert, `counts[e]` rows for expert e) @ w [E, K, N] -> [M, N]. Numerics: each row is a BF16 GEMM
with FP32 accumulation rounded once to the output dtype, as the per-expert `torch.matmul` it replaces
(the K-accumulation order is the library's). Autograd: PyTorch's own derivative of `_grouped_mm`.

`GroupedGemmOps` is the interface of the `grouped_gemm` package that Megatron-Core's `GroupedMLP`
calls (`gmm(a, b, batch_sizes, trans_b=False)`); `use_for_megatron()` points Megatron at it, so
Megatron's own grouped-GEMM MoE runs without that CUDA extension (the trainer benchmark's peer).
"""

from __future__ import annotations

import torch


def group_offsets(counts: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """int32 end offsets [E] of the groups (what `_grouped_mm` takes), on `device`; counts on the
    device stay there (no host sync)."""
    counts = torch.as_tensor(counts)
    if counts.dim() != 1:
        raise ValueError(f"group counts must be one count per expert, got shape {tuple(counts.shape)}")
    return torch.cumsum(counts.to(device=device, dtype=torch.int64), 0).to(torch.int32)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [E, K, N] by groups ending at `offsets` [E] -> [M, N] in x's dtype."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: x [M, K] and w [E, K, N] with the same K; got {tuple(x.shape)} and {tuple(w.shape)}")
    if offsets.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm: {offsets.numel()} group offsets for {w.shape[0]} experts")
    return torch._grouped_mm(x, w, offs=offsets)


class GroupedGemmOps:
    """The `grouped_gemm.ops` interface Megatron-Core's GroupedMLP uses."""

    @staticmethod
    def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
        w = b.transpose(-1, -2) if trans_b else b
        return grouped_mm(a, w, group_offsets(batch_sizes, a.device))


def use_for_megatron() -> None:
    """Let Megatron-Core's GroupedMLP (`moe_grouped_gemm=True` on the local spec) run on
    `torch._grouped_mm` when the `grouped_gemm` package is absent."""
    from megatron.core.transformer.moe import grouped_gemm_util

    if grouped_gemm_util.grouped_gemm is None:
        grouped_gemm_util.grouped_gemm = GroupedGemmOps
        grouped_gemm_util.ops = GroupedGemmOps

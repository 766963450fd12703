"""Beam's pointwise operations as the vLLM model calls them: the fused Triton kernels of
`beam_rl.kernels` on CUDA, the `beam_rl.numerics` reference elsewhere (same rounding contract).

`BEAM_RL_FUSED_KERNELS=0` forces the plain PyTorch reference on CUDA too (the benchmark's
"compiled" and "eager" builds use it).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from beam_rl import numerics
from beam_rl.config import BeamConfig

_TABLES: dict[tuple, torch.Tensor] = {}


def use_fused_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("BEAM_RL_FUSED_KERNELS", "1") != "0"


class HeadNorm(nn.Module):
    """An RMSNorm weight over head_dim (shared by all heads); applied by `qk_norm_positional`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps


class NormWeight(nn.Module):
    """A plain RMSNorm weight over hidden; applied by the boundary op."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)


def _table(kind: str, config: BeamConfig) -> torch.Tensor:
    key = (kind, config.max_position_embeddings, config.head_dim, config.sliding_rope_theta)
    if key not in _TABLES:
        if kind == "rope":
            _TABLES[key] = numerics.rope_cos_sin_cache(config.max_position_embeddings, config.head_dim, config.sliding_rope_theta)
        else:
            _TABLES[key] = numerics.ssmax_scale_cache(config.max_position_embeddings)
    return _TABLES[key]


class _Table(nn.Module):
    """A shared FP32 position table, moved with the model but not a checkpoint tensor."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.register_buffer("table", table, persistent=False)


def rope_tables(config: BeamConfig) -> _Table:
    return _Table(_table("rope", config))


def ssmax_table(config: BeamConfig) -> _Table:
    return _Table(_table("ssmax", config))


def qk_norm_positional(q, k, q_weight, k_weight, positions, eps, is_sliding: bool, tables: _Table):
    """Per-head Q/K RMSNorm then RoPE (sliding layers) or SSMax on q (NoPE layers)."""
    cos_sin = tables.table if is_sliding else None
    ssmax = None if is_sliding else tables.table
    if use_fused_kernels(q):
        from beam_rl.kernels import qk_norm_rope_ssmax

        return qk_norm_rope_ssmax(q, k, q_weight, k_weight, positions, eps, cos_sin, ssmax)
    return numerics.qk_norm_rope_ssmax(q, k, q_weight, k_weight, positions, eps, cos_sin, ssmax)


def output_gate(attn, gate, bias):
    if use_fused_kernels(attn):
        from beam_rl.kernels import output_gate as fused

        return fused(attn, gate, bias)
    return numerics.output_gate(attn, gate, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a packed [T, 2F] gate_up (gate first)."""
    if use_fused_kernels(gate_up):
        from beam_rl.kernels import silu_and_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return numerics.silu_and_mul(gate, up)


def rms_norm(x, weight, eps):
    if use_fused_kernels(x):
        from beam_rl.kernels import rms_norm as fused

        return fused(x, weight, eps)
    return numerics.rms_norm(x, weight, eps)


def sublayer_boundary(sublayer_out, residual, post_weight, next_weight, add_index, eps):
    if use_fused_kernels(sublayer_out):
        from beam_rl.kernels import sublayer_boundary as fused

        return fused(sublayer_out, residual, post_weight, next_weight, add_index, eps)
    return numerics.sublayer_boundary(sublayer_out, residual, post_weight, next_weight, add_index, eps)

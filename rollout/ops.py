"""Beam's pointwise operations as the vLLM model calls them: the fused Triton kernels of
`beam_rl.kernels` on CUDA, the `beam_rl.numerics` reference elsewhere (same rounding contract).

`BEAM_RL_FUSED_KERNELS=0` forces the plain PyTorch reference on CUDA too (the benchmark's
"compiled" and "eager" builds use it).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from beam_rl import kernels, numerics, routing
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


class PositionTable:
    """A shared FP32 table indexed by position (RoPE cos|sin, or SSMax factors). Not a module
    buffer: it is derived from the config, never loaded or reloaded; one copy per device."""

    def __init__(self, kind: str, config: BeamConfig):
        self.key = (kind, config.max_position_embeddings, config.head_dim, config.sliding_rope_theta)

    def on(self, device: torch.device) -> torch.Tensor:
        key = self.key + (str(device),)
        if key not in _TABLES:
            kind, max_pos, head_dim, theta = self.key
            table = (numerics.rope_cos_sin_cache(max_pos, head_dim, theta) if kind == "rope"
                     else numerics.ssmax_scale_cache(max_pos))
            _TABLES[key] = table.to(device)
        return _TABLES[key]


def rope_tables(config: BeamConfig) -> PositionTable:
    return PositionTable("rope", config)


def ssmax_table(config: BeamConfig) -> PositionTable:
    return PositionTable("ssmax", config)


def qk_norm_positional(q, k, q_weight, k_weight, positions, eps, is_sliding: bool, table: PositionTable):
    """Per-head Q/K RMSNorm then RoPE (sliding layers) or SSMax on q (NoPE layers)."""
    cos_sin = table.on(q.device) if is_sliding else None
    ssmax = None if is_sliding else table.on(q.device)
    impl = kernels.qk_norm_rope_ssmax if use_fused_kernels(q) else numerics.qk_norm_rope_ssmax
    return impl(q, k, q_weight, k_weight, positions, eps, cos_sin, ssmax)


def output_gate(attn, gate, bias):
    return (kernels.output_gate if use_fused_kernels(attn) else numerics.output_gate)(attn, gate, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a packed [T, 2F] gate_up (gate first)."""
    if use_fused_kernels(gate_up):
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return numerics.silu_and_mul(gate, up)


def rms_norm(x, weight, eps):
    return (kernels.rms_norm if use_fused_kernels(x) else numerics.rms_norm)(x, weight, eps)


def sublayer_boundary(sublayer_out, residual, post_weight, next_weight, add_index, eps):
    impl = kernels.sublayer_boundary if use_fused_kernels(sublayer_out) else numerics.sublayer_boundary
    return impl(sublayer_out, residual, post_weight, next_weight, add_index, eps)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, config: BeamConfig):
    """FP32 router GEMM + grouped sigmoid top-k -> (FP32 weights incl. routed scaling, ids).

    CUDA: the fused router kernel (split-K FP32 GEMM + top-k in one launch); unfused CUDA: an FP32
    cuBLAS GEMM + the PyTorch top-k; CPU: the reference (FP64-accumulated logits)."""
    args = dict(top_k=config.num_experts_per_tok, n_group=config.n_group, topk_group=config.topk_group,
                routed_scaling_factor=config.routed_scaling_factor, norm_topk_prob=config.norm_topk_prob)
    if use_fused_kernels(x):
        return kernels.route(x, weight, bias, **args)
    logits = x.float() @ weight.t() if x.is_cuda else routing.router_logits(x, weight)
    return routing.select_experts(logits, bias, **args)

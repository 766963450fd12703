"""Beam's pointwise operations as the vLLM model calls them: the fused Triton kernels of
`beam_rl.kernels` on CUDA, the `beam_rl.model.numerics` reference elsewhere (same rounding contract).

`BEAM_RL_FUSED_KERNELS=0` forces the plain PyTorch reference on CUDA too (the benchmark's
"compiled" and "eager" builds use it). The fused kernels are registered as `beam_rl::*` torch
custom ops, so vLLM's torch.compile and CUDA graphs treat each as one opaque call.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from beam_rl import kernels
from beam_rl.model import numerics, routing
from beam_rl.model.config import BeamConfig

_TABLES: dict[tuple, torch.Tensor] = {}


def use_fused_kernels() -> bool:
    """The `beam_rl::*` custom ops: Triton on CUDA, the reference elsewhere. Either way torch.compile
    sees one opaque op and cannot re-round inside it (compiled plain PyTorch does)."""
    return os.environ.get("BEAM_RL_FUSED_KERNELS", "1") != "0"


class NormWeight(nn.Module):
    """A plain RMSNorm weight (hidden, or head_dim for Q/K); the op that uses it applies it."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)


class PositionTable:
    """A shared FP32 table indexed by position (RoPE cos|sin, or SSMax factors), derived from the
    config, never loaded or reloaded (held as a buffer by `PositionalTables`, which vLLM's level-2
    sleep saves and restores). Built at model construction
    on the device vLLM builds the model on (so torch.compile never traces its creation); one copy
    per device, shared by all layers."""

    def __init__(self, kind: str, config: BeamConfig):
        self.key = (kind, config.max_position_embeddings, config.head_dim, config.sliding_rope_theta)
        self.default: torch.Tensor | None = None
        self.default = self.on(torch.get_default_device())

    def on(self, device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        d = self.default
        if d is not None and d.device.type == device.type and (d.device.index or 0) == (device.index or 0):
            return d  # the common case, and the only one inside torch.compile
        key = self.key + (f"{device.type}:{device.index or 0}",)
        if key not in _TABLES:
            kind, max_pos, head_dim, theta = self.key
            table = (numerics.rope_cos_sin_cache(max_pos, head_dim, theta) if kind == "rope"
                     else numerics.ssmax_scale_cache(max_pos))
            _TABLES[key] = table.to(device)
        return _TABLES[key]


class PositionalTables(nn.Module):
    """The model's distinct default-device PositionTable tensors as non-persistent buffers, by kind
    (`rope`, `ssmax`). vLLM's level-2 sleep (SkyRL and verl sleep colocated engines so) discards all
    device memory allocated while the model was built except parameters (the next weight sync
    reloads them) and buffers (saved to the host, copied back in place on wake-up); the tables are
    neither loaded nor synced, so they live here. No checkpoint holds them. vLLM's layerwise
    in-place reload puts them back as it loads nothing into them, logging "PositionalTables: Failed
    to load weights" (as for its own rotary-embedding caches)."""

    def __init__(self, tables):
        super().__init__()
        for t in tables:
            kind = t.key[0]
            if kind in self._buffers and self._buffers[kind] is not t.default:
                raise ValueError(f"two {kind} tables on one device; PositionTable shares one per config and device")
            self.register_buffer(kind, t.default, persistent=False)


def rope_tables(config: BeamConfig) -> PositionTable:
    return PositionTable("rope", config)


def ssmax_table(config: BeamConfig) -> PositionTable:
    return PositionTable("ssmax", config)


@torch.library.custom_op("beam_rl::qk_norm_positional", mutates_args=())
def _fused_qk_norm_positional(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                              positions: torch.Tensor, eps: float, table: torch.Tensor, is_sliding: bool
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.qk_norm_rope_ssmax(q, k, q_weight, k_weight, positions, eps,
                                      table if is_sliding else None, None if is_sliding else table)


@_fused_qk_norm_positional.register_fake
def _(q, k, q_weight, k_weight, positions, eps, table, is_sliding):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("beam_rl::output_gate", mutates_args=())
def _fused_output_gate(attn: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return kernels.output_gate(attn, gate, bias)


@_fused_output_gate.register_fake
def _(attn, gate, bias):
    return torch.empty_like(attn)


@torch.library.custom_op("beam_rl::silu_and_mul", mutates_args=())
def _fused_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return kernels.silu_and_mul(gate_up)


@_fused_silu_and_mul.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("beam_rl::rms_norm", mutates_args=())
def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.rms_norm(x, weight, eps)


@_fused_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("beam_rl::sublayer_boundary", mutates_args=())
def _fused_boundary(sublayer_out: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
                    next_weight: torch.Tensor, add_index: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.sublayer_boundary(sublayer_out, residual, post_weight, next_weight, add_index, eps)


@_fused_boundary.register_fake
def _(sublayer_out, residual, post_weight, next_weight, add_index, eps):
    return torch.empty_like(residual), torch.empty_like(residual)


def qk_norm_positional(q, k, q_weight, k_weight, positions, eps, is_sliding: bool, table: PositionTable):
    """Per-head Q/K RMSNorm then RoPE (sliding layers) or SSMax on q (NoPE layers)."""
    t = table.on(q.device)
    if use_fused_kernels():
        return _fused_qk_norm_positional(q, k, q_weight, k_weight, positions, eps, t, is_sliding)
    return numerics.qk_norm_rope_ssmax(q, k, q_weight, k_weight, positions, eps,
                                       t if is_sliding else None, None if is_sliding else t)


def output_gate(attn, gate, bias):
    return _fused_output_gate(attn, gate, bias) if use_fused_kernels() else numerics.output_gate(attn, gate, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a packed [T, 2F] gate_up (gate first)."""
    if use_fused_kernels():
        return _fused_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return numerics.silu_and_mul(gate, up)


def rms_norm(x, weight, eps):
    return _fused_rms_norm(x, weight, eps) if use_fused_kernels() else numerics.rms_norm(x, weight, eps)


def sublayer_boundary(sublayer_out, residual, post_weight, next_weight, add_index, eps):
    """Post-norm, depth-scaled add, next pre-norm -> (residual', next input); always with a next norm
    here (the last layer's is the final norm)."""
    if use_fused_kernels():
        return _fused_boundary(sublayer_out, residual, post_weight, next_weight, add_index, eps)
    return numerics.sublayer_boundary(sublayer_out, residual, post_weight, next_weight, add_index, eps)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, config: BeamConfig):
    """FP32 router GEMM + grouped sigmoid top-k -> (FP32 weights incl. routed scaling, int32 ids).

    Fused (CUDA): the Triton router (FP64-accumulating split-K GEMM rounded once to FP32, then the
    top-k); unfused, any device: the reference `routing.router_logits` (FP64-accumulated, rounded
    once) + `routing.select_experts`. Both compute the correctly rounded logits, so both builds pick
    the same experts; an FP32 GEMM here would sum in another order and flip near-ties, and the two
    builds' greedy tokens would diverge."""
    args = dict(top_k=config.num_experts_per_tok, n_group=config.n_group, topk_group=config.topk_group,
                routed_scaling_factor=config.routed_scaling_factor, norm_topk_prob=config.norm_topk_prob)
    if use_fused_kernels():
        return kernels.route(x, weight, bias, **args, ids_dtype=torch.int32)
    weights, ids = routing.select_experts(routing.router_logits(x, weight), bias, **args)
    return weights, ids.to(torch.int32)

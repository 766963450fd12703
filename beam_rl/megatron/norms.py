"""Beam's pointwise modules for the Megatron layer spec: RMSNorm and the SwiGLU activation.

Numerics (beam_rl.model.numerics): RMSNorm computes x * rsqrt(mean(x^2) + eps) * w in FP32 and rounds
once after the weight multiply; SwiGLU computes silu(gate) * up in FP32 and rounds only the
product. Megatron's own local norms / `glu` round at other points, so the spec uses these, through
`beam_rl.megatron.fused` (the rollout's kernels forward, a fused backward).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from beam_rl.megatron import fused
from beam_rl.model import numerics


class BeamRMSNorm(fused.FastPaths, MegatronModule):
    """RMSNorm with a plain weight (initialised to ones); `build_module(config, hidden_size, eps)`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__(config=config)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Norm weights are replicated across TP ranks; with sequence parallelism their gradients
        # are partial sums that Megatron all-reduces when this attribute is set.
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_paths:
            return fused.rms_norm(x, self.weight, self.eps)
        return numerics.rms_norm(x, self.weight, self.eps)


class BeamSwiGLU(fused.FastPaths, MegatronModule):
    """Activation of a fused fc1 output [..., 2F] laid out [gate | up] (Megatron's GLU layout):
    silu(gate) * up in FP32, rounded once. Used through `use_te_activation_func=True`, the MLP
    hook that hands the whole fc1 output to a module."""

    def __init__(self, config: TransformerConfig, **_):
        super().__init__(config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_paths:
            return fused.silu_and_mul(x)
        return numerics.silu_and_mul(*torch.chunk(x, 2, dim=-1))

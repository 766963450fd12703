"""Sigmoid output gate: attn * sigmoid(gate + bias[head]) with `numerics.output_gate`'s three roundings."""

import torch

from beam_rl.model import numerics

from ._triton_compat import LAUNCH_OPTS, tl, triton, use_triton
from .exact_math import sigmoid_to_bf16


@triton.jit
def _output_gate_kernel(a_ptr, g_ptr, b_ptr, o_ptr, n, s_at, s_gt, s_ot, HD: tl.constexpr, D: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One flat index over tokens x (heads x head_dim); each token's heads x head_dim block is contiguous."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    t = (i // HD).to(tl.int64)
    hd = i % HD
    dt = o_ptr.dtype.element_ty
    a = tl.load(a_ptr + t * s_at + hd, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * s_gt + hd, mask=m, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + hd // D, mask=m, other=0.0).to(tl.float32)
    g = (g + bias).to(dt).to(tl.float32)
    s = sigmoid_to_bf16(g).to(tl.float32)  # BF16 activations only: the exactness proof covers BF16 inputs
    tl.store(o_ptr + t * s_ot + hd, (a * s).to(dt), mask=m)


def gate_launch_shape(tokens: int) -> tuple[int, int]:
    """(elements per program, warps): 512 over 4 warps at decode sizes (latency-bound), 1024 over 4 warps
    at prefill; chosen with `bench_kernels.py --tune` on the H200 (timings: docs/results/kernels.md)."""
    return (1024, 4) if tokens > 64 else (512, 4)


def output_gate_triton(attn: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor, *, out=None,
                       launch=None) -> torch.Tensor:
    """g = round(gate + bias); s = round(sigmoid(g)); out = round(attn * s), each in FP32 (bit-exact).

    attn, gate, out: BF16 [T, H, D], each token's [H, D] contiguous (rows may be strided, as a view of a
    packed projection is). `launch=(elements per program, warps)` overrides `gate_launch_shape`."""
    assert attn.dim() == 3 and gate.shape == attn.shape, f"attn/gate must be [T, H, D]; got {attn.shape}, {gate.shape}"
    assert attn.dtype == gate.dtype == torch.bfloat16, \
        f"attn/gate: BF16 expected, got {attn.dtype}/{gate.dtype} (output_gate() takes other dtypes to the reference)"
    tokens, heads, head_dim = attn.shape
    for name, x in (("attn", attn), ("gate", gate)):
        assert x.stride(2) == 1 and x.stride(1) == head_dim, \
            f"{name}: each token's [H, D] must be contiguous (strides {x.stride()}); pass {name}.contiguous()"
    assert gate_bias.shape == (heads,) and gate_bias.is_contiguous()
    if out is None:
        out = torch.empty((tokens, heads, head_dim), dtype=attn.dtype, device=attn.device)
    assert out.shape == attn.shape and out.dtype == attn.dtype and out.stride(2) == 1 and out.stride(1) == head_dim
    if out.numel() == 0:
        return out
    block, warps = launch or gate_launch_shape(tokens)
    n = out.numel()
    _output_gate_kernel[(triton.cdiv(n, block),)](
        attn, gate, gate_bias, out, n, attn.stride(0), gate.stride(0), out.stride(0), HD=heads * head_dim, D=head_dim,
        BLOCK=block, num_warps=warps, **LAUNCH_OPTS)
    return out


def output_gate(attn: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor) -> torch.Tensor:
    """Dispatch: Triton for BF16 on CUDA, `numerics.output_gate` elsewhere."""
    if use_triton(attn, gate, gate_bias) and attn.dtype == torch.bfloat16:
        return output_gate_triton(attn, gate, gate_bias)
    return numerics.output_gate(attn, gate, gate_bias)

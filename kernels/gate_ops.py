"""Sigmoid output gate: attn * sigmoid(gate + bias[head]) with `numerics.output_gate`'s three roundings."""

import torch

from beam_rl import numerics

from ._triton_compat import LAUNCH_OPTS, libdevice, tl, triton, use_triton


@triton.jit
def _output_gate_kernel(a_ptr, g_ptr, b_ptr, o_ptr, H, D, s_at, s_ah, s_gt, s_gh, s_ot, s_oh,
                        BH: tl.constexpr, D_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)[:, None]
    d = tl.arange(0, D_P)[None, :]
    m = (h < H) & (d < D)
    dt = o_ptr.dtype.element_ty
    a = tl.load(a_ptr + t * s_at + h * s_ah + d, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * s_gt + h * s_gh + d, mask=m, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    g = (g + bias).to(dt).to(tl.float32)
    # ATen's sigmoid, 1 / (1 + expf(-x)), with the correctly rounded reciprocal (the same value as an IEEE
    # divide of 1, in ~10% fewer instructions: no dividend to scale)
    s = libdevice.rcp_rn(1.0 + libdevice.exp(-g)).to(dt).to(tl.float32)
    tl.store(o_ptr + t * s_ot + h * s_oh + d, (a * s).to(dt), mask=m)


def gate_launch_shape(tokens: int, heads: int, head_dim_p2: int) -> tuple[int, int]:
    """(heads per program, warps) from `bench_kernels.py --tune` (H200): 2048 elements per program over 4
    warps at prefill; at decode sizes, latency-bound, 512 elements over 8 warps (<= 8 tokens) or 4 warps,
    so each thread has one or two elements on its exp -> reciprocal chain."""
    elems, warps = (2048, 4) if tokens > 64 else (512, 8 if tokens <= 8 else 4)
    return min(triton.next_power_of_2(heads), max(1, elems // head_dim_p2)), warps


def output_gate_triton(attn: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor, *, out=None,
                       launch=None) -> torch.Tensor:
    """g = round(gate + bias); s = round(sigmoid(g)); out = round(attn * s), each in FP32 (bit-exact).

    `launch=(heads per program, warps)` overrides `gate_launch_shape` (the benchmark tunes it)."""
    assert attn.dim() == 3 and gate.shape == attn.shape, f"attn/gate must be [T, H, D]; got {attn.shape}, {gate.shape}"
    assert attn.stride(2) == 1 and gate.stride(2) == 1, "head_dim must be contiguous"
    assert gate.dtype == attn.dtype and gate_bias.shape == (attn.shape[1],) and gate_bias.is_contiguous()
    tokens, heads, head_dim = attn.shape
    if out is None:
        out = torch.empty((tokens, heads, head_dim), dtype=attn.dtype, device=attn.device)
    assert out.shape == attn.shape and out.dtype == attn.dtype and out.stride(2) == 1
    if out.numel() == 0:
        return out
    d_p = triton.next_power_of_2(head_dim)
    bh, warps = launch or gate_launch_shape(tokens, heads, d_p)
    _output_gate_kernel[(tokens, triton.cdiv(heads, bh))](
        attn, gate, gate_bias, out, heads, head_dim, attn.stride(0), attn.stride(1), gate.stride(0), gate.stride(1),
        out.stride(0), out.stride(1), BH=bh, D_P=d_p, num_warps=warps, **LAUNCH_OPTS)
    return out


def output_gate(attn: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor) -> torch.Tensor:
    """Dispatch: Triton on CUDA, `numerics.output_gate` elsewhere."""
    if use_triton(attn, gate, gate_bias):
        return output_gate_triton(attn, gate, gate_bias)
    return numerics.output_gate(attn, gate, gate_bias)

"""SwiGLU activation of the dense MLP: silu(gate) * up in FP32, rounded only the product."""

import torch

from beam_rl.model import numerics

from ._triton_compat import LAUNCH_OPTS, tl, triton, use_triton
from .exact_math import silu_fp32


# CUDA's limit on a grid's second dimension: more rows than this are launched in chunks
MAX_GRID_ROWS = 65535


@triton.jit
def _silu_and_mul_kernel(g_ptr, u_ptr, o_ptr, F, s_gt, s_ut, s_ot, BLOCK: tl.constexpr):
    # grid (feature blocks, rows): consecutive programs walk along a row, so the grid streams through memory
    # in address order, and no program divides its id (a 1-D grid would need pid // blocks_per_row)
    t = tl.program_id(1).to(tl.int64)
    f = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = f < F
    g = tl.load(g_ptr + t * s_gt + f, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * s_ut + f, mask=m, other=0.0).to(tl.float32)
    # ATen's silu, x / (1 + expf(-x)), bit for bit (BF16 inputs only: the exactness proof covers BF16 gates)
    tl.store(o_ptr + t * s_ot + f, (silu_fp32(g) * u).to(o_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    assert x.stride(-1) == 1, "the feature dim must be contiguous"
    if x.dim() == 2:
        return x
    assert x.is_contiguous(), "tensors with more than 2 dims must be contiguous"
    return x.view(-1, x.shape[-1])


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor | None = None, *, out=None, launch=None) -> torch.Tensor:
    """Compute SiLU and multiplication in FP32, rounding only the product (bit-exact to the reference); BF16.

    `up=None` takes a packed gate_up [..., 2F] (gate first), as one GEMM of [gate; up] produces it.
    `launch=(block, warps)` overrides the default (the benchmark tunes it)."""
    assert gate.dtype == torch.bfloat16, \
        f"gate/up: BF16 expected, got {gate.dtype} (silu_and_mul() takes other dtypes to the reference)"
    if up is None:
        assert gate.shape[-1] % 2 == 0, "packed gate_up needs an even last dim"
        width = gate.shape[-1] // 2
        packed = _rows(gate)
        g2, u2 = packed[:, :width], packed[:, width:]
        out_shape = (*gate.shape[:-1], width)
    else:
        assert gate.shape == up.shape and gate.dtype == up.dtype, f"{gate.shape} vs {up.shape}"
        width = gate.shape[-1]
        g2, u2 = _rows(gate), _rows(up)
        out_shape = tuple(gate.shape)
    if out is None:
        out = torch.empty(out_shape, dtype=gate.dtype, device=gate.device)
    assert tuple(out.shape) == tuple(out_shape) and out.dtype == gate.dtype and out.is_contiguous()
    if out.numel() == 0:
        return out
    o2 = out.view(-1, width)
    # (block, warps), chosen with `bench_kernels.py --tune` on the H200: 2048 x 4 warps at prefill; at decode
    # sizes (latency-bound) 1024 x 4 warps, and 512 x 4 up to 8 rows
    rows = o2.shape[0]
    block, warps = launch or ((2048, 4) if rows > 64 else (1024, 4) if rows > 8 else (512, 4))
    block = min(block, triton.next_power_of_2(width))
    blocks_per_row = triton.cdiv(width, block)
    for r0 in range(0, rows, MAX_GRID_ROWS):
        g, u, o = g2[r0 : r0 + MAX_GRID_ROWS], u2[r0 : r0 + MAX_GRID_ROWS], o2[r0 : r0 + MAX_GRID_ROWS]
        _silu_and_mul_kernel[(blocks_per_row, o.shape[0])](
            g, u, o, width, g.stride(0), u.stride(0), o.stride(0), BLOCK=block, num_warps=warps, **LAUNCH_OPTS)
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: Triton for BF16 on CUDA, `numerics.silu_and_mul` elsewhere; `up=None` means packed [..., 2F] gate_up."""
    if use_triton(gate, up) and gate.dtype == torch.bfloat16:
        return silu_and_mul_triton(gate, up)
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return numerics.silu_and_mul(gate, up)

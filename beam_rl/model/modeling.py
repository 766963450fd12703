"""The reference Beam model in plain PyTorch: the spec every engine is tested against.

Read top to bottom: norms, attention (Q/K norm, RoPE or SSMax, sliding window, output gate),
MLPs (dense SwiGLU, grouped sigmoid MoE with replay), the decoder layer with sandwich norms and
depth-scaled residual adds, and the causal LM. Pointwise math and its BF16 rounding points live in
`beam_rl.model.numerics`, routing in `beam_rl.model.routing`; nothing here rounds anywhere else.

Routing: `forward(..., routed_experts=None)` returns the chosen expert ids [B, T, moe_layers,
top_k] (MoE layers in order); passing ids replays them (R3): the experts are forced, the gate
weights come from this model's own router scores.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from beam_rl.model import numerics
from beam_rl.model.checkpoint import load_config, load_state_dict
from beam_rl.model.config import BeamConfig
from beam_rl.model.weights import checkpoint_tensors
from beam_rl.model.routing import replay_experts, router_logits, select_experts


class BeamRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return numerics.rms_norm(x, self.weight, self.eps)


@dataclass
class LayerKV:
    """Keys, values and their positions of one layer, for one batch: k/v [B, T, KV, D]."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # (B, T)


class BeamKVCache:
    """Per-layer KV for generation. Keeps every position (sliding layers mask by window)."""

    def __init__(self, num_layers: int):
        self.layers: list[LayerKV | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> LayerKV:
        old = self.layers[layer]
        if old is not None:
            k = torch.cat([old.k, k], dim=1)
            v = torch.cat([old.v, v], dim=1)
            positions = torch.cat([old.positions, positions], dim=1)
        self.layers[layer] = LayerKV(k, v, positions)
        return self.layers[layer]

    @property
    def seq_len(self) -> int:
        return 0 if self.layers[0] is None else self.layers[0].k.shape[1]


class BeamAttention(nn.Module):
    """GQA with per-head Q/K RMSNorm, RoPE + sliding window or NoPE + SSMax, and a sigmoid output gate."""

    def __init__(self, config: BeamConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None
        self.rope_theta = config.sliding_rope_theta
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, q_width, bias=False)
        self.gate_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=False)
        self.q_norm = BeamRMSNorm(self.head_dim, self.eps)  # one weight shared by all heads
        self.k_norm = BeamRMSNorm(self.head_dim, self.eps)
        self.attention_kernel = numerics.AttentionNumerics()  # the spec; BeamForCausalLM.attention_numerics() sets it

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: BeamKVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B * T, self.num_heads, self.head_dim)  # (B*T, H, D)
        k = self.k_proj(x).view(B * T, self.num_kv_heads, self.head_dim)  # (B*T, KV, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        gate = self.gate_proj(x).view(B * T, self.num_heads, self.head_dim)

        max_pos = int(positions.max()) + 1
        flat_pos = positions.reshape(-1)
        if self.is_sliding:
            tables = dict(cos_sin_cache=numerics.rope_cos_sin_cache(max_pos, self.head_dim, self.rope_theta), ssmax_cache=None)
        else:
            tables = dict(cos_sin_cache=None, ssmax_cache=numerics.ssmax_scale_cache(max_pos))
        tables = {name: t if t is None else t.to(x.device) for name, t in tables.items()}
        q, k = numerics.qk_norm_rope_ssmax(q, k, self.q_norm.weight, self.k_norm.weight, flat_pos, self.eps, **tables)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)

        kv = LayerKV(k, v, positions) if cache is None else cache.update(self.layer_idx, k, v, positions)
        attn = torch.stack(
            [
                numerics.attention(q[b], kv.k[b], kv.v[b], positions[b], kv.positions[b], self.sliding_window,
                                   self.attention_kernel)
                for b in range(B)
            ]
        )  # (B, T, H, D)
        out = numerics.output_gate(attn.view(B * T, self.num_heads, self.head_dim), gate, self.gate_bias)
        return self.o_proj(out.view(B, T, -1))


class BeamMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); also one routed expert."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(numerics.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class BeamRouter(nn.Module):
    """FP32 router weight [E, hidden] and correction bias [E]. Both stay FP32 under `.to(dtype)`."""

    def __init__(self, config: BeamConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        def move_keep_fp32(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return t.to(device=moved.device) if moved.dtype != t.dtype else moved

        return super()._apply(move_keep_fp32, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return router_logits(x, self.weight)


class BeamMoE(nn.Module):
    """Routed SwiGLU experts (no shared expert), grouped sigmoid top-k routing, FP32 combine."""

    def __init__(self, config: BeamConfig):
        super().__init__()
        self.config = config
        self.gate = BeamRouter(config)
        self.experts = nn.ModuleList(
            BeamMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def forward(self, x: torch.Tensor, replay_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (out [N, hidden], expert ids [N, top_k])."""
        c = self.config
        logits = self.gate(x)
        if replay_ids is None:
            weights, ids = select_experts(
                logits, self.gate.e_score_correction_bias, top_k=c.num_experts_per_tok, n_group=c.n_group,
                topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob,
            )
        else:
            weights, ids = replay_experts(
                logits, replay_ids, routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob
            )
        expert_out = x.new_zeros(x.shape[0], ids.shape[1], x.shape[1])  # (N, top_k, hidden)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            expert_out[token, slot] = self.experts[e](x[token])
        return numerics.moe_combine(expert_out, weights), ids


class BeamDecoderLayer(nn.Module):
    """attention and MLP, each between a pre-norm and a post-norm, each added to the residual
    stream with depth scaling (adds 2L and 2L+1 for 1-based layer L)."""

    def __init__(self, config: BeamConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.eps = config.rms_norm_eps
        self.is_moe = config.mlp_layer_types[layer_idx] == "sparse"
        self.input_layernorm = BeamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = BeamAttention(config, layer_idx)
        self.post_attention_layernorm = BeamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = BeamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = BeamMoE(config) if self.is_moe else BeamMLP(config.hidden_size, config.intermediate_size)
        self.post_feedforward_layernorm = BeamRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        next_norm: BeamRMSNorm,
        positions: torch.Tensor,
        cache: BeamKVCache | None,
        replay_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`x` is this layer's normed input; returns (residual, next sublayer's normed input, expert ids)."""
        n = 2 * (self.layer_idx + 1)  # this layer's attention add; its MLP add is n + 1
        attn = self.self_attn(x, positions, cache)
        residual, x = numerics.sublayer_boundary(
            attn, residual, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight, n, self.eps
        )
        ids = None
        if self.is_moe:
            B, T, H = x.shape
            flat_replay = None if replay_ids is None else replay_ids.reshape(B * T, -1)
            mlp_out, ids = self.mlp(x.reshape(B * T, H), flat_replay)
            mlp_out, ids = mlp_out.view(B, T, H), ids.view(B, T, -1)
        else:
            mlp_out = self.mlp(x)
        residual, x = numerics.sublayer_boundary(
            mlp_out, residual, self.post_feedforward_layernorm.weight, next_norm.weight, n + 1, self.eps
        )
        return residual, x, ids


@dataclass
class BeamCausalLMOutput:
    logits: torch.Tensor | None = None  # (B, T, vocab) FP32, soft-capped if configured
    routed_experts: torch.Tensor | None = None  # (B, T, moe_layers, top_k) int64
    cache: BeamKVCache | None = None
    hidden_states: torch.Tensor | None = None  # (B, T, hidden): final-normed, what the LM head reads


class BeamPreTrainedModel(PreTrainedModel):
    config_class = BeamConfig
    base_model_prefix = "model"
    _no_split_modules = ["BeamDecoderLayer"]

    def _init_weights(self, module):
        # Seeded initialisation is explicit (`init_weights` below); HF's hook does nothing.
        pass


class BeamModel(BeamPreTrainedModel):
    def __init__(self, config: BeamConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BeamDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = BeamRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: BeamKVCache | None = None,
        routed_experts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (final-normed hidden states [B, T, hidden], expert ids [B, T, moe_layers, top_k])."""
        residual = self.embed_tokens(input_ids)  # the embedding is residual add 1: h = x
        x = self.layers[0].input_layernorm(residual)
        routed: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            replay = None if routed_experts is None or not layer.is_moe else routed_experts[:, :, len(routed)]
            residual, x, ids = layer(residual, x, next_norm, positions, cache, replay)
            if ids is not None:
                routed.append(ids)
        B, T = input_ids.shape
        ids = torch.stack(routed, dim=2) if routed else input_ids.new_zeros(B, T, 0, 0)
        return x, ids


class BeamForCausalLM(BeamPreTrainedModel):
    def __init__(self, config: BeamConfig):
        super().__init__(config)
        self.model = BeamModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @contextlib.contextmanager
    def attention_numerics(self, kernel: numerics.AttentionNumerics):
        """Within the block, every layer's attention rounds as `kernel` (`numerics.AttentionNumerics`:
        as a rollout engine reporting `attention_numerics == kernel` computes it); the spec again
        afterwards."""
        with numerics.attention_kernels((m for m in self.modules() if isinstance(m, BeamAttention)), kernel):
            yield self

    @classmethod
    def from_pretrained(cls, path, *args, dtype: torch.dtype = torch.bfloat16, device="cpu", **kwargs):
        """Strict load of a Beam checkpoint directory (`load_checkpoint`)."""
        for passed_by_auto_classes in ("config", "revision", "trust_remote_code", "adapter_kwargs"):
            kwargs.pop(passed_by_auto_classes, None)
        if args or kwargs:
            raise TypeError(f"BeamForCausalLM.from_pretrained takes (path, dtype=, device=); got extra {args} {sorted(kwargs)}")
        return load_checkpoint(path, dtype=dtype, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: BeamKVCache | None = None,
        use_cache: bool = False,
        routed_experts: torch.Tensor | None = None,
    ) -> BeamCausalLMOutput:
        """input_ids [B, T]; position_ids default to continuing the cache; `routed_experts`
        [B, T, moe_layers, top_k] replays those experts (R3)."""
        B, T = input_ids.shape
        if cache is None and use_cache:
            cache = BeamKVCache(len(self.model.layers))
        if position_ids is None:
            start = cache.seq_len if cache is not None else 0
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        if routed_experts is not None:
            expected = (B, T, self.config.num_moe_layers, self.config.num_experts_per_tok)
            if tuple(routed_experts.shape) != expected:
                raise ValueError(
                    f"routed_experts has shape {tuple(routed_experts.shape)}; expected [batch, tokens, moe_layers, top_k] = {expected}"
                )
        hidden, ids = self.model(input_ids, position_ids, cache, routed_experts)
        logits = numerics.lm_head_logits(hidden, self.lm_head.weight, self.config.final_logit_softcapping)
        return BeamCausalLMOutput(logits=logits, routed_experts=ids, cache=cache, hidden_states=hidden)

    @torch.no_grad()
    def greedy_generate(self, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True) -> torch.Tensor:
        """Greedy continuation [B, max_new_tokens] (argmax, lowest id on ties)."""
        out: list[torch.Tensor] = []
        cache = BeamKVCache(len(self.model.layers)) if use_cache else None
        ids, step_input = input_ids, input_ids
        for _ in range(max_new_tokens):
            logits = self(step_input if use_cache else ids, cache=cache, use_cache=use_cache).logits
            nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
            out.append(nxt)
            ids = torch.cat([ids, nxt], dim=1)
            step_input = nxt
        return torch.cat(out, dim=1)


# -- construction, loading and Auto-class registration -------------------------------------------
def init_weights(model: BeamForCausalLM, seed: int) -> BeamForCausalLM:
    """Seeded, device-independent initialisation (drawn in FP32 on CPU in checkpoint order).

    Embedding ~ N(0, 1): the residual stream starts at unit variance, and since every sublayer
    output is post-normed (unit RMS with unit norm weights) and added as
    h <- sqrt((n-1)/n) h + x / sqrt(n), it keeps unit variance at every depth. Linear weights
    ~ N(0, 1/fan_in) keep each projection's output at the scale of its input; norm weights are 1,
    output-gate biases and router correction biases 0.
    """
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    with torch.no_grad():
        for name, spec in checkpoint_tensors(model.config).items():
            if spec.kind == "norm" or name.endswith(("gate_bias", "e_score_correction_bias")):
                value = torch.ones(spec.shape) if spec.kind == "norm" else torch.zeros(spec.shape)
            elif spec.kind == "embedding":
                value = torch.randn(spec.shape, generator=gen)
            else:
                value = torch.randn(spec.shape, generator=gen) / math.sqrt(spec.shape[-1])
            state[name].copy_(value)
    return model


def build_model(config: BeamConfig, *, seed: int | None = 0, dtype=torch.bfloat16, device="cpu") -> BeamForCausalLM:
    """A reference model of `config`, seeded-initialised (seed=None: weights left empty)."""
    model = BeamForCausalLM(config)
    if seed is not None:
        init_weights(model, seed)
    return model.to(device=device, dtype=dtype).eval()


def load_checkpoint(path: str | os.PathLike, *, dtype=torch.bfloat16, device="cpu") -> BeamForCausalLM:
    """Strictly load a reference model from a checkpoint directory; router tensors stay FP32."""
    config = load_config(path)
    with torch.device("meta"):
        model = BeamForCausalLM(config)
    model.load_state_dict(load_state_dict(path, config, dtype=dtype, device=device), strict=True, assign=True)
    return model.eval()


def register_auto() -> None:
    """Register beam-rl's `beam` with transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers >= 5.2x ships its own `beam`; ours replaces it so that `AutoConfig` /
    # `AutoModelForCausalLM` on a Beam checkpoint give beam-rl's validated config and reference model.
    AutoConfig.register("beam", BeamConfig, exist_ok=True)
    AutoModelForCausalLM.register(BeamConfig, BeamForCausalLM, exist_ok=True)

"""Beam's checkpoint tensors as data: every released HF name with its shape and storage dtype.

One table serves the checkpoint loader (missing / extra / wrongly-shaped tensors), the memory
planner (parameter counts come from here, not from a model instance) and the engines' weight
maps. Shapes use symbolic sizes resolved from a `BeamConfig`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from beam_rl.model.config import BeamConfig

# Per-layer tensors under `model.layers.{i}.`; sizes are keys of `_sizes()`.
ATTENTION_TENSORS: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("hidden",),
    "post_attention_layernorm.weight": ("hidden",),
    "pre_feedforward_layernorm.weight": ("hidden",),
    "post_feedforward_layernorm.weight": ("hidden",),
    "self_attn.q_proj.weight": ("q_width", "hidden"),
    "self_attn.k_proj.weight": ("kv_width", "hidden"),
    "self_attn.v_proj.weight": ("kv_width", "hidden"),
    "self_attn.gate_proj.weight": ("q_width", "hidden"),
    "self_attn.gate_bias": ("heads",),
    "self_attn.o_proj.weight": ("hidden", "q_width"),
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
}
DENSE_MLP_TENSORS: dict[str, tuple[str, ...]] = {
    "mlp.gate_proj.weight": ("d_ff", "hidden"),
    "mlp.up_proj.weight": ("d_ff", "hidden"),
    "mlp.down_proj.weight": ("hidden", "d_ff"),
}
ROUTER_TENSORS: dict[str, tuple[str, ...]] = {
    "mlp.gate.weight": ("experts", "hidden"),
    "mlp.gate.e_score_correction_bias": ("experts",),
}
# Per expert under `model.layers.{i}.mlp.experts.{e}.`
EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "gate_proj.weight": ("moe_d_ff", "hidden"),
    "up_proj.weight": ("moe_d_ff", "hidden"),
    "down_proj.weight": ("hidden", "moe_d_ff"),
}
GLOBAL_TENSORS: dict[str, tuple[str, ...]] = {
    "model.embed_tokens.weight": ("vocab", "hidden"),
    "model.norm.weight": ("hidden",),
    "lm_head.weight": ("vocab", "hidden"),
}
# Kept in FP32 whatever the model dtype (router weight, accumulation and logits are FP32).
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # embedding | lm_head | norm | attention | dense_mlp | router | expert
    layer: int | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.name.endswith(FP32_SUFFIXES) else model_dtype


def _sizes(config: BeamConfig) -> dict[str, int]:
    return {
        "hidden": config.hidden_size,
        "q_width": config.num_attention_heads * config.head_dim,
        "kv_width": config.num_key_value_heads * config.head_dim,
        "heads": config.num_attention_heads,
        "head_dim": config.head_dim,
        "d_ff": config.intermediate_size,
        "moe_d_ff": config.moe_intermediate_size,
        "experts": config.num_experts,
        "vocab": config.vocab_size,
    }


def _kind(suffix: str) -> str:
    if "norm" in suffix:
        return "norm"
    return "attention" if suffix.startswith("self_attn.") else "dense_mlp"


def checkpoint_tensors(config: BeamConfig) -> dict[str, TensorSpec]:
    """Every tensor a Beam checkpoint of this config holds, by released HF name, in file order."""
    size = _sizes(config)
    specs: dict[str, TensorSpec] = {}

    def add(name: str, dims: tuple[str, ...], kind: str, layer=None, expert=None) -> None:
        specs[name] = TensorSpec(name, tuple(size[d] for d in dims), kind, layer, expert)

    add("model.embed_tokens.weight", GLOBAL_TENSORS["model.embed_tokens.weight"], "embedding")
    for i, mlp_type in enumerate(config.mlp_layer_types):
        prefix = f"model.layers.{i}."
        for suffix, dims in ATTENTION_TENSORS.items():
            add(prefix + suffix, dims, _kind(suffix), i)
        if mlp_type == "dense":
            for suffix, dims in DENSE_MLP_TENSORS.items():
                add(prefix + suffix, dims, "dense_mlp", i)
            continue
        for suffix, dims in ROUTER_TENSORS.items():
            add(prefix + suffix, dims, "router", i)
        for e in range(config.num_experts):
            for suffix, dims in EXPERT_TENSORS.items():
                add(f"{prefix}mlp.experts.{e}.{suffix}", dims, "expert", i, e)
    add("model.norm.weight", GLOBAL_TENSORS["model.norm.weight"], "norm")
    add("lm_head.weight", GLOBAL_TENSORS["lm_head.weight"], "lm_head")
    return specs


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 (16 hex digits) of a tensor's dtype, shape and raw bytes: equal iff bit-identical."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]

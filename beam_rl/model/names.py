"""The HF <-> Megatron weight-name table and the PEFT adapter key format, as data.

One table serves checkpoint conversion (`beam_rl.megatron.convert`), LoRA adapters
(`beam_rl.megatron.lora`), weight sync and the Megatron-Bridge mapping registry. HF names are the
released ones (`beam_rl.model.weights`); Megatron names are those of Megatron-Core's GPT model with
Beam's layer spec. `{layer}` / `{expert}` stand for the layer and expert numbers. `shard` says how
the Megatron tensor is split over tensor parallelism:

- `replicated`: norms, Q/K norm weights, router weight and expert bias (FP32);
- `column`: split dim 0 (q/k/v/gate projections, gate bias per head, vocab rows);
- `row`: split dim 1 (o_proj, down projections);
- `glu`: two HF tensors (gate_proj, up_proj) -> Megatron's fused fc1, [gate_r; up_r] per rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    hf: tuple[str, ...]
    megatron: str
    shard: str  # replicated | column | row | glu


_L = "model.layers.{layer}."
_M = "decoder.layers.{layer}."
_E = "mlp.experts.{expert}."
_ME = "mlp.experts.local_experts.{expert}."
MAPPINGS: tuple[Mapping, ...] = (
    Mapping(("model.embed_tokens.weight",), "embedding.word_embeddings.weight", "column"),
    Mapping(("model.norm.weight",), "decoder.final_layernorm.weight", "replicated"),
    Mapping(("lm_head.weight",), "output_layer.weight", "column"),
    Mapping((_L + "input_layernorm.weight",), _M + "input_layernorm.weight", "replicated"),
    Mapping((_L + "post_attention_layernorm.weight",), _M + "post_self_attn_layernorm.weight", "replicated"),
    Mapping((_L + "pre_feedforward_layernorm.weight",), _M + "pre_mlp_layernorm.weight", "replicated"),
    Mapping((_L + "post_feedforward_layernorm.weight",), _M + "post_mlp_layernorm.weight", "replicated"),
    Mapping((_L + "self_attn.q_proj.weight",), _M + "self_attention.linear_q.weight", "column"),
    Mapping((_L + "self_attn.k_proj.weight",), _M + "self_attention.linear_k.weight", "column"),
    Mapping((_L + "self_attn.v_proj.weight",), _M + "self_attention.linear_v.weight", "column"),
    Mapping((_L + "self_attn.gate_proj.weight",), _M + "self_attention.linear_gate.weight", "column"),
    Mapping((_L + "self_attn.gate_bias",), _M + "self_attention.gate_bias", "column"),
    Mapping((_L + "self_attn.o_proj.weight",), _M + "self_attention.linear_proj.weight", "row"),
    Mapping((_L + "self_attn.q_norm.weight",), _M + "self_attention.q_layernorm.weight", "replicated"),
    Mapping((_L + "self_attn.k_norm.weight",), _M + "self_attention.k_layernorm.weight", "replicated"),
    Mapping((_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), _M + "mlp.linear_fc1.weight", "glu"),
    Mapping((_L + "mlp.down_proj.weight",), _M + "mlp.linear_fc2.weight", "row"),
    Mapping((_L + "mlp.gate.weight",), _M + "mlp.router.weight", "replicated"),
    Mapping((_L + "mlp.gate.e_score_correction_bias",), _M + "mlp.router.expert_bias", "replicated"),
    Mapping((_L + _E + "gate_proj.weight", _L + _E + "up_proj.weight"), _M + _ME + "linear_fc1.weight", "glu"),
    Mapping((_L + _E + "down_proj.weight",), _M + _ME + "linear_fc2.weight", "row"),
)
_BY_HF = {pattern: m for m in MAPPINGS for pattern in m.hf}
_NUM = re.compile(r"(layers|experts)\.(\d+)\.")


def hf_pattern(name: str) -> tuple[str, dict[str, int]]:
    """'model.layers.3.mlp.experts.7.up_proj.weight' -> ('model.layers.{layer}.mlp.experts.{expert}.up_proj.weight', {layer: 3, expert: 7})."""
    idx: dict[str, int] = {}

    def sub(m: re.Match) -> str:
        key = "layer" if m.group(1) == "layers" else "expert"
        idx[key] = int(m.group(2))
        return f"{m.group(1)}.{{{key}}}."

    return _NUM.sub(sub, name), idx


def mapping_for(hf_name: str) -> tuple[Mapping, dict[str, int]]:
    pattern, idx = hf_pattern(hf_name)
    if pattern not in _BY_HF:
        raise KeyError(f"no Megatron mapping for HF tensor {hf_name!r} (pattern {pattern!r}); add a row to MAPPINGS")
    return _BY_HF[pattern], idx


# -- LoRA / PEFT ---------------------------------------------------------------------------------
LORA_MODULES: dict[str, tuple[str, ...]] = {
    m.megatron[: -len(".weight")]: tuple(h[: -len(".weight")] for h in m.hf)
    for m in MAPPINGS
    if m.shard in ("column", "row", "glu") and "{layer}" in m.megatron and m.megatron.endswith(".weight")
}
"""Megatron linear module pattern -> the HF module pattern(s) its adapter(s) stand for (two for the
fused [gate | up] fc1, a routed expert's too). Embeddings, the LM head and routers get no adapters."""

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def peft_key(hf_module: str, matrix: str) -> str:
    """PEFT's tensor name for one adapter matrix: 'base_model.model.<HF module>.lora_<A|B>.weight'
    (A [r, in], B [out, r]); what vLLM's LoRA loader reads."""
    if matrix not in ("A", "B"):
        raise ValueError(f"peft_key: matrix must be 'A' or 'B', got {matrix!r}")
    return f"base_model.model.{hf_module}.lora_{matrix}.weight"

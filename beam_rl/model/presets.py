"""Named Beam shapes, as data. `get_preset(name)` returns a validated `BeamConfig`.

- `beam-1.0-501b`: the released shape (501B total, ~23B active).
- `beam-mini`: the GPU workhorse (~1.2B total, ~0.3B active, head_dim 128), every feature on.
- `beam-tiny`: every feature on, small enough for the CPU test suite (head_dim 32 for vLLM's CPU
  attention, window 16 so test sequences cross it, 2 NoPE layers, groups of 4 experts).
"""

from __future__ import annotations

from beam_rl.model.config import BeamConfig, default_layer_types, default_mlp_layer_types

PRESETS: dict[str, dict] = {
    "beam-1.0-501b": dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=20480,
        num_hidden_layers=52,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=1048576,
        sliding_window=512,
        layer_types=default_layer_types(52, full_every=6),
        mlp_layer_types=default_mlp_layer_types(52, num_dense=3),
        moe_intermediate_size=2560,
        num_experts=256,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        final_logit_softcapping=30.0,  # transformers' upstream Beam config default
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None},
    ),
    "beam-mini": dict(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=16,  # q width 2048 != hidden 1024, as in the real model
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=32768,
        sliding_window=512,
        layer_types=default_layer_types(12, full_every=6),  # NoPE at 1-based 6 and 12
        mlp_layer_types=default_mlp_layer_types(12, num_dense=2),
        moe_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None},
    ),
    "beam-tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=6,  # q width 192 != hidden 128
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        sliding_window=16,
        layer_types=default_layer_types(6, full_every=3),  # NoPE at 1-based 3 and 6
        mlp_layer_types=default_mlp_layer_types(6, num_dense=1),
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None},
    ),
}


def get_preset(name: str, **overrides) -> BeamConfig:
    """Build the named preset's config; `overrides` replace individual fields."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return BeamConfig(**{**PRESETS[name], **overrides})

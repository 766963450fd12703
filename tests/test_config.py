import json

import pytest
from transformers import AutoConfig

from beam_rl.model import BeamConfig, BeamConfigError, get_preset
from beam_rl.model.modeling import register_auto
from beam_rl.model.presets import PRESETS

RELEASED_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "sliding_window", "layer_types", "mlp_layer_types", "moe_intermediate_size",
    "num_experts_per_tok", "num_experts", "norm_topk_prob", "n_group", "topk_group",
    "routed_scaling_factor", "final_logit_softcapping", "rope_parameters",
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_roundtrip_json(name, tmp_path):
    config = get_preset(name)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "beam"
    assert saved["architectures"] == ["BeamForCausalLM"]
    assert RELEASED_KEYS <= set(saved)
    again = BeamConfig.from_json_file(str(tmp_path / "config.json"))
    assert {k: getattr(again, k) for k in RELEASED_KEYS} == {k: getattr(config, k) for k in RELEASED_KEYS}


def test_501b_layer_pattern():
    c = get_preset("beam-1.0-501b")
    full_1based = [i + 1 for i in c.full_attention_layer_ids]
    assert full_1based == [6, 12, 18, 24, 30, 36, 42, 48, 52]
    assert c.layer_types.count("sliding_attention") == 43
    assert c.mlp_layer_types[:3] == ["dense"] * 3 and c.moe_layer_ids == list(range(3, 52))
    assert (c.num_attention_heads * c.head_dim, c.hidden_size) == (6144, 5120)


def test_tiny_has_every_feature():
    c = get_preset("beam-tiny")
    assert "dense" in c.mlp_layer_types and c.num_moe_layers >= 3
    assert "sliding_attention" in c.layer_types and "full_attention" in c.layer_types
    assert c.n_group > 1 and c.topk_group < c.n_group and c.final_logit_softcapping
    assert c.num_attention_heads * c.head_dim != c.hidden_size
    assert c.sliding_window < 64 and c.head_dim in (32, 64)


def test_auto_config_registration():
    register_auto()
    config = AutoConfig.for_model("beam", **PRESETS["beam-tiny"])
    assert isinstance(config, BeamConfig)


BAD = [
    (dict(layer_types=["sliding_attention"] * 5), "layer_types", "has 5 entries"),
    (dict(layer_types=["sliding_attention"] * 5 + ["global"]), "layer_types", "entry 5 is 'global'"),
    (dict(mlp_layer_types=["dense"] * 5 + ["moe"]), "mlp_layer_types", "entry 5"),
    (dict(num_key_value_heads=4), "num_key_value_heads", "does not divide"),
    (dict(n_group=3), "n_group", "does not divide num_experts"),
    (dict(topk_group=5), "topk_group", "> n_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok", "cannot be picked"),
    (dict(n_group=16), "n_group", ">= 2 experts"),
    (dict(head_dim=48), "head_dim", "not supported"),
    (dict(hidden_act="gelu"), "hidden_act", "silu"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings", "untied"),
    (dict(hidden_size=0), "hidden_size", "positive integer"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor", "> 0"),
    (dict(final_logit_softcapping=-1.0), "final_logit_softcapping", "positive"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_parameters.rope_type", "default"),
    (dict(rope_parameters={"sliding_attention": {"rope_theta": 1e4}, "full_attention": {"rope_theta": 1e4}}), "rope_parameters.full_attention", "NoPE"),
    (dict(rope_parameters={"rope_type": "default"}), "rope_parameters.rope_theta", "positive"),
]


@pytest.mark.parametrize("overrides,field,message", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_configs_name_the_field(overrides, field, message):
    with pytest.raises(BeamConfigError) as err:
        get_preset("beam-tiny", **overrides)
    assert f"BeamConfig.{field}:" in str(err.value)
    assert message in str(err.value)


def test_unknown_preset():
    with pytest.raises(KeyError, match="beam-tiny"):
        get_preset("beam-huge")


def test_flat_rope_parameters_are_nested_like_the_release():
    c = get_preset("beam-tiny", rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert c.rope_parameters == {"sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}
    assert c.to_dict()["rope_parameters"]["full_attention"] is None  # written in the released layout
    assert c.sliding_rope_theta == 5e5

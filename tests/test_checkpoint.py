"""Checkpoints: released names, bit-exact round trips, seeded init, and errors naming the tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from beam_rl.model import get_preset
from beam_rl.model.checkpoint import CheckpointError, save_checkpoint
from beam_rl.model.modeling import build_model, load_checkpoint
from beam_rl.model.modeling import BeamForCausalLM
from beam_rl.model.weights import checkpoint_tensors


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("preset", ["beam-tiny", "beam-mini", "beam-1.0-501b"])
def test_tensor_table_matches_model(preset):
    config = get_preset(preset, num_hidden_layers=5, layer_types=None, mlp_layer_types=None) if preset != "beam-tiny" else get_preset(preset)
    with torch.device("meta"):
        model = BeamForCausalLM(config)
    state = model.state_dict()
    specs = checkpoint_tensors(config)
    assert list(state) == list(specs) or set(state) == set(specs)
    for name, spec in specs.items():
        assert tuple(state[name].shape) == spec.shape, name


def test_released_names(tiny_config):
    names = set(checkpoint_tensors(tiny_config))
    assert "model.layers.0.mlp.gate_proj.weight" in names  # dense layer 0
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in names
    assert "model.layers.2.self_attn.gate_bias" in names and "lm_head.weight" in names


def test_roundtrip_is_bit_exact(tiny_model, tiny_checkpoint):
    loaded = load_checkpoint(tiny_checkpoint)
    assert_same_state(tiny_model, loaded)
    stored = load_file(tiny_checkpoint / "model.safetensors")
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert stored["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert json.loads((tiny_checkpoint / "config.json").read_text())["model_type"] == "beam"


def test_sharded_roundtrip(tiny_model, tmp_path):
    path = save_checkpoint(tiny_model, tmp_path / "sharded", max_shard_bytes=1 << 20)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_same_state(tiny_model, load_checkpoint(path))


def test_auto_model_loads_strictly(tiny_model, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    from beam_rl.model.modeling import register_auto

    register_auto()
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    assert isinstance(model, BeamForCausalLM)
    assert_same_state(tiny_model, model)


def test_seeded_init_is_deterministic(tiny_config):
    a, b, c = (build_model(tiny_config, seed=s) for s in (7, 7, 8))
    assert_same_state(a, b)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def _corrupt(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    bad = _corrupt(tiny_checkpoint, tmp_path / "bad", lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.2\.self_attn\.k_norm\.weight"):
        load_checkpoint(bad)


def test_extra_tensor_is_named(tiny_checkpoint, tmp_path):
    bad = _corrupt(tiny_checkpoint, tmp_path / "bad", lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor.*shared_expert"):
        load_checkpoint(bad)


def test_wrong_shape_is_named(tiny_checkpoint, tmp_path):
    def shrink(t):
        t["model.layers.3.mlp.experts.4.down_proj.weight"] = t["model.layers.3.mlp.experts.4.down_proj.weight"][:, :-1].contiguous()

    bad = _corrupt(tiny_checkpoint, tmp_path / "bad", shrink)
    with pytest.raises(CheckpointError, match=r"experts\.4\.down_proj\.weight has shape \(128, 63\), config expects \(128, 64\)"):
        load_checkpoint(bad)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(get_preset("beam-tiny").to_dict()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(tmp_path)


def test_save_replaces_atomically(tiny_model, tmp_path):
    path = save_checkpoint(tiny_model, tmp_path / "ck")
    (path / "stale.txt").write_text("old")
    save_checkpoint(tiny_model, path)
    assert not (path / "stale.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ck.tmp")]

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


# -- strict inputs: a checkpoint that is not exactly Beam is refused, naming what is wrong ---------

def _edit_config(src, dst, change):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("sliding_window"), r"missing key\(s\) \['sliding_window'\]"),
    (lambda c: c.pop("final_logit_softcapping"), r"missing key\(s\) \['final_logit_softcapping'\]"),
    (lambda c: c.pop("num_experts"), r"missing key\(s\) \['num_experts'\]"),
    (lambda c: c.update(model_type="llama"), "model_type is 'llama'"),
    (lambda c: c.update(norm_topk_prob="true"), "norm_topk_prob must be true or false, got 'true'"),
    (lambda c: c.update(num_experts=16.0), "num_experts must be a positive integer, got 16.0"),
])
def test_config_keys_that_define_beam_are_strict(tiny_checkpoint, tmp_path, change, message):
    from transformers import AutoConfig

    from beam_rl.model.checkpoint import load_config
    from beam_rl.model.config import BeamConfigError
    from beam_rl.model.modeling import register_auto

    bad = _edit_config(tiny_checkpoint, tmp_path / "bad", change)
    with pytest.raises(BeamConfigError, match=message):
        load_config(bad)
    if "model_type" not in message:  # transformers' loading path (vLLM's) is strict too
        register_auto()
        with pytest.raises(BeamConfigError, match=message):
            AutoConfig.from_pretrained(bad)


@pytest.mark.parametrize("corrupt, message", [
    (lambda t: t.update({"model.layers.1.mlp.gate.weight": t["model.layers.1.mlp.gate.weight"].bfloat16()}),
     r"mlp.gate.weight is stored as torch.bfloat16; router tensors must be stored in FP32"),
    (lambda t: t["model.layers.2.self_attn.q_proj.weight"].view(-1).__setitem__(5, float("nan")),
     r"q_proj.weight holds 1 non-finite value"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}),
     r"model.norm.weight is stored as torch.int32; Beam weights are floating point"),
])
def test_tensors_are_stored_as_beam_needs_them(tiny_checkpoint, tmp_path, corrupt, message):
    bad = _corrupt(tiny_checkpoint, tmp_path / "bad", corrupt)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(bad)


def test_truncated_file_and_bad_json_are_named(tiny_checkpoint, tmp_path):
    import shutil

    from beam_rl.model.checkpoint import load_config

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors.*is the file complete\?"):
        load_checkpoint(bad)
    (bad / "config.json").write_text('{"model_type": "beam",')
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON \(line 1"):
        load_config(bad)


def test_cli_input_errors_are_one_line(tiny_checkpoint, tmp_path, capsys):
    from beam_rl.cli import main

    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1 2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"beam-rl generate: error: {tmp_path}: no config.json; is this a Beam checkpoint directory?"]
    assert main(["plan", "--preset", "beam-tiny", "--gpus", "0"]) == 2
    assert capsys.readouterr().err.strip() == "beam-rl plan: error: --gpus must be a whole number >= 1, got 0"
    assert main(["plan", "--preset", "beam-tiny", "--gpu-gib", "nan"]) == 2
    assert "--gpu-gib must be a positive number" in capsys.readouterr().err
    with pytest.raises(CheckpointError):  # --debug: the traceback
        main(["generate", "--checkpoint", str(tmp_path), "--prompt-ids", "1 2", "--debug"])


def test_gap_and_eval_check_the_checkpoint_before_any_engine(tiny_checkpoint, tmp_path, capsys):
    """A checkpoint with a NaN: `gap` and `eval` refuse it in one line before vLLM starts."""
    from beam_rl.cli import main

    bad = _corrupt(tiny_checkpoint, tmp_path / "bad", lambda t: t["lm_head.weight"].view(-1).__setitem__(0, float("inf")))
    assert main(["gap", "--checkpoint", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("beam-rl gap: error:") and "lm_head.weight holds 1 non-finite" in err[0]
    assert main(["eval", "--data", "builtin", "--checkpoint", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("beam-rl eval: error:") and "lm_head.weight holds 1 non-finite" in err[-1]


def _fingerprint_by_definition(t: torch.Tensor) -> str:
    """`tensor_checksum`'s docstring in plain Python integers."""
    import hashlib

    raw = t.reshape(-1).contiguous().view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    total = 0
    for i, w in enumerate(words.tolist()):
        x = (w % 2**64) ^ (i * 0x9E3779B97F4A7C15 % 2**64)
        x ^= x >> 30
        x = x * 0xBF58476D1CE4E5B9 % 2**64
        x ^= x >> 27
        x = x * 0x94D049BB133111EB % 2**64
        x ^= x >> 31
        total = (total + x) % 2**64
    key = f"{t.dtype}|{tuple(t.shape)}|{words.element_size()}|{total:016x}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def test_tensor_checksums_follow_their_definition_for_any_batching(monkeypatch):
    import beam_rl.model.weights as weights

    g = torch.Generator().manual_seed(0)
    tensors = {f"bf16_{i}": torch.randn(3 + 37 * i, generator=g).to(torch.bfloat16) for i in range(6)}
    tensors.update(fp32=torch.randn(5, 7, generator=g), odd_bytes=torch.arange(7, dtype=torch.uint8),
                   int16=torch.arange(3, dtype=torch.int16), scalar=torch.tensor(3.0), empty=torch.zeros(0),
                   strided=torch.randn(6, 8, generator=g)[:, ::2], offset_view=torch.randn(9, generator=g).bfloat16()[1:6])
    want = {name: _fingerprint_by_definition(t) for name, t in tensors.items()}
    assert weights.tensor_checksums(tensors.items()) == want
    assert {name: weights.tensor_checksum(t) for name, t in tensors.items()} == want
    monkeypatch.setattr(weights, "_BATCH_WORDS", 5)  # tensors split over batches, batches of several tensors
    assert weights.tensor_checksums(tensors.items()) == want
    flipped = tensors["bf16_3"].clone()
    flipped.view(torch.int16)[17] ^= 1
    swapped = tensors["bf16_3"].clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    others = {weights.tensor_checksum(flipped), weights.tensor_checksum(swapped),
              weights.tensor_checksum(tensors["bf16_3"].view(2, -1)), weights.tensor_checksum(tensors["bf16_3"].half())}
    assert want["bf16_3"] not in others and len(others) == 4

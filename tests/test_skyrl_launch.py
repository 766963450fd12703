"""`beam-rl launch` against the installed SkyRL 0.3.0, on CPU: --dry-run of every recipe prints a
config that SkyRL's own `validate_cfg` accepts when read back; bad inputs are one line, exit 2,
naming the key, and nothing starts (Ray is never initialised here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from beam_rl.cli import main
from beam_rl.skyrl._compat import skyrl_module

from skyrl_available import needs_skyrl  # noqa: E402

pytestmark = needs_skyrl

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["dapo-bf16", "dapo-lora", "dapo-mxfp8", "dapo-bf16-501b", "dapo-math-bf16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The arithmetic task data (as `python -m beam_rl.skyrl.data` writes it) and a real beam-tiny
    checkpoint with the task tokenizer: overrides that point a recipe at them."""
    from beam_rl.model.checkpoint import save_checkpoint
    from beam_rl.model.modeling import build_model
    from beam_rl.model.presets import get_preset
    from beam_rl.skyrl.data import task_from_recipe, write_data, write_tokenizer

    tmp = tmp_path_factory.mktemp("skyrl-launch")
    paths = write_data(task_from_recipe(str(ROOT / "recipes/mini-h200.yaml")), tmp / "data")
    ckpt = save_checkpoint(build_model(get_preset("beam-tiny"), seed=0), tmp / "beam-tiny")
    write_tokenizer(ckpt)
    data = [f"data.train_data=[{paths['train']}]", f"data.val_data=[{paths['validation']}]"]
    return {"data": data, "ckpt": f"trainer.policy.model.path={ckpt}", "tmp": tmp}


def launch(*argv):
    return main(["launch", *map(str, argv)])


def read_back(text: str):
    """The printed YAML -> SkyRL's typed config (Beam's algorithm fields included)."""
    import yaml
    from omegaconf import OmegaConf

    from beam_rl.skyrl.config import config_class

    return config_class().from_dict_config(OmegaConf.create(yaml.safe_load(text)))


@pytest.mark.parametrize("name", RECIPES)
def test_dry_run_output_passes_skyrls_validate_cfg(files, capsys, name):
    from beam_rl.skyrl import register

    assert launch(ROOT / f"recipes/skyrl/{name}.yaml", "--dry-run", *files["data"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# beam-rl launch {ROOT}/recipes/skyrl/{name}.yaml") and "not started: --dry-run" in out
    cfg = read_back(out)
    register()
    skyrl_module("skyrl.train.utils").validate_cfg(cfg)  # SkyRL's own checks, on what was printed

    t, ie, mc = cfg.trainer, cfg.generator.inference_engine, cfg.trainer.policy.megatron_config
    assert mc.moe_enable_routing_replay and ie.enable_return_routed_experts and ie.distributed_executor_backend == "mp"
    assert t.algorithm.dynamic_sampling.type == "filter" and t.max_training_steps >= 8
    assert ie.engine_init_kwargs["async_scheduling"] is True
    assert ie.engine_init_kwargs["worker_extension_cls"] == "beam_rl.skyrl.vllm_worker.NewInferenceWorkerWrap"
    assert t.placement.colocate_all
    if name == "dapo-bf16-501b":  # the plan's layout on 128 GPUs
        assert (t.placement.policy_num_nodes * t.placement.policy_num_gpus_per_node, mc.tensor_model_parallel_size,
                mc.expert_model_parallel_size, ie.num_engines, ie.tensor_parallel_size) == (128, 2, 128, 16, 8)
        assert "preset beam-1.0-501b" in out
    else:  # beam-mini on ONE GPU, trainer and vLLM sharing it
        assert t.placement.policy_num_gpus_per_node == ie.num_engines * ie.tensor_parallel_size == 1
    mode = {"dapo-lora": "bf16", "dapo-mxfp8": "mxfp8-emulated"}.get(name, "bf16")
    assert mc.transformer_config_kwargs["beam_mode"] == mode
    assert (t.policy.model.lora.rank > 0) == (name == "dapo-lora")
    # the MXFP8 rollout quantises its linears' inputs as the trainer does (EngineSettings.linear_precision)
    precision = (ie.engine_init_kwargs.get("hf_overrides") or {}).get("beam_linear_precision", "bf16")
    assert precision == ("mxfp8" if mode == "mxfp8-emulated" else "bf16")


def test_resolved_config_travels_to_ray(files, tmp_path):
    """The run hands the typed config (dataclasses made at run time) to a Ray task in another
    process: Ray's cloudpickle must rebuild it there, fields and Beam's algorithm fields included."""
    import subprocess
    import sys

    import ray.cloudpickle

    from beam_rl.skyrl.launch import resolve

    cfg, summary = resolve(str(ROOT / "recipes/skyrl/dapo-bf16.yaml"), [*files["data"], files["ckpt"]], dry_run=True)
    assert any(line.startswith("model: ") and line.endswith("config.json") for line in summary)  # the checkpoint's shape
    (tmp_path / "cfg.pkl").write_bytes(ray.cloudpickle.dumps(cfg))
    code = (f"import dataclasses, ray.cloudpickle as p; c = p.loads(open({str(tmp_path / 'cfg.pkl')!r}, 'rb').read()); "
            "d = dataclasses.asdict(c); print(d['trainer']['algorithm']['overlong_cache_length'], d['trainer']['policy']['model']['path'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["3", cfg.trainer.policy.model.path], out.stderr[-2000:]


def one_line_error(capsys, *argv) -> str:
    assert launch(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("beam-rl launch: error: "), err
    return err


BF16 = ROOT / "recipes/skyrl/dapo-bf16.yaml"


def test_unknown_key(files, capsys):
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], "trainer.algorithm.eps_clip_hihg=0.3")
    assert "unknown key trainer.algorithm.eps_clip_hihg" in err and "trainer.algorithm.eps_clip_high" in err


def test_unknown_key_in_the_recipe_file(files, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"beam:\n  base: {BF16}\ngenerator:\n  inference_engine:\n    tensor_paralel_size: 2\n")
    err = one_line_error(capsys, bad, "--dry-run", *files["data"])
    assert "unknown key generator.inference_engine.tensor_paralel_size" in err


def test_tp_not_dividing_heads(files, capsys):
    # beam-tiny: 6 heads, 2 KV heads; 4 GPUs with TP 4 fit the GPUs but not the heads
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], files["ckpt"],
                         "trainer.placement.policy_num_gpus_per_node=4", "generator.inference_engine.num_engines=4",
                         "trainer.policy.megatron_config.tensor_model_parallel_size=4")
    assert "trainer.policy.megatron_config.tensor_model_parallel_size: TP 4 does not divide" in err
    assert "num_attention_heads=6" in err and "config.json" in err


def test_vllm_tp_not_dividing_heads(files, capsys):
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], files["ckpt"],
                         "trainer.placement.policy_num_gpus_per_node=4", "generator.inference_engine.tensor_parallel_size=4")
    assert "generator.inference_engine.tensor_parallel_size: 4 does not divide num_attention_heads=6" in err


def test_ep_not_dividing_experts_on_paper(files, capsys):
    err = one_line_error(capsys, ROOT / "recipes/skyrl/dapo-bf16-501b.yaml", "--dry-run", *files["data"],
                         "trainer.placement.policy_num_nodes=24", "generator.inference_engine.num_engines=24",
                         "trainer.policy.megatron_config.expert_model_parallel_size=192")
    assert "expert_model_parallel_size: EP 192 does not divide num_experts=256" in err and "beam-1.0-501b" in err


def test_gpus_not_matching_layout(files, capsys):
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], "trainer.policy.megatron_config.tensor_model_parallel_size=2")
    assert "TP 2 x PP 1 x CP 1 = 2 does not divide the 1 policy GPUs" in err


def test_missing_checkpoint_dir(files, capsys, tmp_path):
    gone = tmp_path / "no-such-checkpoint"
    err = one_line_error(capsys, BF16, *files["data"], f"trainer.policy.model.path={gone}")  # a launch, not a dry run
    assert f"trainer.policy.model.path: '{gone}' holds no Beam checkpoint" in err
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], f"trainer.policy.model.path={gone}", "beam.preset=null")
    assert "trainer.policy.model.path" in err and "beam.preset" in err


def test_checkpoint_without_chat_template(files, capsys, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    src = Path(files["ckpt"].split("=", 1)[1])
    shutil.copytree(src, ckpt, ignore=shutil.ignore_patterns("tokenizer*"))
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], f"trainer.policy.model.path={ckpt}")
    assert "chat template" in err and f"--tokenizer-into {ckpt}" in err


def test_missing_data_file(files, capsys, tmp_path):
    err = one_line_error(capsys, BF16, "--dry-run", files["data"][1], f"data.train_data=[{tmp_path}/train.parquet]")
    assert f"data.train_data[0]: {tmp_path}/train.parquet does not exist" in err and "python -m beam_rl.skyrl.data" in err


def test_beam_settings_named(files, capsys):
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], "generator.inference_engine.enable_return_routed_experts=false")
    assert "moe_enable_routing_replay" in err and "enable_return_routed_experts" in err
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], "trainer.flash_attn=true")
    assert err.endswith("trainer.flash_attn: true: Beam's attention (sliding window, SSMax, output gate) is beam-rl's module "
                        "without a FlashAttention path; set false")
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], "trainer.fused_lm_head_logprob=true")
    assert err.endswith("trainer.fused_lm_head_logprob: true: SkyRL's fused LM-head log-probs skip the model's output layer, "
                        "where Beam computes its FP32 logits and soft-caps them; set false")
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], "trainer.policy.megatron_config.tensor_model_parallel_size=two")
    assert "tensor_model_parallel_size='two': expected int" in err
    err = one_line_error(capsys, BF16, "--dry-run", *files["data"], "trainer.policy.megatron_config.moe_token_dispatcher_type=allgather")
    assert err.endswith("moe_token_dispatcher_type: allgather: SkyRL's Megatron worker sets variable_seq_lengths, which "
                        "megatron-core accepts with the alltoall or flex dispatcher only (ValueError at model init); set alltoall")


def test_launch_without_gpus_stops_before_ray(files, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPUs present: a launch would start")
    err = one_line_error(capsys, BF16, *files["data"], files["ckpt"])
    assert "trainer.placement.policy_num_gpus_per_node: 1 GPUs needed, 0 visible" in err
    import ray

    assert not ray.is_initialized()


def test_overrides_and_flags_in_any_order(files, capsys):
    assert launch(BF16, *files["data"], "--dry-run", "trainer.seed=3") == 0
    assert "\n  seed: 3\n" in capsys.readouterr().out

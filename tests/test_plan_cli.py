"""`beam-rl plan` numbers and the CLI."""

import json

import torch

from beam_rl.model import get_preset
from beam_rl.model.modeling import build_model
from beam_rl.cli import main
from beam_rl.plan import count_params, make_plan


def test_501b_plan_matches_launch_figures(capsys):
    assert main(["plan", "--preset", "beam-1.0-501b", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert abs(plan["total_params"] / 501e9 - 1) < 0.01
    assert abs(plan["active_params"] / 23e9 - 1) < 0.03
    assert plan["kv_bytes_per_token_bf16"] == 36864
    assert plan["kv_bytes_per_token_fp8"] == 18432
    assert plan["rollout"]["gpus_per_engine"] == 8
    # BF16 full fine-tuning of 501B cannot fit 8 GPUs; the plan says how many it needs
    assert plan["training"]["bf16"] is None and plan["training_min_gpus"]["bf16"]["num_gpus"] >= 64


def test_counts_equal_a_real_model(tiny_config):
    model = build_model(tiny_config, seed=None, dtype=torch.float32)
    counts = count_params(tiny_config)
    assert counts.total == sum(t.numel() for t in model.state_dict().values())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts.active == counts.total - expert + expert * tiny_config.num_experts_per_tok // tiny_config.num_experts


def test_mini_fits_one_h200_for_every_mode():
    plan = make_plan(get_preset("beam-mini"), "beam-mini", num_gpus=1)
    assert 1.0e9 < plan.total_params < 2.0e9 and 1e8 < plan.active_params < 6e8
    assert all(plan.training[m] for m in ("bf16", "mxfp8", "lora")) and plan.rollout


def test_plan_text_output(capsys):
    assert main(["plan", "--preset", "beam-mini", "--gpus", "2", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "beam-mini" in out and "KV per token" in out and "rollout" in out


def test_init_and_generate(tmp_path, capsys):
    assert main(["init", "--preset", "beam-tiny", "--out", str(tmp_path / "ck"), "--seed", "3"]) == 0
    assert main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prompt-ids", "1 2 3", "--max-new-tokens", "5"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(last.split()) == 5


def test_demo_main_job(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "identical with and without KV cache" in out and "501.27B" in out

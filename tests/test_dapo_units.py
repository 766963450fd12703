"""DAPO pieces on hand-computed examples (no engines)."""

import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from beam_rl.dapo.advantages import compute_advantages
from beam_rl.dapo.config import RecipeError, load_recipe, recipe_from_dict
from beam_rl.dapo.data import DataOrder, sampling_seed
from beam_rl.dapo.loss import LossSettings, aggregate, policy_loss
from beam_rl.dapo.overlong import overlong_keep, soft_overlong_penalty
from beam_rl.dapo.sampling import DynamicSampler, group_is_informative
from beam_rl.tasks.arithmetic import ArithmeticTask, Tokenizer, integer_reward


def test_group_normalised_advantages():
    adv = compute_advantages("grpo", torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))  # a constant group teaches nothing
    torch.testing.assert_close(compute_advantages("rloo", torch.tensor([[1.0, 0.0, 0.0]])), torch.tensor([[1.0, -0.5, -0.5]]))
    with pytest.raises(ValueError, match="dapo.advantage"):
        compute_advantages("nope", torch.zeros(1, 2))


def test_dapo_clip_higher_loss_and_gradient():
    ratio = torch.tensor([[1.5, 0.5, 1.1]])
    lp = ratio.log().requires_grad_(True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss("dapo", lp, old, adv, mask, LossSettings(eps_low=0.2, eps_high=0.28))
    # token 1: min(1.5, 1.28) * 1 -> -1.28 (clipped high); token 2: min(-0.5, -0.8) -> +0.8 (clipped low); token 3: -1.1
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1) / 3, abs=1e-6)
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == pytest.approx(1 / 3)
    loss.backward()
    # clipped tokens carry no gradient; d(-ratio * A)/d logprob = -ratio * A / 3 tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -1.1 / 3]]))


def test_eps_high_is_asymmetric():
    lp = torch.tensor([[math.log(1.25)]])
    loss_pos, _ = policy_loss("dapo", lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), LossSettings())
    assert loss_pos.item() == pytest.approx(-1.25)  # inside 1 + 0.28: not clipped (eps 0.2 would clip at 1.2)


def test_token_level_vs_sequence_level_aggregation():
    v = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert aggregate(v, mask, "token_mean").item() == pytest.approx(7 / 5)  # every token weighs the same
    assert aggregate(v, mask, "seq_mean_token_mean").item() == pytest.approx((1 + 3) / 2)
    assert aggregate(v, mask, "token_mean", normalizer=10.0).item() == pytest.approx(0.7)


def test_truncated_importance_sampling_and_no_kl_by_default():
    lp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[math.log(0.5), math.log(4.0)]])  # weights exp(old - rollout) = 2, 0.25
    adv, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    loss, _ = policy_loss("dapo", lp, old, adv, mask, LossSettings(tis_cap=1.5), rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-(1.5 + 0.25) / 2)  # the weight 2 is truncated at 1.5
    plain, _ = policy_loss("dapo", lp, old, adv, mask, LossSettings(), rollout_logprobs=rollout)
    assert plain.item() == pytest.approx(-1.0)  # kl_coef 0: the rollout log-probs do not enter
    with pytest.raises(ValueError, match="tis_cap"):
        policy_loss("dapo", lp, old, adv, mask, LossSettings(tis_cap=2.0))


def test_soft_overlong_punishment_and_filtering():
    # L_max 5, L_cache 2: free up to 3 tokens, then -1/2 per token, -1 beyond the cap
    assert [soft_overlong_penalty(n, 5, 2) for n in (1, 3, 4, 5, 6)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert soft_overlong_penalty(5, 5, 2, penalty_factor=0.5) == -0.5
    assert overlong_keep([False, True], filtering=True) == [True, False]
    assert overlong_keep([False, True], filtering=False) == [True, True]


def test_dynamic_sampling_drops_uniform_groups_and_caps_rounds():
    assert not group_is_informative([1, 1]) and not group_is_informative([0, 0]) and group_is_informative([0, 1])
    s = DynamicSampler(target=2, max_extra_rounds=1, oversample_factor=2.0)
    assert s.need() == 2
    s.add(["a", "b"], [[1, 1], [0, 1]])  # a is all-correct: dropped
    assert s.kept == ["b"] and s.need() == 4  # ceil(1 missing / (1 kept of 2 seen) * 2): one round at the rate seen fills it
    s.add(["c", "d"], [[0, 0], [0, 0]])
    assert s.kept == ["b"] and s.need() == 0  # the cap on extra rounds ends the step with what it has
    assert s.kept_fraction == pytest.approx(1 / 4)
    none_kept = DynamicSampler(target=4, max_extra_rounds=3, oversample_factor=1.25)
    none_kept.add(list("abcd"), [[0, 0]] * 4)
    assert none_kept.need() == 20  # nothing kept yet: sized at the floor rate 1/4, ceil(4 / 0.25 * 1.25)
    full = DynamicSampler(target=1, max_extra_rounds=3)
    full.add(["x", "y"], [[0, 1], [1, 0]])
    assert full.kept == ["x"] and full.need() == 0  # batch full: no extra round, extras dropped
    off = DynamicSampler(target=2, max_extra_rounds=3, enabled=False)
    off.add(["a", "b"], [[1, 1], [0, 0]])
    assert off.kept == ["a", "b"] and off.need() == 0


def test_recipe_unknown_key_and_bad_values_name_the_field(tmp_path):
    with pytest.raises(RecipeError, match=r"'dapo.eps_hgih'"):
        recipe_from_dict({"dapo": {"eps_hgih": 0.3}})
    with pytest.raises(RecipeError, match=r"'dapo.overlong.lenght'"):
        recipe_from_dict({"dapo": {"overlong": {"lenght": 3}}})
    with pytest.raises(RecipeError, match="train.mode"):
        recipe_from_dict({"train": {"mode": "fp4"}})
    with pytest.raises(RecipeError, match="train.attention"):
        recipe_from_dict({"train": {"attention": "fa3"}})
    with pytest.raises(RecipeError, match="rollout.group_size"):
        recipe_from_dict({"rollout": {"group_size": 1}})
    with pytest.raises(RecipeError, match="dapo.loss"):
        recipe_from_dict({"dapo": {"loss": "ppo2"}})
    with pytest.raises(RecipeError, match="run.seed: expected a number"):
        recipe_from_dict({"run": {"seed": "zero"}})
    for bad, message in (
        ({"rollout": {"group_size": 2.5}}, "rollout.group_size: expected a number, a whole one"),
        ({"rollout": {"sync_dir": 3}}, "rollout.sync_dir: expected a non-empty string"),
        ({"rollout": {"eval_samples": 0}}, "rollout.eval_samples: must be >= 1"),
        ({"rollout": {"kv_cache_gib": -1.0}}, "rollout.kv_cache_gib: must be > 0"),
        ({"rollout": {"gpu_kv_cache_gib": 0}}, "rollout.gpu_kv_cache_gib: must be > 0 GiB, or null"),
        ({"rollout": {"max_model_len": 8}}, r"rollout.max_model_len: 8 < the longest prompt \(5 tokens\) \+ rollout.max_response_tokens"),
        ({"model": {"checkpoint": str(tmp_path / "none")}}, "model.checkpoint: .* has no config.json"),
        ({"dapo": {"enable": True}}, "unknown recipe key 'dapo.enable'"),
        ({"train": {"betas": [0.9]}}, r"train.betas: expected a list of 2 numbers"),
        ({"train": {"mode": "lora", "lora": {"experts": True}}}, r"train.lora.experts: .* set train.lora.merge: true"),
        ({"warm_start": {"micro_batch_size": 0}}, "warm_start.micro_batch_size: must be >= 1, or null for train.micro_batch_size"),
    ):
        with pytest.raises(RecipeError, match=message):
            recipe_from_dict(bad)
    assert recipe_from_dict({"train": {"lr": "1e-3"}}).train.lr == 1e-3  # YAML 1.1 reads 1e-3 as a string
    (tmp_path / "broken.yaml").write_text("run:\n  seed: 1\n bad indent: 2\n")
    with pytest.raises(RecipeError, match=r"broken.yaml: line 3, column 2 is not valid YAML"):
        load_recipe(tmp_path / "broken.yaml")
    r = load_recipe("recipes/tiny-cpu.yaml")
    assert (r.dapo.eps_low, r.dapo.eps_high, r.dapo.kl_coef) == (0.2, 0.28, 0.0)
    assert load_recipe("recipes/mini-h200.yaml").model.preset == "beam-mini"


def test_math_task_recipe_checks_name_the_field():
    for bad, message in (
        ({"task": {"name": "gsm8k"}}, r"task.name: choose one of \['arithmetic', 'math'\]"),
        ({"task": {"name": "math", "levels": "14"}}, "task.levels: use digits from '123'"),
        ({"task": {"name": "math", "num_heldout": 0}}, "task.num_heldout: must be >= 1"),
        ({"task": {"name": "math"}, "rollout": {"max_response_tokens": 16, "max_model_len": 400}},
         r"rollout.max_response_tokens: 16 < the longest worked solution \(\d+ tokens\)"),
        ({"task": {"name": "math"}, "rollout": {"max_response_tokens": 64, "max_model_len": 128}},
         r"rollout.max_model_len: 128 < the longest prompt \(\d+ tokens\)"),
    ):
        with pytest.raises(RecipeError, match=message):
            recipe_from_dict(bad)


def test_recipe_base_chain(tmp_path, monkeypatch):
    """`base:` merges section by section, relative to the file, down a chain; loops and a missing
    base are refused by name. The recipes in recipes/math/ build on their warm-start recipe, those in
    recipes/tiny-cpu/ on the main job's (read from a directory without the checkpoints that a checkout's
    own runs may have written)."""
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "a.yaml").write_text("run:\n  seed: 3\n  total_steps: 7\ntrain:\n  lr: 1.0e-4\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("base: ../a.yaml\nrun:\n  total_steps: 9\n")
    (tmp_path / "c.yaml").write_text("base: sub/b.yaml\ntrain:\n  mode: lora\n")
    r = load_recipe(tmp_path / "c.yaml")
    assert (r.run.seed, r.run.total_steps, r.train.lr, r.train.mode) == (3, 9, 1e-4, "lora")
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(RecipeError, match="base:` chain loops"):
        load_recipe(tmp_path / "loop.yaml")
    (tmp_path / "orphan.yaml").write_text("base: nowhere.yaml\n")
    with pytest.raises(RecipeError, match="nowhere.yaml does not exist"):
        load_recipe(tmp_path / "orphan.yaml")
    monkeypatch.chdir(tmp_path)  # model.checkpoint is relative to the working directory
    warm = load_recipe(repo / "recipes/math/warm-mini-h200.yaml")
    assert (warm.task.name, warm.model.preset, warm.model.checkpoint) == ("math", "beam-mini", None)
    with pytest.raises(RecipeError, match="model.checkpoint: ckpt/math-mini-warm has no config.json"):
        load_recipe(repo / "recipes/math/no-r3.yaml")  # the runs start from the warm start's checkpoint: write it first
    # unvalidated (a setting of a recipe that ran): typed, without the checks, so without the checkpoint
    lora = load_recipe(repo / "recipes/math/lora.yaml", validate=False)
    assert (lora.run.total_steps, lora.train.mode, lora.train.lr) == (50, "lora", 5e-4)
    (tmp_path / "typo.yaml").write_text("run:\n  total_steps: many\n")
    with pytest.raises(RecipeError, match="run.total_steps"):
        load_recipe(tmp_path / "typo.yaml", validate=False)
    # the math suite's CPU rehearsal: beam-tiny on level 1, its runs from its own warm start
    rehearsal = load_recipe(repo / "recipes/math/tiny-cpu/warm.yaml")
    assert (rehearsal.model.preset, rehearsal.task.levels) == ("beam-tiny", "1")
    # each model at its own rate: the rehearsal keeps its sweep's best, beam-mini (8x wider) trains lower
    assert (rehearsal.train.lr, warm.train.lr) == (2e-4, 5e-5)
    with pytest.raises(RecipeError, match="model.checkpoint: ckpt/math-tiny-cpu-warm has no config.json"):
        load_recipe(repo / "recipes/math/tiny-cpu/bf16-lr5e-5.yaml")
    # the CPU set of four: the main job in each mode, from the same seeded warm start
    tiny = {m: load_recipe(repo / f"recipes/tiny-cpu/{m}.yaml") for m in ("bf16", "lora", "mxfp8", "no-r3")}
    assert {m: (r.train.mode, r.train.routing_replay) for m, r in tiny.items()} == {
        "bf16": ("bf16", True), "lora": ("lora", True), "mxfp8": ("mxfp8", True), "no-r3": ("bf16", False)}
    same = lambda r: (r.warm_start, r.model, r.task, r.run.seed)  # noqa: E731
    assert all(same(r) == same(tiny["bf16"]) for r in tiny.values())


def test_data_order_is_deterministic_and_resumable():
    a = DataOrder(5, seed=3)
    first = a.take(7)  # crosses an epoch
    state = a.state_dict()
    rest = a.take(6)
    b = DataOrder(5, seed=3)
    b.load_state_dict(state)
    assert b.take(6) == rest and sorted(first[:5]) == list(range(5))
    assert sampling_seed(0, 1, 0, 0) != sampling_seed(0, 1, 1, 0) != sampling_seed(0, 2, 0, 0)


def test_task_tokenizer_and_reward():
    tok = Tokenizer()
    task = ArithmeticTask(max_operand=9, ops="+", heldout_fraction=0.25)
    assert len(task.train) == 75 and len(task.heldout) == 25 and not set(task.train) & set(task.heldout)
    p = task.heldout[0]
    assert tok.decode(task.prompt_ids(p, tok)) == p.text and task.prompt_ids(p, tok)[0] == tok.bos_id
    good = task.answer_ids(p, tok)
    assert integer_reward(good, p.answer, tok) == 1.0
    assert integer_reward(good[:-1], p.answer, tok) == 0.0  # no </s>: truncated
    assert integer_reward(tok.encode(str(p.answer + 1)) + [tok.eos_id], p.answer, tok) == 0.0
    assert integer_reward(tok.encode("+") + [tok.eos_id], p.answer, tok) == 0.0
    assert tok.vocab_size <= 512
    with pytest.raises(ValueError, match="task.ops"):
        ArithmeticTask(ops="/")


def test_master_weights_keep_small_updates():
    from beam_rl.engines.megatron import MasterAdamW

    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([w], lr=1e-4)
    for _ in range(50):
        w.grad = torch.ones(4, dtype=torch.bfloat16)
        opt.step()
    # each 1e-4 step is below BF16's resolution at 1.0 (2^-7); the FP32 master accumulates them
    assert opt.master[0][0].item() == pytest.approx(1 - 50e-4, abs=1e-5)
    assert w[0].item() == pytest.approx(0.9951, abs=4e-3) and w[0].item() < 1.0


def test_master_adamw_refuses_an_optimizer_state_of_other_tensors():
    """A checkpoint's optimizer state for other trained tensors (per-expert LoRA adapters, say, where
    this model stacks them) is refused before anything is copied: a [r, in] tensor would otherwise
    broadcast into a stacked [experts, r, in] one."""
    from beam_rl.engines.megatron import MasterAdamW
    from beam_rl.errors import InputError

    stacked = torch.nn.Parameter(torch.zeros(3, 2, 4))
    per_expert = [torch.nn.Parameter(torch.ones(2, 4)) for _ in range(3)]
    opt = MasterAdamW([stacked], lr=1e-4)
    saved = MasterAdamW(per_expert, lr=1e-4).state_dict()
    with pytest.raises(InputError, match=r"3 trained tensors against 1, first difference at tensor 0 \(\(2, 4\) saved, \(3, 2, 4\) here\)"):
        opt.load_state_dict(saved)
    assert stacked.abs().sum() == 0
    opt.load_state_dict(MasterAdamW([torch.nn.Parameter(torch.ones(3, 2, 4))], lr=1e-4).state_dict())
    assert stacked.eq(1).all()


def test_metrics_resume_truncation_and_plot(tmp_path):
    from beam_rl.dapo.metrics import MetricsWriter, read_metrics
    from beam_rl.dapo.plot import plot_run

    w = MetricsWriter(tmp_path, tensorboard=False)
    phases = {"rollout_s": 2.0, "rollout_generate_s": 1.5, "rollout_grade_s": 0.1, "gpu_peak_allocated_gib": 40.0, "gpu_peak_reserved_gib": 50.0}
    for step in range(4):
        w.write({"step": step, "reward_mean": step / 4, "mean_abs_logprob_diff": 1e-4, **({"heldout_avg8": 0.1} if step % 2 == 0 else {}),
                 **(phases if step else {})})
    MetricsWriter(tmp_path, resume_step=1, tensorboard=False)  # a resume from step 1 drops steps 2, 3
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1]
    names = {p.name for p in plot_run(tmp_path)}
    # a panel per group present: the rollout phase's parts, a CUDA run's memory peaks
    assert {"reward_mean.png", "heldout_avg8.png", "mean_abs_logprob_diff.png", "rollout_s.png", "gpu_peak_allocated_gib.png"} <= names
    assert "sync_s.png" not in names
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path / "nothing")


def test_plot_compares_runs_a_line_per_run(tmp_path, capsys):
    from beam_rl.cli import main
    from beam_rl.dapo.metrics import MetricsWriter

    for name, slope in (("bf16", 0.1), ("no-r3", 0.05)):
        w = MetricsWriter(tmp_path / name, tensorboard=False)
        for step in range(3):
            w.write({"step": step, "heldout_avg8": 0.2 + slope * step, "reward_mean": slope * step, "response_length": 30.0,
                     "mean_abs_logprob_diff": 1e-3 * (1 + step)})
    runs = [str(tmp_path / "bf16"), str(tmp_path / "no-r3")]
    assert main(["plot", *runs, "--out", str(tmp_path / "cmp"), "--label", "bf16, R3", "--label", "bf16, no R3"]) == 0
    assert {p.name for p in (tmp_path / "cmp").iterdir()} == {"heldout_avg8.png", "reward_mean.png", "response_length.png",
                                                             "mean_abs_logprob_diff.png"}
    capsys.readouterr()
    assert main(["plot", *runs]) == 2  # several runs need a folder to compare them in
    assert "--out" in capsys.readouterr().err
    assert main(["plot", *runs, "--out", str(tmp_path / "cmp"), "--label", "one"]) == 2
    assert "--label given 1 times for 2 run directories" in capsys.readouterr().err


# -- run directories and checkpoints (nothing lost, nothing silent) --------------------------------

def _save_ckpt(run_dir, step, run_id, tiny_config):
    from beam_rl.dapo import checkpointing

    tensors = {"w": torch.full((4,), float(step))}
    return checkpointing.save(run_dir, step, tensors, tiny_config, {"run_id": run_id})


def test_prune_keeps_the_newest_checkpoints(tmp_path, tiny_config):
    from beam_rl.dapo import checkpointing

    paths = [_save_ckpt(tmp_path, step, "run-a", tiny_config) for step in (5, 10, 15)]
    assert checkpointing.prune(tmp_path, 2, paths[-1]) == [paths[0]]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000010", "step_000015"]
    assert checkpointing.latest(tmp_path, "run-a") == paths[-1]
    assert checkpointing.prune(tmp_path, 1, paths[1]) == []  # nothing older than step 10 is left; step 15 is newer
    with pytest.raises(RecipeError, match="run.keep_checkpoints: must be >= 1"):
        recipe_from_dict({"run": {"keep_checkpoints": 0}})


def test_latest_falls_back_past_a_damaged_checkpoint(tmp_path, tiny_config):
    from beam_rl.dapo import checkpointing

    _save_ckpt(tmp_path, 1, "run-a", tiny_config)
    second = _save_ckpt(tmp_path, 2, "run-a", tiny_config)
    assert checkpointing.latest(tmp_path, "run-a") == second
    with (second / "hf" / "model.safetensors").open("r+b") as f:  # one flipped byte in the weights
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    said = []
    assert checkpointing.latest(tmp_path, "run-a", log=said.append) == checkpointing.checkpoint_dir(tmp_path, 1)
    assert "step_000002" in said[0] and "differ from the checksums" in said[0]
    # a checkpoint of another run is never resumed from
    assert checkpointing.latest(tmp_path, "run-b", log=said.append) is None and "belongs to run run-a" in said[-1]


def test_fresh_start_refuses_an_earlier_run_unless_told(tmp_path):
    from beam_rl.dapo import rundir
    from beam_rl.dapo.config import RecipeError

    first = rundir.start_fresh(tmp_path, overwrite=False, recipe_dict={"a": 1})
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("the user's own file")
    with pytest.raises(RecipeError, match="--resume to continue it or --overwrite"):
        rundir.start_fresh(tmp_path, overwrite=False, recipe_dict={"a": 1})
    assert (tmp_path / "metrics.jsonl").read_text()  # untouched
    second = rundir.start_fresh(tmp_path, overwrite=True, recipe_dict={"a": 1})
    assert second != first and rundir.run_id_of(tmp_path) == second
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "notes.txt").exists()  # only what a run writes is removed


def test_resume_checks_recipe_and_metrics(tmp_path):
    from beam_rl.dapo import rundir
    from beam_rl.dapo.config import RecipeError, recipe_from_dict, recipe_to_dict

    recipe = recipe_to_dict(recipe_from_dict({}))
    rundir.start_fresh(tmp_path, overwrite=False, recipe_dict=recipe)
    longer = recipe_to_dict(recipe_from_dict({"run": {"total_steps": 50}}))
    rundir.check_same_recipe(tmp_path, longer)  # running longer is a resume
    with pytest.raises(RecipeError, match=r"differs from the run's in \['train.lr'\]"):
        rundir.check_same_recipe(tmp_path, recipe_to_dict(recipe_from_dict({"train": {"lr": 0.5}})))
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (0, 1, 2)))
    rundir.check_metrics_reach(tmp_path, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')  # truncated by an earlier mistake
    with pytest.raises(RecipeError, match=r"lacks step\(s\) \[1, 2\]"):
        rundir.check_metrics_reach(tmp_path, 2)


def test_resume_of_a_finished_run_does_nothing(tmp_path):
    """A finished run whose checkpoints were removed is not started over by --resume (its metrics kept)."""
    from beam_rl.dapo import rundir
    from beam_rl.dapo.config import RecipeError, recipe_from_dict, recipe_to_dict
    from beam_rl.dapo.loop import run_dapo

    recipe = recipe_from_dict({"run": {"total_steps": 2}})
    rundir.start_fresh(tmp_path, overwrite=False, recipe_dict=recipe_to_dict(recipe))
    rows = "".join(f'{{"step": {s}, "reward_mean": 0.{s}}}\n' for s in (0, 1, 2))
    (tmp_path / "metrics.jsonl").write_text(rows)
    assert rundir.finished(tmp_path, 2) and not rundir.finished(tmp_path, 3)
    said = []
    history = run_dapo(recipe, tmp_path, resume=True, log=said.append)
    assert [m["step"] for m in history] == [0, 1, 2] and (tmp_path / "metrics.jsonl").read_text() == rows
    assert said == [f"--resume: {tmp_path} has recorded all 2 steps; nothing to do"]
    with pytest.raises(RecipeError, match=r"differs from the run's in \['train.lr'\]"):
        run_dapo(recipe_from_dict({"run": {"total_steps": 2}, "train": {"lr": 0.5}}), tmp_path, resume=True, log=said.append)


def test_leftovers_of_killed_runs_are_removed(tmp_path):
    import json
    import subprocess
    import sys

    from beam_rl.dapo import rundir

    stale_tmp = tmp_path / "checkpoints" / ".step_000004.tmp-abc"
    stale_tmp.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    gone = shm / f"{rundir.SHM_PREFIX}test-dead-{dead.pid}"
    live = shm / f"{rundir.SHM_PREFIX}test-live-{os.getpid()}"
    for d, pid in ((gone, dead.pid), (live, os.getpid())):
        d.mkdir(exist_ok=True)
        (d / rundir.OWNER_FILE).write_text(json.dumps({"pid": pid}))
    try:
        removed = rundir.clean_leftovers(tmp_path)
        assert stale_tmp in removed and gone in removed and not stale_tmp.exists() and not gone.exists()
        assert live.exists()  # its process is alive
    finally:
        for d in (gone, live):
            shutil.rmtree(d, ignore_errors=True)


def test_resumed_metrics_hold_each_step_once(tmp_path):
    """After a resume from step 1, metrics.jsonl and TensorBoard hold every step once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torch.utils.tensorboard import SummaryWriter

    from beam_rl.dapo.metrics import MetricsWriter, read_metrics

    for i in range(1000):  # TensorBoard numbers a process's writers in its file names: the two below cross a digit (".9", ".10")
        SummaryWriter(str(tmp_path / "other" / str(i))).close()
        if set(str(int(next((tmp_path / "other" / str(i)).iterdir()).name.split(".")[-1]) + 1)) == {"9"}:
            break
    first = MetricsWriter(tmp_path)
    for step in (1, 2, 3):  # a run killed after step 3, its checkpoint at step 1
        first.write({"step": step, "reward_mean": float(step)})
    first.close()
    resumed = MetricsWriter(tmp_path, resume_step=1)
    for step in (2, 3):
        resumed.write({"step": step, "reward_mean": 10.0 * step})
    resumed.close()
    assert [(m["step"], m["reward_mean"]) for m in read_metrics(tmp_path)] == [(1, 1.0), (2, 20.0), (3, 30.0)]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_supervised_step_in_micro_batches_is_the_whole_batch_step(tiny_model, tiny_config):
    """The warm start's step accumulated over micro-batches (the recipe's train.micro_batch_size, so
    a big warm-start batch fits beside the rollout engine) is the one-batch step: the same loss, the
    mean over every response token of the batch, and the same updated weights up to FP32 summation
    order."""
    from beam_rl.engines import build_trainer

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 400, (6, 20), generator=g)
    lengths = torch.tensor([20, 14, 9, 20, 17, 11])
    prompts = torch.tensor([5, 3, 4, 8, 2, 6])
    got = []
    for micro in (None, 4):
        trainer = build_trainer(tiny_config, tiny_model.state_dict())
        trainer.make_optimizer(lr=1e-3)
        loss = trainer.supervised_step(ids, lengths, prompts, micro_batch_size=micro)
        got.append((loss, {k: v.float() for k, v in trainer.export().items()}))
    (whole, w_whole), (micro, w_micro) = got
    assert abs(whole - micro) < 1e-5 * abs(whole)
    moved = [k for k in w_whole if not torch.equal(w_whole[k], tiny_model.state_dict()[k].float())]
    assert moved, "the step changed no weight"
    worst = max((w_whole[k] - w_micro[k]).abs().max().item() for k in w_whole)
    differ = sum(int((w_whole[k] != w_micro[k]).sum()) for k in w_whole) / sum(v.numel() for v in w_whole.values())
    print(f"\nloss {whole:.6f} vs {micro:.6f}; {differ:.2e} of the weights differ, max|diff| {worst:.2e}")
    # Adam's first step moves a weight by ~lr whatever its gradient's size: a gradient near 0 whose
    # last bits differ can move it the other way (2 lr), then one BF16 rounding
    assert worst <= 2 * 1e-3 + 2**-8 and differ < 0.01


def test_a_compile_does_not_stop_a_warm_start_early(monkeypatch):
    """The time-limit estimate of the next step leaves out torch.compile's seconds: a first step that
    is mostly compilation (67 s of 74 on the H100) does not end the call's part of the run at once."""
    import time

    from beam_rl.dapo import warmstart
    from beam_rl.dapo.config import WarmStartConfig
    from beam_rl.tasks.arithmetic import Tokenizer

    compiled = {"s": 0.0}
    monkeypatch.setattr(warmstart, "torch_compile_seconds", lambda: compiled["s"])

    class Policy:  # the supervised step's timing only: the first step compiles for 0.5 s
        def supervised_step(self, ids, lengths, prompts, micro_batch_size=None):
            if not compiled["s"]:
                time.sleep(0.5)
                compiled["s"] = 0.5
            time.sleep(0.01)
            return 1.0

    recipe = recipe_from_dict({"run": {"total_steps": 1}, "model": {"preset": "beam-tiny"}})
    cfg = WarmStartConfig(steps=1000, batch_size=2)
    p = warmstart.warm_start(Policy(), recipe.task.build(), Tokenizer(), cfg, seed=0, log=lambda *_: None,
                             stop_by=time.monotonic() + 0.8)
    assert not p.finished and 5 <= p.step < 1000  # ~0.3 s left after step 1: room for many 0.01 s steps


def test_warm_start_writes_a_checkpoint_dapo_can_start_from(tmp_path):
    """`beam-rl warm-start`: the recipe's supervised steps on the real Megatron trainer, saved in the
    released format (strictly verified, FP32 routers), the loss falling; a non-empty --out is refused;
    a warm start stopped early resumes to the uninterrupted one's weights."""
    from beam_rl.dapo.warmstart import write_warm_start
    from beam_rl.model.checkpoint import read_tensors, verify_checkpoint

    recipe = recipe_from_dict({"run": {"seed": 0, "total_steps": 1}, "model": {"preset": "beam-tiny", "init_seed": 0},
                               "warm_start": {"steps": 6, "batch_size": 16, "lr": 1.0e-3, "micro_batch_size": 8}})
    out = tmp_path / "warm"
    done = write_warm_start(recipe, out, log=lambda *_: None)
    losses = done.losses
    assert done.finished and done.evals == [] and not (out / "warm_start.json").exists()  # no target: no evaluation
    assert len(losses) == 6 and losses[-1] < losses[0]
    config = verify_checkpoint(out)
    routers = {k: t for k, t in read_tensors(out, config) if k.endswith(("mlp.gate.weight", "e_score_correction_bias"))}
    assert routers and all(t.dtype == torch.float32 for t in routers.values())
    with pytest.raises(RecipeError, match="--out .* is not empty; pass --overwrite"):
        write_warm_start(recipe, out, log=lambda *_: None)
    with pytest.raises(RecipeError, match="warm_start.steps"):
        write_warm_start(recipe_from_dict({"run": {"total_steps": 1}, "model": {"preset": "beam-tiny"}, "warm_start": {"steps": 0}}),
                         tmp_path / "none", log=lambda *_: None)

    # stopped after step 3 (as a device call's time limit stops it), then resumed: the uninterrupted
    # run's problems, losses and weights, bit for bit
    part = tmp_path / "part"
    stopped = write_warm_start(recipe, part, stop_after=3, log=lambda *_: None)
    assert not stopped.finished and stopped.step == 3 and not (part / "config.json").exists()
    assert [p.name for p in (part / "checkpoints").iterdir()] == ["step_000003"]
    with pytest.raises(RecipeError, match="--out .* is not empty; pass --overwrite to replace it, --resume"):
        write_warm_start(recipe, part, log=lambda *_: None)
    changed = recipe_from_dict({"run": {"seed": 0, "total_steps": 1}, "model": {"preset": "beam-tiny", "init_seed": 0},
                                "warm_start": {"steps": 6, "batch_size": 16, "lr": 2.0e-3}})
    with pytest.raises(RecipeError, match="--resume: warm_start differs .* restore warm_start, or pass --overwrite"):
        write_warm_start(changed, part, resume=True, log=lambda *_: None)
    with pytest.raises(RecipeError, match="--overwrite and --resume contradict"):
        write_warm_start(recipe, part, resume=True, overwrite=True, log=lambda *_: None)
    again = write_warm_start(recipe, part, resume=True, max_seconds=0, log=lambda *_: None)  # no time for a second step
    assert not again.finished and again.step == 4 and [p.name for p in (part / "checkpoints").iterdir()] == ["step_000004"]
    resumed = write_warm_start(recipe, part, resume=True, log=lambda *_: None)
    assert resumed.finished and resumed.losses == losses and not (part / "checkpoints").exists()
    whole, parts = dict(read_tensors(out, config)), dict(read_tensors(part, config))
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)
    with pytest.raises(RecipeError, match="--resume: the warm start in .* is finished"):
        write_warm_start(recipe, part, resume=True, log=lambda *_: None)


def test_warm_start_evaluates_from_eval_from():
    """warm_start.eval_from: no evaluation before it, then every eval_every steps, and the last step."""
    from beam_rl.dapo.warmstart import initial_policy
    from beam_rl.model.presets import get_preset
    from beam_rl.tasks.arithmetic import Tokenizer

    recipe = recipe_from_dict({"run": {"seed": 0, "total_steps": 1}, "model": {"preset": "beam-tiny", "init_seed": 0},
                               "warm_start": {"steps": 7, "batch_size": 4, "target_heldout_avg": 0.9, "eval_every": 2,
                                              "eval_from": 3}})
    seen = []
    _, progress = initial_policy(recipe, get_preset("beam-tiny"), recipe.task.build(), Tokenizer(), log=lambda *_: None,
                                 evaluate=lambda policy: seen.append(len(seen)) or 0.0)
    assert [s for s, _ in progress.evals] == [4, 6, 7] and len(seen) == 3
    with pytest.raises(RecipeError, match="warm_start.eval_from: must be >= 0"):
        recipe_from_dict({"run": {"total_steps": 1}, "warm_start": {"eval_from": -1}})

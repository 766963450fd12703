"""Megatron Beam on one GPU (beam-mini): parity with the reference under R3, every mode builds,
trains one step. Skips cleanly without CUDA or megatron-core."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")

from beam_rl.checkpoint import build_model  # noqa: E402
from beam_rl.megatron import replay as r3  # noqa: E402
from beam_rl.megatron.cpu import init_single_process  # noqa: E402
from beam_rl.megatron.logprobs import sequence_logprobs  # noqa: E402
from beam_rl.megatron.provider import BeamModelProvider  # noqa: E402
from beam_rl.presets import get_preset  # noqa: E402

pytestmark = pytest.mark.gpu
B, T = 2, 1024  # crosses beam-mini's 512-token window


@pytest.fixture(scope="module")
def setup():
    init_single_process()
    config = get_preset("beam-mini")
    ref = build_model(config, seed=0, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        out = ref(ids)
    return config, ref, ids, out


def replay_gap(setup, mode, **kw):
    """|logprob(Megatron, replaying the reference's experts) - logprob(reference)| per token."""
    config, ref, ids, out = setup
    model = BeamModelProvider(config, mode=mode, **kw).provide_loaded(ref.state_dict()).eval()
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, ids, config=config, routed_experts=out.routed_experts)
    r3.clear_replay(model)
    want = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (lp - want).abs()


@pytest.mark.parametrize("attention_dtype", ["fp32", "bf16"])
def test_bf16_replay_parity_beam_mini(setup, attention_dtype):
    gap = replay_gap(setup, "bf16", attention_dtype=attention_dtype)
    print(f"\nbeam-mini BF16 ({attention_dtype} attention) replay: mean|logprob diff| = {gap.mean():.3e}, max = {gap.max():.3e}")
    assert gap.mean().item() < 0.01


def test_mxfp8_emulated_gap_beam_mini(setup):
    gap = replay_gap(setup, "mxfp8-emulated")
    print(f"\nbeam-mini MXFP8 (emulated) vs BF16 reference, replay: mean|logprob diff| = {gap.mean():.3e}")
    assert gap.mean().item() < 0.25


def test_training_step_with_recompute_and_replay(setup):
    config, ref, ids, out = setup
    model = BeamModelProvider(config, mode="bf16", recompute=True).provide_loaded(ref.state_dict()).train()
    lp, mask = sequence_logprobs(model, ids, config=config, routed_experts=out.routed_experts)
    (-(lp * mask).mean()).backward()
    r3.clear_replay(model)
    routers = r3.model_routers(model.module)
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)

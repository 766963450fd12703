"""The reference model: routing capture and replay, KV cache, FP32 router, residual variance,
and parity with transformers' own Beam implementation."""

import pytest
import torch

from beam_rl.model.modeling import build_model


def tokens(config, batch, length, seed=0):
    return torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_router_stays_fp32(tiny_model):
    for layer in tiny_model.model.layers:
        if layer.is_moe:
            assert layer.mlp.gate.weight.dtype == torch.float32
            assert layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
            assert layer.mlp.experts[0].up_proj.weight.dtype == torch.bfloat16
    assert tiny_model.lm_head.weight.dtype == torch.bfloat16


def test_forward_returns_fp32_logits_and_routing(tiny_model, tiny_config):
    out = tiny_model(tokens(tiny_config, 2, 24))
    assert out.logits.shape == (2, 24, tiny_config.vocab_size) and out.logits.dtype == torch.float32
    assert out.routed_experts.shape == (2, 24, tiny_config.num_moe_layers, tiny_config.num_experts_per_tok)
    assert out.logits.abs().max() <= tiny_config.final_logit_softcapping
    # every token picks distinct experts
    ids = out.routed_experts.sort(dim=-1).values
    assert (ids[..., 1:] != ids[..., :-1]).all()


def test_replaying_own_routing_is_identical(tiny_model, tiny_config):
    ids = tokens(tiny_config, 2, 30)
    out = tiny_model(ids)
    replayed = tiny_model(ids, routed_experts=out.routed_experts)
    assert torch.equal(replayed.logits, out.logits)
    assert torch.equal(replayed.routed_experts, out.routed_experts)


def test_replay_forces_other_experts_and_router_gets_gradient(tiny_config):
    model = build_model(tiny_config, seed=3, dtype=torch.float32).train()
    ids = tokens(tiny_config, 1, 20)
    free = model(ids)
    forced = torch.stack(
        [torch.randperm(tiny_config.num_experts, generator=torch.Generator().manual_seed(i))[: tiny_config.num_experts_per_tok]
         for i in range(20 * tiny_config.num_moe_layers)]
    ).view(1, 20, tiny_config.num_moe_layers, -1)
    out = model(ids, routed_experts=forced)
    assert torch.equal(out.routed_experts, forced)
    assert not torch.allclose(out.logits, free.logits)
    out.logits.log_softmax(-1)[..., 0].sum().backward()
    routers = [layer.mlp.gate.weight for layer in model.model.layers if layer.is_moe]
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in routers)


def test_replay_shape_mismatch_is_refused(tiny_model, tiny_config):
    ids = tokens(tiny_config, 1, 8)
    bad = torch.zeros(1, 8, tiny_config.num_moe_layers - 1, tiny_config.num_experts_per_tok, dtype=torch.long)
    with pytest.raises(ValueError, match="moe_layers"):
        tiny_model(ids, routed_experts=bad)


def test_generation_with_and_without_kv_cache_is_identical(tiny_model, tiny_config):
    prompts = tokens(tiny_config, 3, 10, seed=5)
    cached = tiny_model.greedy_generate(prompts, 64, use_cache=True)
    full = tiny_model.greedy_generate(prompts, 64, use_cache=False)
    assert cached.shape == (3, 64)
    assert torch.equal(cached, full)  # 74 positions: well past the 16-token window


def test_batched_equals_one_by_one(tiny_model, tiny_config):
    ids = tokens(tiny_config, 3, 21)
    batched = tiny_model(ids)
    for b in range(3):
        single = tiny_model(ids[b : b + 1])
        assert torch.equal(single.logits[0], batched.logits[b])
        assert torch.equal(single.routed_experts[0], batched.routed_experts[b])


def test_fresh_model_residual_stream_has_unit_variance(tiny_config):
    model = build_model(tiny_config, seed=0, dtype=torch.float32)
    seen = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda mod, args, out: seen.append(out[0].var().item()))
    model(tokens(tiny_config, 4, 64))
    assert len(seen) == tiny_config.num_hidden_layers
    assert all(0.85 < v < 1.15 for v in seen), seen


def test_matches_transformers_upstream_beam_in_fp32(tiny_config, tmp_path):
    """Independent check of the architecture: transformers ships its own Beam (5.2x+)."""
    upstream = pytest.importorskip("transformers.models.beam.modeling_beam", reason="this transformers has no Beam")
    from beam_rl.model.checkpoint import save_checkpoint

    model = build_model(tiny_config, seed=1, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial gate and correction biases
        for layer in model.model.layers:
            layer.self_attn.gate_bias.copy_(torch.randn(tiny_config.num_attention_heads, generator=g))
            if layer.is_moe:
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(tiny_config.num_experts, generator=g) * 0.1)
    save_checkpoint(model, tmp_path / "ckpt")
    theirs = upstream.BeamForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ids = tokens(tiny_config, 2, 40)  # crosses the 16-token window
    with torch.no_grad():
        diff = (model(ids).logits - theirs(ids).logits).abs().max().item()
    assert diff < 1e-4, diff

"""HF <-> Megatron conversion (bit-exact, TP2/EP2 sharding as pure tensor ops), LoRA in PEFT
format, and emulated MXFP8 on beam-tiny (CPU)."""

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from beam_rl.model.modeling import build_model  # noqa: E402
from beam_rl.megatron import lora  # noqa: E402
from beam_rl.megatron.convert import Layout, export_hf, hf_to_megatron, shard, unshard  # noqa: E402
from beam_rl.model.names import MAPPINGS, mapping_for  # noqa: E402
from beam_rl.megatron.cpu import init_single_process  # noqa: E402
from beam_rl.megatron.logprobs import sequence_logprobs  # noqa: E402
from beam_rl.megatron.mxfp8 import mxfp8_fake_quant, served_weights  # noqa: E402
from beam_rl.model.mxfp8 import mxfp8_quantize  # noqa: E402
from beam_rl.megatron.provider import BeamModelProvider  # noqa: E402
from beam_rl.model.weights import checkpoint_tensors  # noqa: E402


@pytest.fixture(scope="module")
def world():
    init_single_process()


def build(config, ref, mode, **kw):
    return BeamModelProvider(config, mode=mode, **kw).provide_loaded(ref.state_dict()).eval()


def test_hf_megatron_hf_bit_exact(world, tiny_model, tiny_config):
    model = build(tiny_config, tiny_model, "bf16")
    hf = tiny_model.state_dict()
    back = list(export_hf(model, tiny_config))
    assert [n for n, _ in back] == list(checkpoint_tensors(tiny_config)), "export must stream in checkpoint order"
    for name, t in back:
        assert t.dtype == hf[name].dtype and torch.equal(t, hf[name]), name
    assert dict(back)["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_every_hf_name_has_one_mapping(tiny_config):
    used = {mapping_for(n)[0] for n in checkpoint_tensors(tiny_config)}
    assert used == set(MAPPINGS)


@pytest.mark.parametrize("kind", ["column", "row", "glu", "replicated"])
def test_shard_unshard_tp2(kind):
    g = torch.Generator().manual_seed(0)
    tensors = (torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g))[: 2 if kind == "glu" else 1]
    parts = [shard(tensors, kind, r, 2) for r in range(2)]
    if kind == "glu":  # rank r holds [gate_r; up_r]
        assert torch.equal(parts[1], torch.cat([tensors[0][4:], tensors[1][4:]]))
    for got, want in zip(unshard(parts, kind), tensors):
        assert torch.equal(got, want)


def test_hf_to_megatron_tp2_ep2_layouts_reassemble(tiny_model, tiny_config):
    hf = tiny_model.state_dict()
    ranks = {(tp, ep): hf_to_megatron(hf, tiny_config, Layout(tp_rank=tp, tp_size=2, ep_rank=ep, ep_size=2)) for tp in range(2) for ep in range(2)}
    per_rank = tiny_config.num_experts // 2
    assert ranks[0, 0]["decoder.layers.0.self_attention.linear_q.weight"].shape[0] == hf["model.layers.0.self_attn.q_proj.weight"].shape[0] // 2
    assert ranks[1, 0]["decoder.layers.0.self_attention.gate_bias"].shape == (tiny_config.num_attention_heads // 2,)
    e = per_rank + 3  # lives on EP rank 1 as local expert 3
    fc1 = [ranks[tp, 1]["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"] for tp in range(2)]
    gate, up = unshard(fc1, "glu")
    assert torch.equal(gate, hf[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"])
    assert torch.equal(up, hf[f"model.layers.2.mlp.experts.{e}.up_proj.weight"])
    o = unshard([ranks[tp, 0]["decoder.layers.4.self_attention.linear_proj.weight"] for tp in range(2)], "row")[0]
    assert torch.equal(o, hf["model.layers.4.self_attn.o_proj.weight"])
    # pipeline stage 2 of 2: layers 3..5 become local 0..2
    stage = hf_to_megatron(hf, tiny_config, Layout(layer_offset=3, num_layers=3))
    assert torch.equal(stage["decoder.layers.0.input_layernorm.weight"], hf["model.layers.3.input_layernorm.weight"])
    assert not any(k.startswith("decoder.layers.3.") for k in stage)


def test_conversion_errors_name_the_tensor(world, tiny_model, tiny_config):
    hf = dict(tiny_model.state_dict())
    hf.pop("model.layers.2.self_attn.gate_bias")
    with pytest.raises(KeyError, match="gate_bias"):
        hf_to_megatron(hf, tiny_config)


@pytest.mark.parametrize("experts", [False, True], ids=["attention-and-dense", "with-experts"])
def test_lora_peft_roundtrip(world, tiny_config, tmp_path, experts):
    """The Megatron adapters saved in PEFT's format: PEFT on the reference model computes the same
    logits, and the merged export is PEFT's merge (the routed experts' adapters included)."""
    peft = pytest.importorskip("peft")
    ref = build_model(tiny_config, seed=0, dtype=torch.float32)
    model = build(tiny_config, ref, "fp32")
    adapted = lora.add_lora(model, r=4, alpha=8, targets=lora.DEFAULT_TARGETS + (lora.EXPERT_TARGETS if experts else ()))
    moe_layers = tiny_config.mlp_layer_types.count("sparse")
    # attention x5 per layer + dense fc1/fc2 (+ fc1/fc2 of every routed expert)
    assert len(adapted) == 5 * tiny_config.num_hidden_layers + 2 * (tiny_config.num_hidden_layers - moe_layers) + (
        2 * tiny_config.num_experts * moe_layers if experts else 0)
    assert all(not p.requires_grad or ".lora." in n for n, p in model.named_parameters())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    lora.save_peft_adapter(model, tmp_path, tiny_config, r=4, alpha=8)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and "model.layers.0.mlp.up_proj" in cfg["target_modules"]
    assert any("experts" in m for m in cfg["target_modules"]) == experts
    lc = peft.LoraConfig.from_pretrained(str(tmp_path))
    lc.task_type = None  # the reference is not a GenerationMixin; vLLM reads the saved CAUSAL_LM config
    peft_model = peft.PeftModel.from_pretrained(ref, str(tmp_path), config=lc)
    ids = torch.randint(0, tiny_config.vocab_size, (2, 24), generator=g)
    with torch.no_grad():
        want = peft_model(ids).logits
        got = model(ids, torch.arange(24).expand(2, 24), None)
        diff = (got - want).abs().max().item()
        print(f"\nLoRA Megatron vs PEFT-on-reference FP32 max|logit diff| = {diff:.3e}")
        assert diff < 1e-4
        # merged full weights == PEFT's merge
        merged = dict(export_hf(model, tiny_config, transform=lora.merged_transform(model)))
        peft_merged = peft_model.merge_and_unload().state_dict()
    names = ["model.layers.3.self_attn.gate_proj.weight"]
    if experts:
        last = tiny_config.num_experts - 1
        names += [f"model.layers.1.mlp.experts.{last}.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        assert not torch.equal(merged[names[-1]], dict(export_hf(model, tiny_config))[names[-1]])  # the delta is there
    for name in names:
        torch.testing.assert_close(merged[name], peft_merged[name], atol=1e-6, rtol=1e-6)


def test_mxfp8_quantizer_format():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 96, generator=g) * torch.logspace(-3, 3, 96)
    values, exp = mxfp8_quantize(x)
    assert values.dtype == torch.float8_e4m3fn and exp.shape == (4, 3)
    dq = mxfp8_fake_quant(x)
    blocks, dblocks = x.view(4, 3, 32), dq.view(4, 3, 32)
    scale = torch.exp2(exp.float())[..., None]
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # E8M0: powers of two
    assert ((dblocks / scale).abs() <= 448).all()
    rel = ((dblocks - blocks).abs() / blocks.abs().amax(-1, keepdim=True)).max().item()
    assert rel <= 2**-4  # E4M3 keeps 3 mantissa bits relative to each block's max
    odd = torch.randn(3, 40, generator=g)
    assert mxfp8_fake_quant(odd).shape == odd.shape  # K not a multiple of 32 is padded


def test_mxfp8_emulation_changes_logprobs_boundedly(world, tiny_model, tiny_config):
    ids = torch.randint(0, tiny_config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routed = tiny_model(ids).routed_experts
        lps = {}
        for mode in ("bf16", "mxfp8-emulated"):
            model = build(tiny_config, tiny_model, mode)
            lps[mode], _ = sequence_logprobs(model, ids, config=tiny_config, routed_experts=routed)
    gap = (lps["bf16"] - lps["mxfp8-emulated"]).abs()
    print(f"\nMXFP8 (emulated) vs BF16 under replay: mean|logprob diff| = {gap.mean().item():.3e}, max = {gap.max().item():.3e}")
    # A random beam-tiny has peaked logits (unit-variance stream, no training), so 3-bit mantissas
    # move its log-probs more than a trained model's; the bound guards against a broken quantiser.
    assert 0 < gap.mean().item() < 0.25


def test_mxfp8_served_weights_are_what_the_linears_compute_with(world, tiny_model, tiny_config):
    """The export a rollout serves (`served_weights`): every emulated-MXFP8 linear's weight (attention
    q/k/v/gate/o, dense and expert gate/up/down) quantised and dequantised, exactly as its forward
    uses it, the rest (router, norms, embeddings, LM head) untouched; the plain export (checkpoints)
    keeps the unquantised weights. A BF16 model has nothing to transform."""
    model = build(tiny_config, tiny_model, "mxfp8-emulated")
    plain, served = dict(export_hf(model, tiny_config)), dict(export_hf(model, tiny_config, transform=served_weights(model)))
    assert list(plain) == list(served) and torch.equal(plain["model.layers.0.self_attn.q_proj.weight"],
                                                       tiny_model.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    quantised = [n for n in plain if n.endswith("_proj.weight")]  # the router is mlp.gate.weight
    moe = tiny_config.num_moe_layers
    assert len(quantised) == tiny_config.num_hidden_layers * 5 + 3 * (moe * tiny_config.num_experts + tiny_config.num_hidden_layers - moe)
    for name in plain:
        want = mxfp8_fake_quant(plain[name]) if name in quantised else plain[name]
        assert served[name].dtype == plain[name].dtype and torch.equal(served[name], want), name
    assert not torch.equal(served[quantised[0]], plain[quantised[0]])
    assert served_weights(build(tiny_config, tiny_model, "bf16")) is None
    # the same by HF name, for sources with no Megatron model (`beam-rl sync --serve mxfp8`)
    from beam_rl.megatron.mxfp8 import SERVED_HF_WEIGHT, serve_hf_weight

    assert [n for n in plain if SERVED_HF_WEIGHT.fullmatch(n)] == quantised
    assert all(torch.equal(serve_hf_weight(n, plain[n]), served[n]) for n in plain)


def test_unknown_provider_mode_names_the_choices(tiny_config):
    with pytest.raises(ValueError, match=r"mode='mxfp8-te'; choose one of \('bf16', 'fp32', 'mxfp8-emulated'\)"):
        BeamModelProvider(tiny_config, mode="mxfp8-te").transformer_config()

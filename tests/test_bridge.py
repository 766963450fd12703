"""Beam through Megatron-Bridge 0.3.1 (`AutoBridge`), the way SkyRL 0.3.0 builds and syncs it, on
beam-tiny (CPU, gloo, real megatron-core and Megatron-Bridge).

The bridge-built model must be beam-rl's: its config is `BeamModelProvider`'s, its loaded tensors
are `convert.hf_to_megatron`'s, its HF export is the checkpoint, and its log-probs (with and
without R3 replay) are `BeamModelProvider`'s, all bit for bit (its logits stay split by vocabulary
over TP, as SkyRL's log-prob function takes them: gathered here, and SkyRL's function checked on the
shards). TP2 with sequence parallelism
(expert TP 1 and 2) and EP2 run in one 2-process spawn, comparing each rank with the same-world
`BeamModelProvider` model.

Skips without megatron-bridge (`pytest.importorskip` cannot be used: importing `megatron.bridge`
needs the Transformer Engine stub of `beam_rl.megatron.bridge.import_megatron_bridge`).
"""

import dataclasses
import importlib.util
import os
import socket
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed: pip install --no-deps megatron-bridge==0.3.1", allow_module_level=True)

from beam_rl.megatron import replay as r3  # noqa: E402
from beam_rl.skyrl._compat import skyrl_module  # noqa: E402
from beam_rl.megatron.bridge import register_bridge  # noqa: E402
from beam_rl.megatron.convert import Layout, hf_to_megatron, load_hf_into_model  # noqa: E402
from beam_rl.megatron.cpu import init_single_process  # noqa: E402
from beam_rl.megatron.logprobs import sequence_logprobs  # noqa: E402
from beam_rl.megatron.provider import BeamModelProvider  # noqa: E402
from beam_rl.model.checkpoint import load_config, read_tensors  # noqa: E402

B, T = 2, 40  # T > sliding_window (16); even, for sequence parallelism
LENGTHS, PROMPTS = torch.tensor([40, 29]), torch.tensor([1, 5])  # row 1 right-padded
# SkyRL sets the alltoall dispatcher (beam-rl's own trainer uses allgather). Under expert parallelism
# the two add a token's expert outputs in different orders (allgather: each rank's partial sum, then
# the reduce-scatter; alltoall: one scatter-add in global expert order), so their FP32 sums can differ
# in the last bit and a later BF16 rounding or router choice can flip: the bitwise comparison of the
# bridge's model with the provider's is made under SkyRL's dispatcher.
SKYRL_DISPATCH = dict(overrides=dict(moe_token_dispatcher_type="alltoall"))
# world -> init_single_process kwargs, SkyRL-side provider sizes, the matching BeamModelProvider kwargs
WORLDS = {
    "tp2-sp": dict(init=dict(tensor_parallel=2), skyrl=dict(tp=2),
                   beam=dict(tensor_model_parallel_size=2, sequence_parallel=True, **SKYRL_DISPATCH)),
    # SkyRL's default expert TP (unset: ETP = TP)
    "tp2-sp-etp2": dict(init=dict(tensor_parallel=2, expert_tensor_parallel=2), skyrl=dict(tp=2, etp=2),
                        beam=dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2,
                                  **SKYRL_DISPATCH)),
    "ep2": dict(init=dict(expert_parallel=2), skyrl=dict(ep=2), beam=dict(expert_model_parallel_size=2, **SKYRL_DISPATCH)),
}


def skyrl_settings(provider, *, tp=1, ep=1, etp=1, gpu=False):
    """What SkyRL 0.3.0's `MegatronWorker.init_configs` sets on the provider, with the beam-rl recipe's
    values (flash attention and grouped GEMM off, R3 on; SkyRL always sets `variable_seq_lengths`, which
    megatron-core accepts with the alltoall dispatcher only), then `finalize()`. `gpu=False` (models
    run here): no activation recompute, the recipe's expert TP. `gpu=True`: SkyRL's defaults for
    those (full recompute, expert TP unset)."""
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = 1
    provider.pipeline_dtype = torch.bfloat16
    provider.context_parallel_size = 1
    provider.expert_model_parallel_size = ep
    provider.expert_tensor_parallel_size = None if gpu else etp
    provider.sequence_parallel = tp > 1
    provider.attention_backend = "fused"
    provider.variable_seq_lengths = True
    provider.masked_softmax_fusion = True
    provider.moe_token_dispatcher_type = "alltoall"
    provider.moe_router_load_balancing_type = "none"
    provider.moe_aux_loss_coeff = 0.0
    provider.moe_router_dtype = "fp32"
    provider.moe_grouped_gemm = False
    provider.moe_enable_routing_replay = True
    if gpu:  # SkyRL's default transformer_config_kwargs
        provider.recompute_granularity, provider.recompute_method, provider.recompute_num_layers = "full", "uniform", 1
        provider.recompute_modules = ["core_attn"]
    else:  # trainer.gradient_checkpointing=false
        provider.recompute_granularity = provider.recompute_method = provider.recompute_num_layers = None
    provider.gradient_accumulation_fusion = False
    provider.mtp_num_layers = None
    provider.finalize()
    return provider


def build_from_bridge(bridge, **sizes):
    """SkyRL's `make_megatron_module` without DDP (CPU: `use_cpu_initialization`, no `.cuda()`)."""
    provider = skyrl_settings(bridge.to_megatron_provider(), **sizes)
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True, bf16=True)


def checkpoint(path):
    config = load_config(path)
    return config, dict(read_tensors(path, config))


def exact(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def mismatches(want: dict, got: dict) -> list:
    return sorted(set(want) ^ set(got)) + [k for k in want if k in got and not exact(want[k], got[k])]


def inputs(config):
    ids = torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    ids[1, int(LENGTHS[1]):] = 0
    return ids


def logprobs(model, config, ids, routed, rows=slice(None)):
    with torch.no_grad():
        lp, mask = sequence_logprobs(model, ids[rows], config=config, lengths=LENGTHS[rows], prompt_lengths=PROMPTS[rows],
                                     routed_experts=None if routed is None else routed[rows])
    r3.clear_replay(model)
    return lp, mask


# -- one process (TP1) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bridge(tiny_checkpoint):
    init_single_process()
    register_bridge()
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def bridge_model(bridge):
    return build_from_bridge(bridge)


def test_import_keeps_megatron_core_without_transformer_engine(bridge):
    import megatron.core.extensions.transformer_engine as te_ext
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.transformer.attention as attention

    from beam_rl.megatron import bridge as mb

    assert not any(n.split(".")[0] == "transformer_engine" for n in sys.modules)
    assert importlib.util.find_spec("transformer_engine") is None
    assert not any(isinstance(f, mb._TEStubFinder) for f in sys.meta_path)
    assert (te_ext.HAVE_TE, specs.HAVE_TE, attention.HAVE_TE) == (False, False, False)
    stubbed = [m for m, mod in list(sys.modules.items()) if m.startswith("megatron.core") and mod is not None
               and any(isinstance(v, mb._StubModule) or (isinstance(v, type) and issubclass(v, mb._MissingTE))
                       for v in vars(mod).values())]
    assert not stubbed, f"megatron-core modules saw the Transformer Engine stub: {stubbed}"
    from megatron.bridge.peft import lora_layers

    with pytest.raises(RuntimeError, match="transformer_engine.pytorch.Linear needs Transformer Engine"):
        lora_layers.te.Linear(4, 4)
    assert register_bridge() is register_bridge()  # idempotent


def test_provider_is_beam_provider_config(bridge, tiny_config):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from beam_rl.megatron.bridge_model import BeamBridgeProvider

    provider = bridge.to_megatron_provider()
    provider.finalize()
    assert type(provider) is BeamBridgeProvider and provider.beam is bridge.hf_pretrained.config
    want = BeamModelProvider(tiny_config).transformer_config()
    # init methods are closures built by __post_init__; loading weights turns initialisation off
    skip = {"init_method", "output_layer_init_method", "embedding_init_method", "perform_initialization"}
    diff = {f.name: (getattr(provider, f.name), getattr(want, f.name)) for f in dataclasses.fields(TransformerConfig)
            if f.name not in skip and getattr(provider, f.name) != getattr(want, f.name)}
    assert not diff, f"bridge provider differs from BeamModelProvider's TransformerConfig: {diff}"
    assert provider.share_embeddings_and_output_weights is False and provider.vocab_size == tiny_config.vocab_size


def test_loaded_parameters_are_hf_to_megatron(bridge_model, ckpt):
    from beam_rl.megatron.layers import BeamGPTModel

    config, hf = ckpt
    inner = bridge_model[0].module
    assert type(inner) is BeamGPTModel
    got = {k: v for k, v in inner.state_dict().items() if not k.endswith("_extra_state")}
    assert not mismatches(hf_to_megatron(hf, config), got)
    routers = r3.model_routers(inner)
    assert routers and all(r.weight.dtype == torch.float32 and r.expert_bias.dtype == torch.float32 for r in routers)


def test_export_is_the_checkpoint(bridge, bridge_model, ckpt):
    _, hf = ckpt
    exported = dict(bridge.export_hf_weights(bridge_model, cpu=True, show_progress=False))
    assert not mismatches(hf, exported)
    assert exported["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    # SkyRL's bucketed weight sync: a fresh task list, exported in slices
    tasks = bridge.get_conversion_tasks(bridge_model)
    bucketed = {}
    for i in range(0, len(tasks), 50):
        for name, t in bridge.export_hf_weights(bridge_model, show_progress=False, conversion_tasks=tasks[i : i + 50]):
            assert name not in bucketed, f"{name} exported twice"
            bucketed[name] = t
    assert not mismatches(hf, bucketed)
    # SkyRL sizes its buckets by mapping.tp_size x (ep_size if mapping.is_expert)
    assert all(t.mapping.is_expert == (".mlp.experts." in t.param_name) for t in tasks)


def test_logprobs_equal_beam_provider(bridge_model, tiny_model, tiny_config, ckpt):
    config, hf = ckpt
    ours = BeamModelProvider(config, mode="bf16").provide_loaded(hf).eval()
    ids = inputs(config)
    with torch.no_grad():
        routed = tiny_model(ids).routed_experts
    model = bridge_model[0].eval()
    for replay in (None, routed):
        lp, mask = logprobs(model, config, ids, replay)
        lp_ours, mask_ours = logprobs(ours, config, ids, replay)
        assert torch.equal(mask, mask_ours) and mask.any()
        assert torch.equal(lp, lp_ours), f"replay={replay is not None}: max|diff| {(lp - lp_ours).abs().max().item():.3e}"


def test_padding_positions_never_reach_real_tokens(bridge_model, ckpt):
    """SkyRL's unpacked batches give right padding the position 0 (beam-rl continues 0..T-1): the
    real tokens' logits are the same either way, bit for bit, so no real query sees a padding key."""
    config, _ = ckpt
    ids = inputs(config)
    model = bridge_model[0].eval()
    ours = torch.arange(T).expand(B, T)
    padding = ours >= LENGTHS[:, None]
    skyrl = torch.where(padding, 0, ours)
    with torch.no_grad():
        r3.clear_replay(model)
        want, got = (model(ids, pos, None, padding_mask=padding) for pos in (ours, skyrl))
    assert padding.any() and torch.equal(got[~padding], want[~padding])


def test_accepts_skyrl_gpu_settings(bridge):
    skyrl_settings(bridge.to_megatron_provider(load_weights=False), tp=2, ep=2, gpu=True).check_beam()


@pytest.mark.parametrize("field, value, match", [
    ("moe_grouped_gemm", True, r"moe_grouped_gemm=True.*trainer.policy.megatron_config.moe_grouped_gemm"),
    ("moe_router_dtype", "fp64", r"moe_router_dtype='fp64'.*'fp32'"),
    ("attention_backend", "flash", r"trainer.flash_attn=false"),
    ("context_parallel_size", 2, r"context_parallel_size=1"),
    ("recompute_granularity", "selective", r"recompute_granularity=full"),
    ("mtp_num_layers", 1, r"no MTP heads"),
    ("beam_mode", "fp32", r"beam_mode='fp32' builds torch.float32 parameters"),
    ("num_moe_experts", 8, r"num_moe_experts=8"),
])
def test_refuses_what_beam_cannot_honour(bridge, field, value, match):
    provider = bridge.to_megatron_provider(load_weights=False)
    setattr(provider, field, value)
    with pytest.raises(ValueError, match=match):
        provider.check_beam()


def test_mxfp8_weight_sync_serves_the_quantised_weights(bridge, ckpt, monkeypatch):
    """SkyRL with beam_mode=mxfp8-emulated: its weight sync (`MegatronWeightExtractor.extract_weights`,
    patched by `serve_mxfp8_weights`) sends each linear's weight as the trainer's forward computes
    with it (MXFP8 quantised, dequantised); the bridge's plain export (HF saves) keeps the
    checkpoint's weights."""
    from beam_rl.megatron.mxfp8 import mxfp8_fake_quant
    from beam_rl.skyrl import patches as P

    _, hf = ckpt
    provider = skyrl_settings(bridge.to_megatron_provider())
    provider.beam_mode = "mxfp8-emulated"
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True, bf16=True)
    assert not mismatches(hf, dict(bridge.export_hf_weights(model, cpu=True, show_progress=False)))
    worker = skyrl_module(P.MEGATRON_WORKER)
    cls = worker.MegatronWeightExtractor
    monkeypatch.setattr(cls, "extract_weights", P.original(cls.extract_weights))
    P.serve_mxfp8_weights(worker)
    P.serve_mxfp8_weights(worker)  # idempotent
    sent = {n: t for c in cls(bridge, model, enable_bucketing=False).extract_weights(torch.bfloat16)
            for n, t in zip(c.names, c.tensors)}
    linears = [n for n in hf if n.endswith("_proj.weight")]
    assert set(sent) == set(hf) and linears
    for name, t in hf.items():
        want = mxfp8_fake_quant(t) if name in linears else t.to(torch.bfloat16)
        assert torch.equal(sent[name].cpu(), want), name
    assert not torch.equal(sent[linears[0]].cpu(), hf[linears[0]])


def test_skyrl_lora_wraps_the_recipe_targets_and_merges_into_the_export(bridge, ckpt):
    """recipes/skyrl/dapo-lora.yaml through SkyRL's own `configure_lora` and pre-wrap hook: Megatron-
    Bridge's LoRA wraps exactly the recipe's targets in Beam's layers (without Transformer Engine),
    only the adapters train, and the synced export is W + (alpha / rank) * B @ A for exactly the
    targeted weights (the base and FP32 routers untouched)."""
    import types
    from pathlib import Path

    from beam_rl.skyrl.config import load_config

    cfg = load_config(Path(__file__).parents[1] / "recipes/skyrl/dapo-lora.yaml").trainer
    worker = types.SimpleNamespace(cfg=cfg)
    skyrl_module("skyrl.backends.skyrl_train.workers.megatron.megatron_worker").MegatronWorker.configure_lora(
        worker, cfg.policy.model.lora, cfg.policy.megatron_config.lora_config.lora_type)
    lora = worker.lora_cls
    provider = skyrl_settings(bridge.to_megatron_provider())

    def hook(model):  # SkyRL's make_megatron_module hook
        wrapped = lora(model, training=True)
        lora.set_params_to_save(wrapped)
        return wrapped

    provider.register_pre_wrap_hook(hook)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True, bf16=True)
    inner = model[0].module
    targets = {t.split(".")[-1] for t in cfg.policy.model.lora.target_modules}
    wrapped = {n for n, m in inner.named_modules() if type(m).__name__ == "LoRALinear"}
    assert wrapped and {n.split(".")[-1] for n in wrapped} == targets
    assert not any(".experts." in n for n in wrapped)
    trainable = [n for n, p in inner.named_parameters() if p.requires_grad]
    assert trainable and all(".adapter." in n for n in trainable)

    config, hf = ckpt
    ids = inputs(config)
    lp, mask = sequence_logprobs(model[0], ids, config=config, lengths=LENGTHS, prompt_lengths=PROMPTS, routed_experts=None)
    (lp * mask).sum().backward()
    r3.clear_replay(model[0])
    # B starts at zero, so B's gradient is A's projection of the input (non-zero) and A's is zero
    grads = {n: p.grad for n, p in inner.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    assert all(bool(g.abs().sum() > 0) for n, g in grads.items() if ".linear_out." in n)

    assert not mismatches(hf, dict(bridge.export_hf_weights(model, cpu=True, show_progress=False)))  # B = 0
    with torch.no_grad():
        for n, p in inner.named_parameters():
            if ".adapter.linear_out." in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(p.dtype) * 0.01)
    exported = dict(bridge.export_hf_weights(model, cpu=True, show_progress=False))
    changed = {k for k in hf if not exact(hf[k], exported[k])}
    assert set(exported) == set(hf) and changed
    assert all(k.rsplit(".", 2)[-2] in {"q_proj", "k_proj", "v_proj", "gate_proj", "o_proj", "up_proj", "down_proj"}
               and ".experts." not in k for k in changed)
    assert exported["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    q = inner.decoder.layers[0].self_attention.linear_q.adapter
    scale = cfg.policy.model.lora.alpha / cfg.policy.model.lora.rank
    want = hf["model.layers.0.self_attn.q_proj.weight"].float() + scale * (q.linear_out.weight.float() @ q.linear_in.weight.float())
    torch.testing.assert_close(exported["model.layers.0.self_attn.q_proj.weight"].float(), want, rtol=0, atol=2e-2)


def test_distributed_optimizer_index_finds_each_parameters_own_shard(bridge, monkeypatch):
    """Beam's FP32 routers beside BF16 weights in megatron-core's distributed optimizer, built the
    way SkyRL's Megatron worker builds it (DDP with the distributed optimizer, megatron-core's own
    param groups and range maps): the (group, position) index every checkpoint format reads finds
    each parameter's own shard in the inner optimizer. megatron-core 0.16.1's own index points most
    parameters at another one (the H200 run's final checkpoint stopped there)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups_and_buffers
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from beam_rl.megatron.optimizer import order_groups_like_the_optimizer

    inner = build_from_bridge(bridge)[0]
    model = DistributedDataParallel(config=inner.config, module=inner,
                                    ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    assert {b.param_dtype for b in model.buffers} == {torch.bfloat16, torch.float32}
    config = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True)
    # CPU stand-in for a CUDA-only call: the optimizer sorts parameters by their torch.cuda type name
    names = {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor"}
    cpu_type = torch.Tensor.type
    monkeypatch.setattr(torch.nn.Parameter, "type", lambda p, *a, **k: cpu_type(p, *a, **k) if a or k else names[p.dtype],
                        raising=False)

    def wrong_shards(build_group_ranges):
        groups, buffers = _get_param_groups_and_buffers([model], 0, config, None, lambda g: True, "buffers")
        gbuf_ranges = [DistributedOptimizer._build_gbuf_range_map(b) for bs in buffers.values() for b in bs]
        index, group_ranges = build_group_ranges(groups, gbuf_ranges)
        DistributedOptimizer._build_model_and_main_param_groups(
            gbuf_ranges, DistributedOptimizer._build_model_param_gbuf_map(gbuf_ranges), group_ranges, config)
        assert set(index) == set(model.parameters())
        wrong = []
        for p in model.parameters():
            group, order = index[p]
            shard = group_ranges[group]["orig_group"]["params"][order]  # what the inner optimizer steps
            if shard.shape != (p.numel(),) or not torch.equal(shard.float(), p.detach().float().view(-1)):
                wrong.append(p)
        return wrong

    order_groups_like_the_optimizer()  # register_bridge applied it: a second call changes nothing
    patched = DistributedOptimizer._build_optimizer_group_ranges
    unpatched = patched.__func__.__wrapped__.__get__(DistributedOptimizer)
    assert len(wrong_shards(unpatched)) > len(list(model.parameters())) // 2
    assert wrong_shards(patched) == []


def test_optimizer_fix_refuses_another_megatron_core(monkeypatch):
    import importlib.metadata

    from beam_rl.megatron.optimizer import OptimizerFixRefused, order_groups_like_the_optimizer

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.17.0")
    with pytest.raises(OptimizerFixRefused, match=r"megatron-core 0\.16\.1, found 0\.17\.0.*Megatron-LM PR #5835"):
        order_groups_like_the_optimizer()


# -- TP2 with sequence parallelism (expert TP 1 and 2), and EP2 (2 processes) --------------------
def _worker(rank, world, port, ckpt_path, inputs_path, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # two ranks on a small CPU
    from megatron.core import parallel_state as ps

    register_bridge()
    from megatron.bridge import AutoBridge

    config, hf = checkpoint(ckpt_path)
    data = torch.load(inputs_path)
    result = {}
    for name, spec in WORLDS.items():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        init_single_process(**spec["init"])
        layout = Layout.from_parallel_state()
        rows = slice(rank, rank + 1) if layout.ep_size > 1 else slice(None)  # EP ranks are data-parallel ranks
        bridge = AutoBridge.from_hf_pretrained(ckpt_path)
        model = build_from_bridge(bridge, **spec["skyrl"])
        got = {k: v for k, v in model[0].module.state_dict().items() if not k.endswith("_extra_state")}
        exported = dict(bridge.export_hf_weights(model, cpu=True, show_progress=False))
        ours = BeamModelProvider(config, mode="bf16", **spec["beam"]).provide_wrapped().eval()
        load_hf_into_model(ours, hf, config, layout)
        lps = {}
        whole = VocabGathered(model[0].eval())
        for replay in (False, True):
            routed = data["routed"] if replay else None
            lps[replay] = (logprobs(whole, config, data["ids"], routed, rows),
                           logprobs(ours, config, data["ids"], routed, rows))
        skyrl_lp = skyrl_logprobs(model[0].eval(), data["ids"][rows], LENGTHS[rows])
        result[name] = dict(load=mismatches(hf_to_megatron(hf, config, layout), got), export=mismatches(hf, exported),
                            logprobs=lps, skyrl_logprobs=skyrl_lp)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


class VocabGathered(torch.nn.Module):
    """The bridge model with its vocabulary shards gathered (it keeps them apart for SkyRL)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(self.model(*args, **kwargs))


def skyrl_logprobs(model, ids, lengths):
    """SkyRL 0.3.0's log-probs of the bridge model (no replay): its `from_parallel_logits_to_logprobs`
    over this rank's vocabulary shard and the TP group, as SkyRL's Megatron worker computes them."""
    from megatron.core import parallel_state as ps

    mu = skyrl_module("skyrl.backends.skyrl_train.distributed.megatron.model_utils")
    B, T = ids.shape
    positions = torch.arange(T).expand(B, T)
    padding = positions >= lengths[:, None]
    r3.clear_replay(model)
    with torch.no_grad():
        shard = model(ids, positions, None, padding_mask=padding if bool(padding.any()) else None)
    v = shard.shape[-1]
    rank = ps.get_tensor_model_parallel_rank()
    return mu.from_parallel_logits_to_logprobs(shard, ids, rank * v, (rank + 1) * v, ps.get_tensor_model_parallel_group(),
                                               inference_only=True)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def parallel(tiny_checkpoint, tiny_model, tmp_path_factory):
    import torch.multiprocessing as mp

    config = load_config(tiny_checkpoint)
    ids = inputs(config)
    with torch.no_grad():
        routed = tiny_model(ids).routed_experts
    out = tmp_path_factory.mktemp("bridge-parallel")
    torch.save({"ids": ids, "routed": routed}, out / "inputs.pt")
    mp.spawn(_worker, args=(2, _free_port(), str(tiny_checkpoint), str(out / "inputs.pt"), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("world", list(WORLDS))
def test_parallel_bridge_is_beam_provider(parallel, world):
    for rank, results in enumerate(parallel):
        res = results[world]
        assert not res["load"], f"{world} rank {rank}: loaded shards differ from hf_to_megatron: {res['load'][:5]}"
        assert not res["export"], f"{world} rank {rank}: export differs from the checkpoint: {res['export'][:5]}"
        for replay, ((lp, mask), (lp_ours, mask_ours)) in res["logprobs"].items():
            assert torch.equal(mask, mask_ours)
            assert torch.equal(lp, lp_ours), f"{world} rank {rank} replay={replay}: max|diff| {(lp - lp_ours).abs().max().item():.3e}"
        # SkyRL's vocabulary-parallel log-softmax of the shards against the whole-row FP32 one
        lp_ours, mask = res["logprobs"][False][1]
        skyrl_lp = res["skyrl_logprobs"]
        assert skyrl_lp.shape == lp_ours.shape and torch.allclose(skyrl_lp[mask], lp_ours[mask], atol=1e-5, rtol=0), \
            f"{world} rank {rank}: SkyRL's log-probs max|diff| {(skyrl_lp - lp_ours)[mask].abs().max().item():.3e}"

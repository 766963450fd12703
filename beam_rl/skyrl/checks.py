"""What `beam-rl launch` checks before anything starts, beyond SkyRL's own `validate_cfg`: the
settings a Beam run needs, the parallel layouts against the model's shape, and the files.

Every check raises `InputError` naming the key and the fix. The model's shape comes from
`trainer.policy.model.path`/config.json when it exists, else from the recipe's `beam.preset`
(a layout on paper); Megatron's rules (world = TP x PP x CP x DP for the dense part and
ETP x EP x PP x expert-DP for the experts), vLLM's (heads and KV heads over TP, experts over EP)
and SkyRL's (colocated GPUs, one node per `mp` engine) are written out here so that a bad
layout fails in the driver, not minutes later in a Ray worker.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from beam_rl.errors import InputError

MC = "trainer.policy.megatron_config"
IE = "generator.inference_engine"
PL = "trainer.placement"
DATA_HINT = "python -m beam_rl.skyrl.data --recipe recipes/mini-h200.yaml --out data/skyrl-beam-arith"


def fail(key: str, msg: str) -> None:
    raise InputError(f"{key}: {msg}")


@dataclass
class Model:
    config: object
    """`BeamConfig`."""
    source: str
    """Where the shape came from (for the printed summary)."""
    checkpoint: bool
    """Whether `trainer.policy.model.path` holds the checkpoint."""


def model_shape(cfg, preset: str | None) -> Model:
    """The Beam config of the run: the checkpoint's config.json, else the preset."""
    from beam_rl.model.checkpoint import load_config
    from beam_rl.model.presets import PRESETS, get_preset

    path = cfg.trainer.policy.model.path
    config_json = Path(path) / "config.json" if path else None
    if config_json is not None and config_json.is_file():
        try:
            config = load_config(path)  # strict: model_type, every key that defines Beam, their types
        except InputError as exc:
            fail("trainer.policy.model.path", str(exc))
        return Model(config, f"{config_json}", checkpoint=True)
    if preset is None:
        fail("trainer.policy.model.path", f"{path!r} holds no Beam checkpoint (no config.json); give a checkpoint "
             f"directory (a warm-started one: beam-rl dapo --recipe recipes/mini-h200.yaml writes "
             f"runs/mini-h200/checkpoints/step_*/hf), or set beam.preset to check a layout on paper with --dry-run")
    if preset not in PRESETS:
        fail("beam.preset", f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return Model(get_preset(preset), f"preset {preset} (no checkpoint at {path})", checkpoint=False)


def check_beam_settings(cfg) -> None:
    """Settings Beam's Megatron model and R3 need (beam_rl.megatron.bridge_model enforces the same
    at build time, on the GPU; these fail before anything starts)."""
    with warnings.catch_warnings():  # megatron-core warns about Transformer Engine / Apex on import
        warnings.simplefilter("ignore")
        from beam_rl.megatron.provider import MODES

    t, mc, ie = cfg.trainer, cfg.trainer.policy.megatron_config, cfg.generator.inference_engine
    if t.strategy != "megatron":
        fail("trainer.strategy", f"{t.strategy!r}: Beam trains on SkyRL's Megatron backend; set megatron")
    if mc.moe_enable_routing_replay != ie.enable_return_routed_experts:
        fail(f"{MC}.moe_enable_routing_replay", f"{mc.moe_enable_routing_replay} but {IE}.enable_return_routed_experts="
             f"{ie.enable_return_routed_experts}: R3 needs both (vLLM records the experts, Megatron replays them); set both true")
    if ie.enable_return_routed_experts and ie.enable_prefix_caching:
        fail(f"{IE}.enable_prefix_caching", "true: a prompt block served from the prefix cache never passes the model, so "
             "vLLM records no experts for it and R3 cannot replay it (docs/r3.md); set false")
    if t.flash_attn:
        fail("trainer.flash_attn", "true: Beam's attention (sliding window, SSMax, output gate) is beam-rl's module "
             "without a FlashAttention path; set false")
    if t.remove_microbatch_padding:
        fail("trainer.remove_microbatch_padding", "true: SkyRL's sample packing hands the model packed (THD) sequences, "
             "which Beam's attention does not take; set false")
    if getattr(t, "fused_lm_head_logprob", False):
        fail("trainer.fused_lm_head_logprob", "true: SkyRL's fused LM-head log-probs skip the model's output layer, where "
             "Beam computes its FP32 logits and soft-caps them; set false")
    if mc.context_parallel_size != 1:
        fail(f"{MC}.context_parallel_size", f"{mc.context_parallel_size}: Beam's attention has no context parallelism; set 1")
    if mc.moe_token_dispatcher_type == "allgather":
        fail(f"{MC}.moe_token_dispatcher_type", "allgather: SkyRL's Megatron worker sets variable_seq_lengths, which "
             "megatron-core accepts with the alltoall or flex dispatcher only (ValueError at model init); set alltoall")
    if mc.moe_grouped_gemm:
        fail(f"{MC}.moe_grouped_gemm", "true: Beam's experts sum FP32 gate-weighted outputs (beam_rl.megatron.router); set false")
    if mc.moe_router_dtype != "fp32":
        fail(f"{MC}.moe_router_dtype", f"{mc.moe_router_dtype!r}: Beam's router is FP32; set fp32")
    kw = mc.transformer_config_kwargs or {}
    if kw.get("fp8") is not None:
        fail(f"{MC}.transformer_config_kwargs.fp8", f"{kw['fp8']!r}: Beam's MXFP8 is emulated; remove fp8 and set "
             "transformer_config_kwargs.beam_mode=mxfp8-emulated")
    if kw.get("beam_mode", "bf16") not in MODES:
        fail(f"{MC}.transformer_config_kwargs.beam_mode", f"{kw['beam_mode']!r}; choose one of {MODES}")
    if kw.get("moe_router_fusion"):
        fail(f"{MC}.transformer_config_kwargs.moe_router_fusion", "true: the fused router skips RouterReplay; remove it")
    if cfg.trainer.policy.model.lora.rank > 0 and ie.enable_return_routed_experts and not mc.lora_config.merge_lora:
        fail(f"{MC}.lora_config.merge_lora", "false: SkyRL's routed-expert endpoint refuses LoRA in vLLM; set true "
             "(the merged weights are synced) or turn R3 off")


def check_layout(cfg, model: Model) -> dict:
    """Trainer and vLLM layouts against the GPUs and the model; returns the sizes for the summary."""
    c = model.config
    mc, ie, pl = cfg.trainer.policy.megatron_config, cfg.generator.inference_engine, cfg.trainer.placement
    gpus = pl.policy_num_nodes * pl.policy_num_gpus_per_node
    tp, pp, cp, ep = (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size, mc.context_parallel_size,
                      mc.expert_model_parallel_size)
    etp = tp if mc.expert_tensor_parallel_size is None else mc.expert_tensor_parallel_size
    for key, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                   ("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if v < 1:
            fail(f"{MC}.{key}", f"{v}; must be >= 1")
    where = f"{gpus} policy GPUs ({PL}.policy_num_nodes x policy_num_gpus_per_node)"
    if gpus % (tp * pp * cp):
        fail(f"{MC}.tensor_model_parallel_size", f"TP {tp} x PP {pp} x CP {cp} = {tp * pp * cp} does not divide the {where}; "
             "change TP / PP or the GPU count")
    if gpus % (etp * ep * pp):
        fail(f"{MC}.expert_model_parallel_size", f"expert TP {etp} x EP {ep} x PP {pp} = {etp * ep * pp} does not divide the "
             f"{where}; change EP or the GPU count")
    if etp != 1:
        fail(f"{MC}.expert_tensor_parallel_size", f"{mc.expert_tensor_parallel_size} (expert TP {etp}): Beam keeps each expert "
             "whole (it rounds an expert GEMM once; beam_rl.megatron.provider); set 1 and spread experts with EP")
    for n, what in ((c.num_attention_heads, "num_attention_heads"), (c.num_key_value_heads, "num_key_value_heads"),
                    (c.intermediate_size, "intermediate_size")):
        if n % tp:
            fail(f"{MC}.tensor_model_parallel_size", f"TP {tp} does not divide the model's {what}={n} ({model.source}); "
                 f"choose a TP that divides {c.num_attention_heads} heads and {c.num_key_value_heads} KV heads")
    if c.num_experts % ep:
        fail(f"{MC}.expert_model_parallel_size", f"EP {ep} does not divide num_experts={c.num_experts} ({model.source})")
    if c.num_hidden_layers % pp:
        fail(f"{MC}.pipeline_model_parallel_size", f"PP {pp} does not divide num_hidden_layers={c.num_hidden_layers} ({model.source})")

    itp, ipp, idp, iep, engines = (ie.tensor_parallel_size, ie.pipeline_parallel_size, ie.data_parallel_size,
                                   ie.expert_parallel_size, ie.num_engines)
    if c.num_attention_heads % itp:
        fail(f"{IE}.tensor_parallel_size", f"{itp} does not divide num_attention_heads={c.num_attention_heads} ({model.source})")
    if c.num_key_value_heads % itp and itp % c.num_key_value_heads:
        fail(f"{IE}.tensor_parallel_size", f"{itp} and num_key_value_heads={c.num_key_value_heads} ({model.source}): vLLM "
             "needs one to divide the other (it replicates KV heads beyond their count)")
    if iep > 1:
        if idp * itp != iep:
            fail(f"{IE}.expert_parallel_size", f"{iep}: SkyRL runs vLLM's expert parallelism over the engine's DP x TP "
                 f"ranks ({idp} x {itp} = {idp * itp}); set it to {idp * itp} or 1")
        if c.num_experts % iep:
            fail(f"{IE}.expert_parallel_size", f"{iep} does not divide num_experts={c.num_experts} ({model.source})")
    elif c.moe_intermediate_size % itp:
        fail(f"{IE}.tensor_parallel_size", f"{itp} does not divide moe_intermediate_size={c.moe_intermediate_size} "
             f"(without expert parallelism vLLM splits each expert over TP); set {IE}.expert_parallel_size")
    if ie.enable_return_routed_experts and ipp > 1:
        fail(f"{IE}.pipeline_parallel_size", f"{ipp}: vLLM's routed-expert capture (R3) refuses pipeline parallelism; set 1")
    rollout_gpus = engines * itp * ipp * idp
    if pl.colocate_all and rollout_gpus != gpus:
        fail(f"{IE}.num_engines", f"{engines} engines x TP {itp} x PP {ipp} x DP {idp} = {rollout_gpus} GPUs, but "
             f"{PL}.colocate_all=true shares the {where}; make them equal")
    if ie.distributed_executor_backend == "mp" and itp * ipp > pl.policy_num_gpus_per_node:
        fail(f"{IE}.tensor_parallel_size", f"TP {itp} x PP {ipp} GPUs per engine exceed one node "
             f"({PL}.policy_num_gpus_per_node={pl.policy_num_gpus_per_node}); vLLM's mp executor stays on one node")
    return dict(gpus=gpus, tp=tp, pp=pp, ep=ep, dp=gpus // (tp * pp * cp), edp=gpus // (etp * ep * pp),
                engines=engines, itp=itp, iep=iep, idp=idp)


def check_files(cfg, model: Model, dry_run: bool) -> list[str]:
    """Checkpoint (weights, tokenizer with a chat template) and data files; returns notes for the
    summary. A missing checkpoint is accepted by --dry-run on a `beam.preset` layout only."""
    notes = []
    path = cfg.trainer.policy.model.path
    if not model.checkpoint:
        if not dry_run:
            fail("trainer.policy.model.path", f"{path!r} holds no Beam checkpoint (no config.json); launching needs one "
                 "(beam.preset only checks a layout on paper, with --dry-run)")
        notes.append(f"no checkpoint at {path}: layout checked against the preset; launching needs the checkpoint")
    else:
        ckpt = Path(path)
        if not any(ckpt.glob("*.safetensors")):
            fail("trainer.policy.model.path", f"{ckpt} has a config.json but no *.safetensors weights; give a complete checkpoint")
        tok = ckpt / "tokenizer_config.json"
        try:
            template = json.loads(tok.read_text()).get("chat_template") if tok.is_file() else None
        except json.JSONDecodeError:
            template = None
        if not template:
            fail("trainer.policy.model.path", f"{ckpt} has no tokenizer with a chat template (SkyRL renders prompts with it); "
                 f"write the task tokenizer into it: {DATA_HINT} --tokenizer-into {ckpt}")
    for key in ("train_data", "val_data"):
        for i, f in enumerate(getattr(cfg.data, key)):
            if Path(f).suffix in (".parquet", ".json", ".jsonl") and not Path(f).is_file():
                fail(f"data.{key}[{i}]", f"{f} does not exist; write the arithmetic task data: {DATA_HINT}")
    return notes


def check_gpus(cfg) -> None:
    """A launch (not --dry-run) needs the GPUs of one node here."""
    import torch

    need = cfg.trainer.placement.policy_num_gpus_per_node
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need and cfg.trainer.placement.policy_num_nodes == 1:
        fail(f"{PL}.policy_num_gpus_per_node", f"{need} GPUs needed, {have} visible (SkyRL's workers and vLLM need CUDA); "
             "run on the GPU machine, or validate here with --dry-run")

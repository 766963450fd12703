"""`beam-rl plan`: parameters, memory and a parallel layout from the config alone (no allocation).

Parameter counts come from the checkpoint tensor table (`beam_rl.model.weights`), so the plan, the
checkpoints and the models agree by construction. Memory models, stated so they can be checked:

- Rollout (vLLM): one engine spans `t` GPUs with tensor parallelism t for attention / dense MLP /
  embeddings and expert parallelism t for the routed experts; engines are replicated (DP) to use
  all GPUs. Weights take their serving format; what is left of `gpu_memory_utilization` holds KV.
- Training (Megatron-Core): TP t and PP p shard the dense part, EP e and PP p the experts
  (expert TP 1, `BeamModelProvider.expert_tensor_parallel_size`'s default: every expert whole on
  its EP rank, so expert memory divides by e p, not t e p; Megatron needs N divisible by e p);
  the distributed optimizer shards FP32 master weights and Adam moments (12 B/param)
  over the data-parallel ranks of each part (dense DP = N/(t p), expert DP = N/(e p)).
  Per-parameter bytes besides those: BF16 full fine-tuning 2 (BF16 weight) + 4 (FP32 grad);
  MXFP8 the same plus 1.03 (MXFP8 weight copy with E8M0 scales per 32); LoRA 2 (frozen BF16 base,
  adapters negligible, no optimizer state for the base). `activation_fraction` of each GPU is
  reserved for activations (full recompute assumed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from beam_rl.errors import InputError
from beam_rl.model.config import BeamConfig
from beam_rl.model.weights import checkpoint_tensors

GIB = 1 << 30
# Bytes per element of weight storage formats (block scales included).
FORMAT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4 / 128, "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
TRAIN_BYTES_PER_PARAM = {"bf16": 6.0, "mxfp8": 6.0 + FORMAT_BYTES["mxfp8"], "lora": 2.0}
OPTIMIZER_BYTES_PER_PARAM = {"bf16": 12.0, "mxfp8": 12.0, "lora": 0.0}


@dataclass
class ParamCounts:
    total: int
    active: int
    by_kind: dict[str, int]  # embedding, lm_head, attention, norm, dense_mlp, router, expert


def count_params(config: BeamConfig) -> ParamCounts:
    by_kind: dict[str, int] = {}
    for spec in checkpoint_tensors(config).values():
        by_kind[spec.kind] = by_kind.get(spec.kind, 0) + spec.numel
    total = sum(by_kind.values())
    inactive = by_kind.get("expert", 0) * (config.num_experts - config.num_experts_per_tok) // config.num_experts
    return ParamCounts(total=total, active=total - inactive, by_kind=by_kind)


def kv_bytes_per_token(config: BeamConfig, bytes_per_value: float) -> int:
    """KV bytes one token keeps for the whole sequence: only full-attention layers do."""
    per_layer = 2 * config.num_key_value_heads * config.head_dim
    return int(len(config.full_attention_layer_ids) * per_layer * bytes_per_value)


def sliding_kv_bytes_per_sequence(config: BeamConfig, bytes_per_value: float) -> int:
    """The bounded KV of the sliding layers: `sliding_window` tokens each, per sequence."""
    n_sliding = config.num_hidden_layers - len(config.full_attention_layer_ids)
    return int(n_sliding * 2 * config.num_key_value_heads * config.head_dim * config.sliding_window * bytes_per_value)


def weight_bytes(counts: ParamCounts, expert_format: str, dense_format: str = "bf16",
                 lm_head_format: str = "bf16") -> dict[str, float]:
    """Bytes of the weights: experts in `expert_format`, router FP32, the LM head in `lm_head_format`
    (the vLLM rollout keeps it in FP32 for its FP32 GEMM), the rest in `dense_format`."""
    k = counts.by_kind
    experts = k.get("expert", 0) * FORMAT_BYTES[expert_format]
    router = k.get("router", 0) * FORMAT_BYTES["fp32"]
    linear = (k.get("attention", 0) + k.get("dense_mlp", 0)) * FORMAT_BYTES[dense_format]
    rest = (k.get("embedding", 0) + k.get("norm", 0)) * FORMAT_BYTES["bf16"] + k.get("lm_head", 0) * FORMAT_BYTES[lm_head_format]
    return {"experts": experts, "router": router, "dense": linear + rest, "total": experts + router + linear + rest}


def _pow2_upto(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if d <= n]


@dataclass
class RolloutLayout:
    gpus_per_engine: int
    tensor_parallel: int
    expert_parallel: int
    engines: int
    weight_gib_per_gpu: float
    kv_gib_per_gpu: float
    kv_tokens_per_engine: int
    expert_format: str


def plan_rollout(config: BeamConfig, counts: ParamCounts, num_gpus: int, gpu_gib: float, *,
                 expert_format: str = "fp8", kv_format: str = "fp8", gpu_memory_utilization: float = 0.9,
                 max_seqs: int = 256, min_kv_tokens: int = 1 << 21) -> RolloutLayout | None:
    """Smallest engine (TP = EP = t GPUs) whose weights leave room for the sliding-window KV of
    `max_seqs` sequences plus `min_kv_tokens` tokens of full-attention KV (default: 256 x 8K)."""
    w = weight_bytes(counts, expert_format, lm_head_format="fp32")
    kv_value_bytes = FORMAT_BYTES[kv_format] if kv_format != "bf16" else 2.0
    kv_tok = kv_bytes_per_token(config, kv_value_bytes)
    sliding = max_seqs * sliding_kv_bytes_per_sequence(config, kv_value_bytes)
    for t in _pow2_upto(num_gpus):
        if num_gpus % t or config.num_experts % t:
            continue
        # KV heads are replicated when t exceeds them, so KV per GPU shrinks only down to one head.
        kv_shards = min(t, config.num_key_value_heads)
        per_gpu_weights = w["dense"] / t + w["router"] + w["experts"] / t
        free = gpu_gib * GIB * gpu_memory_utilization - per_gpu_weights - sliding / kv_shards
        if free <= 0:
            continue
        kv_tokens = int(free / (kv_tok / kv_shards))
        if kv_tokens >= min_kv_tokens:
            return RolloutLayout(t, t, t, num_gpus // t, per_gpu_weights / GIB, free / GIB, kv_tokens, expert_format)
    return None


@dataclass
class TrainLayout:
    mode: str
    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int
    data_parallel: int
    expert_data_parallel: int
    gib_per_gpu: float
    num_gpus: int


def _train_bytes_per_gpu(counts: ParamCounts, mode: str, t: int, p: int, e: int, n: int) -> float:
    expert = counts.by_kind.get("expert", 0)
    dense = counts.total - expert
    dp, edp = n // (t * p), n // (e * p)
    per = TRAIN_BYTES_PER_PARAM[mode]
    opt = OPTIMIZER_BYTES_PER_PARAM[mode]
    return dense / (t * p) * (per + opt / dp) + expert / (e * p) * (per + opt / edp)


def plan_training(config: BeamConfig, counts: ParamCounts, num_gpus: int, gpu_gib: float, mode: str, *,
                  activation_fraction: float = 0.25) -> TrainLayout | None:
    """First fitting layout, preferring small PP, then TP within a node (<= 8), then small EP."""
    budget = gpu_gib * GIB * (1 - activation_fraction)
    layers = config.num_hidden_layers
    for p in [d for d in _pow2_upto(num_gpus) if d <= layers]:
        for t in [d for d in _pow2_upto(min(8, num_gpus)) if config.num_attention_heads % d == 0]:
            for e in [d for d in _pow2_upto(num_gpus) if config.num_experts % d == 0]:
                if num_gpus % (t * p) or num_gpus % (e * p):
                    continue
                need = _train_bytes_per_gpu(counts, mode, t, p, e, num_gpus)
                if need <= budget:
                    return TrainLayout(mode, t, p, e, num_gpus // (t * p), num_gpus // (e * p), need / GIB, num_gpus)
    return None


def min_gpus_for_training(config: BeamConfig, counts: ParamCounts, gpu_gib: float, mode: str, gpus_per_node: int = 8) -> TrainLayout | None:
    n = gpus_per_node
    while n <= 4096:
        layout = plan_training(config, counts, n, gpu_gib, mode)
        if layout is not None:
            return layout
        n *= 2
    return None


@dataclass
class Plan:
    preset: str
    total_params: int
    active_params: int
    params_by_kind: dict[str, int]
    weight_bytes: dict[str, dict[str, float]]
    kv_bytes_per_token_bf16: int
    kv_bytes_per_token_fp8: int
    sliding_kv_bytes_per_sequence_bf16: int
    num_gpus: int
    gpu_gib: float
    rollout: dict | None
    training: dict[str, dict | None] = field(default_factory=dict)
    training_min_gpus: dict[str, dict | None] = field(default_factory=dict)


def make_plan(config: BeamConfig, name: str = "custom", num_gpus: int = 8, gpu_gib: float = 141.0,
              expert_format: str = "fp8") -> Plan:
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise InputError(f"--gpus must be a whole number >= 1, got {num_gpus!r}")
    if not (isinstance(gpu_gib, (int, float)) and math.isfinite(gpu_gib) and gpu_gib > 0):
        raise InputError(f"--gpu-gib must be a positive number of GiB, got {gpu_gib!r}")
    counts = count_params(config)
    rollout = plan_rollout(config, counts, num_gpus, gpu_gib, expert_format=expert_format)
    return Plan(
        preset=name,
        total_params=counts.total,
        active_params=counts.active,
        params_by_kind=counts.by_kind,
        weight_bytes={fmt: weight_bytes(counts, fmt) for fmt in ("bf16", "mxfp8", "fp8", "nvfp4")},
        kv_bytes_per_token_bf16=kv_bytes_per_token(config, 2),
        kv_bytes_per_token_fp8=kv_bytes_per_token(config, 1),
        sliding_kv_bytes_per_sequence_bf16=sliding_kv_bytes_per_sequence(config, 2),
        num_gpus=num_gpus,
        gpu_gib=gpu_gib,
        rollout=asdict(rollout) if rollout else None,
        training={m: _asdict_or_none(plan_training(config, counts, num_gpus, gpu_gib, m)) for m in TRAIN_BYTES_PER_PARAM},
        training_min_gpus={m: _asdict_or_none(min_gpus_for_training(config, counts, gpu_gib, m)) for m in TRAIN_BYTES_PER_PARAM},
    )


def _asdict_or_none(x):
    return asdict(x) if x is not None else None


def format_plan(plan: Plan) -> str:
    def b(n: float) -> str:
        return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"

    lines = [
        f"Beam plan: {plan.preset}",
        f"  parameters        total {b(plan.total_params)}   active/token {b(plan.active_params)}",
        "  by kind           " + ", ".join(f"{k} {b(v)}" for k, v in plan.params_by_kind.items()),
        "  weights           " + ", ".join(f"{fmt} experts: {w['total'] / GIB:,.1f} GiB" for fmt, w in plan.weight_bytes.items()),
        f"  KV per token      {plan.kv_bytes_per_token_bf16 / 1024:g} KiB BF16, {plan.kv_bytes_per_token_fp8 / 1024:g} KiB FP8 "
        f"(full-attention layers only; sliding layers add {plan.sliding_kv_bytes_per_sequence_bf16 / 2**20:g} MiB BF16 per sequence)",
        f"  on {plan.num_gpus} x {plan.gpu_gib:g} GiB GPUs:",
    ]
    r = plan.rollout
    if r:
        lines.append(
            f"    rollout         {r['engines']} engine(s) of {r['gpus_per_engine']} GPU(s): TP {r['tensor_parallel']}, "
            f"EP {r['expert_parallel']} ({r['expert_format']} experts), {r['weight_gib_per_gpu']:.1f} GiB weights/GPU, "
            f"KV for {r['kv_tokens_per_engine']:,} tokens/engine"
        )
    else:
        lines.append("    rollout         does not fit (weights leave no room for 256 sequences x 8K tokens of KV); add GPUs or use nvfp4 experts")
    for mode, t in plan.training.items():
        if t:
            lines.append(
                f"    train {mode:<9} TP {t['tensor_parallel']}, PP {t['pipeline_parallel']}, EP {t['expert_parallel']}, "
                f"DP {t['data_parallel']} (expert DP {t['expert_data_parallel']}): {t['gib_per_gpu']:.1f} GiB/GPU before activations"
            )
        else:
            m = plan.training_min_gpus.get(mode)
            need = f"needs >= {m['num_gpus']} GPUs (TP {m['tensor_parallel']}, PP {m['pipeline_parallel']}, EP {m['expert_parallel']})" if m else "does not fit"
            lines.append(f"    train {mode:<9} does not fit on {plan.num_gpus} GPUs: {need}")
    return "\n".join(lines)

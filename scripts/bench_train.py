"""Tokens/s and model-FLOPs utilisation of one Megatron Beam training step per mode (one GPU).

    python scripts/bench_train.py --preset beam-mini --batch 4 --seq 4096 [--modes bf16 lora mxfp8-emulated]

A step = forward (R3 replay of random valid expert ids) + backward of a log-prob loss (+ SGD for
the trainable parameters). MFU = 6 x active parameters x tokens (+ attention 12 x layers x q_width
x effective context) / step time / peak dense BF16 FLOP/s (`--peak-tflops`, H200: 989).
Emulated MXFP8 runs BF16 GEMMs on quantise-dequantised operands, so its MFU is a BF16 figure.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def active_params(config) -> int:
    from beam_rl.model.weights import checkpoint_tensors

    total = 0
    for spec in checkpoint_tensors(config).values():
        if spec.kind == "embedding":
            continue  # a lookup, no FLOPs
        if spec.kind == "expert":
            total += spec.numel * config.num_experts_per_tok / config.num_experts
        else:
            total += spec.numel
    return int(total)


def attention_flops_per_token(config, seq: int) -> float:
    q_width = config.num_attention_heads * config.head_dim
    flops = 0.0
    for t in config.layer_types:
        ctx = min(seq, config.sliding_window) if t == "sliding_attention" else seq / 2
        flops += 12 * q_width * ctx  # QK^T and PV, forward + backward
    return flops


def bench(mode: str, args) -> dict:
    from beam_rl.megatron import lora
    from beam_rl.megatron import replay as r3
    from beam_rl.megatron.logprobs import sequence_logprobs
    from beam_rl.megatron.provider import BeamModelProvider
    from beam_rl.model.presets import get_preset

    config = get_preset(args.preset)
    base_mode = "bf16" if mode == "lora" else mode
    model = BeamModelProvider(config, mode=base_mode, recompute=args.recompute, attention_dtype=args.attention_dtype).provide_wrapped().cuda().train()
    if mode == "lora":
        lora.add_lora(model, r=16, alpha=32)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).cuda()
    K, L, E = config.num_experts_per_tok, config.num_moe_layers, config.num_experts
    routed = torch.rand(args.batch, args.seq, L, E, generator=g).argsort(-1)[..., :K].cuda()

    def step():
        opt.zero_grad(set_to_none=True)
        lp, mask = sequence_logprobs(model, ids, config=config, routed_experts=routed)
        (-(lp * mask).sum() / mask.sum()).backward()
        r3.clear_replay(model)
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - start) / args.steps
    tokens = args.batch * args.seq
    flops = tokens * (6 * active_params(config) + attention_flops_per_token(config, args.seq))
    return {
        "mode": mode, "preset": args.preset, "tokens_per_step": tokens, "step_s": round(dt, 4),
        "tokens_per_s": round(tokens / dt, 1), "mfu": round(flops / dt / (args.peak_tflops * 1e12), 4),
        "max_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="beam-mini")
    ap.add_argument("--modes", nargs="+", default=["bf16", "lora", "mxfp8-emulated"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--attention-dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense BF16 peak of the GPU (H200: 989)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU")
    from beam_rl.megatron.cpu import init_single_process

    init_single_process()
    for mode in args.modes:
        torch.cuda.reset_peak_memory_stats()
        print(json.dumps(bench(mode, args)), flush=True)


if __name__ == "__main__":
    main()

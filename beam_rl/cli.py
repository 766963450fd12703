"""`beam-rl` command line: parse, build, run. Each subcommand is one function."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def cmd_plan(args) -> int:
    from beam_rl.plan import format_plan, make_plan
    from beam_rl.model.presets import get_preset

    plan = make_plan(get_preset(args.preset), args.preset, args.gpus, args.gpu_gib, args.expert_format)
    print(json.dumps(asdict(plan), indent=1) if args.json else format_plan(plan))
    return 0


def cmd_init(args) -> int:
    from beam_rl.model.checkpoint import save_checkpoint
    from beam_rl.model.modeling import build_model
    from beam_rl.model.presets import get_preset

    model = build_model(get_preset(args.preset), seed=args.seed, dtype=_dtype(args.dtype))
    path = save_checkpoint(model, args.out)
    print(f"wrote seeded {args.preset} checkpoint (seed {args.seed}, {args.dtype}) to {path}")
    return 0


def cmd_generate(args) -> int:
    import torch

    from beam_rl.model.modeling import load_checkpoint

    model = load_checkpoint(args.checkpoint, dtype=_dtype(args.dtype))
    prompt = torch.tensor([[int(t) for t in args.prompt_ids.split()]])
    tokens = model.greedy_generate(prompt, args.max_new_tokens)
    print(" ".join(str(t) for t in tokens[0].tolist()))
    return 0


def cmd_demo(args) -> int:
    """The embedded default job: seeded beam-tiny checkpoint -> strict reload -> greedy
    generation (KV cache checked against full recompute) -> routing summary -> the 501B plan."""
    import torch

    from beam_rl.model.checkpoint import save_checkpoint
    from beam_rl.model.modeling import build_model, load_checkpoint
    from beam_rl.plan import format_plan, make_plan
    from beam_rl.model.presets import get_preset

    out = Path(args.out)
    config = get_preset("beam-tiny")
    t0 = time.perf_counter()
    ckpt = save_checkpoint(build_model(config, seed=args.seed), out / "beam-tiny")
    model = load_checkpoint(ckpt)
    print(f"[1/3] seeded beam-tiny checkpoint at {ckpt} ({sum(p.numel() for p in model.parameters()):,} params), reloaded strictly")

    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, config.vocab_size, (3, 12), generator=gen)
    cached = model.greedy_generate(prompts, args.max_new_tokens, use_cache=True)
    full = model.greedy_generate(prompts, args.max_new_tokens, use_cache=False)
    if not torch.equal(cached, full):
        print("error: greedy tokens with the KV cache differ from full recompute", file=sys.stderr)
        return 1
    routed = model(torch.cat([prompts, cached], dim=1)).routed_experts  # (B, T, moe_layers, top_k)
    load = torch.bincount(routed.flatten(), minlength=config.num_experts).float()
    print(f"[2/3] greedy generation, {args.max_new_tokens} tokens x {len(prompts)} prompts: identical with and without KV cache")
    for i, row in enumerate(cached.tolist()):
        print(f"      prompt {i}: ... -> {' '.join(map(str, row[:16]))} ...")
    print(f"      routing: {routed.shape[2]} MoE layers x top-{routed.shape[3]}; expert load min/max "
          f"{int(load.min())}/{int(load.max())} over {config.num_experts} experts")
    print("[3/3] " + format_plan(make_plan(get_preset("beam-1.0-501b"), "beam-1.0-501b")))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from beam_rl.model.presets import PRESETS

    parser = argparse.ArgumentParser(prog="beam-rl", description="DAPO post-training of Beam MoE with Rollout Routing Replay.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="parameters, memory and parallel layout of a preset (no allocation)")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--gpus", type=int, default=8, help="number of GPUs to lay out (default 8)")
    p.add_argument("--gpu-gib", type=float, default=141.0, help="memory per GPU in GiB (default 141, an H200)")
    p.add_argument("--expert-format", default="fp8", choices=["bf16", "fp8", "mxfp8", "nvfp4"], help="rollout expert weights")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("init", help="write a seeded random checkpoint of a preset")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("generate", help="greedy generation with the reference model")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt-ids", required=True, help="space-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the embedded default job on beam-tiny (what the README runs)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(func=cmd_demo)
    from beam_rl.dapo.cli import add_dapo_parser, add_plot_parser, add_warm_start_parser
    from beam_rl.drafter.train import add_train_drafter_parser
    from beam_rl.eval.run import add_eval_parser
    from beam_rl.gap.cli import add_gap_parser
    from beam_rl.skyrl.launch import add_launch_parser
    from beam_rl.sync.run import add_sync_parser

    for add in (add_eval_parser, add_sync_parser, add_gap_parser, add_dapo_parser, add_warm_start_parser, add_plot_parser, add_launch_parser,
                add_train_drafter_parser):
        add(sub)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Bad input (`beam_rl.errors.InputError`, a missing file) prints one line,
    `beam-rl <command>: error: <what and how to fix it>`, and exits 2."""
    from beam_rl.errors import InputError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (InputError, FileNotFoundError) as e:
        if args.debug:
            raise
        message = " ".join(str(e).split())
        print(f"beam-rl {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The DAPO loop's train phase at a recipe's shape: every row computing its own prompt against
shared-prompt packing (`beam_rl.megatron.packing`), in one trainer.

    python scripts/bench_dapo_train.py --recipe recipes/math/bf16.yaml [--checkpoint CKPT]
                                       [--groups N] [--repeats 3] [--unpacked-micro-batch N] [--json OUT.json]

One Megatron trainer built as `beam-rl dapo` builds it for the recipe (mode, attention, recompute;
CKPT's weights, or the recipe's preset at its init seed), and one step's kept groups: `--groups`
training problems (default the recipe's `prompts_per_step`) with `group_size` responses each, every
response the problem's worked solution (the lengths a warm-started model answers with), rewards
alternating so every group is informative, R3 ids drawn at random (a group's copies of its prompt
routed alike, as one prefill would route them). Each variant runs `dapo.loop.train_groups`, the
loop's train phase (old log-probs, then `dapo.updates_per_step` updates in micro-batches of
`train.micro_batch_size`), once untimed, then `--repeats` times interleaved:
- unpacked: `train.share_prompts: false`: length-sorted micro-batches, every row its prompt, the LM
            head at every position; `--unpacked-micro-batch N` sets its micro-batch size where the
            recipe's is sized for packed rows (recipes/math/warm-mini-h200.yaml's 256 unpacked rows of
            ~215 tokens need 7.5 GiB for one copy of their FP32 logits alone: out of an H100's memory;
            that recipe ran unpacked at 64)
- packed:   `train.share_prompts: true`, the recipe's default: micro-batches keep a group together,
            each group one row with its prompt once, the LM head only where a log-prob is read
Per variant, for one pass over the step's rollouts: micro-batches, the token rows the model computes
(padding included) and LM-head rows; then train seconds (median) and the time over unpacked's. The mean trainer-vs-replayed gap is not
meaningful here (no rollout log-probs); the packed-vs-unpacked agreement is tests/test_packing.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import bench_provenance

VARIANTS = ("unpacked", "packed")


def step_groups(recipe, config, groups: int | None, seed: int = 0):
    """A step's kept groups (`dapo.loop.Group`) as the module docstring describes."""
    import numpy as np

    from beam_rl.dapo.data import DataOrder
    from beam_rl.dapo.loop import Group
    from beam_rl.r3 import RolloutSample, rollout_id_dtype
    from beam_rl.tasks.arithmetic import Tokenizer

    task, tok = recipe.task.build(), Tokenizer()
    n, G = groups or recipe.rollout.prompts_per_step, recipe.rollout.group_size
    rng = np.random.default_rng(seed)
    L, K, E = config.num_moe_layers, config.num_experts_per_tok, config.num_experts
    out = []
    for i in DataOrder(len(task.train), recipe.run.seed).take(n):
        problem = task.train[i]
        prompt = np.asarray(task.prompt_ids(problem, tok), dtype=np.int64)
        answer = np.asarray(task.answer_ids(problem, tok), dtype=np.int64)
        prompt_routing = np.argsort(rng.random((len(prompt), L, E)), axis=-1)[..., :K]
        samples = []
        for _ in range(G):
            response = np.argsort(rng.random((len(answer) - 1, L, E)), axis=-1)[..., :K]
            samples.append(RolloutSample(prompt_ids=prompt, output_ids=answer, logprobs=np.full(len(answer), -1.0, np.float32),
                                         routed_experts=np.concatenate([prompt_routing, response]).astype(rollout_id_dtype(E))))
        out.append(Group(problem_index=int(i), samples=samples, rewards=[float(j % 2) for j in range(G)],
                         correct=[float(j % 2) for j in range(G)], truncated=[False] * G))
    return out


def shapes(recipe, config, groups) -> dict:
    """Micro-batches, model token rows (padding included) and LM-head rows of one pass over the step's
    rollouts, micro-batched as `recipe` says (`dapo.loop.update_micro_batches`)."""
    from beam_rl.dapo.loop import update_micro_batches
    from beam_rl.megatron.packing import pack_shared_prompts
    from beam_rl.r3 import RolloutBatch

    batch = RolloutBatch(tuple(s for g in groups for s in g.samples), config)
    counts = {"micro_batches": 0, "token_rows": 0, "lm_head_rows": 0}
    for update in update_micro_batches(batch, recipe, len(groups)):
        for mb in update:
            counts["micro_batches"] += 1
            if recipe.train.share_prompts:
                p = pack_shared_prompts(mb.input_ids, mb.lengths, mb.prompt_lengths)
                counts["token_rows"] += p.input_ids.numel()
                counts["lm_head_rows"] += p.logit_rows.numel()
            else:
                counts["token_rows"] += mb.input_ids.numel()
                counts["lm_head_rows"] += mb.input_ids.numel()
    return counts


def measure(policy, recipe, config, groups, *, repeats: int = 3, variants=VARIANTS,
            unpacked_micro_batch: int | None = None) -> list[dict]:
    """One row per variant (median train seconds over `repeats` interleaved calls, after one untimed call
    of each); `variants` start with 'unpacked', the baseline of the ratios, which runs in micro-batches
    of `unpacked_micro_batch` rows where given (else the recipe's)."""
    import torch

    from beam_rl.dapo.loop import train_groups

    if not variants or variants[0] != "unpacked":
        raise ValueError(f"variants {tuple(variants)}: 'unpacked' must come first, the baseline of the ratios")

    def train_settings(variant: str):
        if variant == "unpacked" and unpacked_micro_batch:
            return dataclasses.replace(recipe.train, share_prompts=False, micro_batch_size=unpacked_micro_batch)
        return dataclasses.replace(recipe.train, share_prompts=variant == "packed")

    recipes = {v: dataclasses.replace(recipe, train=train_settings(v)) for v in variants}

    def run(variant: str) -> float:
        r = recipes[variant]
        policy.share_prompts = r.train.share_prompts
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_groups(policy, config, r, groups)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for v in variants:
        run(v)  # compiles and first-call work
    times = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            times[v].append(run(v))
    rows = []
    for v in variants:
        rows.append({"variant": v, **shapes(recipes[v], config, groups),
                     "sequences": sum(len(g.samples) for g in groups), "train_s": round(statistics.median(times[v]), 3)})
    for row in rows:
        row["vs_unpacked"] = round(row["train_s"] / rows[0]["train_s"], 3)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':10s} {'seqs':>6s} {'micro-batches':>13s} {'token rows':>11s} {'LM-head rows':>13s} {'train s':>8s} {'x unpacked':>10s}")
    for r in rows:
        print(f"{r['variant']:10s} {r['sequences']:6d} {r['micro_batches']:13d} {r['token_rows']:11d} {r['lm_head_rows']:13d} "
              f"{r['train_s']:8.3f} {r['vs_unpacked']:9.3f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="a DAPO recipe (its train, dapo and rollout settings, task and seed)")
    ap.add_argument("--checkpoint", default=None, help="HF checkpoint directory (default: the recipe's preset, its init seed)")
    ap.add_argument("--groups", type=int, default=None, help="kept groups of the step (default: the recipe's prompts_per_step)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--unpacked-micro-batch", type=int, default=None,
                    help="the unpacked variant's micro-batch size (default: the recipe's train.micro_batch_size)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1 or (args.groups is not None and args.groups < 1):
        raise SystemExit("--repeats and --groups must be >= 1")
    if args.unpacked_micro_batch is not None and args.unpacked_micro_batch < 1:
        raise SystemExit("--unpacked-micro-batch must be >= 1")
    if args.checkpoint and not (Path(args.checkpoint) / "config.json").is_file():
        raise SystemExit(f"--checkpoint {args.checkpoint}: no config.json there; give an HF checkpoint directory")

    import torch

    from beam_rl.dapo.config import load_recipe
    from beam_rl.engines import build_trainer
    from beam_rl.model.checkpoint import load_config, read_tensors
    from beam_rl.model.modeling import build_model
    from beam_rl.model.presets import get_preset

    recipe = load_recipe(args.recipe, validate=False)  # its checkpoint may live on another machine: --checkpoint
    if args.checkpoint:
        config = load_config(args.checkpoint)
        tensors = dict(read_tensors(args.checkpoint, config))
    else:
        config = get_preset(recipe.model.preset)
        tensors = build_model(config, seed=recipe.model.init_seed).state_dict()
    t = recipe.train
    policy = build_trainer(config, tensors, mode=t.mode, recompute=t.recompute, attention=t.attention)
    if t.mode == "lora":
        policy.add_lora(t.lora.r, t.lora.alpha, seed=recipe.run.seed, experts=t.lora.experts, merged=t.lora.merge)
    policy.make_optimizer(lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip)
    rows = measure(policy, recipe, config, step_groups(recipe, config, args.groups), repeats=args.repeats,
                   unpacked_micro_batch=args.unpacked_micro_batch)
    print_table(rows)
    if args.json:
        from importlib.metadata import version

        from rollout_bench.host_probe import cpu_info

        host = f"{len(os.sched_getaffinity(0))}-core {cpu_info().get('cpu_model') or 'CPU'}"
        device = (torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU: {host}") + \
            f", torch {torch.__version__}, megatron-core {version('megatron-core')}"
        prov = {"command": "python scripts/bench_dapo_train.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "date": time.strftime("%Y-%m-%d"), "device": device, "commit": bench_provenance.commit(),
                "model": recipe.model.preset + (f", {args.checkpoint}" if args.checkpoint else f", init seed {recipe.model.init_seed}"),
                "mode": t.mode, "micro_batch_size": t.micro_batch_size,
                "unpacked_micro_batch_size": args.unpacked_micro_batch or t.micro_batch_size,
                "updates_per_step": recipe.dapo.updates_per_step, "group_size": recipe.rollout.group_size}
        args.json.write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

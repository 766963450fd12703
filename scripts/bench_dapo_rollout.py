"""The DAPO loop's rollout phase at a recipe's shape, taken apart: where a step's rollout seconds go.

    python scripts/bench_dapo_rollout.py --recipe recipes/math/bf16.yaml --checkpoint CKPT
                                         [--prompts N] [--repeats 3] [--profile] [--json OUT.json]

One engine started as `beam-rl dapo` starts it for the recipe (`Job.engine_settings`: async
scheduling, R3 capture, the recipe's batch and KV-cache limits), on CKPT's weights; the requests of
the first step's first generation round (`--prompts` training problems, default the recipe's
`prompts_per_step`, times `group_size` samples, the loop's seeds). Variants, one call each per
repeat, repeats interleaved so a drift of the host's speed reaches every variant alike:
- loop:           `generate_groups`, the loop's call: vLLM's generate with per-request seeds and the
                  sampled tokens' log-probs, then the captured routing fetched and the batch assembled
- vllm:           the same requests, vLLM's generate alone (`VLLMEngine.request_outputs`; the
                  routing dropped after the clock stops): loop minus R3's host side
- vllm-row-generators: vllm with vLLM's own seeded sampling (one generator call per seeded row on
                  every step) instead of the engine's counter-seeded sampling (`beam_rl.rollout.sampling`,
                  one launch for all rows); on CPU both are vLLM's CPU sampler
- vllm-unseeded:  vllm without per-request seeds: vLLM samples every row from one generator
Per variant (medians over repeats): wall seconds, sequences, generated tokens, tokens/s, the
engine's model steps (`VLLMEngine.model_steps`) and wall ms per step, and the wall time over
loop's. `--profile` adds one more loop call under cProfile: host time by source area and the top
functions (`rollout_bench.harness.host_profile`; cProfile slows Python, read the shares).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import bench_provenance

VARIANTS = ("loop", "vllm", "vllm-row-generators", "vllm-unseeded")


def first_round(recipe, prompts: int | None):
    """(task, tokenizer, problems, seeds) of the first step's first generation round."""
    from beam_rl.dapo.data import DataOrder, sampling_seed
    from beam_rl.tasks.arithmetic import Tokenizer

    task, tok = recipe.task.build(), Tokenizer()
    n = prompts or recipe.rollout.prompts_per_step
    problems = [task.train[i] for i in DataOrder(len(task.train), recipe.run.seed).take(n)]
    seeds = [sampling_seed(recipe.run.seed, 1, 0, i) for i in range(n * recipe.rollout.group_size)]
    return task, tok, problems, seeds


def run_variant(variant: str, engine, recipe, round_) -> dict:
    """One call of `variant` on `round_` (`first_round`'s): wall s, sequences, generated tokens, model steps."""
    from beam_rl.dapo.loop import generate_groups, group_requests

    task, tok, problems, seeds = round_
    group = recipe.rollout.group_size
    steps0 = engine.model_steps()
    if variant == "loop":
        t0 = time.perf_counter()
        batch = generate_groups(engine, task, tok, recipe, problems, seeds, group)
        wall = time.perf_counter() - t0
        lengths = [len(s.output_ids) for s in batch.samples]
    else:
        prompts, sampling = group_requests(task, tok, recipe, problems, seeds, group)
        if variant == "vllm-unseeded":
            sampling = [dataclasses.replace(s, seed=None) for s in sampling]
        if variant == "vllm-row-generators":
            engine.set_counter_seeded_sampling(False)
        try:
            t0 = time.perf_counter()
            outputs = engine.request_outputs(prompts, sampling)
            wall = time.perf_counter() - t0
        finally:
            if variant == "vllm-row-generators":
                engine.set_counter_seeded_sampling(engine.settings.counter_seeded_sampling)
        engine.drop_routing(outputs)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return {"wall_s": wall, "sequences": len(lengths), "generated_tokens": sum(lengths), "steps": engine.model_steps() - steps0}


def measure(engine, recipe, round_, *, repeats: int = 3, variants=VARIANTS) -> list[dict]:
    """One row per variant on `round_` (`first_round`'s; medians over `repeats` interleaved calls),
    after one untimed loop call. `variants` start with 'loop', the baseline of the ratios."""
    if not variants or variants[0] != "loop":
        raise ValueError(f"variants {tuple(variants)}: 'loop' must come first, the baseline of the ratios")
    run_variant("loop", engine, recipe, round_)  # warm-up: first-call work in the engine and the task
    calls = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            calls[v].append(run_variant(v, engine, recipe, round_))
    rows = []
    for v in variants:
        med = {k: statistics.median(c[k] for c in calls[v]) for k in calls[v][0]}
        rows.append({"variant": v, "sequences": int(med["sequences"]), "generated_tokens": int(med["generated_tokens"]),
                     "wall_s": round(med["wall_s"], 3), "tokens_per_s": round(med["generated_tokens"] / med["wall_s"], 1),
                     "steps": int(med["steps"]), "ms_per_step": round(med["wall_s"] / max(med["steps"], 1) * 1e3, 2),
                     "wall_s_all": [round(c["wall_s"], 3) for c in calls[v]]})
    base = rows[0]["wall_s"]
    for r in rows:
        r["vs_loop"] = round(r["wall_s"] / base, 3)
    return rows


def profile_loop(engine, recipe, round_, steps: int) -> dict:
    """One loop call under cProfile: own host time per model step (`steps`: the loop call's, from
    `measure`; seeded, so every call runs the same steps) by source area, and the top functions."""
    from rollout_bench.harness import host_profile

    return host_profile(lambda: run_variant("loop", engine, recipe, round_), steps=max(steps, 1), top=25)


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':15s} {'seqs':>6s} {'tokens':>8s} {'wall s':>8s} {'tok/s':>9s} {'steps':>6s} {'ms/step':>8s} {'x loop':>7s}")
    for r in rows:
        print(f"{r['variant']:15s} {r['sequences']:6d} {r['generated_tokens']:8d} {r['wall_s']:8.3f} {r['tokens_per_s']:9.1f} "
              f"{r['steps']:6d} {r['ms_per_step']:8.2f} {r['vs_loop']:6.3f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="a DAPO recipe (its rollout settings, task and seed)")
    ap.add_argument("--checkpoint", required=True, help="HF checkpoint directory of the served model (e.g. the recipe's warm start)")
    ap.add_argument("--prompts", type=int, default=None, help="training problems of the round (default: the recipe's prompts_per_step)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}; loop first")
    ap.add_argument("--profile", action="store_true", help="add one loop call under cProfile (host time by area, top functions)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants or variants[0] != "loop":
        raise SystemExit(f"--variants {args.variants!r}: give variants from {', '.join(VARIANTS)}, 'loop' first (the baseline)")
    if args.repeats < 1 or (args.prompts is not None and args.prompts < 1):
        raise SystemExit("--repeats and --prompts must be >= 1")
    if not (Path(args.checkpoint) / "config.json").is_file():
        raise SystemExit(f"--checkpoint {args.checkpoint}: no config.json there; give an HF checkpoint directory")

    from beam_rl.dapo.config import load_recipe
    from beam_rl.dapo.loop import Job
    from beam_rl.engines import start_rollout_engine
    from beam_rl.tasks.arithmetic import TOKENIZER_DIR

    recipe = load_recipe(args.recipe)
    settings = dataclasses.replace(Job.engine_settings(recipe, Path(args.checkpoint)), tokenizer=str(TOKENIZER_DIR))
    engine = start_rollout_engine(settings)
    try:
        round_ = first_round(recipe, args.prompts)
        rows = measure(engine, recipe, round_, repeats=args.repeats, variants=variants)
        profile = profile_loop(engine, recipe, round_, rows[0]["steps"]) if args.profile else None
    finally:
        engine.shutdown()
    print_table(rows)
    if args.json:
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        import vllm

        prov = {"command": "python scripts/bench_dapo_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "date": time.strftime("%Y-%m-%d"), "device": f"{device}, vLLM {vllm.__version__}", "commit": bench_provenance.commit(),
                "async_scheduling": settings.async_scheduling, "max_num_seqs": settings.max_num_seqs}
        args.json.write_text(json.dumps({"provenance": prov, "rows": rows, "profile": profile}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

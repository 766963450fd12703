"""Speculative decoding of the Beam rollout with its DFlash2 drafter: tokens/s and acceptance, modes in one run.

    python scripts/bench_spec.py --checkpoint CKPT --drafter DRAFTER [--recipe recipes/math/warm-mini-h200.yaml]
                                 [--modes none,fixed,adaptive] [--concurrency 1,8,32,128] [--num-speculative 7]
                                 [--max-tokens 128] [--waves 3] [--eager] [--json docs/bench/spec.json]

Each mode runs in its own process (this script with `--mode`), one engine with beam-rl's engine
settings (async scheduling; torch.compile + CUDA graphs unless `--eager`), greedy decoding of the
recipe task's held-out prompts (`drafter` of the recipe's task, as `beam-rl train-drafter` uses):
- at each concurrency c, waves of exactly c requests of `--max-tokens` tokens each (`ignore_eos`:
  every request runs the whole length, so c requests are in flight throughout), one warm-up wave,
  then `--waves` timed waves: tokens/s = c * max_tokens / wave wall time (median over waves);
- mean acceptance length = 1 + accepted / drafts over the timed waves (vLLM's spec-decode counters:
  tokens gained per target step);
- greedy equivalence: the fraction of requests whose tokens equal mode `none`'s at the same
  concurrency (the same batch shape).
The parent prints the table (each mode's tokens/s over `none`'s at the same concurrency) and writes
`{"rows": [{concurrency, mode, tokens_per_s, acceptance_length, same_tokens_as_none, ...}], ...}`.

Modes: `none` (no speculation), `fixed` (DFlash2, every request verifies `--num-speculative`
tokens per step), `adaptive` (DFlash2 with `EngineSettings.adaptive_verification`: per step only the
draft tokens whose estimated acceptance pays for their measured cost; it truncates drafts on the
host, so it runs with synchronous scheduling where the other modes run asynchronous).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("none", "fixed", "adaptive")


def parse_list(text: str, what: str, cast=int, allowed=None) -> list:
    items = [t for t in text.split(",") if t]
    try:
        values = [cast(t) for t in items]
    except ValueError:
        raise SystemExit(f"{what} {text!r}: expected comma-separated values") from None
    bad = [v for v in values if (allowed is not None and v not in allowed) or (cast is int and v < 1)]
    if not values or bad or len(set(values)) != len(values):
        raise SystemExit(f"{what} {text!r}: {'bad entries ' + str(bad) if bad else 'empty or repeated'}"
                         + (f"; choose from {', '.join(allowed)}" if allowed else "; positive integers"))
    return values


def prompts(recipe: str, n: int) -> list[list[int]]:
    """n held-out prompts of the recipe's task, as token ids (cycled when the split is shorter)."""
    from beam_rl.dapo.config import load_recipe
    from beam_rl.tasks.arithmetic import Tokenizer

    task, tok = load_recipe(recipe).task.build(), Tokenizer()
    held = [task.prompt_ids(p, tok) for p in task.heldout]
    if not held:
        raise SystemExit(f"--recipe {recipe}: its task has no held-out problems")
    return [held[i % len(held)] for i in range(n)]


def spec_counts(llm) -> tuple[float, float]:
    got = {m.name: m.value for m in llm.get_metrics() if m.name in ("vllm:spec_decode_num_drafts",
                                                                      "vllm:spec_decode_num_accepted_tokens")}
    return got.get("vllm:spec_decode_num_drafts", 0.0), got.get("vllm:spec_decode_num_accepted_tokens", 0.0)


def run_mode(args) -> dict:
    """One mode in this process: the engine, then every concurrency's waves."""
    from vllm import SamplingParams

    from beam_rl.engines import EngineSettings, start_rollout_engine

    conc = parse_list(args.concurrency, "--concurrency")
    waves = args.waves + 1
    ids = prompts(args.recipe, max(conc) * waves)
    longest = max(len(p) for p in ids)
    engine_args: dict = {"disable_log_stats": False}
    if args.mode in ("fixed", "adaptive"):
        engine_args["speculative_config"] = dict(method="dflash", model=args.drafter, num_speculative_tokens=args.num_speculative)
        if not args.eager:  # the verify step runs c * (1 + K) tokens: CUDA graphs for those sizes
            engine_args["compilation_config"] = {"max_cudagraph_capture_size": max(conc) * (1 + args.num_speculative)}
    t0 = time.perf_counter()
    engine = start_rollout_engine(EngineSettings(
        model=args.checkpoint, seed=0, max_model_len=longest + args.max_tokens + args.num_speculative + 8,
        max_num_seqs=max(conc), enforce_eager=args.eager, capture_routing=False,
        adaptive_verification=args.mode == "adaptive", async_scheduling=args.mode != "adaptive",
        gpu_memory_utilization=args.gpu_memory_utilization, engine_args=engine_args))
    start_s = time.perf_counter() - t0
    print(f"PROGRESS {args.mode}: engine up in {start_s:.0f} s", flush=True)
    llm = engine.llm
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    out = {"mode": args.mode, "engine_start_s": start_s, "by_concurrency": {}}
    for c in conc:
        walls, tokens = [], []
        for w in range(waves):
            batch = [{"prompt_token_ids": p} for p in ids[w * c : (w + 1) * c]]
            if w == 1:
                before = spec_counts(llm)
                stats0 = llm.collective_rpc("beam_adaptive_verification_stats")[0] if args.mode == "adaptive" else None
            t = time.perf_counter()
            res = llm.generate(batch, sp, use_tqdm=False)
            wall = time.perf_counter() - t
            if w >= 1:  # wave 0 warms up
                walls.append(wall)
                tokens += [list(r.outputs[0].token_ids) for r in res]
        drafts, accepted = (a - b for a, b in zip(spec_counts(llm), before))
        verified_fraction = None
        if stats0 is not None:  # the share of the drafted tokens adaptive verification admitted
            stats = llm.collective_rpc("beam_adaptive_verification_stats")[0]
            drafted = stats["drafted"] - stats0["drafted"]
            verified_fraction = (stats["verified"] - stats0["verified"]) / drafted if drafted else None
        wall = statistics.median(walls)
        out["by_concurrency"][str(c)] = r = dict(
            tokens_per_s=c * args.max_tokens / wall, wave_s=wall, wave_s_all=walls,
            acceptance_length=1 + accepted / drafts if drafts else None, drafts=drafts, accepted=accepted,
            verified_fraction=verified_fraction, tokens=tokens)
        print(f"PROGRESS {args.mode}: concurrency {c}: {r['tokens_per_s']:.1f} tokens/s, acceptance length "
              f"{r['acceptance_length']}", flush=True)
    engine.shutdown()
    return out


def summarize(results: dict, conc: list[int]) -> tuple[list[dict], list[str]]:
    rows, lines = [], ["| concurrency | mode | tokens/s | vs none | acceptance length | same tokens as none |",
                       "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for c in conc:
        base = results.get("none", {}).get("by_concurrency", {}).get(str(c))
        for mode, res in results.items():
            r = res["by_concurrency"][str(c)]
            same = None
            if base is not None:
                same = sum(a == b for a, b in zip(r["tokens"], base["tokens"])) / len(base["tokens"])
            ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else None
            rows.append(dict(concurrency=c, mode=mode, tokens_per_s=r["tokens_per_s"], acceptance_length=r["acceptance_length"],
                             speedup_over_none=ratio, same_tokens_as_none=same, verified_fraction=r.get("verified_fraction"),
                             wave_s_all=r["wave_s_all"]))
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            lines.append(f"| {c} | {mode} | {r['tokens_per_s']:.1f} | {fmt(ratio, '.2f')}x | {fmt(r['acceptance_length'], '.2f')} "
                         f"| {fmt(same, '.2f')} |")
    return rows, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="the target's HF checkpoint directory")
    ap.add_argument("--drafter", help="the DFlash2 drafter directory (`beam-rl train-drafter --out`); needed by modes fixed, adaptive")
    ap.add_argument("--recipe", default="recipes/math/warm-mini-h200.yaml", help="the task whose held-out prompts are decoded")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--mode", choices=MODES, help="(internal) run one mode in this process")
    ap.add_argument("--concurrency", default="1,8,32,128", help="requests in flight, comma-separated")
    ap.add_argument("--num-speculative", type=int, default=7, help="draft tokens per step (the block has 1 + K rows)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--waves", type=int, default=3, help="timed waves per concurrency (after one warm-up wave)")
    ap.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs (the CPU runner is eager anyway)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--json", help="write the rows and every mode's measurements here")
    args = ap.parse_args(argv)
    if args.num_speculative < 1 or args.max_tokens < 1 or args.waves < 1:
        raise SystemExit("--num-speculative, --max-tokens and --waves must be >= 1")
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return 0
    modes = parse_list(args.modes, "--modes", str, MODES)
    conc = parse_list(args.concurrency, "--concurrency")
    if {"fixed", "adaptive"} & set(modes) and not (args.drafter and os.path.isfile(os.path.join(args.drafter, "config.json"))):
        raise SystemExit(f"--drafter {args.drafter!r}: modes fixed and adaptive need a DFlash2 drafter directory with config.json "
                         "(beam-rl train-drafter --out DIR)")
    results, failed = {}, []
    argv = argv if argv is not None else sys.argv[1:]

    def write(partial: bool) -> None:
        if not args.json:
            return
        rows = summarize(results, conc)[0] if results else []
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python scripts/bench_spec.py", *argv]), "partial": partial,
                       "num_speculative_tokens": args.num_speculative, "max_tokens": args.max_tokens, "rows": rows,
                       "failed": failed, "modes": results}, f, indent=1)

    for mode in modes:
        # the child's progress lines as they come: a run cut short by a time limit still shows them
        err_file = tempfile.TemporaryFile(mode="w+")  # vLLM logs a lot: a pipe left unread would block the child
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--mode", mode],
                                stdout=subprocess.PIPE, stderr=err_file, text=True)
        result = None
        for line in proc.stdout:
            if line.startswith("PROGRESS "):
                print(line[len("PROGRESS "):], end="", flush=True)
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        proc.wait()
        err_file.seek(0)
        err = err_file.read()
        if proc.returncode or result is None:
            failed.append(mode)
            print(f"mode {mode} failed (exit {proc.returncode}):\n{err[-3000:]}", file=sys.stderr)
        else:
            results[mode] = result
        write(partial=True)
    rows, lines = summarize(results, conc) if results else ([], [])
    print("\n".join(lines))
    write(partial=False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Rollout speed of the vLLM Beam model: builds of the same model, each timed in its own process, in one run.

    python scripts/bench_rollout.py --checkpoint CKPT [--builds fused,compiled,eager] [--rounds N] [--json OUT.json]
    python scripts/bench_rollout.py --host-sweep [PASSES] [--cpus 0-7] [--json OUT.json]
    python scripts/bench_rollout.py --concurrency --checkpoint CKPT [--variants ...] [--decode-batches 64,256]
                                    [--weight-update N] [--json OUT.json]

`--concurrency`: decode at RL concurrency (batch 1 and `--decode-batches`) for the variants of
`rollout_bench.concurrency.VARIANTS`, each its own process: async scheduling on and off, R3 capture
off and on (beam-rl's, and vLLM's own for comparison), vLLM's Qwen3-MoE class of the same size as
the peer; tokens/s, wall and GPU ms per step, whether every variant captured the same routing, and
the in-memory weight update against the file route. Prints the tables with the issue's goals.

Builds (`rollout_bench.harness.BUILDS`):
- fused:    beam-rl's Triton kernels (BEAM_RL_FUSED_KERNELS=1), vLLM's torch.compile + CUDA graphs
- compiled: Beam's operations in plain PyTorch (the numerics reference) under vLLM's default
            torch.compile + CUDA graphs
- eager:    the same plain PyTorch without compilation (CUDA graphs kept where vLLM allows it
            without compilation; the build's actual compilation/cudagraph settings are printed)
- compiled_fp32, eager_fp32: the plain builds with the norms' sum of squares summed in FP32

What one build's process measures (batch-1 decode ms/step, 8-prompt prefill, probes of the host's
speed around every timed repeat, GPU time per step): `rollout_bench.harness`. This script starts
one process per build with vLLM's engine core inside it (VLLM_ENABLE_V1_MULTIPROCESSING=0, unless
`--env` says otherwise); `--rounds N` runs the builds round-robin N times in fresh processes, so a
drift of the host's speed reaches every build alike, and merges each build's rounds (medians over
rounds, every timed repeat kept). It prints the tables (`rollout_bench.report`: each build against
a baseline build of the same run, host speed, GPU time, the speed goals) and writes the JSON, after
every process (with "partial": true) and at the end. `--host-sweep` instead times the fixed
CPython probe pinned to each CPU in turn (`rollout_bench.host_probe.sweep`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys

from rollout_bench import concurrency
from rollout_bench.harness import BUILDS, MAIN_BUILDS, run_build
from rollout_bench.host_probe import parse_cpus, sweep_report
from rollout_bench.report import summarize


def parse_engine_args(items: list[str]) -> dict:
    """['disable_hybrid_kv_cache_manager=true', ...] -> {name: JSON value (a bare word stays a string)}; names
    must be `vllm.LLM` engine arguments."""
    from vllm.engine.arg_utils import EngineArgs

    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in EngineArgs.__dataclass_fields__:
            raise SystemExit(f"--engine-arg {item!r}: expected NAME=VALUE with NAME an EngineArgs field")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def parse_env(items: list[str], where: str = "--env", form: str = "KEY=VALUE") -> dict[str, str]:
    """['KEY=VALUE', ...] (`--env`, and the environment of a `--builds` entry) -> {KEY: VALUE}; an error
    names `where` and the expected `form`."""
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{where} {item!r}: expected {form}")
        parsed[key] = value
    return parsed


def parse_builds(spec: str) -> dict[str, tuple[str, dict[str, str]]]:
    """'fused,eager,fused:K=V+K2=V2' -> {entry: (build, extra env)}, in order; each BUILD must be in BUILDS
    and each entry unique (it names the build's results)."""
    builds: dict[str, tuple[str, dict[str, str]]] = {}
    for entry in spec.split(","):
        build, _, env_spec = entry.partition(":")
        if build not in BUILDS:
            raise SystemExit(f"--builds {entry!r}: unknown build {build!r}; choose from {sorted(BUILDS)}")
        if entry in builds:
            raise SystemExit(f"--builds: {entry!r} is listed twice")
        env = parse_env(env_spec.split("+") if env_spec else [], where=f"--builds {entry!r}, item",
                        form="BUILD:KEY=VALUE[+KEY=VALUE]")
        builds[entry] = (build, env)
    return builds


def parse_batches(spec: str) -> list[int]:
    """'8,64' -> [8, 64]: distinct batch sizes >= 2 for `--decode-batches` ('' -> [])."""
    if not spec:
        return []
    try:
        batches = [int(b) for b in spec.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected comma-separated integers, e.g. 8,64") from None
    if any(b < 2 for b in batches) or len(set(batches)) != len(batches):
        raise argparse.ArgumentTypeError(f"{spec!r}: batch sizes must be distinct and >= 2 (batch 1 is always timed)")
    return batches


def run_child(cmd: list[str], env: dict[str, str], args, log_name: str) -> subprocess.CompletedProcess:
    """Run one measuring child process (with `--host-profile` / `--cpus` passed on); its output also
    goes to `<log dir>/<log_name>.log`."""
    if args.host_profile:
        cmd = cmd + ["--host-profile"]
    if args.cpus:
        cmd = cmd + ["--cpus", args.cpus]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, f"{log_name}.log"), "w") as fh:
            fh.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc


def run_variant_process(name: str, args) -> dict | None:
    """One `--concurrency` variant in its own process (`--variant NAME`); its RESULT dict, or None."""
    env = {**os.environ, "BEAM_RL_FUSED_KERNELS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, __file__, "--checkpoint", args.checkpoint, "--variant", name, "--work", args.work,
           "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats),
           "--decode-batches", ",".join(map(str, args.decode_batches)), "--weight-update", str(args.weight_update)]
    if not args.gpu_time:
        cmd.append("--no-gpu-time")
    proc = run_child(cmd, env, args, name)
    for line in proc.stdout.splitlines():
        if line.startswith("[") and not line.startswith("RESULT"):
            print(line, flush=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"variant {name} failed (exit {proc.returncode}):", proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def run_concurrency(args) -> int:
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in concurrency.VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(concurrency.VARIANTS)}")
    results, failed = {}, []
    for name in variants:
        r = run_variant_process(name, args)
        if r is None:
            failed.append(name)
        else:
            results[name] = r
        write_json(args.json, {"partial": True, "variants": results, "failed": failed})
    summary, lines = concurrency.summarize(results)
    for line in lines:
        print(line, flush=True)
    write_json(args.json, {**summary, "environment": environment(), "decode_tokens": args.decode_tokens,
                           "repeats": args.repeats, "failed": failed, "variants": results})
    if failed:
        raise SystemExit(f"variants failed: {failed}")
    return 0


def run_build_process(name: str, args, extra_env: dict[str, str], log_name: str) -> dict | None:
    """One build in its own process (`--build NAME`); its RESULT dict, or None if it failed."""
    # engine core in the build's process (the profiler sees it) unless --env says otherwise
    env = {**os.environ, **BUILDS[name]["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **extra_env}
    separate_core = env["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0"
    cmd = [sys.executable, __file__, "--checkpoint", args.checkpoint, "--build", name,
           "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats), "--prefill-len", str(args.prefill_len),
           "--decode-batches", ",".join(map(str, args.decode_batches))]
    cmd += [f"--engine-arg={item}" for item in args.engine_arg]
    if not args.gpu_time or separate_core:  # the profiler sees only this process
        cmd.append("--no-gpu-time")
    if args.trace_steps and not separate_core:
        cmd += ["--trace-steps", str(args.trace_steps)]
    proc = run_child(cmd, env, args, log_name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"build {name} failed (exit {proc.returncode}):", proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith(f"[{name}] engine"):
            print(line, flush=True)
        elif line.startswith("[trace]"):
            print(f"[{name}] {line}", flush=True)
    return json.loads(lines[-1][len("RESULT "):])


ROUND_MEDIANS = ("decode_ms", "prefill_ms", "decode_step_ms_median", "decode_step_ms_p10", "decode_step_ms_p90",
                 "decode_gpu_ms", "prefill_gpu_ms", "python_probe_ms", "torch_probe_us")
ROUND_LISTS = ("decode_ms_all", "prefill_ms_all", "decode_probe_pairs_ms", "prefill_probe_pairs_ms",
               "decode_steal_fraction_all", "prefill_steal_fraction_all")


def merge_stats(runs: list[dict]) -> dict:
    """The last run's dict with, for every key all runs have, the median over runs of each `ROUND_MEDIANS`
    key (also listed as KEY_by_round) and the concatenation of each `ROUND_LISTS` key."""
    merged = dict(runs[-1])
    for key in ROUND_MEDIANS:
        if all(key in r for r in runs):
            merged[key] = statistics.median(r[key] for r in runs)
            merged[f"{key}_by_round"] = [r[key] for r in runs]
    for key in ROUND_LISTS:
        if all(key in r for r in runs):
            merged[key] = [x for r in runs for x in r[key]]
    return merged


def merge_rounds(runs: list[dict]) -> dict:
    """One build's result over `--rounds` processes: the medians over rounds of its per-process statistics
    (`ROUND_MEDIANS`, each also listed as KEY_by_round), every timed repeat kept; tokens, log-probs and
    settings from the last round, and whether every round generated the same tokens and log-probs."""
    merged = merge_stats(runs)
    merged["decode_batches"] = {b: merge_stats([r["decode_batches"][b] for r in runs])  # each batch size alike
                                for b in runs[-1].get("decode_batches", {})}
    merged["same_outputs_every_round"] = all(r["tokens"] == runs[0]["tokens"] and r["logprobs"] == runs[0]["logprobs"]
                                             for r in runs)
    return merged


def environment() -> dict:
    """The device and vLLM version the run measured."""
    import torch
    import vllm

    cpu = platform.processor() or platform.machine()
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"none (CPU: {cpu})",
            "vllm_version": vllm.__version__}


def write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(data, fh, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", help="HF checkpoint directory of the Beam model (required unless --host-sweep)")
    ap.add_argument("--build", choices=sorted(BUILDS), help="(internal) run one build in this process")
    ap.add_argument("--concurrency", action="store_true", help="decode at RL concurrency for --variants (see the top)")
    ap.add_argument("--variants", default=",".join(concurrency.VARIANTS),
                    help="--concurrency: comma-separated subset of " + ",".join(concurrency.VARIANTS))
    ap.add_argument("--variant", choices=sorted(concurrency.VARIANTS), help="(internal) run one variant in this process")
    ap.add_argument("--weight-update", type=int, default=3, metavar="N",
                    help="--concurrency: time N in-memory weight updates (and one through files) in beam-async; 0: none")
    ap.add_argument("--work", default="/tmp/beam-bench", help="--concurrency: scratch directory (the peer's config)")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs per build (cheap next to the engine start; the host-bound step time jitters)")
    ap.add_argument("--prefill-len", type=int, default=2048, help="tokens per prompt of the 8-prompt prefill")
    ap.add_argument("--decode-batches", type=parse_batches, default=[], metavar="B[,B...]",
                    help="also time decode with B requests in flight, for each B >= 2 (batch 1 is always timed); in the "
                         "same engine, after the batch-1 measurements (max_num_seqs grows to the largest B)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the builds round-robin this many times, each in a fresh process, and report medians over "
                         "rounds (separate processes of one build can run on hosts of different speed)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--log-dir", default=None, help="keep each build's full stdout/stderr here")
    ap.add_argument("--builds", default=",".join(MAIN_BUILDS),
                    help="comma-separated subset of " + ",".join(BUILDS) + "; BUILD:KEY=VALUE[+KEY=VALUE] runs a build "
                         "with extra environment as its own entry, so an A/B of a setting shares the rounds (e.g. "
                         "fused,eager,fused:VLLM_ENABLE_V1_MULTIPROCESSING=1,eager:VLLM_ENABLE_V1_MULTIPROCESSING=1)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in every build's process, after the build's own settings (e.g. VLLM_USE_V2_MODEL_RUNNER=1, "
                         "or VLLM_ENABLE_V1_MULTIPROCESSING=1 for vLLM's separate engine-core process: no GPU-time pass then)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="extra vllm.LLM engine argument for every build, VALUE as JSON (e.g. "
                         "disable_hybrid_kv_cache_manager=true: one KV-cache group instead of one per attention type)")
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="also profile this many decode steps with host activity and print where a step's time goes (CUDA)")
    ap.add_argument("--cpus", default="",
                    help="pin every build's process to these CPUs (e.g. 0-7): the step time is host-bound, and "
                         "builds that land on different cores are not comparable")
    ap.add_argument("--host-profile", action="store_true",
                    help="also run one decode under cProfile and print the Python functions with the most host time "
                         "(--concurrency: per variant at the top batch, with own time by source area)")
    ap.add_argument("--nominal-host-factor", type=float, default=1.3,
                    help="a timed repeat counts as on a nominal host when the python probes around it are within this "
                         "factor of the run's fastest probe")
    ap.add_argument("--no-gpu-time", dest="gpu_time", action="store_false",
                    help="skip the profiled pass that measures GPU time and kernel count per step (CUDA only: pass it on CPU)")
    ap.add_argument("--host-sweep", type=int, nargs="?", const=3, default=None, metavar="PASSES",
                    help="instead of benchmarking: time the fixed CPython probe pinned to each CPU of --cpus (default: "
                         "this process's affinity) in turn, PASSES times (default 3), and print it by CPU")
    args = ap.parse_args()
    if args.host_sweep is not None:
        cpus = parse_cpus(args.cpus) if args.cpus else os.sched_getaffinity(0)
        result, lines = sweep_report(sorted(cpus), args.host_sweep)
        print("\n".join(lines) + "\n" + json.dumps(result))
        write_json(args.json, result)
        return 0
    if not args.checkpoint:
        ap.error("--checkpoint is required")
    if args.variant:
        if args.cpus:
            os.sched_setaffinity(0, parse_cpus(args.cpus))
        if args.weight_update and args.variant != "beam-async":
            args.weight_update = 0
        print("RESULT " + json.dumps(concurrency.run_variant(args)), flush=True)
        return 0
    if args.concurrency:
        if args.cpus:
            parse_cpus(args.cpus)
        return run_concurrency(args)
    if args.build:
        if args.cpus:  # before torch and vLLM start their threads: they inherit the mask
            os.sched_setaffinity(0, parse_cpus(args.cpus))
        print("RESULT " + json.dumps(run_build(args, parse_engine_args(args.engine_arg))), flush=True)
        return 0
    engine_args = parse_engine_args(args.engine_arg)
    extra_env = parse_env(args.env)
    if args.cpus:
        parse_cpus(args.cpus)  # fail here, not in every build
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be >= 1")
    builds = parse_builds(args.builds)
    runs: dict[str, list[dict]] = {name: [] for name in builds}
    failed: list[str] = []
    for rnd in range(args.rounds):  # round-robin: a drift of the host's speed reaches every build alike
        for name, (build, build_env) in builds.items():
            if name in failed:
                continue
            log_name = re.sub(r"[^A-Za-z0-9_.-]", "_", name) + (f".round{rnd}" if args.rounds > 1 else "")
            r = run_build_process(build, args, {**extra_env, **build_env}, log_name)
            if r is None:
                failed.append(name)
                continue
            r["build_env"] = build_env
            runs[name].append(r)
            label = f"[{name}]" + (f" round {rnd}" if args.rounds > 1 else "")
            if "decode_step_ms_median" in r:
                print(f"{label} engine steps: median {r['decode_step_ms_median']:.3f} ms (p10 {r['decode_step_ms_p10']:.3f}, "
                      f"p90 {r['decode_step_ms_p90']:.3f})", flush=True)
            print(f"{label} start {r['engine_start_s']:.0f} s, decode {r['decode_ms']:.3f} ms/step, "
                  f"prefill {r['prefill_ms']:.1f} ms ({r['mode']}); host probes: python {r['python_probe_ms']:.2f} ms, "
                  f"torch {r['torch_probe_us']:.2f} us ({r.get('cpu_model')}, {r.get('cpu_mhz_mean') or 0:.0f} MHz)", flush=True)
            # every finished process is on disk, should a later one run out of time
            write_json(args.json, {"partial": True, "runs": runs, "failed": failed, "env": args.env})
    results = {name: merge_rounds(rs) for name, rs in runs.items() if rs and name not in failed}
    summary, lines = summarize(results, rounds=args.rounds, prefill_len=args.prefill_len,
                               nominal_factor=args.nominal_host_factor, environment=environment())
    for line in lines:
        print(line, flush=True)
    print(json.dumps(summary, indent=1), flush=True)
    summary["env"] = args.env
    summary["engine_args"] = engine_args
    if failed:
        summary["failed"] = failed
    write_json(args.json, {**summary, "builds": results})
    if failed:
        raise SystemExit(f"builds failed: {failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

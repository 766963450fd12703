"""Rollout speed of the vLLM Beam model, three builds of the same model in one run (H200):

    python scripts/bench_rollout.py --checkpoint /tmp/beam-gpu/beam-mini [--json OUT.json]

- fused:    beam-rl's Triton kernels (BEAM_RL_FUSED_KERNELS=1), vLLM's torch.compile + CUDA graphs
- compiled: Beam's operations in plain PyTorch (the numerics reference) under vLLM's default
            torch.compile + CUDA graphs: what a user gets for free
- eager:    the same plain PyTorch without compilation (CUDA graphs kept where vLLM allows it
            without compilation; the build's actual compilation/cudagraph settings are printed)

Batch-1 decode: ms per step from (t(1 + N tokens) - t(1 token)) / N (`--decode-batches 8,64` also
times it with that many requests in flight, in the same engine); prefill: 8 x 2048-token prompts, one
output token, prefix caching off. Medians of --repeats runs. Each build runs in its
own process, with vLLM's engine core inside it (VLLM_ENABLE_V1_MULTIPROCESSING=0); `--rounds N`
runs the builds round-robin N times in fresh processes and reports medians over rounds plus each
round's ratios (processes of one configuration differed by up to 28% on the H200). One more
profiled pass per build measures GPU time (kernels and copies) and kernels per step: at beam-mini
size a decode step's wall time is mostly vLLM's host work, which no kernel changes. So every process
also times two fixed host workloads (`host_speed`: CPython objects, PyTorch dispatch; the first also
just before and after every timed repeat) and records the CPU model and the hypervisor's steal time
during each timed repeat, telling a slow host from a slow build; the summary adds each build's medians
over the repeats that ran on a host at its nominal speed (`nominal_host`), and issue 4's goals by wall
clock, wall clock on a nominal host and GPU time (`goal_rows`). Also reports whether fused and eager
builds produce identical greedy tokens and log-probs (they share the numerics contract; compiled
PyTorch may re-round).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

BUILDS = {
    "fused": dict(env={"BEAM_RL_FUSED_KERNELS": "1"}, compilation=None),
    "compiled": dict(env={"BEAM_RL_FUSED_KERNELS": "0"}, compilation=None),
    "eager": dict(env={"BEAM_RL_FUSED_KERNELS": "0"}, compilation={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}),
    # The two plain builds with the norms' sum of squares summed in FP32 (`use_fp32_sum_of_squares`: the
    # arithmetic of `x.float().pow(2).mean(-1)`, beam-rl's reference before 2026-12-01 and what most PyTorch
    # code writes, up to the summation order): not the numerics contract (their outputs differ in the last
    # bits), but the baseline a user would compare against.
    "compiled_fp32": dict(env={"BEAM_RL_FUSED_KERNELS": "0"}, compilation=None, fp32_sum=True),
    "eager_fp32": dict(env={"BEAM_RL_FUSED_KERNELS": "0"}, compilation={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
                       fp32_sum=True),
}
MAIN_BUILDS = ("fused", "compiled", "eager")


def use_fp32_sum_of_squares() -> None:
    """Swap the reference's FP64 sum of squares for an FP32 one in this process (the engine core runs
    here, so the model built next calls it)."""
    from beam_rl.model import numerics

    numerics.sum_of_squares = lambda xf: (xf * xf).sum(dim=-1, keepdim=True)


def run_build(args) -> dict:
    if args.cpus:  # before vLLM starts its threads: they inherit the mask
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    from vllm import LLM, SamplingParams

    extra = {}
    build = BUILDS[args.build]
    if build.get("fp32_sum"):
        use_fp32_sum_of_squares()
    if build["compilation"] is not None:
        extra["compilation_config"] = build["compilation"]
    user_args = json.loads(args.engine_args_json)
    extra.update(user_args)
    max_len = max(args.prefill_len + 1, 32 + 1 + args.decode_tokens)
    engine_args = dict(model=args.checkpoint, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_len,
                       max_num_batched_tokens=max(16384, 8 * args.prefill_len), max_num_seqs=max([16, *args.decode_batches]),
                       enable_prefix_caching=False, gpu_memory_utilization=0.6, seed=0)
    t0 = time.time()
    try:
        llm = LLM(**engine_args, **extra)
        mode = "as configured"
    except Exception as err:  # no CUDA graphs without compilation on this vLLM: plain eager
        print(f"[{args.build}] {extra} refused ({type(err).__name__}: {err}); using enforce_eager", flush=True)
        llm = LLM(**engine_args, **user_args, enforce_eager=True)
        mode = "enforce_eager"
    start_s = time.time() - t0
    cfg = llm.llm_engine.vllm_config
    engine = dict(async_scheduling=cfg.scheduler_config.async_scheduling,
                  cudagraph_mode=str(cfg.compilation_config.cudagraph_mode),
                  compilation_mode=str(cfg.compilation_config.mode),
                  v2_model_runner=getattr(cfg, "use_v2_model_runner", None), kv_cache_groups=kv_cache_groups(llm),
                  engine_args=user_args)
    print(f"[{args.build}] engine: {engine}", flush=True)
    from beam_rl.model.checkpoint import load_config

    vocab = load_config(args.checkpoint).vocab_size
    prompt = [(i * 7919) % vocab for i in range(32)]

    def timed(prompts, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t

    timed([prompt], 8)  # warm-up
    n = args.decode_tokens
    decode, decode_probe, decode_steal = probed_repeats(lambda: decode_ms_per_step(timed, [prompt], n), args.repeats)
    with step_clock(llm) as steps_ms:  # the same decode, one engine step at a time
        timed([prompt], 1 + n)
    steady = sorted(steps_ms[2:-1])  # drop the prefill and the first decode step, and the final drain
    step_stats = dict(decode_step_ms_median=statistics.median(steady), decode_step_ms_p10=steady[len(steady) // 10],
                      decode_step_ms_p90=steady[len(steady) * 9 // 10]) if steady else {}
    long_prompts = [[(i * 31 + j * 17) % vocab for i in range(args.prefill_len)] for j in range(8)]
    timed(long_prompts, 1)
    prefill, prefill_probe, prefill_steal = probed_repeats(lambda: timed(long_prompts, 1) * 1e3, args.repeats)
    gpu = {}
    if args.gpu_time:  # one more pass of each, under the profiler (it slows the wall clock, not the kernels)
        pre = gpu_time(lambda: timed(long_prompts, 1))
        gpu = dict(decode_gpu(timed, [prompt], n), prefill_gpu_ms=pre[0], prefill_kernels=pre[1])
    trace = step_trace(lambda: timed([prompt], 1 + args.trace_steps), args.trace_steps) if args.trace_steps else {}
    if args.host_profile:
        trace["host_profile"] = host_profile(lambda: timed([prompt], 1 + n), n)
    batches = {str(b): decode_at_batch(timed, b, vocab, n, args.repeats, args.gpu_time) for b in args.decode_batches}
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
    return dict(build=args.build, mode=mode, engine=engine, engine_start_s=start_s, **host_speed(),
                decode_ms=statistics.median(decode), decode_ms_all=decode, decode_probe_pairs_ms=decode_probe,
                decode_steal_fraction_all=decode_steal, **step_stats, prefill_ms=statistics.median(prefill),
                prefill_ms_all=prefill, prefill_probe_pairs_ms=prefill_probe, prefill_steal_fraction_all=prefill_steal,
                **gpu, **trace, decode_batches=batches,
                tokens=list(out.token_ids), logprobs=[d[t].logprob for d, t in zip(out.logprobs, out.token_ids)])


def decode_at_batch(timed, batch: int, vocab: int, n: int, repeats: int, with_gpu_time: bool) -> dict:
    """Decode ms per step with `batch` requests in flight (distinct 32-token prompts, so the MoE routes
    them apart), measured like batch 1: (t(1 + n tokens) - t(1)) / n, medians of `repeats`, the python
    probe around each repeat; with `with_gpu_time` also GPU ms and kernels per step. Where batch 1 is
    bound by vLLM's host work, this shows at what batch the GPU work per step takes over."""
    prompts = [[(i * 7919 + j * 104729) % vocab for i in range(32)] for j in range(batch)]
    timed(prompts, 8)  # warm-up (and this batch size's first graph replay)
    times, probes, steal = probed_repeats(lambda: decode_ms_per_step(timed, prompts, n), repeats)
    out = dict(decode_ms=statistics.median(times), decode_ms_all=times, decode_probe_pairs_ms=probes,
               decode_steal_fraction_all=steal)
    return dict(out, **decode_gpu(timed, prompts, n)) if with_gpu_time else out


def decode_ms_per_step(timed, prompts: list[list[int]], n: int) -> float:
    """ms per decode step of these prompts, (t(1 + n tokens) - t(1 token)) / n: the prefill cancels."""
    return (timed(prompts, 1 + n) - timed(prompts, 1)) / n * 1e3


def decode_gpu(timed, prompts: list[list[int]], n: int) -> dict:
    """GPU ms and kernels per decode step of these prompts, from one profiled pass of 1 and of 1 + n tokens."""
    one, full = gpu_time(lambda: timed(prompts, 1)), gpu_time(lambda: timed(prompts, 1 + n))
    return dict(decode_gpu_ms=(full[0] - one[0]) / n, decode_kernels_per_step=(full[1] - one[1]) / n)


def probed_repeats(fn, repeats: int) -> tuple[list[float], list[list[float]], list[float]]:
    """`repeats` calls of fn (each returning ms), each with the python probe taken just before and just after
    it and the share of this process's CPUs' time the hypervisor stole during it (the host moves within
    seconds): (ms, [[probe before, after], ...], steal fractions)."""
    cpus = os.sched_getaffinity(0)
    times, probes, steal = [], [], []
    for _ in range(repeats):
        before, ticks = python_probe_ms(), cpu_jiffies(cpus)
        times.append(fn())
        after = cpu_jiffies(cpus)
        probes.append([before, python_probe_ms()])
        if ticks and after and after[1] > ticks[1]:
            steal.append((after[0] - ticks[0]) / (after[1] - ticks[1]))
    return times, probes, steal


class _ProbeItem:
    __slots__ = ("key", "size")

    def __init__(self, key, size):
        self.key, self.size = key, size


def python_probe_ms(repeats: int = 3) -> float:
    """Median ms of a fixed CPython workload (20000 small objects into a dict, then summed: object
    creation, attribute access, calls and hashing, like vLLM's scheduler and input preparation)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        table = {}
        for i in range(20000):
            table[f"req-{i % 4096}"] = _ProbeItem(i, i % 97)
        sum(item.size for item in table.values() if item.key % 3)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def cpu_jiffies(cpus: set[int]) -> tuple[int, int] | None:
    """(steal, total) clock ticks of these CPUs since boot, from /proc/stat; None where it is unreadable.
    Steal is the time the hypervisor ran something else while this VM's vCPU wanted to run: on a lent
    VM, the direct measure of a host slowed by its neighbours."""
    try:
        with open("/proc/stat") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    steal = total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            steal += ticks[7]
            total += sum(ticks)
    return steal, total


def host_speed(repeats: int = 7) -> dict:
    """How fast this process's host runs the kind of work a host-bound decode step is made of, measured
    after the timed runs on the same pinned CPUs (no engine work in flight): `python_probe_ms`
    (`python_probe_ms()`, median of `repeats`), and `torch_probe_us`, median host us of one CPU-tensor
    slice + view + empty (PyTorch's dispatcher, like the `aten::slice`/`copy_` calls of a step). Same
    work every process, so a ratio between processes or machines is a ratio of host speed; also the CPU
    model and its MHz."""
    import torch

    x = torch.zeros(64, 64)
    torch_us = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(2000):
            x[1:9].view(-1)
            torch.empty(8)
        torch_us.append((time.perf_counter() - t) * 1e6 / 2000)
    cpu = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
        model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        mhz = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([0-9.]+)$", info, re.M)]
        cpu = dict(cpu_model=model.group(1).strip() if model else None,
                   cpu_mhz_mean=statistics.fmean(mhz) if mhz else None)
    return dict(python_probe_ms=python_probe_ms(repeats), torch_probe_us=statistics.median(torch_us), **cpu)


def kv_cache_groups(llm) -> int | None:
    """Number of KV-cache groups of the in-process engine core: vLLM's hybrid KV-cache manager gives each
    group of layers with one attention type its own block table, and a decode step's input preparation
    (slot mapping, block table copy, attention metadata) runs once per group on the host."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    return None if config is None else len(config.kv_cache_groups)


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


def parse_cpus(spec: str) -> set[int]:
    """'0-7,12' -> {0, ..., 7, 12}; every CPU must exist on this machine."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    missing = cpus - os.sched_getaffinity(0)
    if missing:
        raise SystemExit(f"--cpus {spec}: CPUs {sorted(missing)} are not available here ({sorted(os.sched_getaffinity(0))})")
    return cpus


@contextlib.contextmanager
def step_clock(llm):
    """Yields a list that receives the wall ms of every `llm_engine.step()` (one engine-core step and its
    output processing) while the block runs: the per-step distribution behind the decode average."""
    engine = llm.llm_engine
    durations: list[float] = []
    original = engine.step

    def step():
        t = time.perf_counter()
        out = original()
        durations.append((time.perf_counter() - t) * 1e3)
        return out

    engine.step = step
    try:
        yield durations
    finally:
        del engine.step  # back to the class's method


def host_profile(fn, steps: int, top: int = 30) -> list:
    """cProfile of one decode run: the Python functions with the most own time, as [name, calls/step,
    own us/step, cumulative us/step]. cProfile slows Python calls, so read the shares, not the totals."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((f"{os.path.basename(file)}:{line}:{name}", calls / steps, tt / steps * 1e6, ct / steps * 1e6)
                   for (file, line, name), (_, calls, tt, ct, _) in stats.items()), key=lambda r: -r[2])[:top]
    print(f"[trace] host profile ({steps} steps; own us/step, cumulative us/step):", flush=True)
    for name, calls, own, cum in rows:
        print(f"[trace]   {own:9.1f} us own {cum:9.1f} us cum {calls:7.1f} calls  {name}", flush=True)
    return rows


def profiled(fn, host: bool = False):
    """(profiler events, wall ms) of one call of fn under the torch profiler: CUDA activity (CUPTI, which
    also records the kernels inside CUDA-graph replays), with `host` also the host's. The engine core
    runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set for every build), so its kernels are seen."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if host else [ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        window_ms = (time.perf_counter() - t0) * 1e3
    return prof.events(), window_ms


def _on(events, device_type: str) -> list:
    import torch

    return [e for e in events if e.device_type == getattr(torch.autograd.DeviceType, device_type)]


def gpu_time(fn) -> tuple[float, int]:
    """(ms of GPU activity, number of kernels/copies) while fn runs."""
    device = _on(profiled(fn)[0], "CUDA")
    return sum(e.device_time_total for e in device) / 1e3, len(device)


def step_trace(fn, steps: int) -> dict:
    """Where a decode step's wall time goes: one generate of 1 + `steps` tokens under the profiler with
    host and GPU activity. Reports the window, the GPU's busy time (union of kernel/copy intervals), the
    kernels by GPU time and the host calls by self time, per step, and the host's blocking waits
    (stream/event/device synchronisations and synchronous copies)."""
    events, window_ms = profiled(fn, host=True)
    device, cpu = _on(events, "CUDA"), _on(events, "CPU")
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in device):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)

    def per_step(evs, us_of) -> list:  # [name, calls/step, us/step], largest first
        tally: dict[str, list] = {}
        for e in evs:
            row = tally.setdefault(e.name[:90], [0, 0.0])
            row[0] += 1
            row[1] += us_of(e)
        return sorted(([n, c / steps, us / steps] for n, (c, us) in tally.items()), key=lambda r: -r[2])

    host = per_step(cpu, lambda e: e.self_cpu_time_total)
    out = dict(trace_window_ms_per_step=window_ms / steps, trace_gpu_busy_ms_per_step=busy / 1e3 / steps,
               trace_kernels=per_step(device, lambda e: e.device_time_total)[:30], trace_host=host[:40],
               trace_waits=[r for r in host if "Synchronize" in r[0] or r[0] in ("cudaMemcpy", "cudaMemcpy2D")])
    print(f"[trace] {steps} steps: window {window_ms / steps:.3f} ms/step (profiled), GPU busy "
          f"{busy / 1e3 / steps:.3f} ms/step", flush=True)
    for title, rows in (("kernels (GPU us/step)", out["trace_kernels"][:25]), ("host (self us/step)", out["trace_host"][:30]),
                        ("host waits", out["trace_waits"])):
        print(f"[trace] {title}:", flush=True)
        for name, calls, us in rows:
            print(f"[trace]   {us:9.1f} us  {calls:6.1f} calls  {name}", flush=True)
    return out


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


def run_build_process(name: str, args, extra_env: dict[str, str], engine_args_json: str, log_name: str) -> dict | None:
    """One build in its own process (`--build NAME`); its RESULT dict, or None if it failed."""
    # engine core in the build's process (the profiler sees it) unless --env says otherwise
    env = {**os.environ, **BUILDS[name]["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **extra_env}
    separate_core = env["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0"
    cmd = [sys.executable, __file__, "--checkpoint", args.checkpoint, "--build", name,
           "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats), "--prefill-len", str(args.prefill_len),
           "--engine-args-json", engine_args_json, "--decode-batches", ",".join(map(str, args.decode_batches))]
    if not args.gpu_time or separate_core:  # the profiler sees only this process
        cmd.append("--no-gpu-time")
    if args.trace_steps and not separate_core:
        cmd += ["--trace-steps", str(args.trace_steps)]
    if args.host_profile:
        cmd.append("--host-profile")
    if args.cpus:
        cmd += ["--cpus", args.cpus]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, f"{log_name}.log"), "w") as fh:
            fh.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"build {name} failed (exit {proc.returncode}):", proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith(("[trace]", f"[{name}] engine")):
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--build", choices=sorted(BUILDS), help="(internal) run one build in this process")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs per build (cheap next to the engine start; the host-bound step time jitters)")
    ap.add_argument("--prefill-len", type=int, default=2048, help="tokens per prompt of the 8-prompt prefill")
    ap.add_argument("--decode-batches", type=parse_batches, default=[], metavar="B[,B...]",
                    help="also time decode with B requests in flight, for each B >= 2 (batch 1 is always timed); in the "
                         "same engine, after the batch-1 measurements (max_num_seqs grows to the largest B)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the builds round-robin this many times, each in a fresh process, and report medians over "
                         "rounds (processes of one configuration differ by up to ~25%% in host speed)")
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
    ap.add_argument("--engine-args-json", default="{}", help=argparse.SUPPRESS)  # (internal) the parsed --engine-arg
    ap.add_argument("--trace-steps", type=int, default=0,
                    help="also profile this many decode steps with host activity and print where a step's time goes")
    ap.add_argument("--cpus", default="",
                    help="pin every build's process to these CPUs (e.g. 0-7): the step time is host-bound, and "
                         "builds that land on different cores are not comparable")
    ap.add_argument("--host-profile", action="store_true",
                    help="also run one decode under cProfile and print the Python functions with the most host time")
    ap.add_argument("--nominal-host-factor", type=float, default=1.3,
                    help="a timed repeat counts as on a nominal host when the python probes around it are within this "
                         "factor of the run's fastest probe (the H200 host's two speeds are ~2x apart)")
    ap.add_argument("--no-gpu-time", dest="gpu_time", action="store_false",
                    help="skip the profiled pass that measures GPU time and kernel count per step")
    args = ap.parse_args()
    if args.build:
        print("RESULT " + json.dumps(run_build(args)), flush=True)
        return 0
    engine_args = parse_engine_args(args.engine_arg)
    engine_args_json = json.dumps(engine_args)
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
            r = run_build_process(build, args, {**extra_env, **build_env}, engine_args_json, log_name)
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
            if args.json:  # every finished process is on disk, should a later one run out of time
                with open(args.json, "w") as fh:
                    json.dump({"partial": True, "runs": runs, "failed": failed, "env": args.env}, fh, indent=1)
    results = {name: merge_rounds(rs) for name, rs in runs.items() if rs and name not in failed}
    summary = summarize(results, args)
    summary["env"] = args.env
    summary["engine_args"] = engine_args
    if failed:
        summary["failed"] = failed
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**summary, "builds": results}, fh, indent=1)
    if failed:
        raise SystemExit(f"builds failed: {failed}")
    return 0


def host_fit(probe_ms: list[float], decode_ms: list[float]) -> dict | None:
    """Least-squares fit decode = intercept + slope x probe over a build's repeats (each repeat's decode
    with the python probe taken around it), and their correlation; None with fewer than 3 repeats or a
    constant probe. On a steady host the probe's spread is its own noise, and so is the fit."""
    if len(probe_ms) != len(decode_ms) or len(probe_ms) < 3 or len(set(probe_ms)) < 2 or len(set(decode_ms)) < 2:
        return None
    line = statistics.linear_regression(probe_ms, decode_ms)
    return dict(repeats=len(probe_ms), correlation=statistics.correlation(probe_ms, decode_ms),
                intercept_ms=line.intercept, slope=line.slope)


def nominal_host(results: dict[str, dict], factor: float) -> tuple[float, dict] | None:
    """The timed repeats that ran on a host at its nominal speed: those whose python probes, taken just
    before and just after the repeat, are both within `factor` x the fastest probe of the whole run (every
    build, decode and prefill). The probe is the same fixed work in every process and knows nothing of
    the build, so the selection is build-blind. Returns (threshold ms, {build: {phase: (median ms or None,
    selected repeats, all repeats)}}), None without probes. Why: the lent H200's vCPUs change speed within
    seconds and with no steal time, mostly between two speeds about 2x apart (probe ~6-8 or ~12-17 ms),
    so a repeat's wall clock measures the host's state as much as the build."""
    probes = [p for r in results.values() for key in ("decode_probe_pairs_ms", "prefill_probe_pairs_ms")
              for pair in r.get(key, []) for p in pair]
    if not probes:
        return None
    threshold = factor * min(probes)
    selected = {}
    for name, r in results.items():
        selected[name] = {}
        for phase in ("decode", "prefill"):
            pairs, times = r.get(f"{phase}_probe_pairs_ms", []), r[f"{phase}_ms_all"]
            kept = [t for t, pair in zip(times, pairs) if max(pair) <= threshold]
            selected[name][phase] = (statistics.median(kept) if kept else None, len(kept), len(times))
    return threshold, selected


GOALS = (("decode", "eager", 2.5), ("decode", "compiled", 1.3), ("prefill", "eager", 1.8), ("prefill", "compiled", 1.05))


def goal_rows(results: dict[str, dict], nominal: dict | None) -> list[dict]:
    """Issue 4's speed goals (fused at least `target` x faster than the baseline build) by each measure the
    run has: wall clock (medians over rounds), wall clock on a nominal host (`nominal_host`'s selection)
    and GPU time. A measure is None where a build or its data is missing."""
    fused = results.get("fused")
    rows = []
    for phase, ref_name, target in GOALS:
        ref = results.get(ref_name)
        if fused is None or ref is None:
            continue
        wall = ref[f"{phase}_ms"] / fused[f"{phase}_ms"]
        ours, theirs = ((nominal or {}).get(name, {}).get(phase, (None,))[0] for name in ("fused", ref_name))
        gpu_key = f"{phase}_gpu_ms"
        gpu = ref[gpu_key] / fused[gpu_key] if gpu_key in ref and gpu_key in fused else None
        rows.append(dict(goal=f"{phase} >= {target}x {ref_name}", target=target, wall=wall,
                         wall_nominal_host=theirs / ours if ours and theirs else None, gpu=gpu))
    return rows


def summarize(results: dict[str, dict], args) -> dict:
    """Print the comparison tables of the builds that ran (fused against eager and/or compiled, whichever
    are there) and return the summary keys (`decode_ms_<build>`, ...; ratios only for builds present)."""
    import torch
    import vllm

    summary = {
        **{f"{phase}_ms_{name}": r[f"{phase}_ms"] for phase in ("decode", "prefill") for name, r in results.items()},
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"none (CPU: {platform.processor() or platform.machine()})",
        "vllm_version": vllm.__version__, "rounds": args.rounds,
    }
    f, c, e = (results.get(name) for name in MAIN_BUILDS)
    if f and e:
        summary["fused_equals_eager_tokens"] = f["tokens"] == e["tokens"]
        summary["fused_equals_eager_logprobs"] = f["logprobs"] == e["logprobs"]
    if c and e:
        summary["compiled_equals_eager_logprobs"] = c["logprobs"] == e["logprobs"]
    if e:
        summary["eager_build_mode"] = e["mode"]
    base_name = next((name for name in ("eager", "fused", *results) if name in results), None)
    base = results.get(base_name)
    print(f"\n| build | decode ms/step (batch 1) | x vs {base_name} | 8x{args.prefill_len} prefill ms | x |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['decode_ms']:.3f} | {base['decode_ms'] / r['decode_ms']:.2f} | {r['prefill_ms']:.1f} | "
              f"{base['prefill_ms'] / r['prefill_ms']:.2f} |")
    if f and c:
        print(f"fused vs compiled: decode {c['decode_ms'] / f['decode_ms']:.2f}x, prefill {c['prefill_ms'] / f['prefill_ms']:.2f}x")
    if args.rounds > 1 and f:  # the same ratios within each round: their spread is the run-to-run noise
        for phase in ("decode", "prefill"):
            for ref_name, b in (("eager", e), ("compiled", c)):
                if b is None:
                    continue
                ratios = [x / y for x, y in zip(b[f"{phase}_ms_by_round"], f[f"{phase}_ms_by_round"])]
                summary[f"{phase}_x_{ref_name}_by_round"] = ratios
                print(f"fused {phase} x {ref_name} by round: " + ", ".join(f"{r:.2f}" for r in ratios))
    if args.rounds > 1:
        summary["same_outputs_every_round"] = all(r["same_outputs_every_round"] for r in results.values())
    if results and all("decode_step_ms_median" in r for r in results.values()):
        summary.update({f"decode_step_ms_median_{name}": r["decode_step_ms_median"] for name, r in results.items()})
        print("engine step medians (ms): " + ", ".join(f"{name} {r['decode_step_ms_median']:.3f} "
                                                      f"(p10 {r['decode_step_ms_p10']:.3f})" for name, r in results.items()))
    if results and all("python_probe_ms" in r for r in results.values()):  # the host's speed, process by process
        for key in ("python_probe_ms", "torch_probe_us"):  # merge_rounds lists every statistic by round
            summary.update({f"{key}_{name}": r[f"{key}_by_round"] for name, r in results.items()})
        print("host probes by round (python ms / torch us): " + "; ".join(
            f"{name} " + ", ".join(f"{p:.2f}/{t:.2f}" for p, t in zip(r["python_probe_ms_by_round"], r["torch_probe_us_by_round"]))
            for name, r in results.items()))
        summary["cpu_model"] = next(iter(results.values())).get("cpu_model")
    nominal = nominal_host(results, args.nominal_host_factor)
    if nominal:
        threshold, selected = nominal
        summary["nominal_host_threshold_ms"] = threshold
        print(f"\non a nominal host (repeats with both python probes <= {threshold:.2f} ms, "
              f"{args.nominal_host_factor} x the run's fastest):")
        print("| build | decode ms/step | repeats | prefill ms | repeats |")
        print("|---|---|---|---|---|")
        for name, phases in selected.items():
            cells = []
            for phase in ("decode", "prefill"):
                ms, kept, total = phases[phase]
                summary[f"{phase}_ms_nominal_host_{name}"] = ms
                summary[f"{phase}_nominal_host_repeats_{name}"] = [kept, total]
                cells += ["-" if ms is None else f"{ms:.3f}" if phase == "decode" else f"{ms:.1f}", f"{kept}/{total}"]
            print(f"| {name} | " + " | ".join(cells) + " |")  # the ratios: in the goals table below
    for name, r in results.items():  # within a build, how much of the decode's spread the host's speed explains
        fit = host_fit([statistics.fmean(pair) for pair in r.get("decode_probe_pairs_ms", [])], r["decode_ms_all"])
        if fit:
            summary[f"decode_vs_host_probe_{name}"] = fit
            print(f"{name}: decode ms vs python probe ms over {fit['repeats']} repeats: correlation {fit['correlation']:.2f}, "
                  f"decode = {fit['intercept_ms']:.3f} + {fit['slope']:.4f} x probe", flush=True)
        steal = r.get("decode_steal_fraction_all")
        if steal:
            summary[f"decode_steal_fraction_{name}"] = steal
            print(f"{name}: CPU time stolen by the hypervisor during the decode repeats: "
                  + ", ".join(f"{x:.1%}" for x in steal), flush=True)
    if f and results and all("decode_gpu_ms" in r for r in results.values()):
        for key in ("decode_gpu_ms", "prefill_gpu_ms"):
            summary.update({f"{key}_{name}": r[key] for name, r in results.items()})
        print("\nGPU time (profiled pass: kernels and copies only, no host overhead)")
        print("| build | decode GPU ms/step | kernels/step | x fused | prefill GPU ms | x fused |")
        print("|---|---|---|---|---|---|")
        for name, r in results.items():
            print(f"| {name} | {r['decode_gpu_ms']:.3f} | {r['decode_kernels_per_step']:.0f} | "
                  f"{r['decode_gpu_ms'] / f['decode_gpu_ms']:.2f} | {r['prefill_gpu_ms']:.1f} | "
                  f"{r['prefill_gpu_ms'] / f['prefill_gpu_ms']:.2f} |")
    batch_sizes = sorted({int(b) for r in results.values() for b in r.get("decode_batches", {})})
    if batch_sizes:  # where the GPU work per step takes over from the host's
        print("\ndecode ms/step by batch size (wall clock; GPU time in brackets where measured)")
        print("| batch | " + " | ".join(results) + " | " + " | ".join(f"fused x {n}" for n in results if n != "fused" and f) + " |")
        print("|---" * (1 + len(results) + (len(results) - 1 if f else 0)) + "|")
        for b in batch_sizes:
            rows = {n: r.get("decode_batches", {}).get(str(b)) for n, r in results.items()}
            cells = []
            for name, row in rows.items():
                if row is None:
                    cells.append("-")
                    continue
                summary[f"decode_ms_b{b}_{name}"] = row["decode_ms"]
                gpu = row.get("decode_gpu_ms")
                if gpu is not None:
                    summary[f"decode_gpu_ms_b{b}_{name}"] = gpu
                cells.append(f"{row['decode_ms']:.3f}" + (f" ({gpu:.3f})" if gpu is not None else ""))
            if f:
                ours = rows.get("fused")
                for name, row in rows.items():
                    if name == "fused":
                        continue
                    cells.append(f"{row['decode_ms'] / ours['decode_ms']:.2f}" if row and ours else "-")
            print(f"| {b} | " + " | ".join(cells) + " |")
    goals = goal_rows(results, nominal[1] if nominal else None)
    if goals:
        summary["goals"] = goals
        print("\n| goal (issue 4) | wall clock | on a nominal host | GPU time |")
        print("|---|---|---|---|")
        for g in goals:
            cells = ["-" if g[k] is None else f"{g[k]:.2f}x " + ("met" if g[k] >= g["target"] else "missed")
                     for k in ("wall", "wall_nominal_host", "gpu")]
            print(f"| {g['goal']} | " + " | ".join(cells) + " |")
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(main())

"""What runs inside one build's process: the engine, the timed loops, the profiled passes.

The engine starts through `beam_rl.engines.start_rollout_engine` (prefix caching off, no tokenizer,
no routing capture); the timing drives its `vllm.LLM` directly. The parent runs this process with
vLLM's engine core inside it (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the profiler sees its kernels.

- Batch-1 decode: ms per step = (t(1 + N tokens) - t(1 token)) / N of one 32-token prompt (the
  prefill cancels); `decode_batches` repeats it with B distinct prompts in flight.
- Prefill: 8 prompts of `prefill_len` tokens, one output token.
- Every timed repeat has the python probe (`host_probe.python_probe_ms`) taken just before and
  just after it, and the share of the pinned CPUs' time the hypervisor stole during it.
- Engine steps: the wall ms of every `llm_engine.step()` of one decode (`step_clock`).
- GPU time: one more pass per measurement under the torch profiler (CUDA activity only, which
  includes the kernels inside CUDA-graph replays): GPU ms and kernels per step.
- Optional: a host+GPU trace of some decode steps (`step_trace`), a cProfile of one decode.
- After the timed runs, the fixed host workloads (`host_probe.host_speed`), then 64 greedy tokens
  and their log-probs (to compare the builds' outputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time

from rollout_bench.host_probe import cpu_jiffies, host_speed, python_probe_ms

_EAGER = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
BUILDS = {
    "fused": dict(env={"BEAM_RL_FUSED_KERNELS": "1"}, compilation=None),
    "compiled": dict(env={"BEAM_RL_FUSED_KERNELS": "0"}, compilation=None),
    "eager": dict(env={"BEAM_RL_FUSED_KERNELS": "0"}, compilation=_EAGER),
    # The two plain builds with the norms' sum of squares summed in FP32 (`use_fp32_sum_of_squares`: the
    # arithmetic of `x.float().pow(2).mean(-1)` up to the summation order): outside the numerics contract
    # (their outputs differ in the last bits), a baseline as plain PyTorch code would write it.
    "compiled_fp32": dict(env={"BEAM_RL_FUSED_KERNELS": "0"}, compilation=None, fp32_sum=True),
    "eager_fp32": dict(env={"BEAM_RL_FUSED_KERNELS": "0"}, compilation=_EAGER, fp32_sum=True),
}
"""build -> environment of its process, vLLM `compilation_config` (None: vLLM's default), FP32 sum."""
MAIN_BUILDS = ("fused", "compiled", "eager")
PROMPT_LEN = 32
"""Tokens of each decode prompt."""


def use_fp32_sum_of_squares() -> None:
    """Swap the reference's FP64 sum of squares for an FP32 one in this process (the engine core runs
    here, so the model built next calls it)."""
    from beam_rl.model import numerics

    numerics.sum_of_squares = lambda xf: (xf * xf).sum(dim=-1, keepdim=True)


def engine_settings(args, user_args: dict):
    """(settings as the build asks, the same with `enforce_eager` and no compilation settings)."""
    from beam_rl.engines import EngineSettings

    base = {"max_num_batched_tokens": max(16384, 8 * args.prefill_len)}
    compilation = BUILDS[args.build]["compilation"]
    wanted = {**base, **({"compilation_config": compilation} if compilation is not None else {}), **user_args}
    settings = EngineSettings(model=args.checkpoint, max_model_len=max(args.prefill_len + 1, PROMPT_LEN + 1 + args.decode_tokens),
                              max_num_seqs=max([16, *args.decode_batches]), seed=0, enforce_eager=False,
                              capture_routing=False, gpu_memory_utilization=0.6, engine_args=wanted)
    return settings, dataclasses.replace(settings, enforce_eager=True, engine_args={**base, **user_args})


def run_build(args, user_args: dict) -> dict:
    """Every measurement of build `args.build` (the child's command line; `user_args`: the parsed
    `--engine-arg`s) in this process, already pinned to `--cpus`; the RESULT dict."""
    from vllm import SamplingParams

    from beam_rl.engines import start_rollout_engine

    if BUILDS[args.build].get("fp32_sum"):
        use_fp32_sum_of_squares()
    settings, eager_settings = engine_settings(args, user_args)
    t0 = time.time()
    try:
        engine = start_rollout_engine(settings)
        mode = "as configured"
    except Exception as err:  # no CUDA graphs without compilation on this vLLM: plain eager
        print(f"[{args.build}] {settings.engine_args} refused ({type(err).__name__}: {err}); using enforce_eager", flush=True)
        engine = start_rollout_engine(eager_settings)
        mode = "enforce_eager"
    start_s = time.time() - t0
    llm = engine.llm  # the underlying vllm.LLM, timed step by step
    cfg = llm.llm_engine.vllm_config
    engine_info = dict(async_scheduling=cfg.scheduler_config.async_scheduling,
                       cudagraph_mode=str(cfg.compilation_config.cudagraph_mode),
                       compilation_mode=str(cfg.compilation_config.mode),
                       v2_model_runner=getattr(cfg, "use_v2_model_runner", None), kv_cache_groups=kv_cache_groups(llm),
                       engine_args=user_args)
    print(f"[{args.build}] engine: {engine_info}", flush=True)
    vocab = engine.config.vocab_size
    prompt = [(i * 7919) % vocab for i in range(PROMPT_LEN)]

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
    return dict(build=args.build, mode=mode, engine=engine_info, engine_start_s=start_s, **host_speed(),
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
    return decode_at_batch_interleaved({"": timed}, batch, vocab, n, repeats, with_gpu_time)[""]


def decode_at_batch_interleaved(timers: dict, batch: int, vocab: int, n: int, repeats: int, with_gpu_time: bool) -> dict:
    """`decode_at_batch` of several modes of one engine ({mode: timed}, e.g. R3 capture off and on),
    each repeat timing every mode in turn: the host's speed drifts within a run (the H200's by up to
    2x between calls), and interleaving puts that drift on all modes alike. {mode: result}."""
    prompts = [[(i * 7919 + j * 104729) % vocab for i in range(PROMPT_LEN)] for j in range(batch)]
    for timed in timers.values():
        timed(prompts, 8)  # warm-up (and this batch size's first graph replay)
    runs = {mode: ([], [], []) for mode in timers}
    for _ in range(repeats):
        for mode, timed in timers.items():
            for into, got in zip(runs[mode], probed_repeats(lambda: decode_ms_per_step(timed, prompts, n), 1)):
                into.extend(got)
    out = {}
    for mode, (times, probes, steal) in runs.items():
        out[mode] = dict(decode_ms=statistics.median(times), decode_ms_all=times, decode_probe_pairs_ms=probes,
                         decode_steal_fraction_all=steal)
        if with_gpu_time:
            out[mode].update(decode_gpu(timers[mode], prompts, n))
    return out


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


def kv_cache_groups(llm) -> int | None:
    """Number of KV-cache groups of the in-process engine core: vLLM's hybrid KV-cache manager gives each
    group of layers with one attention type its own block table, and a decode step's input preparation
    (slot mapping, block table copy, attention metadata) runs once per group on the host."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    return None if config is None else len(config.kv_cache_groups)


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


HOST_AREAS = (("vllm/v1/core/", "scheduler + KV-cache manager"), ("vllm/v1/worker/", "model runner"),
              ("vllm/v1/attention/", "attention metadata"), ("vllm/v1/sample/", "sampler"),
              ("vllm/v1/engine/", "engine core + output processing"), ("vllm/", "vLLM, other"),
              ("beam_rl/", "beam-rl"), ("torch/", "torch (Python)"), ("", "other (C calls, numpy, stdlib)"))
"""Source areas of `host_profile`, first match of the function's file path."""


def host_profile(fn, steps: int, top: int = 30) -> dict:
    """cProfile of one decode run (the engine core must run in this thread): own us per step by area of
    `HOST_AREAS`, and the `top` Python functions by own time as [name, calls/step, own us/step,
    cumulative us/step]. cProfile slows Python calls, so read the shares, not the totals."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    areas: dict[str, float] = {}
    for (file, _, _), (_, _, tt, _, _) in stats.items():
        area = next(label for prefix, label in HOST_AREAS if prefix in file.replace(os.sep, "/"))
        areas[area] = areas.get(area, 0.0) + tt / steps * 1e6
    areas = dict(sorted(areas.items(), key=lambda kv: -kv[1]))
    rows = sorted(((f"{os.path.basename(file)}:{line}:{name}", calls / steps, tt / steps * 1e6, ct / steps * 1e6)
                   for (file, line, name), (_, calls, tt, ct, _) in stats.items()), key=lambda r: -r[2])[:top]
    print(f"[trace] host profile ({steps} steps; own us/step by area): "
          + ", ".join(f"{a} {us:.0f}" for a, us in areas.items()), flush=True)
    for name, calls, own, cum in rows:
        print(f"[trace]   {own:9.1f} us own {cum:9.1f} us cum {calls:7.1f} calls  {name}", flush=True)
    return dict(steps=steps, areas_us_per_step=areas, top=rows)


def profiled(fn, host: bool = False):
    """(profiler events, wall ms) of one call of fn under the torch profiler: CUDA activity (CUPTI, which
    also records the kernels inside CUDA-graph replays), with `host` also the host's. CUDA only."""
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

"""Benchmark Beam's Triton kernels on a CUDA GPU against the PyTorch references (eager and torch.compile).

For each kernel at decode sizes (1, 8, 64 tokens) and prefill (8 x 2048 tokens): median time
(each call timed alone after an L2 flush, as triton.testing.do_bench does, but by default with a flush that
leaves the L2 clean: `--flush`; decode sizes also as CUDA-graph replays, 10 calls per graph, per call),
achieved bytes/s against the device-to-device copy bandwidth measured in this run, speedups over the
eager reference and over torch.compile of it, and whether each output is bit-identical to the eager
reference. The FP32 router is timed at 1-64 tokens in CUDA graphs against two baselines: its reference
(`eager`: cuBLAS DGEMM logits + PyTorch top-k, the contract) and the issue's cuBLAS FP32 GEMM + PyTorch top-k
(`fp32_cublas_us`: FP32 logits in cuBLAS's summation order, so not the contract's; whether its ids match
is recorded). Prints a table last; writes JSON rows to $OUT/kernels.json (or --out).

    python scripts/bench_kernels.py [--only k1,k2,...] [--tune] [--rounds N] [--out PATH]

`--tune` first sweeps the launch shapes of the router GEMM and the memory-bound kernels (what picked
their defaults), checking each shape's bits.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton

from beam_rl.model import numerics, routing
from beam_rl.kernels import boundary_ops, gate_ops, qk_norm_rope_ops, router_ops, swiglu_ops

DEV = "cuda"
BF16 = torch.bfloat16
EPS = 1e-6
HIDDEN, HEADS, KV, HEAD_DIM, D_FF = 5120, 48, 8, 128, 20480
DECODE = [1, 8, 64]
PREFILL = 8 * 2048
GRAPH_CALLS = 10


# How the L2 is emptied before each timed call (`--flush`). triton's do_bench zeroes a 256 MB buffer: that leaves
# the 50 MB L2 full of dirty lines, whose write-back then lands inside the timed kernel (the Q/K kernels are the
# most sensitive to it). `read` sums the buffer instead: the same lines are evicted and the L2 is left clean.
FLUSH_MODES = ("read", "zero")
flush_mode = "read"
_flush_buffer = None


def flush_l2():
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(256 * 1024**2 // 4, dtype=torch.int32, device=DEV)
    if flush_mode == "zero":
        _flush_buffer.zero_()
    else:
        _flush_buffer.sum()


def bench(fn, rep=40, warmup=10):
    """Median us of fn, each call timed alone (CUDA events) after `flush_l2()`: triton's do_bench loop (runtime
    estimate, `warmup` ms of calls, then `rep` ms of timed calls) with the flush of `flush_mode`."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush_l2()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = start.elapsed_time(end) / 5
    for _ in range(max(1, int(warmup / estimate_ms))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(1, int(rep / estimate_ms)))]
    for a, b in events:
        flush_l2()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events) * 1e3


def graph_bench(fn):
    """Per-call time of GRAPH_CALLS back-to-back calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return bench(graph.replay) / GRAPH_CALLS


def timed_alternately(fns, timer, rounds):
    """Median per function of `rounds` timings taken in turn (ours, eager, compile, ours, ...), so a drift of
    the machine reaches every function alike; also the per-round lists.
    rounds=1 times each once."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for ts, fn in zip(times, fns):
            ts.append(timer(fn))
    return [statistics.median(ts) for ts in times], times


def copy_bandwidth():
    src = torch.empty(2 * 1024**3 // 4, dtype=torch.float32, device=DEV).uniform_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), rep=200)
    return 2 * src.numel() * 4 / (t * 1e-6)


def same_bits(a, b):
    if isinstance(a, (tuple, list)):
        return all(same_bits(x, y) for x, y in zip(a, b) if x is not None or y is not None)
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b)


def frac_differing(a, b):
    if isinstance(a, (tuple, list)):
        a, b = a[0], b[0]
    return (a.view(torch.int16) != b.view(torch.int16)).float().mean().item() if a.element_size() == 2 \
        else (a != b).float().mean().item()


# ---- cases: each returns (ours, reference, bytes moved) -----------------------------------------------
# The norm cases also register FP32_FORMULA[kernel]: the same operation with the sum of squares in FP32
# (`x.float().pow(2).mean(-1)`, what most PyTorch code writes).
# torch.compile of it is timed as a second baseline (`compile_fp32_us`): inductor makes the FP64 sum of
# the reference slower than an FP32 one, and the FP32 formula is the baseline a user would compare to.
FP32_FORMULA = {}


def fp32_rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def fp32_boundary(x, h, wp, wn, add_index):
    r_scale, x_scale = numerics.residual_scales(add_index)
    a = (fp32_rms_norm(x, wp).float() * x_scale).to(x.dtype)
    hn = (a.float() + (h.float() * r_scale).to(x.dtype).float()).to(x.dtype)
    return hn, fp32_rms_norm(hn, wn)


def case_boundary(t):
    x, h = (3 * torch.randn(t, HIDDEN, device=DEV)).to(BF16), torch.randn(t, HIDDEN, device=DEV).to(BF16)
    wp, wn = (1 + 0.2 * torch.randn(2, HIDDEN, device=DEV)).to(BF16)
    ours = lambda: boundary_ops.sublayer_boundary_triton(x, h, wp, wn, 37, EPS)  # noqa: E731
    ref = lambda: numerics.sublayer_boundary(x, h, wp, wn, 37, EPS)  # noqa: E731
    FP32_FORMULA["boundary"] = lambda: fp32_boundary(x, h, wp, wn, 37)
    return ours, ref, 4 * t * HIDDEN * 2 + 2 * HIDDEN * 2


def case_rms_norm(t):
    x, w = torch.randn(t, HIDDEN, device=DEV).to(BF16), (1 + 0.2 * torch.randn(HIDDEN, device=DEV)).to(BF16)
    FP32_FORMULA["rms_norm"] = lambda: fp32_rms_norm(x, w)
    return (lambda: boundary_ops.rms_norm_triton(x, w, EPS)), (lambda: numerics.rms_norm(x, w, EPS)), \
        2 * t * HIDDEN * 2 + HIDDEN * 2


def _qkv(t):
    d = HEAD_DIM
    packed = torch.randn(t, (2 * HEADS + 2 * KV) * d, device=DEV).to(BF16)
    q = packed[:, : HEADS * d].view(t, HEADS, d)
    k = packed[:, HEADS * d : (HEADS + KV) * d].view(t, KV, d)
    v = packed[:, (HEADS + KV) * d : (HEADS + 2 * KV) * d].view(t, KV, d)
    g = packed[:, (HEADS + 2 * KV) * d :].view(t, HEADS, d)
    qw, kw = (1 + 0.2 * torch.randn(2, d, device=DEV)).to(BF16)
    pos = torch.randint(0, 32768, (t,), device=DEV)
    return q, k, v, g, qw, kw, pos


def case_qk(t, rope=True, cache=False):
    q, k, v, _, qw, kw, pos = _qkv(t)
    tables = dict(cos_sin_cache=numerics.rope_cos_sin_cache(32768, HEAD_DIM, 10000.0).to(DEV), ssmax_cache=None) \
        if rope else dict(cos_sin_cache=None, ssmax_cache=numerics.ssmax_scale_cache(32768).to(DEV))
    nbytes = 2 * t * (HEADS + KV) * HEAD_DIM * 2
    if not cache:
        ours = lambda: qk_norm_rope_ops.qk_norm_rope_ssmax_triton(q, k, qw, kw, pos, EPS, **tables)  # noqa: E731
        ref = lambda: numerics.qk_norm_rope_ssmax(q, k, qw, kw, pos, EPS, **tables)  # noqa: E731
        if rope:
            cs = tables["cos_sin_cache"]
            FP32_FORMULA["qk_norm_rope"] = lambda: (numerics.apply_rope(fp32_rms_norm(q, qw), pos, cs),
                                                    numerics.apply_rope(fp32_rms_norm(k, kw), pos, cs))
        return ours, ref, nbytes
    block_size = 16
    blocks = t // block_size + 2
    kv_ours = torch.zeros(2, blocks, block_size, KV, HEAD_DIM, device=DEV, dtype=BF16)
    kv_ref = kv_ours.clone()
    slots = torch.randperm(blocks * block_size, device=DEV)[:t]
    blk, off = slots // block_size, slots % block_size

    def ours():
        qo, ko = qk_norm_rope_ops.qk_norm_rope_ssmax_triton(q, k, qw, kw, pos, EPS, **tables, v=v, kv_cache=kv_ours,
                                                             slot_mapping=slots)
        return qo, ko, kv_ours

    def ref():  # index assignment (all slots valid here, so no host sync)
        qo, ko = numerics.qk_norm_rope_ssmax(q, k, qw, kw, pos, EPS, **tables)
        kv_ref[0][blk, off] = ko
        kv_ref[1][blk, off] = v
        return qo, ko, kv_ref

    return ours, ref, nbytes + 3 * t * KV * HEAD_DIM * 2


def case_gate(t):
    _, _, _, g, _, _, _ = _qkv(t)
    attn = torch.randn(t, HEADS, HEAD_DIM, device=DEV).to(BF16)
    bias = torch.randn(HEADS, device=DEV).to(BF16)
    return (lambda: gate_ops.output_gate_triton(attn, g, bias)), (lambda: numerics.output_gate(attn, g, bias)), \
        3 * t * HEADS * HEAD_DIM * 2


def case_swiglu(t):
    gu = (3 * torch.randn(t, 2 * D_FF, device=DEV)).to(BF16)
    return (lambda: swiglu_ops.silu_and_mul_triton(gu)), \
        (lambda: numerics.silu_and_mul(gu[:, :D_FF], gu[:, D_FF:])), 3 * t * D_FF * 2


ROUTERS = {"router_5120x256": (5120, 256, 8, 4, 8), "router_1024x64": (1024, 64, 8, 4, 8),
           "router_128x16": (128, 16, 4, 2, 4),
           # the same call with the logits always from cuBLAS DGEMM (the path route_triton takes above
           # TRITON_GEMM_MAX_TOKENS), to choose that threshold from measurements
           "router_5120x256_dgemm": (5120, 256, 8, 4, 8)}


def _dgemm_logits(call):
    def run():
        saved, router_ops.TRITON_GEMM_MAX_TOKENS = router_ops.TRITON_GEMM_MAX_TOKENS, 0
        try:
            return call()
        finally:
            router_ops.TRITON_GEMM_MAX_TOKENS = saved
    return run


def case_router(t, name, split_k=None):
    hidden, experts, ng, tg, tk = ROUTERS[name]
    x = torch.randn(t, hidden, device=DEV).to(BF16)
    w = torch.randn(experts, hidden, device=DEV) / hidden**0.5
    bias = 0.05 * torch.randn(experts, device=DEV)
    kw = dict(top_k=tk, n_group=ng, topk_group=tg, routed_scaling_factor=2.5)
    ours = lambda: router_ops.route_triton(x, w, bias, **kw, split_k=split_k)  # noqa: E731
    if name.endswith("_dgemm"):
        ours = _dgemm_logits(ours)
    ref = lambda: routing.select_experts(routing.router_logits(x, w), bias, **kw)  # noqa: E731
    # the baseline: cuBLAS FP32 GEMM (its own blocking, not the contract's logits) + PyTorch top-k
    FP32_CUBLAS_ROUTER[name] = lambda: routing.select_experts(x.float() @ w.t(), bias, **kw)
    return ours, ref, experts * hidden * 4 + t * hidden * 2 + t * tk * 12


# router name -> cuBLAS FP32 GEMM + PyTorch top-k on the case's inputs, timed as `fp32_cublas_us`
FP32_CUBLAS_ROUTER = {}


KERNELS = {
    "boundary": case_boundary,
    "rms_norm": case_rms_norm,
    "qk_norm_rope": lambda t: case_qk(t, rope=True),
    "qk_norm_ssmax": lambda t: case_qk(t, rope=False),
    "qk_rope_kv_write": lambda t: case_qk(t, rope=True, cache=True),
    "output_gate": case_gate,
    "silu_and_mul": case_swiglu,
}


def run_case(kernel, size, tokens, make, copy_bw, decode, rounds=1):
    torch.manual_seed(hash((kernel, tokens)) % 2**31)
    FP32_FORMULA.pop(kernel, None)
    ours, ref, nbytes = make()
    out_ours, out_ref = ours(), ref()
    exact = same_bits(out_ours, out_ref) if not kernel.startswith("router") else \
        bool(torch.equal(out_ours[1], out_ref[1]))
    compiled = torch.compile(ref, dynamic=False)
    t0 = time.time()
    out_comp = compiled()
    compile_s = time.time() - t0
    compile_exact = same_bits(out_comp, out_ref) if not kernel.startswith("router") else \
        bool(torch.equal(out_comp[1], out_ref[1]))
    row = dict(kernel=kernel, size=size, tokens=tokens, bytes=nbytes, exact=exact, compile_exact=compile_exact,
               compile_differing_fraction=0.0 if compile_exact or kernel.startswith("router")
               else frac_differing(out_comp, out_ref), compile_s=round(compile_s, 1))
    (s_ours, s_eager, s_comp), s_rounds = timed_alternately((ours, ref, compiled), bench, rounds)
    row.update(stream_us=s_ours, stream_eager_us=s_eager, stream_compile_us=s_comp)
    if decode:
        (g_ours, g_eager, g_comp), g_rounds = timed_alternately((ours, ref, compiled), graph_bench, rounds)
        row.update(timing="cuda_graph", time_us=g_ours, eager_us=g_eager, compile_us=g_comp)
    else:
        g_rounds = s_rounds
        row.update(timing="events", time_us=s_ours, eager_us=s_eager, compile_us=s_comp)
    if rounds > 1:
        row.update(rounds=rounds, time_us_by_round=g_rounds[0], eager_us_by_round=g_rounds[1],
                   compile_us_by_round=g_rounds[2])
    row["bandwidth_fraction"] = nbytes / (row["time_us"] * 1e-6) / copy_bw
    row["speedup_vs_eager"] = row["eager_us"] / row["time_us"]
    row["speedup_vs_compile"] = row["compile_us"] / row["time_us"]
    if kernel in FP32_CUBLAS_ROUTER:
        base = FP32_CUBLAS_ROUTER.pop(kernel)
        row["fp32_cublas_ids_equal"] = bool(torch.equal(base()[1], out_ref[1]))
        row["fp32_cublas_us"] = graph_bench(base)
        row["speedup_vs_fp32_cublas"] = row["fp32_cublas_us"] / row["time_us"]
    if kernel in FP32_FORMULA:
        fp32_compiled = torch.compile(FP32_FORMULA[kernel], dynamic=False)
        row["compile_fp32_differing_fraction"] = frac_differing(fp32_compiled(), out_ref)
        row["compile_fp32_us"] = graph_bench(fp32_compiled) if decode else bench(fp32_compiled)
        row["speedup_vs_compile_fp32"] = row["compile_fp32_us"] / row["time_us"]
    return row


# (rows per program, warps, chunk, tail): chunk < 5120 walks the row; 8192 holds it as one masked block,
# 4096 + 1024 as a head and a tail (`boundary_ops.launch_shape`)
NORM_LAUNCHES = [(1, 4, 1024, 0), (1, 8, 1024, 0), (1, 8, 2048, 0), (1, 8, 8192, 0), (1, 16, 8192, 0), (1, 2, 4096, 1024),
                 (1, 4, 4096, 1024), (1, 8, 4096, 1024), (1, 16, 4096, 1024), (2, 8, 4096, 1024)]


def _sweep(label, t, shapes, run, want, nbytes, copy_bw):
    """Time run(shape) for each launch shape (CUDA-graph replays at decode sizes) and check its bits."""
    for shape in shapes:
        call = lambda shape=shape: run(shape)  # noqa: E731
        exact = same_bits(call(), want)
        us = graph_bench(call) if t != PREFILL else bench(call)
        print(f"tune {label:12} T={t:5d} launch={shape}: {us:8.2f} us  bw {nbytes / (us * 1e-6) / copy_bw:.3f}"
              f"  exact {exact}", flush=True)


# router launches per token count: (RouterLaunch(block_t, block_e, block_k, gemm warps, top-k warps), split_k
# or None = the default split); each tile keeps <= 64 FP64 accumulators a thread (t * e * k / (32 * warps))
def _router_launches():
    """The first launch at each size is the default (`router_ops._gemm_config`)."""
    L = router_ops.RouterLaunch
    return {
        1: [(L(1, 32, 32, 1, 4), None), (L(1, 32, 32, 1, 2), None), (L(1, 64, 32, 4, 4), None), (L(1, 32, 32, 2, 4), None),
            (L(1, 32, 64, 1, 4), None), (L(1, 16, 32, 1, 4), None), (L(1, 64, 32, 4, 1), None)],
        8: [(L(8, 32, 16, 4, 4), None), (L(8, 32, 16, 4, 2), None), (L(8, 64, 16, 4, 4), None), (L(4, 32, 32, 4, 4), None),
            (L(8, 32, 32, 4, 4), None), (L(8, 16, 32, 4, 4), None), (L(8, 32, 16, 2, 4), None)],
        64: [(L(16, 32, 16, 4, 4), None), (L(16, 32, 16, 4, 2), None), (L(16, 64, 8, 4, 4), None), (L(16, 32, 8, 4, 4), None),
             (L(32, 32, 8, 4, 4), None), (L(16, 16, 32, 4, 4), None), (L(16, 32, 16, 4, 4), 32), (L(16, 32, 16, 8, 4), None)],
    }


def tune(copy_bw, names):
    """Sweep the launch shapes of the kernels in `names` at every size (bits checked against the reference
    per shape); any router name sweeps the 5120 x 256 router's GEMM tiles."""
    print("== tuning (launch shapes; decode sizes as CUDA-graph replays) ==", flush=True)
    names = set(names)
    if any(n.startswith("router") for n in names):
        hidden, experts, ng, tg, tk = ROUTERS["router_5120x256"]
        kw = dict(top_k=tk, n_group=ng, topk_group=tg, routed_scaling_factor=2.5)
        for t, shapes in _router_launches().items():
            x = torch.randn(t, hidden, device=DEV).to(BF16)
            w = torch.randn(experts, hidden, device=DEV) / hidden**0.5
            bias = 0.05 * torch.randn(experts, device=DEV)
            _sweep("router", t, shapes,
                   lambda launch: router_ops.route_triton(x, w, bias, **kw, launch=launch[0], split_k=launch[1]),
                   routing.select_experts(routing.router_logits(x, w), bias, **kw), experts * hidden * 4, copy_bw)
    for t in DECODE + [PREFILL] if {"boundary", "rms_norm"} & names else ():
        x = (3 * torch.randn(t, HIDDEN, device=DEV)).to(BF16)
        h = torch.randn(t, HIDDEN, device=DEV).to(BF16)
        w = (1 + 0.2 * torch.randn(HIDDEN, device=DEV)).to(BF16)
        if "boundary" in names:
            _sweep("boundary", t, NORM_LAUNCHES,
                   lambda launch: boundary_ops.sublayer_boundary_triton(x, h, w, w, 37, EPS, launch=launch),
                   numerics.sublayer_boundary(x, h, w, w, 37, EPS), 4 * t * HIDDEN * 2, copy_bw)
        if "rms_norm" in names:
            _sweep("rms_norm", t, NORM_LAUNCHES, lambda launch: boundary_ops.rms_norm_triton(x, w, EPS, launch=launch),
                   numerics.rms_norm(x, w, EPS), 2 * t * HIDDEN * 2, copy_bw)
    for t in DECODE + [PREFILL] if {"qk_norm_rope", "output_gate", "silu_and_mul"} & names else ():
        q, k, v, g, qw, kw, pos = _qkv(t)
        if "qk_norm_rope" in names:
            cs = numerics.rope_cos_sin_cache(32768, HEAD_DIM, 10000.0).to(DEV)
            _sweep("qk_norm_rope", t, (1, 2, 4, 8, 16),  # num_warps
                   lambda warps: qk_norm_rope_ops.qk_norm_rope_ssmax_triton(q, k, qw, kw, pos, EPS, cs, None, num_warps=warps),
                   numerics.qk_norm_rope_ssmax(q, k, qw, kw, pos, EPS, cs, None), 2 * t * (HEADS + KV) * HEAD_DIM * 2,
                   copy_bw)
        if "output_gate" in names:
            attn = torch.randn(t, HEADS, HEAD_DIM, device=DEV).to(BF16)
            bias = torch.randn(HEADS, device=DEV).to(BF16)
            _sweep("output_gate", t, ((256, 2), (256, 4), (512, 2), (512, 4), (512, 8), (1024, 4), (1024, 8), (2048, 4),
                                      (2048, 8), (4096, 8), (4096, 16)),
                   lambda launch: gate_ops.output_gate_triton(attn, g, bias, launch=launch),
                   numerics.output_gate(attn, g, bias), 3 * t * HEADS * HEAD_DIM * 2, copy_bw)
        if "silu_and_mul" in names:
            gu = (3 * torch.randn(t, 2 * D_FF, device=DEV)).to(BF16)
            _sweep("silu_and_mul", t, ((128, 4), (256, 4), (256, 8), (512, 4), (512, 8), (512, 16), (256, 1), (512, 2),
                                       (1024, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (2048, 16), (4096, 8)),
                   lambda launch: swiglu_ops.silu_and_mul_triton(gu, launch=launch),
                   numerics.silu_and_mul(gu[:, :D_FF], gu[:, D_FF:]), 3 * t * D_FF * 2, copy_bw)


def _dump(path, rows):
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated kernel names")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels.json"))
    ap.add_argument("--flush", choices=FLUSH_MODES, default="read",
                    help="empty the L2 before each timed call by reading a 256 MB buffer (default: leaves it clean) or "
                         "by zeroing it as triton's do_bench does (leaves it dirty)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time ours / eager / compile in turn this many times and report medians (per-round times in the JSON)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be >= 1")
    global flush_mode
    flush_mode = args.flush
    torch._dynamo.config.cache_size_limit = 256
    copy_bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    names = [n for n in args.only.split(",") if n] or list(KERNELS) + list(ROUTERS)
    if args.tune:
        tune(copy_bw, names)
    rows = []
    for kernel in names:
        if kernel in ROUTERS:
            cases = [(f"{t}", t, (lambda t=t, k=kernel: case_router(t, k))) for t in DECODE]
        else:
            make = KERNELS[kernel]
            cases = [("8x2048" if t == PREFILL else f"{t}", t, (lambda t=t, m=make: m(t))) for t in DECODE + [PREFILL]]
        for size, tokens, thunk in cases:
            row = run_case(kernel, size, tokens, thunk, copy_bw, decode=tokens != PREFILL, rounds=args.rounds)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _dump(args.out, rows)
    # the allocator's setting and the flush are part of the result: a dirty L2 (do_bench's zeroing flush)
    # slows some kernels' timed calls
    meta = dict(device=torch.cuda.get_device_name(), copy_bandwidth_TBps=copy_bw / 1e12, torch=torch.__version__,
                triton=triton.__version__, command=" ".join(["python"] + sys.argv),
                cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"), l2_flush=flush_mode)
    for row in rows:  # a flat list of rows, each carrying every meta key (the run's device, bandwidth, ...)
        row.update(meta, copy_bandwidth_TBps=round(meta["copy_bandwidth_TBps"], 3))
    _dump(args.out, rows)
    print(json.dumps(meta))
    print(f"\ncopy bandwidth {copy_bw / 1e12:.2f} TB/s; decode rows timed as CUDA-graph replays, prefill as single "
          f"calls; L2 flush: {flush_mode}")
    hdr = f"{'kernel':18} {'size':>7} {'ours us':>9} {'eager us':>9} {'comp us':>9} {'x eager':>8} {'x comp':>7} " \
          f"{'BW frac':>7} {'exact':>5} {'comp exact':>10} {'comp32 us':>9} {'x comp32':>8} (router: cuBLAS FP32 + top-k)"
    print(hdr)
    for r in rows:
        fp32 = f"{r['compile_fp32_us']:9.2f} {r['speedup_vs_compile_fp32']:8.2f}" if "compile_fp32_us" in r else \
            f"{r['fp32_cublas_us']:9.2f} {r['speedup_vs_fp32_cublas']:8.2f}" if "fp32_cublas_us" in r else ""
        print(f"{r['kernel']:18} {r['size']:>7} {r['time_us']:9.2f} {r['eager_us']:9.2f} {r['compile_us']:9.2f} "
              f"{r['speedup_vs_eager']:8.2f} {r['speedup_vs_compile']:7.2f} {r['bandwidth_fraction']:7.3f} "
              f"{str(r['exact']):>5} {str(r['compile_exact']):>10} {fp32}")


if __name__ == "__main__":
    main()

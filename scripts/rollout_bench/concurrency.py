"""What runs inside one process of `bench_rollout.py --concurrency`: one engine (a variant), decode
timed at each concurrency with R3 capture off and on, and the routing it captured.

Variants (`VARIANTS`): the fused Beam build with async scheduling on or off; the same with vLLM's
own capture (`enable_return_routed_experts`) instead of beam-rl's; vLLM's Qwen3-MoE model class
with beam-mini's dimensions and random weights (`load_format="dummy"`), the peer.

- Decode at batch B: ms per step = (t(1 + N tokens) - t(1 token)) / N with B distinct 32-token
  prompts in flight (`harness.decode_at_batch_interleaved`: medians of the repeats, GPU ms per step
  from one profiled pass). With beam-rl's capture each timed generate also collects every request's
  routing (`fetch_captured_routing`), as a rollout does; capture off and on alternate repeat by
  repeat in the one engine, so the host's drift over the run falls on both.
- Routing: one greedy generate of `ROUTING_BATCH` prompts; its tokens and routing are digested so
  the parent can compare variants (async vs sync scheduling); where both captures run, beam-rl's
  arrays are compared with vLLM's in this process.
- Weight update (beam variants with `--weight-update`): the checkpoint's tensors on the GPU into
  the running engine, in memory (`RolloutEngine.load_weights`: sender and receiver fingerprints on
  the GPU) and, as the baseline, through files (`_engine_dir` + `update_weights`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time

from rollout_bench.harness import PROMPT_LEN, decode_at_batch_interleaved, host_profile, kv_cache_groups

VARIANTS = {
    "beam-async": dict(model="beam", async_scheduling=True, r3="beam"),
    "beam-sync": dict(model="beam", async_scheduling=False, r3="beam"),
    "beam-async-vllm-r3": dict(model="beam", async_scheduling=True, r3="vllm"),
    "beam-async-hybrid": dict(model="beam", async_scheduling=True, r3="beam", hybrid_kv_cache=True),
    "qwen3moe-async": dict(model="peer", async_scheduling=True, r3="off"),
}
"""name -> model ("beam": the checkpoint, fused kernels; "peer": Qwen3-MoE of the same size), async
scheduling, R3 capture timed in the same engine next to capture off ("beam": beam-rl's, "vllm":
vLLM's own, which is an engine setting, so capture-off rows come from the other variants);
`hybrid_kv_cache`: vLLM's hybrid KV-cache manager (one group per run of sliding / full layers; the
other variants get beam-rl's default at this length, one group: `EngineSettings.hybrid_kv_cache`)."""
ROUTING_BATCH = 64
ROUTING_TOKENS = 32


def peer_config_dir(beam_checkpoint: str, out: str) -> str:
    """config.json of vLLM's Qwen3-MoE class with the Beam checkpoint's dimensions (hidden size,
    layers, heads, experts, top-k, widths, vocabulary; its dense layers as `mlp_only_layers`)."""
    from transformers import Qwen3MoeConfig

    from beam_rl.model.checkpoint import load_config

    c = load_config(beam_checkpoint)
    dense = [i for i, t in enumerate(c.mlp_layer_types) if t != "sparse"]
    peer = Qwen3MoeConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                          num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                          num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                          max_position_embeddings=c.max_position_embeddings, moe_intermediate_size=c.moe_intermediate_size,
                          num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok, norm_topk_prob=True,
                          mlp_only_layers=dense, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
                          dtype="bfloat16")
    os.makedirs(out, exist_ok=True)
    peer.save_pretrained(out)
    return out


def run_variant(args) -> dict:
    """Every measurement of variant `args.variant` in this process; the RESULT dict."""
    from vllm import SamplingParams

    from beam_rl.engines import EngineSettings, start_rollout_engine, start_vllm
    from beam_rl.rollout.routing import fetch_captured_routing

    v = VARIANTS[args.variant]
    peer = v["model"] == "peer"
    engine_args = {"max_num_batched_tokens": 16384}
    if v["r3"] == "vllm":
        engine_args["enable_return_routed_experts"] = True
    if peer:
        engine_args["load_format"] = "dummy"
    batches = [1, *args.decode_batches]
    settings = EngineSettings(
        model=peer_config_dir(args.checkpoint, os.path.join(args.work, "qwen3moe-peer")) if peer else args.checkpoint,
        max_model_len=PROMPT_LEN + 2 + max(args.decode_tokens, ROUTING_TOKENS), max_num_seqs=max(batches + [ROUTING_BATCH]),
        seed=0, enforce_eager=False, capture_routing=False, async_scheduling=v["async_scheduling"],
        hybrid_kv_cache=v.get("hybrid_kv_cache"),
        gpu_memory_utilization=0.6, engine_args=engine_args)
    t0 = time.time()
    engine = None if peer else start_rollout_engine(settings)
    llm = start_vllm(settings) if peer else engine.llm
    start_s = time.time() - t0
    cfg = llm.llm_engine.vllm_config
    info = dict(async_scheduling=cfg.scheduler_config.async_scheduling, kv_cache_groups=kv_cache_groups(llm), cudagraph_mode=str(cfg.compilation_config.cudagraph_mode),
                compilation_mode=str(cfg.compilation_config.mode), engine_args=engine_args)
    print(f"[{args.variant}] engine: {info}", flush=True)
    vocab = cfg.model_config.hf_config.vocab_size
    capture = {"on": False}

    def capturing(on: bool) -> None:
        """beam-rl's capture filing on or off (the model records either way; only filing costs)."""
        if on != capture["on"]:
            llm.collective_rpc("beam_start_routing_capture" if on else "beam_stop_routing_capture")
            capture["on"] = on

    def timed(prompts, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        if capture["on"]:
            fetch_captured_routing(llm, outs)
        return time.perf_counter() - t

    def timed_with(on: bool):
        def run(prompts, max_tokens):
            capturing(on)
            return timed(prompts, max_tokens)
        return run

    def at_batches(modes: dict[str, bool], label: str) -> None:
        """Every batch size, the modes ({key: beam-rl capture on}) interleaved repeat by repeat."""
        timers = {key: timed_with(on) for key, on in modes.items()}
        for key in modes:
            result["decode"][key] = {}
        for b in batches:
            got = decode_at_batch_interleaved(timers, b, vocab, args.decode_tokens, args.repeats, args.gpu_time)
            for key, m in got.items():
                result["decode"][key][str(b)] = m
                print(f"[{args.variant}] {label[key]} batch {b}: {m['decode_ms']:.3f} ms/step, "
                      f"GPU {m.get('decode_gpu_ms', float('nan')):.3f} ms/step", flush=True)
        if args.host_profile:
            top = max(batches)
            prompts = [[(i * 7919 + j * 104729 + 7) % vocab for i in range(PROMPT_LEN)] for j in range(top)]
            for key, timed_mode in timers.items():
                result["host_profile"][key] = dict(batch=top, **host_profile(lambda: timed_mode(prompts, 1 + args.decode_tokens),
                                                                              args.decode_tokens + 1))

    result = dict(variant=args.variant, **v, engine=info, engine_start_s=start_s, decode={}, host_profile={})
    if v["r3"] == "vllm":
        at_batches({"vLLM": False}, {"vLLM": "R3 vLLM"})
    elif v["r3"] == "beam":
        at_batches({"off": False, "beam-rl": True}, {"off": "R3 off", "beam-rl": "R3 beam-rl"})
    else:
        at_batches({"off": False}, {"off": "R3 off"})
    if not peer:
        result["routing"] = routing_digest(llm, vocab, v["r3"])
    if not peer and args.weight_update:
        result["weight_update"] = weight_update(engine, args.checkpoint, args.work, args.weight_update)
    return result


def routing_digest(llm, vocab: int, r3: str) -> dict:
    """One greedy generate of `ROUTING_BATCH` prompts with beam-rl's capture filing: sha256 of its
    tokens and of its routing arrays; with vLLM's capture on as well, whether the two captures agree."""
    import numpy as np
    from vllm import SamplingParams

    from beam_rl.rollout.routing import fetch_captured_routing

    llm.collective_rpc("beam_start_routing_capture")
    prompts = [[(i * 7919 + j * 104729 + 13) % vocab for i in range(PROMPT_LEN)] for j in range(ROUTING_BATCH)]
    sp = SamplingParams(temperature=0, max_tokens=ROUTING_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ours = fetch_captured_routing(llm, outs)
    tokens = hashlib.sha256(json.dumps([list(o.outputs[0].token_ids) for o in outs]).encode()).hexdigest()[:16]
    routing = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in ours)).hexdigest()[:16]
    out = dict(tokens_sha=tokens, routing_sha=routing, rows=int(sum(a.shape[0] for a in ours)))
    if r3 == "vllm":
        theirs = [np.asarray(o.outputs[0].routed_experts) for o in outs]
        out["equal_to_vllm_capture"] = all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(ours, theirs))
    return out


def weight_update(engine, checkpoint: str, work: str, repeats: int) -> dict:
    """Seconds to push the checkpoint's tensors (already on the GPU, as a colocated trainer holds
    them) into the engine: in memory as the DAPO loop does (`RolloutEngine.load_weights`: the
    sender's fingerprints, then the verified load), the same through vLLM's layerwise reload, and
    through files on /dev/shm (write + reload); and whether the three leave bit-identical parameters."""
    import torch
    from pathlib import Path

    from beam_rl.dapo.loop import _engine_dir
    from beam_rl.engines.base import checksums_of
    from beam_rl.model.checkpoint import load_config, read_tensors
    from beam_rl.model.weights import tensor_checksums as defined_checksums
    from beam_rl.rollout.reload import load_weights

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    config = load_config(checkpoint)
    tensors = {name: t.to(device) for name, t in read_tensors(checkpoint, config)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = lambda: engine.llm.collective_rpc("beam_parameter_checksums")[0]  # noqa: E731

    def clock(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    sender, load, layerwise = [], [], []
    for _ in range(repeats):
        sent = {}
        sender.append(clock(lambda: sent.update(checksums_of(tensors.items()))))
        load.append(clock(lambda: engine.load_weights(tensors, sent)))
    after_load = params()
    definition, defined = [], {}
    for _ in range(repeats):
        definition.append(clock(lambda: defined.update(defined_checksums(tensors.items()))))
    for _ in range(repeats):
        layerwise.append(clock(lambda: load_weights(engine.llm, tensors, layerwise=True)))
    after_layerwise = params()
    root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(work)
    written = {}
    files_write = clock(lambda: written.update(zip(("path", "sent"), _engine_dir(root / "beam-bench-sync", tensors, config))))
    files_reload = clock(lambda: engine.update_weights(written["path"], written["sent"]))
    total = [a + b for a, b in zip(sender, load)]
    out = dict(bytes=nbytes, tensors=len(tensors), in_memory_s=statistics.median(total), in_memory_s_all=total,
               sender_checksums_s=statistics.median(sender), verified_load_s=statistics.median(load),
               definition_checksums_s=statistics.median(definition), checksums_equal_definition=defined == sent,
               layerwise_load_s=statistics.median(layerwise), files_write_s=files_write, files_reload_s=files_reload,
               files_s=files_write + files_reload,
               same_parameters=after_load == after_layerwise == params())
    print(f"[weights] {nbytes / 2**30:.2f} GiB, {len(tensors)} tensors: in memory {out['in_memory_s']:.3f} s "
          f"(fingerprints {out['sender_checksums_s']:.3f} s + verified load {out['verified_load_s']:.3f} s; by the "
          f"definition {out['definition_checksums_s']:.3f} s, equal: {out['checksums_equal_definition']}; layerwise "
          f"load {out['layerwise_load_s']:.3f} s); files {out['files_s']:.2f} s (write {files_write:.2f} + reload "
          f"{files_reload:.2f}); identical parameters: {out['same_parameters']}", flush=True)
    return out


def rows_of(results: dict[str, dict]) -> list[dict]:
    """One row per (variant, R3 capture, concurrency): tokens/s, wall and GPU ms per decode step."""
    rows = []
    for name, r in results.items():
        for r3, by_batch in r["decode"].items():
            for b, m in by_batch.items():
                wall = m["decode_ms"]
                rows.append(dict(variant=name, model="qwen3-moe peer" if r["model"] == "peer" else "beam (fused)",
                                 async_scheduling=r["async_scheduling"], r3=r3, concurrency=int(b),
                                 tokens_per_s=int(b) / wall * 1e3, wall_ms_per_step=wall, gpu_ms_per_step=m.get("decode_gpu_ms")))
    return rows


def paired_ratios(results: dict[str, dict], variant: str, mode: str, base: str, batch: int) -> list[float]:
    """mode's step over base's, repeat by repeat, where the two were timed interleaved in one engine
    (`harness.decode_at_batch_interleaved`: equal numbers of repeats, in the same order)."""
    d = results.get(variant, {}).get("decode", {})
    a, b = (d.get(m, {}).get(str(batch), {}).get("decode_ms_all") or [] for m in (mode, base))
    return [x / y for x, y in zip(a, b)] if len(a) == len(b) else []


def summarize(results: dict[str, dict]) -> tuple[dict, list[str]]:
    """The tables and the goals of the rollout-at-concurrency issue, from one run's variants."""
    rows = rows_of(results)
    lines = ["| variant | R3 capture | concurrency | tokens/s | wall ms/step | GPU ms/step |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        gpu = "-" if r["gpu_ms_per_step"] is None else f"{r['gpu_ms_per_step']:.2f}"
        lines.append(f"| {r['variant']} | {r['r3']} | {r['concurrency']} | {r['tokens_per_s']:.0f} | {r['wall_ms_per_step']:.2f} | {gpu} |")

    def wall(variant, r3, b):
        m = results.get(variant, {}).get("decode", {}).get(r3, {}).get(str(b))
        return None if m is None else m["decode_ms"]

    def gpu_of(variant, r3, b):
        m = results.get(variant, {}).get("decode", {}).get(r3, {}).get(str(b))
        return None if m is None else m.get("decode_gpu_ms")

    goals, batches = [], sorted({r["concurrency"] for r in rows})
    top = max(batches) if batches else None

    def goal(name, value, bound, below=True):
        if value is not None:
            goals.append(dict(goal=name, value=value, bound=bound, met=value <= bound if below else value >= bound))

    if top is not None:
        on, off = wall("beam-async", "beam-rl", top), wall("beam-async", "off", top)
        pairs = paired_ratios(results, "beam-async", "beam-rl", "off", top)
        # the repeats interleave the two modes in one engine, so each pair shares the host's speed of its
        # moment: the median of the pairs' ratios is the ratio that drift does not move
        goal(f"batch {top}: R3-on step / R3-off step (beam-rl capture, async; median of {len(pairs)} interleaved pairs)",
             statistics.median(pairs) if pairs else None, 1.1)
        goal(f"batch {top}: the same, ratio of the two medians", on / off if on and off else None, 1.1)
        g = gpu_of("beam-async", "beam-rl", top)
        goal(f"batch {top}: R3-on wall / its GPU time", on / g if on and g else None, 2.0)
    for b in batches:
        ours, peer = wall("beam-async", "off", b), wall("qwen3moe-async", "off", b)
        goal(f"batch {b}: Beam R3-off step / Qwen3-MoE peer step", ours / peer if ours and peer else None, 1.2)
    info = []
    for b in batches:
        vllm_r3, off = wall("beam-async-vllm-r3", "vLLM", b), wall("beam-async", "off", b)
        sync, asyn = wall("beam-sync", "off", b), wall("beam-async", "off", b)
        hybrid, one = wall("beam-async-hybrid", "off", b), wall("beam-async", "off", b)
        info.append(dict(concurrency=b, vllm_capture_over_off=vllm_r3 / off if vllm_r3 and off else None,
                         sync_over_async=sync / asyn if sync and asyn else None,
                         hybrid_over_one_group=hybrid / one if hybrid and one else None))
    routing = {n: r.get("routing") for n, r in results.items() if r.get("routing")}
    digests = {(d["tokens_sha"], d["routing_sha"]) for d in routing.values()}
    checks = dict(routing_identical_across_variants=len(digests) == 1 if routing else None,
                  beam_capture_equals_vllm_capture=routing.get("beam-async-vllm-r3", {}).get("equal_to_vllm_capture"))
    wu = next((r["weight_update"] for r in results.values() if r.get("weight_update")), None)
    if wu:
        goal("weight update in memory, s", wu["in_memory_s"], 0.5)
    lines += ["", "| goal | value | bound | met |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {g['goal']} | {g['value']:.3f} | {g['bound']} | {'yes' if g['met'] else '**no**'} |" for g in goals]
    lines += ["", "ratios at each concurrency: " + ", ".join(
        f"{i['concurrency']}: vLLM capture / off {i['vllm_capture_over_off'] or float('nan'):.2f}x, "
        f"sync / async {i['sync_over_async'] or float('nan'):.2f}x, "
        f"hybrid KV cache / one group {i['hybrid_over_one_group'] or float('nan'):.2f}x" for i in info)]
    lines.append(f"routing checks: {checks}")
    for name, r in results.items():
        for key, prof in r.get("host_profile", {}).items():
            lines.append(f"host profile {name}, R3 {key}, batch {prof['batch']} (cProfile, own us/step): "
                         + ", ".join(f"{a} {us:.0f}" for a, us in prof["areas_us_per_step"].items()))
    if wu:
        lines.append(f"weight update: {wu['bytes'] / 2**30:.2f} GiB in {wu['tensors']} tensors: in memory {wu['in_memory_s']:.3f} s, "
                     f"through files {wu['files_s']:.2f} s ({wu['files_s'] / wu['in_memory_s']:.1f}x)")
    return dict(rows=rows, goals=goals, ratios=info, routing_checks=checks, routing=routing, weight_update=wu), lines

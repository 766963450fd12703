"""H200 parity check of the vLLM Beam model (vLLM 0.26 + CUDA) against the reference model.

    python scripts/gpu_rollout_check.py --preset beam-mini --out /tmp/beam-gpu [--json OUT.json]

1. Writes a seeded checkpoint (in a child process: torch CPU work before vLLM forks can hang it).
2. One eager engine with BOTH routed-expert capture paths on: vLLM's own
   (`enable_return_routed_experts=True`) and beam-rl's worker extension; greedy generation.
3. Checks: the two capture paths return identical ids; the reference model replaying the
   captured routing reproduces vLLM's token log-probs (mean / max |delta| reported) and its greedy
   choices wherever the reference's top-2 margin exceeds 0.05; reports how many greedy tokens
   the free-running reference shares with vLLM (over its first `--free-running-tokens` tokens: the
   reference's token-by-token generation is the slow part of this check) and the router
   disagreement without replay.
4. In-place reload A -> B -> A (`beam_reload_weights`: every tensor's checksum as received must
   equal the file's, and every parameter, FusedMoE experts included, must have received data):
   back on A every parameter and buffer is bit-identical to the fresh load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def write_checkpoint(preset: str, path: str, seed: int) -> None:
    code = (
        "from beam_rl.model.checkpoint import save_checkpoint; from beam_rl.model.modeling import build_model; from beam_rl.model.presets import get_preset;"
        f"save_checkpoint(build_model(get_preset({preset!r}), seed={seed}), {path!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def check_reload(llm, ckpt: str, args, config) -> bool:
    """A -> B -> A in place: B's checksums as received equal B's files, B's parameters differ from
    A's, and back on A every parameter and buffer is bit-identical to the fresh load of A
    (`beam_parameter_checksums`)."""
    from beam_rl.model.checkpoint import read_tensors
    from beam_rl.rollout.reload import reload_weights
    from beam_rl.model.weights import tensor_checksum

    other = os.path.join(args.out, f"{args.preset}-seed1")
    if not os.path.exists(os.path.join(other, "config.json")):
        write_checkpoint(args.preset, other, seed=1)
    fresh = llm.collective_rpc("beam_parameter_checksums")
    t = time.time()
    received = reload_weights(llm, other)  # raises if a parameter got no data
    seconds = time.time() - t
    sent = {name: tensor_checksum(x) for name, x in read_tensors(other, config)}
    on_b = llm.collective_rpc("beam_parameter_checksums")
    reload_weights(llm, ckpt)
    back = llm.collective_rpc("beam_parameter_checksums")
    as_sent = all(r == sent for r in received)
    b_differs = all(x != y for x, y in zip(on_b, fresh))
    restored = back == fresh
    print(f"reload A -> B -> A: {len(sent)} tensors in {seconds:.1f} s; checksums as received == files on every worker: "
          f"{as_sent}; B's parameters differ from A's: {b_differs}; back on A every parameter/buffer bit-identical to the "
          f"fresh load: {restored} ({len(fresh[0])} per worker)", flush=True)
    return as_sent and b_differs and restored


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="beam-mini")
    ap.add_argument("--out", default="/tmp/beam-gpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--free-running-tokens", type=int, default=None,
                    help="tokens the free-running reference generates per prompt (default: --max-tokens)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tensor-parallel", type=int, default=1, help="vLLM tensor_parallel_size (GPUs)")
    args = ap.parse_args()
    free_tokens = args.max_tokens if args.free_running_tokens is None else args.free_running_tokens
    if not 0 < free_tokens <= args.max_tokens:
        raise SystemExit(f"--free-running-tokens {free_tokens}: must be in 1..--max-tokens ({args.max_tokens})")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process does torch work
    ckpt = os.path.join(args.out, args.preset)
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        t = time.time()
        write_checkpoint(args.preset, ckpt, seed=0)
        print(f"checkpoint {ckpt} written in {time.time() - t:.0f} s", flush=True)

    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    from beam_rl.model.checkpoint import load_config
    from beam_rl.rollout.routing import fetch_captured_routing, moe_layers

    config = load_config(ckpt)
    llm = LLM(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=2048,
              gpu_memory_utilization=0.5, seed=0, enable_return_routed_experts=True,
              tensor_parallel_size=args.tensor_parallel,
              worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension")
    llm.collective_rpc("beam_start_routing_capture")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 200, (args.prompts,), generator=gen)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    native = [np.asarray(o.outputs[0].routed_experts) for o in outs]
    ext = fetch_captured_routing(llm, outs)
    same_capture = all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(native, ext))
    print(f"capture paths identical: {same_capture}; shapes {[a.shape for a in native[:3]]} dtype {native[0].dtype}")
    reload_ok = check_reload(llm, ckpt, args, config)
    del llm
    torch.cuda.empty_cache()

    from beam_rl.model.modeling import load_checkpoint

    ref = load_checkpoint(ckpt, device="cuda")
    report = {"capture_paths_identical": bool(same_capture), "reload_a_b_a_identical": reload_ok,
              "tensor_parallel": args.tensor_parallel, "free_running_tokens": free_tokens}
    t_ref = time.time()
    diffs, agree, considered, shared, dis = [], 0, 0, [], []
    with torch.no_grad():
        for i, (p, o, routed) in enumerate(zip(prompts, outs, native)):
            g = list(o.outputs[0].token_ids)
            seq = torch.tensor([p + g[:-1]], device="cuda")
            r = torch.from_numpy(moe_layers(routed, config).astype(np.int64)).cuda()[None]
            rep = ref(seq, routed_experts=r)
            logits = rep.logits[0, len(p) - 1:]
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(g, device="cuda")[:, None])[:, 0]
            vlp = torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, g)], device="cuda")
            diffs.append((lp - vlp).abs().cpu())
            top2 = logits.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 0.05
            agree += int(((logits.argmax(-1) == torch.tensor(g, device="cuda")) & clear).sum())
            considered += int(clear.sum())
            free = ref(seq)
            dis.append((free.routed_experts[0].sort(-1).values != r[0].sort(-1).values).any(-1).float().mean().item())
            own = ref.greedy_generate(torch.tensor([p], device="cuda"), free_tokens)[0].tolist()
            shared.append(next((j for j, (a, b) in enumerate(zip(own, g)) if a != b), free_tokens))
            print(f"reference parity: prompt {i + 1}/{len(prompts)} done at {time.time() - t_ref:.0f} s "
                  f"(mean |delta| so far {float(torch.cat(diffs).mean()):.4f})", flush=True)
    d = torch.cat(diffs)
    report.update(
        mean_abs_logprob_diff_replay=float(d.mean()), max_abs_logprob_diff_replay=float(d.max()),
        greedy_agreement_clear_margin=agree / max(considered, 1), clear_margin_positions=considered,
        free_running_shared_greedy_tokens=shared, router_disagreement_no_replay=float(np.mean(dis)),
        num_tokens=int(d.numel()),
    )
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if same_capture and reload_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Which parameters an in-place reload A -> B -> A leaves different from the fresh load of A
(vLLM on GPU), and whether greedy generation is deterministic without any reload.

    python scripts/diag_reload_gpu.py --out /tmp/beam-gpu

Parameters are fingerprinted by `BeamWorkerExtension.beam_parameter_checksums`. (The run of
2026-12-01 used an equivalent function of its own, passed to `collective_rpc` under
VLLM_ALLOW_INSECURE_SERIALIZATION=1, and had prefix caching on.)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from gpu_rollout_check import write_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="beam-mini")
    ap.add_argument("--out", default="/tmp/beam-gpu")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    a, b = (os.path.join(args.out, f"{args.preset}{s}") for s in ("", "-seed1"))
    for path, seed in ((a, 0), (b, 1)):
        if not os.path.exists(os.path.join(path, "config.json")):
            write_checkpoint(args.preset, path, seed)
    import torch
    from vllm import LLM, SamplingParams

    # prefix caching off: a repeated prompt would otherwise read its cached KV instead of recomputing it
    # (the run of 2026-12-01 had it on, so its "second generation differs" compared two computations)
    llm = LLM(model=a, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.5, seed=0, enable_prefix_caching=False,
              worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32000, (int(n),), generator=gen).tolist() for n in torch.randint(8, 200, (8,), generator=gen)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=0, detokenize=False)
    run = lambda: [(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                   for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]  # noqa: E731
    fresh = llm.collective_rpc("beam_parameter_checksums")[0]
    first, second = run(), run()
    print(f"no reload: second generation identical to first: tokens {[x[0] for x in first] == [x[0] for x in second]}, "
          f"log-probs {first == second}", flush=True)
    llm.collective_rpc("beam_reload_weights", args=(a,))
    same_a = llm.collective_rpc("beam_parameter_checksums")[0]
    print("reload A onto A: parameters differing from fresh:", sorted(n for n in fresh if same_a.get(n) != fresh[n])[:12], flush=True)
    llm.collective_rpc("beam_reload_weights", args=(b,))
    llm.collective_rpc("beam_reload_weights", args=(a,))
    back = llm.collective_rpc("beam_parameter_checksums")[0]
    bad = sorted(n for n in fresh if back.get(n) != fresh[n])
    print(f"A -> B -> A: {len(bad)} of {len(fresh)} parameters/buffers differ from fresh, e.g. {bad[:12]}", flush=True)
    third = run()
    print(f"after A -> B -> A: identical to first: tokens {[x[0] for x in first] == [x[0] for x in third]}, log-probs {first == third}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

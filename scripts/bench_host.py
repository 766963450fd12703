"""The trainer step's host time on CPU, per mode: beam-mini's structure (12 layers, 64 experts, top-8,
the adapters of each LoRA mode) at widths small enough (hidden 64) that the arithmetic is negligible,
so what is timed is the Python, autograd and dispatcher work per step, which a GPU step pays too:
beam-mini's BF16 step on the H200 is host-bound (docs/results/trainer.md: device idle time).

    python scripts/bench_host.py [--modes bf16 lora lora-merged] [--steps 10] [--json docs/bench/train_host_cpu.json]

A step = forward of a log-prob loss with R3 replay of random expert ids, backward, AdamW on the
trained parameters (as `MasterAdamW` steps FP32 adapters: in place); batch 2 x 32 tokens, one
thread. Reported per mode: trained tensors, forward / backward / optimizer ms (medians of --steps
timed steps after 3 warm-up steps) and the step's ratio to bf16's in the same run. The CPU runs
paths the GPU does not (the grouped GEMMs as per-expert loops), so the figures rank host costs
between modes and versions; they are not GPU step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import bench_provenance

MODES = ("bf16", "lora", "lora-merged")


def narrow_mini():
    from beam_rl.model.presets import get_preset

    return get_preset("beam-mini", hidden_size=64, intermediate_size=64, moe_intermediate_size=16, vocab_size=512,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def bench(mode: str, steps: int) -> dict:
    from bench_train import add_adapters

    from beam_rl.megatron import replay as r3
    from beam_rl.megatron.logprobs import sequence_logprobs
    from beam_rl.megatron.provider import BeamModelProvider

    config = narrow_mini()
    model = BeamModelProvider(config, mode="bf16").provide_wrapped().train()
    add_adapters(model, mode)  # bench_train's modes
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=g)
    routed = torch.rand(2, 32, config.num_moe_layers, config.num_experts, generator=g).argsort(-1)[..., :config.num_experts_per_tok]

    def step() -> tuple[float, float, float]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lp, mask = sequence_logprobs(model, ids, config=config, routed_experts=routed)
        loss = -(lp * mask).sum() / mask.sum()
        t1 = time.perf_counter()
        loss.backward()
        r3.clear_replay(model)
        t2 = time.perf_counter()
        opt.step()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for _ in range(3):
        step()
    fwd, bwd, upd = (statistics.median(x) * 1e3 for x in zip(*(step() for _ in range(steps))))
    return {"mode": mode, "trained_tensors": len(params), "forward_ms": round(fwd, 1), "backward_ms": round(bwd, 1),
            "optimizer_ms": round(upd, 1), "step_ms": round(fwd + bwd + upd, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode (after 3 warm-up steps)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows and their provenance here")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    from beam_rl.megatron.cpu import init_single_process

    torch.set_num_threads(1)
    init_single_process()
    modes = ["bf16"] + [m for m in args.modes if m != "bf16"]  # the baseline of the ratios, measured in this run
    rows = [bench(m, args.steps) for m in modes]
    base = rows[0]["step_ms"]
    for r in rows:
        r["vs_bf16"] = round(r["step_ms"] / base, 2)
    print(f"{'mode':12s} {'tensors':>8s} {'fwd ms':>8s} {'bwd ms':>8s} {'opt ms':>8s} {'step ms':>8s} {'vs bf16':>8s}")
    for r in rows:
        print(f"{r['mode']:12s} {r['trained_tensors']:8d} {r['forward_ms']:8.1f} {r['backward_ms']:8.1f} {r['optimizer_ms']:8.1f} "
              f"{r['step_ms']:8.1f} {r['vs_bf16']:7.2f}x")
    if args.json:
        from rollout_bench.host_probe import cpu_info

        prov = {"command": "python scripts/bench_host.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "date": time.strftime("%Y-%m-%d"),
                "device": f"CPU: {cpu_info().get('cpu_model') or 'unknown model'}, one thread, torch {torch.__version__}",
                "commit": bench_provenance.commit()}
        args.json.write_text(json.dumps({"provenance": prov, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

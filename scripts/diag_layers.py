"""Megatron Beam vs the reference model, sublayer by sublayer, with the reference's routing replayed:
where the first difference appears and how it grows with depth (docs/benchmarks.md, "R3 gap").

    python scripts/diag_layers.py --preset beam-mini --tokens 768 [--exact-gemm]

`--exact-gemm` computes every BF16 x BF16 GEMM of both models order-independently (FP64
accumulation, one BF16 rounding), removing reduction order as a source. Prints the end-to-end
mean |delta logprob| and, per attention / MLP sublayer output, the fraction of elements that
differ, the max abs and max relative difference, and the first token row that differs.
"""
import argparse

import torch
import torch.nn.functional as F

from beam_rl.model.modeling import build_model
from beam_rl.megatron.cpu import init_single_process
from beam_rl.megatron.logprobs import sequence_logprobs
from beam_rl.megatron.provider import BeamModelProvider
from beam_rl.model.presets import get_preset

_linear, _matmul = F.linear, torch.matmul


def exact_linear(x, w, b=None):
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        y = x.double() @ w.double().t()
        return (y if b is None else y + b.double()).to(torch.bfloat16)
    return _linear(x, w, b)


def exact_matmul(a, b, *args, **kw):
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and not args and not kw:
        return (a.double() @ b.double()).to(torch.bfloat16)
    return _matmul(a, b, *args, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="beam-mini")
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--exact-gemm", action="store_true")
    args = ap.parse_args()
    if args.exact_gemm:
        F.linear, torch.matmul = exact_linear, exact_matmul
    device = "cuda" if torch.cuda.is_available() else "cpu"
    init_single_process()
    config = get_preset(args.preset)
    ref = build_model(config, seed=0, dtype=torch.bfloat16, device=device)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(device)
    caps = {}

    def hook(name, megatron):
        def record(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if megatron:  # Megatron is sequence-major [s, b, h]
                out = out.transpose(0, 1)
            # Megatron's MoE returns its FP32 combine (the layer rounds it): compare as BF16
            caps[name] = out.detach().to(torch.bfloat16).float().reshape(-1, out.shape[-1])
        return record

    for i, layer in enumerate(ref.model.layers):
        layer.self_attn.register_forward_hook(hook(f"ref attn {i}", False))
        layer.mlp.register_forward_hook(hook(f"ref mlp {i}", False))
    with torch.no_grad():
        out = ref(ids)
    want = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    model = BeamModelProvider(config, mode="bf16").provide_loaded(ref.state_dict()).eval()
    for i, layer in enumerate(model.module.decoder.layers):
        layer.self_attention.register_forward_hook(hook(f"meg attn {i}", True))
        layer.mlp.register_forward_hook(hook(f"meg mlp {i}", True))
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, ids, config=config, routed_experts=out.routed_experts)
    gap = (lp - want).abs()
    print(f"{args.preset}, {args.tokens} tokens, exact GEMMs {args.exact_gemm}: mean |delta logprob| {gap.mean():.3e}, max {gap.max():.3e}")
    print(f"{'sublayer':>12s} {'differing':>10s} {'max abs':>10s} {'max rel':>10s} {'first row':>10s}")
    for i in range(config.num_hidden_layers):
        for kind in ("attn", "mlp"):
            a, b = caps[f"ref {kind} {i}"], caps[f"meg {kind} {i}"]
            d = (a - b).abs()
            rows = (d.amax(-1) > 0).nonzero()
            first = int(rows[0]) if len(rows) else -1
            print(f"{f'{i} {kind}':>12s} {(d > 0).float().mean().item():10.4f} {d.max().item():10.3e} "
                  f"{(d.max() / a.abs().max()).item():10.3e} {first:10d}")


if __name__ == "__main__":
    main()

"""Outputs and input gradients of a function, for comparing a fast op with its definition."""

import torch


def outputs_and_grads(fn, inputs, out_grads, diff):
    """fn(*inputs)'s outputs (a tuple) and the gradients of sum(out * g) w.r.t. inputs[i] for i in
    diff (fresh leaves; None outputs are skipped)."""
    leaves = [t.detach().clone().requires_grad_(i in diff) if isinstance(t, torch.Tensor) else t for i, t in enumerate(inputs)]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * g).sum() for o, g in zip(outs, out_grads) if o is not None)
    return outs, torch.autograd.grad(loss, [leaves[i] for i in diff])


def merged_lora_runs(x, w, adapters, offsets, up, grouped: bool):
    """(output, x's gradient, every adapter parameter's gradient) of sum(y * up) for merged-serving
    LoRA, first through `lora.merged_linear`, then through the straight-through definition
    (`straight_through_merged`, then the linear's GEMM or the experts' grouped GEMM). x: a leaf
    requiring grad; w [E, out, in] (E = 1 for a dense linear); one adapter per expert."""
    from beam_rl.megatron import lora
    from beam_rl.megatron.grouped_gemm import grouped_mm

    params = [p for ad in adapters for p in ad.parameters()]
    merged = lambda ad, w: straight_through_merged(w, ad.A, ad.B, ad.scaling)  # noqa: E731
    stack = lora.ExpertLoRA(adapters) if grouped else None  # the experts' adapters stacked, as add_lora keeps them

    def per_expert_grads():  # the stacked parameters' gradients in `params` order: per expert, its A slices then B slices
        return [p.grad[e].clone() for e in range(len(adapters)) for p in (*stack.A, *stack.B)]

    def run(fast: bool):
        for p in (*params, *(stack.parameters() if stack else ())):
            p.grad = None
        x.grad = None
        if fast:
            y = lora.merged_linear(x, w, stack, offsets) if grouped else lora.merged_linear(x, w[0], adapters[0])
        elif grouped:
            y = grouped_mm(x, torch.stack([merged(ad, w[e]) for e, ad in enumerate(adapters)]).transpose(1, 2), offsets)
        else:
            y = torch.nn.functional.linear(x, merged(adapters[0], w[0]))
        (y.float() * up.float()).sum().backward()
        grads = per_expert_grads() if fast and grouped else [p.grad.clone() for p in params]
        return y.detach(), x.grad.clone(), grads

    return run(True), run(False)


def straight_through_merged(w, a, b, scaling):
    """W' = rnd(W + [scaling * B_i A_i stacked along out]) in W's dtype (FP32 add, rounded once) under
    autograd, the rounding straight through: the definition of merged serving's forward and of A's
    and B's gradients, written out independently of `lora.served_weight`."""
    exact = w.float() + torch.cat([scaling * (bi.float() @ ai.float()) for ai, bi in zip(a, b)], dim=-2)
    return (exact + (exact.to(w.dtype).float() - exact).detach()).to(w.dtype)

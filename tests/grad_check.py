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

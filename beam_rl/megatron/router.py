"""Beam's MoE router and routed experts for Megatron's `MoELayer`.

Router contract (beam_rl.model.routing): FP32 weight [E, hidden] that stays FP32 through Megatron's
Float16Module wrapping and `reset_parameters`; logits accumulate in FP64 and round once to FP32
(the reference's batch-size-independent logits); grouped sigmoid top-k with the expert bias, gate
weights = unbiased scores renormalised x `routed_scaling_factor` (Megatron's native
`topk_routing_with_score_function`, which also implements R3 replay through `RouterReplay`).

Experts contract (beam_rl.model.numerics.moe_combine): each expert's SwiGLU output is rounded to the
activation dtype, multiplied by its FP32 gate weight in FP32 and summed in FP32; the MoE layer's
output stays FP32 until the decoder layer rounds it once. (Megatron's SequentialMLP instead
scales the intermediate activation by the probability and sums in BF16.) The sum runs in expert
order rather than the reference's top-k order: an FP32 reassociation, not a rounding point.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter

from beam_rl.model.routing import router_logits


class BeamRouter(TopKRouter):
    """`TopKRouter` with an FP32 weight that stays FP32 and FP64-accumulated logits."""

    def __init__(self, config, pg_collection=None):
        if config.moe_router_fusion and config.moe_enable_routing_replay:
            raise ValueError(
                "moe_router_fusion=True skips RouterReplay (the fused top-k returns before the replay "
                "check); set moe_router_fusion=False when moe_enable_routing_replay=True"
            )
        super().__init__(config=config, pg_collection=pg_collection)

    def reset_parameters(self):
        super().reset_parameters()  # casts to params_dtype; Beam's router weight is FP32
        self.weight.data = self.weight.data.float()

    def _apply(self, fn, recurse=True):
        # Float16Module calls `.bfloat16()`; keep the router weight and expert bias in FP32
        # (moving devices still works).
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            if t.dtype == torch.float32 and moved.dtype != torch.float32 and moved.is_floating_point():
                return t.to(device=moved.device)
            return moved

        return super()._apply(keep_fp32, recurse)

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's expert-load bookkeeping, uncompiled: megatron-core 0.16.1 ANDs routing_map
        [s*b, E] with the flattened padding_mask [s*b] (a shape error in training mode with padded
        batches), and its torch.compile'd version recompiles on CPU for every new batch shape."""
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """FP32 logits [s, b, E] (or [T, E]) of input [..., hidden], accumulated in FP64."""
        flat = input.reshape(-1, input.shape[-1])
        return router_logits(flat, self.weight).view(*input.shape[:-1], self.num_experts)


class BeamExperts(SequentialMLP):
    """Routed SwiGLU experts returning FP32 gate-weighted outputs (combined in FP32)."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.config.moe_apply_probs_on_input:
            raise ValueError("moe_apply_probs_on_input changes where Beam rounds; set it to False")
        counts = tokens_per_expert.tolist()
        outputs = []
        for expert, tokens, probs in zip(
            self.local_experts,
            torch.split(permuted_local_hidden_states, counts),
            torch.split(permuted_probs, counts),
        ):
            out, _ = expert(tokens)  # (n, hidden), rounded to the activation dtype by fc2
            outputs.append(out.float() * probs.float()[:, None])
        if not outputs:
            return permuted_local_hidden_states.new_zeros(0, self.config.hidden_size, dtype=torch.float32), None
        return torch.cat(outputs, dim=0), None

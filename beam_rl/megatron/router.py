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

The experts run as two grouped GEMMs over all local experts (`beam_rl.megatron.grouped_gemm`: one
launch each for fc1 and fc2, each row a GEMM with FP32 accumulation rounded once, as one expert's
own linear computes it), with the experts' own weights stacked per forward, so parameters, names and
checkpoints stay per expert. Expert tensor parallelism (ETP > 1, whose fc2 returns FP32 partials
for the dispatcher to reduce) and hooked expert linears take the per-expert loop instead.

Dispatch on one rank (TP = EP = 1, Megatron's allgather dispatcher: beam-rl's own trainer) runs
without a host sync (`OneRankTokenDispatcher`): the same expert-major permutation, with the token
counts left on the device for the grouped GEMMs. Megatron's own reads them to the host every layer.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from beam_rl.megatron.fused import FastPaths
from beam_rl.megatron.grouped_gemm import group_offsets, grouped_mm
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


class OneRankTokenDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's allgather dispatcher where nothing is gathered (TP = EP = 1, no token dropping):
    tokens permuted expert-major and, within an expert, in token order (Megatron's `permute`
    order), summed back in FP32 by `index_add`, with the permutation computed on the device from
    the routing map's T x top_k entries (every token routes to exactly top_k experts), so no layer
    waits for the host. Falls back to Megatron's path when its layer's fast paths are off."""

    layer: "BeamMoELayer"

    def dispatch_postprocess(self, hidden_states, probs):
        if not self.layer.fast_paths:
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        routing_map = self.routing_map  # [T, E] bool, top_k True per row
        tokens = routing_map.shape[0]
        expert_major = routing_map.t().reshape(-1)
        # the positions of the True entries, in order: a stable sort puts every True (0) first
        order = torch.argsort((~expert_major).to(torch.int8), stable=True)[: tokens * self.router_topk]
        self.token_index = order % tokens
        permuted_probs = probs.t().reshape(-1).index_select(0, order)
        self.routing_map = None
        return hidden_states.index_select(0, self.token_index), routing_map.sum(dim=0), permuted_probs

    def combine_preprocess(self, hidden_states):
        if not self.layer.fast_paths:
            return super().combine_preprocess(hidden_states)
        out = hidden_states.new_zeros(self.hidden_shape_before_permute)
        return out.index_add(0, self.token_index, hidden_states)


class BeamMoELayer(FastPaths, MoELayer):
    """Megatron's MoELayer with `OneRankTokenDispatcher` where it applies (one rank, allgather)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        d = self.token_dispatcher
        if (type(d) is MoEAllGatherTokenDispatcher and d.tp_size == 1 and d.ep_size == 1
                and config.moe_expert_capacity_factor is None):
            d.__class__ = OneRankTokenDispatcher
            d.layer = self


class BeamExperts(FastPaths, SequentialMLP):
    """Routed SwiGLU experts returning FP32 gate-weighted outputs (combined in FP32)."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.config.moe_apply_probs_on_input:
            raise ValueError("moe_apply_probs_on_input changes where Beam rounds; set it to False")
        if self._grouped():
            out = self._grouped_forward(permuted_local_hidden_states, tokens_per_expert)
        else:
            out = self._per_expert_forward(permuted_local_hidden_states, tokens_per_expert)
        return out.float() * permuted_probs.float()[:, None], None

    def _grouped(self) -> bool:
        fc = [lin for e in self.local_experts for lin in (e.linear_fc1, e.linear_fc2)]
        return self.fast_paths and self.tp_group.size() == 1 and not any(lin._forward_hooks or lin._forward_pre_hooks for lin in fc)

    def _grouped_forward(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """fc1, SwiGLU and fc2 of every token at once: [M, hidden] -> [M, hidden] in x's dtype."""
        from beam_rl.megatron.mxfp8 import is_mxfp8_linear, mxfp8_fake_quant

        experts = self.local_experts
        offsets = group_offsets(tokens_per_expert, x.device)
        w1 = torch.stack([e.linear_fc1.weight for e in experts])  # (E, 2F, hidden)
        w2 = torch.stack([e.linear_fc2.weight for e in experts])  # (E, hidden, F)
        quant = is_mxfp8_linear(experts[0].linear_fc1)
        if quant:  # what each expert's MXFP8 linear computes with: blocks of 32 along the input dim
            x, w1 = mxfp8_fake_quant(x), mxfp8_fake_quant(w1)
        h = experts[0].activation_func(grouped_mm(x, w1.transpose(1, 2), offsets))  # BeamSwiGLU, rounded once
        if quant:
            h, w2 = mxfp8_fake_quant(h), mxfp8_fake_quant(w2)
        return grouped_mm(h, w2.transpose(1, 2), offsets)

    def _per_expert_forward(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        counts = tokens_per_expert.tolist()
        outputs = [expert(tokens)[0] for expert, tokens in zip(self.local_experts, torch.split(x, counts))]
        if not outputs:
            return x.new_zeros(0, self.config.hidden_size)
        return torch.cat(outputs, dim=0)  # each (n, hidden), rounded to the activation dtype by fc2

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
without a host sync and without scatters (`OneRankTokenDispatcher`): the same expert-major
permutation, with the token counts left on the device for the grouped GEMMs (Megatron's own reads
them to the host every layer); the combine gathers each token's K expert rows and sums their
gate-weighted FP32 products in expert order (one fused kernel on CUDA, no FP32 copy of the expert
outputs), and the dispatch's backward gathers each token's K row gradients, sums them in FP32 and
rounds once (Megatron scatter-adds them in BF16, atomically on CUDA).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from beam_rl.megatron.fused import FastPaths, cuda_compiled
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


def _gather_sum(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 sum over k of rows[slots[:, k]] (times weights[:, k]), k in order: [T, K] -> [T, hidden].
    The adds run one after another in slot order (experts ascending), as an in-order scatter-add
    of the same products would, with no atomics."""
    acc = None
    for k in range(slots.shape[1]):
        term = rows.index_select(0, slots[:, k]).float()
        if weights is not None:
            term = term * weights[:, k : k + 1]
        acc = term if acc is None else acc + term
    return acc


_dispatch_bwd = cuda_compiled(lambda g, slots: _gather_sum(g, slots).to(g.dtype))
_combine_fwd = cuda_compiled(_gather_sum, separate_roundings=True)  # bit-equal to the eager sum


@cuda_compiled
def _combine_bwd(g, y, weights, slots, token_index, slot_of_row):
    """Gradients of `_gather_sum(y, slots, weights)`: dy [N, hidden] (y's dtype), dweights [T, K] FP32."""
    g = g.float()
    dy = (g.index_select(0, token_index) * weights.reshape(-1).index_select(0, slot_of_row)[:, None]).to(y.dtype)
    dw = torch.stack([(g * y.index_select(0, slots[:, k]).float()).sum(-1) for k in range(slots.shape[1])], dim=1)
    return dy, dw


def routing_slots(routing_map: torch.Tensor, top_k: int):
    """The expert-major permutation of a routing map [T, E] (bool, top_k True per row), on the device:
    token_index [T * K] (the token of each permuted row: expert-major, tokens ascending within an
    expert, Megatron's `permute` order), slots [T, K] (each token's rows, experts ascending),
    slot_of_row [T * K] (each row's index in slots' flattened order) and experts [T, K] (the experts
    of slots)."""
    tokens = routing_map.shape[0]
    # the positions of the True entries of the expert-major map, in order: a stable sort puts every True (0) first
    order = torch.argsort((~routing_map.t().reshape(-1)).to(torch.int8), stable=True)[: tokens * top_k]
    token_index = order % tokens
    slots = torch.argsort(token_index, stable=True)  # token-major; a token's experts ascending
    slot_of_row = torch.empty_like(slots)
    slot_of_row[slots] = torch.arange(slots.numel(), device=slots.device)
    slots = slots.view(tokens, top_k)
    return token_index, slots, slot_of_row, (order // tokens)[slots]


class _DispatchTokens(torch.autograd.Function):
    """x [T, hidden] -> x[token_index] [T * K, hidden]. Backward: each token's K row gradients summed
    in FP32 (experts ascending) and rounded once, where Megatron's unpermute scatter-adds them in the
    activation dtype."""

    @staticmethod
    def forward(ctx, x, token_index, slots):
        ctx.save_for_backward(slots)
        return x.index_select(0, token_index)

    @staticmethod
    def backward(ctx, g):
        (slots,) = ctx.saved_tensors
        return _dispatch_bwd(g, slots), None, None


class _WeightedCombine(torch.autograd.Function):
    """Expert outputs y [T * K, hidden] (activation dtype) and gate weights [T, K] (FP32) -> the FP32
    sum over each token's K experts of weight x y, the products and the sum in FP32
    (`numerics.moe_combine`; the sum in expert order), with no FP32 copy of y in between."""

    @staticmethod
    def forward(ctx, y, weights, slots, token_index, slot_of_row):
        ctx.save_for_backward(y, weights, slots, token_index, slot_of_row)
        return _combine_fwd(y.detach(), slots, weights.detach())  # one graph: the autograd flags of the training forward are no guard

    @staticmethod
    def backward(ctx, g):
        y, weights, slots, token_index, slot_of_row = ctx.saved_tensors
        dy, dw = _combine_bwd(g, y, weights, slots, token_index, slot_of_row)
        return dy, dw, None, None, None


class OneRankTokenDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's allgather dispatcher where nothing is gathered (TP = EP = 1, no token dropping),
    with gathers in place of scatters: tokens permuted expert-major and, within an expert, in token
    order (Megatron's `permute` order), computed on the device from the routing map's T x top_k
    entries (every token routes to exactly top_k experts), so no layer waits for the host; the
    combine gathers each token's top_k expert rows and sums their gate-weighted FP32 products in
    expert order, and the dispatch's backward gathers the same way. `BeamMoELayer` calls `permute`
    and `combine` when its fast paths are on; Megatron's own methods run otherwise."""

    def permute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """hidden_states [T, hidden], probs [T, E] FP32 -> (rows [T * K, hidden], tokens per expert [E])."""
        routing_map, self.routing_map = self.routing_map, None  # [T, E] bool, top_k True per row
        token_index, slots, slot_of_row, experts = routing_slots(routing_map, self.router_topk)
        weights = probs.float().gather(1, experts)  # [T, K] gate weights, the router's gradient path
        self._combine_inputs = (weights, slots, token_index, slot_of_row)
        return _DispatchTokens.apply(hidden_states, token_index, slots), routing_map.sum(dim=0)

    def combine(self, expert_rows: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs [T * K, hidden] -> the gate-weighted FP32 sum per token [T, hidden]."""
        weights, slots, token_index, slot_of_row = self._combine_inputs
        self._combine_inputs = None
        return _WeightedCombine.apply(expert_rows, weights, slots, token_index, slot_of_row)


class BeamMoELayer(FastPaths, MoELayer):
    """Megatron's MoELayer with `OneRankTokenDispatcher` where it applies (one rank, allgather)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        d = self.token_dispatcher
        if (type(d) is MoEAllGatherTokenDispatcher and d.tp_size == 1 and d.ep_size == 1
                and config.moe_expert_capacity_factor is None):
            d.__class__ = OneRankTokenDispatcher

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        d = self.token_dispatcher
        if not (self.fast_paths and isinstance(d, OneRankTokenDispatcher) and isinstance(self.experts, BeamExperts)):
            return super().routed_experts_compute(hidden_states, probs)
        rows, tokens_per_expert = d.permute(hidden_states, probs)
        expert_rows, _ = self.experts(rows, tokens_per_expert, None)  # unweighted: the combine weights them
        return d.combine(expert_rows), None


class BeamExperts(FastPaths, SequentialMLP):
    """Routed SwiGLU experts returning FP32 gate-weighted outputs (combined in FP32)."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """(FP32 gate-weighted outputs [M, hidden], None); with `permuted_probs=None` each row's
        unweighted expert output in the input's dtype (`OneRankTokenDispatcher.combine` weights it)."""
        out = self._outputs(permuted_local_hidden_states, tokens_per_expert)
        if permuted_probs is None:
            return out, None
        return out.float() * permuted_probs.float()[:, None], None

    def _outputs(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """Each row's expert output [M, hidden] in x's dtype (rows grouped by expert, counts per expert)."""
        if self.config.moe_apply_probs_on_input:
            raise ValueError("moe_apply_probs_on_input changes where Beam rounds; set it to False")
        if self._grouped():
            return self._grouped_forward(x, tokens_per_expert)
        return self._per_expert_forward(x, tokens_per_expert)

    def _grouped(self) -> bool:
        """The grouped GEMM path applies each linear's LoRA adapter itself; a hook on an expert's
        linear, or a linear wrapped in another module (Megatron-Bridge's LoRA wraps the linears it
        adapts: the wrapper has no weight), needs the per-expert loop."""
        if not (self.fast_paths and self.tp_group.size() == 1):
            return False
        # read through the modules' own dicts: nn.Module.__getattr__ per expert and linear is host time
        # every MoE layer's forward pays
        fc = [e._modules[n] for e in self.local_experts for n in ("linear_fc1", "linear_fc2")]
        hooked = any(lin._forward_pre_hooks or lin._forward_hooks for lin in fc)
        wrapped = not all(isinstance(lin._parameters.get("weight"), torch.Tensor) for lin in fc)
        return not hooked and not wrapped

    def _grouped_forward(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """fc1, SwiGLU and fc2 of every token at once: [M, hidden] -> [M, hidden] in x's dtype. LoRA as
        the adapted linears compute it: the adapters' deltas added to fc1's and fc2's outputs, or under
        merged serving the experts' merged weights in place of theirs."""
        from beam_rl.megatron.lora import add_rounded, grouped_delta, merged_linear
        from beam_rl.megatron.mxfp8 import is_mxfp8_linear, mxfp8_fake_quant

        offsets = group_offsets(tokens_per_expert, x.device)
        quant = is_mxfp8_linear(self.local_experts[0].linear_fc1)

        def linear(x, which):  # each expert's linear on its rows: [M, in] -> [M, out]
            weights, adapters = self.gathered(which)
            if adapters is not None and adapters.merged:  # (`add_lora` refuses merged adapters on MXFP8 linears)
                return merged_linear(x, weights, adapters, offsets)
            w = torch.stack(weights)  # (E, out, in)
            if quant:  # what each expert's MXFP8 linear computes with: blocks of 32 along the input dim
                x, w = mxfp8_fake_quant(x), mxfp8_fake_quant(w)
            y = grouped_mm(x, w.transpose(1, 2), offsets)
            if adapters is not None and not adapters.merged:
                y = add_rounded(y, grouped_delta(x, adapters, offsets, y.dtype))
            return y

        h = linear(x, "linear_fc1")  # (M, 2F)
        h = self.local_experts[0].activation_func(h)  # BeamSwiGLU, rounded once
        return linear(h, "linear_fc2")

    def gathered(self, which: str):
        """(weights, `lora.ExpertLoRA` or None) of every local expert's `which` linear ("linear_fc1",
        "linear_fc2"), kept while the first expert's weight and adapter are the same objects (a
        model's adapters are added to all experts at once): the forward reads them without a Python
        access per expert."""
        first = getattr(self.local_experts[0], which)
        key = (first.weight, getattr(first, "lora", None))
        cache = self.__dict__.setdefault("_gathered_linears", {})
        hit = cache.get(which)
        if hit is None or hit[0][0] is not key[0] or hit[0][1] is not key[1]:
            linears = tuple(getattr(e, which) for e in self.local_experts)
            adapters = key[1].stack if key[1] is not None else None  # the experts' stacked adapters (add_lora)
            hit = cache[which] = (key, (tuple(lin.weight for lin in linears), adapters))
        return hit[1]

    def _per_expert_forward(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        counts = tokens_per_expert.tolist()
        outputs = [expert(tokens)[0] for expert, tokens in zip(self.local_experts, torch.split(x, counts))]
        if not outputs:
            return x.new_zeros(0, self.config.hidden_size)
        return torch.cat(outputs, dim=0)  # each (n, hidden), rounded to the activation dtype by fc2

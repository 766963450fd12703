"""Beam's decoder layer and GPT model on Megatron-Core.

`BeamTransformerLayer` (a `TransformerLayer`): sandwich norms and depth-scaled residual adds,
with the GLOBAL 1-based layer number L (Megatron adds the pipeline offset), so the attention add
is n = 2L and the MLP add n = 2L + 1 on every pipeline stage:

    x = prenorm(h); h, x = boundary(attn(x), h, n=2L); h, _ = boundary(mlp(x), h, n=2L+1)

where `boundary` is `beam_rl.model.numerics.sublayer_boundary` (post-norm, round(y * x_scale) +
round(h * r_scale), rounded), computed by `beam_rl.megatron.fused`. Dropout is not part of Beam (hidden_dropout must be 0).

`BeamGPTModel` (a `GPTModel`, position_embedding_type="none"): hands the position ids to the
layers where Megatron passes rotary embeddings, and returns FP32 soft-capped logits [b, s, V]
when it is the last pipeline stage. Its LM head is `FP32OutputLayer`: the logits GEMM
accumulates in FP32 and is never rounded to BF16 (`numerics.lm_head_logits`, which says why).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from beam_rl.megatron import fused
from beam_rl.model import numerics


@dataclass
class BeamTransformerLayerSubmodules(TransformerLayerSubmodules):
    post_self_attn_layernorm: Union[ModuleSpec, type] = None
    post_mlp_layernorm: Union[ModuleSpec, type] = None


class BeamTransformerLayer(fused.FastPaths, TransformerLayer):
    def __init__(self, config, submodules: BeamTransformerLayerSubmodules, layer_number: int = 1, **kwargs):
        if config.hidden_dropout or config.attention_dropout:
            raise ValueError("Beam has no dropout; set hidden_dropout=0 and attention_dropout=0")
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        norm = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, **norm)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm)

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, padding_mask=None, **kwargs):
        """hidden_states: the residual stream [s, b, hidden]; returns (stream, context)."""
        if kwargs.get("inference_context") is not None:
            raise NotImplementedError("BeamTransformerLayer is a training layer; use the reference model or vLLM to generate")
        eps = self.config.layernorm_epsilon
        n = 2 * self.layer_number  # global: TransformerLayer adds the pipeline offset
        h = hidden_states
        x = self.input_layernorm(h)
        attn, _ = self.self_attention(x, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                      packed_seq_params=kwargs.get("packed_seq_params"))
        boundary = fused.sublayer_boundary if self.fast_paths else numerics.sublayer_boundary
        h, x = boundary(attn, h, self.post_self_attn_layernorm.weight, self.pre_mlp_layernorm.weight, n, eps)
        if self.is_moe_layer:
            mlp_out, _ = self.mlp(x, padding_mask=padding_mask)
        else:
            mlp_out, _ = self.mlp(x)
        mlp_out = mlp_out.to(h.dtype)  # MoE combines in FP32 and rounds here, once
        h, _ = boundary(mlp_out, h, self.post_mlp_layernorm.weight, None, n + 1, eps)
        return h, context


class FP32OutputLayer(tensor_parallel.ColumnParallelLinear):
    """Megatron's vocab-parallel LM head computing `numerics.lm_head_logits` (FP32, unrounded).
    `logit_rows` (set by `BeamGPTModel.forward`): only those rows of the sequence-first flattened
    hidden states [s * b] get logits, returned as [n, 1, V]."""

    logit_rows: torch.Tensor | None = None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            input_ = tensor_parallel.gather_from_sequence_parallel_region(input_)
        else:
            input_ = tensor_parallel.copy_to_tensor_model_parallel_region(input_)
        if self.logit_rows is not None:
            input_ = input_.reshape(-1, input_.shape[-1]).index_select(0, self.logit_rows).unsqueeze(1)
        logits = numerics.lm_head_logits(input_, weight, None)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return logits, None


class _FP32TensorParallelReduction:
    """Row-parallel linear whose TP partial products are summed in FP32 and rounded once.

    Beam rounds a GEMM's output once, from an FP32 accumulation (numerics contract). Megatron's
    RowParallelLinear rounds each TP rank's partial product to BF16 and all-reduces (or, with
    sequence parallelism, reduce-scatters) in BF16: two more roundings per o_proj / down_proj,
    which on beam-tiny moved TP2 BF16 log-probs by a mean 1.4e-2 from the (bit-exact) TP1 model.
    With TP > 1 and a non-FP32 input, the partial GEMM here runs on FP32 copies of input and
    weight, the reduction runs in FP32 and the sum is rounded to the input dtype. Expert fc2
    under expert TP (explicit_expert_comm: the MoE dispatcher reduce-scatters in FP32 after the
    gate-weight multiply) returns the FP32 partial unrounded. TP = 1 and FP32 are unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        impl = self._forward_impl
        self._fp32_partials = False

        def forward_impl(input, weight, *a, **kw):
            if self._fp32_partials:
                input, weight = input.float(), weight.float()
            return impl(input, weight, *a, **kw)

        self._forward_impl = forward_impl

    def forward(self, input_):
        self._fp32_partials = input_.dtype != torch.float32 and self.tp_group is not None and self.tp_group.size() > 1
        try:
            output, bias = super().forward(input_)
        finally:
            fp32, self._fp32_partials = self._fp32_partials, False
        if fp32 and not self.explicit_expert_comm:
            output = output.to(input_.dtype)
        return output, bias


@functools.cache
def fp32_tp_reduction(row_cls: type) -> type:
    """`row_cls` (RowParallelLinear or a subclass) with `_FP32TensorParallelReduction`."""
    return type(f"Beam{row_cls.__name__}", (_FP32TensorParallelReduction, row_cls), {})


class BeamGPTModel(GPTModel):
    """GPTModel whose layers get position ids and whose output is FP32 soft-capped logits."""

    def __init__(self, *args, final_logit_softcapping: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.final_logit_softcapping = final_logit_softcapping
        if self.post_process:
            # GPTModel builds its output layer inline (not through the spec): swap in the FP32 head.
            self.output_layer.__class__ = FP32OutputLayer

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        out = list(super()._preprocess(input_ids, position_ids, *args, **kwargs))
        if position_ids is None:
            raise ValueError("BeamGPTModel needs position_ids [b, s] (int64)")
        # checked once here (one host sync) for every layer's RoPE / SSMax table lookup
        lo, hi = torch.stack(torch.aminmax(position_ids)).tolist() if position_ids.numel() else (0, 0)
        if lo < 0 or hi >= self.max_sequence_length:
            raise ValueError(f"position ids span [{lo}, {hi}]; they must lie in [0, max_position_embeddings="
                             f"{self.max_sequence_length})")
        out[1] = position_ids.long()  # the rotary_pos_emb slot carries the position ids
        return tuple(out)

    def forward(self, input_ids, position_ids, attention_mask=None, *args, labels=None, logit_rows=None, **kwargs):
        """input_ids, position_ids [b, s] -> FP32 logits [b, s, V] (soft-capped; [b, s, V / TP] with
        parallel_output) on the last stage; with `logit_rows` [n] (rows of the sequence-first [s * b]
        tokens) only theirs, [1, n, V]. `attention_mask`: None, or segment ids [b, s] of packed rows
        (`BeamSelfAttention`)."""
        if labels is not None:
            raise ValueError("BeamGPTModel returns logits; compute losses with beam_rl.megatron.logprobs")
        if self.post_process:
            self.output_layer.logit_rows = logit_rows
        try:
            out = super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            if self.post_process:
                self.output_layer.logit_rows = None
        if self.post_process:
            return numerics.softcap(out, self.final_logit_softcapping)
        return out

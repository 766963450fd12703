"""Beam's layer spec on Megatron's local (non-Transformer-Engine) path.

Dense layers: Beam attention + MLP(ColumnParallelLinear fc1 = [gate | up], BeamSwiGLU,
RowParallelLinear fc2). MoE layers: Beam attention + `BeamMoELayer` (Megatron's `MoELayer`) with
`BeamRouter` and `BeamExperts` (SequentialMLP of the same SwiGLU MLP, run as grouped GEMMs). Every norm is `BeamRMSNorm`. The spec list
is global and sliced to this pipeline stage, like Megatron's `get_gpt_decoder_block_spec`.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from beam_rl.megatron.attention import BeamAttentionSubmodules, BeamSelfAttention
from beam_rl.megatron.layers import BeamTransformerLayer, BeamTransformerLayerSubmodules
from beam_rl.megatron.norms import BeamRMSNorm, BeamSwiGLU
from beam_rl.megatron.router import BeamExperts, BeamMoELayer, BeamRouter


def _mlp_submodules(linear_cls=(ColumnParallelLinear, RowParallelLinear)) -> MLPSubmodules:
    fc1, fc2 = linear_cls
    return MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2, activation_func=BeamSwiGLU)


def beam_layer_spec(*, moe: bool, attention_params: dict, linear_cls=(ColumnParallelLinear, RowParallelLinear)) -> ModuleSpec:
    """One Beam decoder layer. `linear_cls` swaps the (column, row) parallel linear classes
    (MXFP8 emulation uses quantising subclasses)."""
    col, row = linear_cls
    attention = ModuleSpec(
        module=BeamSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, **attention_params},
        submodules=BeamAttentionSubmodules(
            linear_q=col, linear_k=col, linear_v=col, linear_gate=col, linear_proj=row,
            q_layernorm=BeamRMSNorm, k_layernorm=BeamRMSNorm,
        ),
    )
    if moe:
        mlp = ModuleSpec(
            module=BeamMoELayer,
            submodules=MoESubmodules(
                router=BeamRouter,
                experts=ModuleSpec(module=BeamExperts, submodules=_mlp_submodules(linear_cls)),
            ),
        )
    else:
        mlp = ModuleSpec(module=MLP, submodules=_mlp_submodules(linear_cls))
    return ModuleSpec(
        module=BeamTransformerLayer,
        submodules=BeamTransformerLayerSubmodules(
            input_layernorm=BeamRMSNorm,
            self_attention=attention,
            post_self_attn_layernorm=BeamRMSNorm,
            pre_mlp_layernorm=BeamRMSNorm,
            mlp=mlp,
            post_mlp_layernorm=BeamRMSNorm,
        ),
    )


def beam_block_spec(config, *, attention_params: dict, vp_stage=None, pp_rank=None,
                    linear_cls=(ColumnParallelLinear, RowParallelLinear)) -> TransformerBlockSubmodules:
    """Layer specs of this pipeline stage (from `config.moe_layer_freq`, a 0/1 list) + final norm."""
    pattern = config.moe_layer_freq
    if not isinstance(pattern, list) or len(pattern) != config.num_layers:
        raise ValueError(f"moe_layer_freq must be a 0/1 list of num_layers={config.num_layers} entries, got {pattern!r}")
    specs = [beam_layer_spec(moe=bool(p), attention_params=attention_params, linear_cls=linear_cls) for p in pattern]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=BeamRMSNorm)

"""`BeamModelProvider`: Beam config -> Megatron `TransformerConfig` + `BeamGPTModel`.

The kind of object a Megatron-Bridge bridge returns (`provide(pre_process, post_process,
vp_stage)`), so a SkyRL / Megatron-Bridge trainer can build Beam unchanged. Native Megatron
config carries everything it can express; each override below says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from beam_rl.model.config import BeamConfig
from beam_rl.megatron.layer_spec import beam_block_spec
from beam_rl.megatron.layers import BeamGPTModel

MODES = ("bf16", "fp32", "mxfp8-emulated")


@dataclass
class BeamModelProvider:
    """Builds Beam on Megatron-Core; fields mirror the trainer's YAML."""

    beam: BeamConfig
    """The HF Beam config (validated)."""
    mode: str = "bf16"
    """bf16 (full fine-tuning / LoRA base), fp32 (parity tests), mxfp8-emulated (MXFP8 numerics emulated
    in PyTorch on any device; Transformer Engine's native MXFP8 needs Blackwell and TE, neither here)."""
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    """TP size of the routed experts (Megatron's ETP; must equal the world's, see
    `cpu.init_single_process`). 1 keeps every expert whole on each rank, for two reasons:
    (1) Beam rounds each GEMM once from an FP32 accumulation, and a whole expert does exactly that,
    whereas ETP > 1 splits the down projection into partial products that Megatron reduces
    (reduce-scatter in the dispatcher) only after the gate-weight multiply, so the expert output is
    never rounded where Beam rounds it (on beam-tiny TP2 BF16 with replay, ETP = TP moves log-probs
    measurably from the one-rank model: tests/test_megatron_parallel.py); (2) it is the usual layout for
    large MoE training: experts are spread by expert parallelism, TP shards only attention / dense
    MLP / embeddings, and expert GEMMs stay large. Megatron's own default (None) is ETP = TP."""
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    attention_dtype: str = "fp32"
    """'fp32': FP32 scores/softmax/PV (the contract, any device); 'bf16': BF16 inputs, FP32 accumulation;
    'bf16-probs': probabilities rounded to BF16 before P.V, as the rollout's attention does where
    `beam_rl.megatron.attention.trainer_attention_dtype()` returns it (BeamSelfAttention)."""
    recompute: bool = False
    """Full activation recompute of every layer (R3 replays during the recompute too)."""
    routing_replay: bool = True
    """Build RouterReplay instances (R3); router fusion is then refused."""
    expert_bias_update_rate: float = 0.0
    """Megatron updates the expert bias in finalize_model_grads even when frozen; 0 keeps it fixed."""
    overrides: dict = field(default_factory=dict)
    """Extra TransformerConfig fields (applied last)."""

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.float32 if self.mode == "fp32" else torch.bfloat16

    def transformer_config_kwargs(self) -> dict:
        """The `TransformerConfig` fields of Beam with this provider's settings (validated);
        `transformer_config()` builds from them, `beam_rl.megatron.bridge_model` fills its
        Megatron-Bridge provider with them."""
        c = self.beam
        if self.mode not in MODES:
            raise ValueError(f"BeamModelProvider.mode={self.mode!r}; choose one of {MODES}")
        if not c.norm_topk_prob:
            raise ValueError("BeamConfig.norm_topk_prob=False: Megatron's sigmoid top-k always renormalises; keep it true")
        if c.num_experts_per_tok % c.topk_group or c.num_experts_per_tok // c.topk_group != 2:
            raise ValueError(
                f"Megatron scores a group by its top (num_experts_per_tok // topk_group) experts; Beam uses the top 2, "
                f"so num_experts_per_tok={c.num_experts_per_tok} must be 2 x topk_group={c.topk_group}"
            )
        sliding = [t == "sliding_attention" for t in c.layer_types]
        kwargs = dict(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_key_value_heads,
            kv_channels=c.head_dim,  # q width != hidden, as in Beam
            ffn_hidden_size=c.intermediate_size,
            normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps,
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            # The hook that hands the whole fc1 output to a module (BeamSwiGLU, one rounding);
            # nothing of Transformer Engine is used on the local spec.
            use_te_activation_func=True,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            qk_layernorm=True,
            window_size=(c.sliding_window - 1, 0),  # Megatron counts earlier tokens; Beam's window includes the query
            window_attn_skip_freq=[1 if s else 0 for s in sliding],
            no_rope_freq=[0 if s else 1 for s in sliding],
            num_moe_experts=c.num_experts,
            moe_ffn_hidden_size=c.moe_intermediate_size,
            moe_router_topk=c.num_experts_per_tok,
            moe_layer_freq=[1 if t == "sparse" else 0 for t in c.mlp_layer_types],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=self.expert_bias_update_rate,
            moe_router_num_groups=c.n_group,
            moe_router_group_topk=c.topk_group,
            moe_router_topk_scaling_factor=c.routed_scaling_factor,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",  # RL: no aux loss
            moe_aux_loss_coeff=0.0,
            moe_router_fusion=False,  # the fused path skips RouterReplay
            moe_permute_fusion=False,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",  # beam-rl's trainer (fixed lengths); SkyRL sets alltoall
            moe_enable_routing_replay=self.routing_replay,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            sequence_parallel=self.sequence_parallel,
            params_dtype=self.params_dtype,
            bf16=self.params_dtype == torch.bfloat16,
            use_cpu_initialization=not torch.cuda.is_available(),
            init_method_std=c.initializer_range,
        )
        if self.recompute:
            kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        kwargs.update(self.overrides)
        return kwargs

    def transformer_config(self) -> TransformerConfig:
        return TransformerConfig(**self.transformer_config_kwargs())

    def _linear_classes(self):
        """(column, row) parallel linear classes; the row class reduces TP partials in FP32
        (`layers.fp32_tp_reduction`: Beam rounds a GEMM once)."""
        from beam_rl.megatron.layers import fp32_tp_reduction
        from beam_rl.megatron.mxfp8 import MXFP8ColumnParallelLinear, MXFP8RowParallelLinear

        if self.mode == "mxfp8-emulated":
            col, row = MXFP8ColumnParallelLinear, MXFP8RowParallelLinear
        else:
            from megatron.core.tensor_parallel.layers import ColumnParallelLinear as col, RowParallelLinear as row
        return col, fp32_tp_reduction(row)

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None) -> BeamGPTModel:
        """The Megatron model of this pipeline stage (first / last stage by default from parallel_state)."""
        return self.build_model(self.transformer_config(), pre_process, post_process, vp_stage)

    def build_model(self, config: TransformerConfig, pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None, parallel_output: bool = False) -> BeamGPTModel:
        """`BeamGPTModel` of this pipeline stage on `config`: `transformer_config()`, or a finalised config
        holding the same Beam fields plus a trainer's parallel / MoE / recompute settings (the
        Megatron-Bridge provider). Beam itself, the attention dtype and the mode (linear classes,
        params dtype) come from this provider. `parallel_output`: logits split by vocabulary over TP
        (SkyRL's vocabulary-parallel log-probs) instead of whole rows (`beam_rl.megatron.logprobs`)."""
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            # The expert linears take their shapes from the world's expert-TP group, not from the
            # config: a mismatch would build (and load) a different layout than the one asked for.
            world = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_expert_tensor_parallel_world_size())
            if world != (config.tensor_model_parallel_size, config.expert_tensor_parallel_size):
                raise ValueError(
                    f"BeamModelProvider(tensor_model_parallel_size={config.tensor_model_parallel_size}, "
                    f"expert_tensor_parallel_size={config.expert_tensor_parallel_size}) but the model-parallel world has "
                    f"TP {world[0]}, expert TP {world[1]}; initialise it with the same sizes "
                    f"(init_single_process(tensor_parallel=..., expert_tensor_parallel=...))"
                )
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
        spec = beam_block_spec(
            config,
            attention_params=dict(
                attention_dtype=self.attention_dtype,
                rope_theta=float(self.beam.rope_parameters["sliding_attention"]["rope_theta"]),
                max_positions=self.beam.max_position_embeddings,
            ),
            vp_stage=vp_stage,
            linear_cls=self._linear_classes(),
        )
        model = BeamGPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=self.beam.vocab_size,
            max_sequence_length=self.beam.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,  # Beam's LM head is untied
            position_embedding_type="none",  # Beam computes its own FP32 RoPE / SSMax per layer
            parallel_output=parallel_output,
            vp_stage=vp_stage,
            final_logit_softcapping=self.beam.final_logit_softcapping,
        )
        return model.to(self.params_dtype)

    def provide_wrapped(self, **kwargs):
        """`provide()` wrapped in Megatron's Float16Module for BF16 (router tensors stay FP32)."""
        from megatron.core.transformer.module import Float16Module

        model = self.provide(**kwargs)
        return Float16Module(model.config, model) if self.params_dtype == torch.bfloat16 else model

    def provide_loaded(self, hf_tensors: dict, **kwargs):
        """`provide_wrapped()` with HF-named tensors (e.g. a reference model's state_dict) loaded."""
        from beam_rl.megatron.convert import load_hf_into_model

        model = self.provide_wrapped(**kwargs)
        if torch.cuda.is_available():
            model = model.cuda()
        load_hf_into_model(model, hf_tensors, self.beam)
        return model

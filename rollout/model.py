"""Beam for vLLM: decoder layers with sandwich norms and depth-scaled residual adds (one fused
boundary op per sublayer), vocab-parallel embedding, untied LM head, FP32 soft cap.

The layer structure mirrors `beam_rl.model.modeling` line for line: `residual` is the depth-scaled
stream, `x` the normed input of the next sublayer; each boundary computes post-norm, scaled add
and the next pre-norm (the next layer's input norm, or the final norm after the last layer).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsEagle3, SupportsLoRA
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper
from vllm.sequence import IntermediateTensors

from beam_rl.kernels.fingerprint import tensor_checksums
from beam_rl.model import numerics
from beam_rl.model.config import BeamConfig
from beam_rl.rollout import ops
from beam_rl.rollout.attention import BeamAttention
from beam_rl.rollout.capture import RoutingRecorder
from beam_rl.rollout import compat
from beam_rl.rollout.compat import parameter_names
from beam_rl.model.mxfp8 import LINEAR_PRECISION_KEY
from beam_rl.rollout.linear import linear_precision
from beam_rl.rollout.moe import BeamDenseMLP, BeamMoE

# HF checkpoint name -> (vLLM parameter, shard) for the stacked projections; experts are loaded by
# vLLM's fused-MoE loader, everything else by name.
HF_TO_VLLM = WeightsMapper(
    orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
        ".mlp.up_proj": (".mlp.gate_up_proj", 1),
    }
)


CHECKSUM_BATCH_BYTES = 1 << 28
"""Received bytes fingerprinted per batch during a weight update (see `BeamForCausalLM._checksummed`)."""

class BeamDecoderLayer(nn.Module):
    def __init__(self, config: BeamConfig, layer_idx: int, cache_config, quant_config, recorder, prefix: str):
        super().__init__()
        self.layer_idx = layer_idx
        self.eps = config.rms_norm_eps
        self.input_layernorm = ops.NormWeight(config.hidden_size)
        self.self_attn = BeamAttention(config, layer_idx, cache_config, quant_config, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = ops.NormWeight(config.hidden_size)
        self.pre_feedforward_layernorm = ops.NormWeight(config.hidden_size)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = BeamMoE(config, layer_idx, recorder, quant_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = BeamDenseMLP(config, quant_config, prefix=f"{prefix}.mlp")
        self.post_feedforward_layernorm = ops.NormWeight(config.hidden_size)

    def forward(self, positions, residual, x, next_norm_weight):
        n = 2 * (self.layer_idx + 1)  # this layer's attention add; the MLP add is n + 1
        attn = self.self_attn(positions, x)
        residual, x = ops.sublayer_boundary(
            attn, residual, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight, n, self.eps
        )
        mlp_out = self.mlp(x)
        residual, x = ops.sublayer_boundary(
            mlp_out, residual, self.post_feedforward_layernorm.weight, next_norm_weight, n + 1, self.eps
        )
        return residual, x


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0})
class BeamModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", recorder: RoutingRecorder | None = None):
        super().__init__()
        config: BeamConfig = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            BeamDecoderLayer(config, i, vllm_config.cache_config, vllm_config.quant_config, recorder, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = ops.NormWeight(config.hidden_size)
        self.positional_tables = ops.PositionalTables(layer.self_attn.positional for layer in self.layers)
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """The final normed hidden states; with `aux_hidden_state_layers` set (a drafter reads the
        target's states), also the residual streams entering those layers (vLLM's aux index i: the
        stream after 0-based layer i - 1, which DFlash's `target_layer_ids` name as i - 1)."""
        residual = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)  # residual add 1
        x = ops.rms_norm(residual, self.layers[0].input_layernorm.weight, self.config.rms_norm_eps)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_state_layers:
                aux.append(residual)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            residual, x = layer(positions, residual, x, next_norm.weight)
        if len(self.layers) in self.aux_hidden_state_layers:
            aux.append(residual)
        return (x, aux) if self.aux_hidden_state_layers else x


class BeamLMHead(ParallelLMHead):
    """The untied LM head with an FP32 weight holding model-dtype values.

    `numerics.lm_head_logits` is an FP32 GEMM; keeping the weight in FP32 saves converting it on every
    decode step (a read of the BF16 head and a write of twice its size) at the price of twice the
    head's memory. Every load rounds to the model dtype first, so the
    weight is what a BF16 head would hold and the logits are unchanged bit for bit."""

    def __init__(self, vocab_size: int, hidden_size: int, model_dtype: torch.dtype, prefix: str):
        super().__init__(vocab_size, hidden_size, params_dtype=torch.float32, prefix=prefix)
        self.model_dtype = model_dtype

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        super().weight_loader(param, loaded_weight.to(self.model_dtype))


class BeamForCausalLM(nn.Module, SupportsLoRA, SupportsEagle3):
    """vLLM entry point for `architectures: ["BeamForCausalLM"]` (registered by beam_rl.rollout).

    LoRA (PEFT adapters, `enable_lora=True`): attention q/k/v (packed into qkv_proj), the output
    gate projection, o_proj, and the dense MLP's gate/up (packed) and down projections. Adapters
    must name modules fully (e.g. `model.layers.0.mlp.gate_proj`), not by a bare suffix that would
    also match the routed experts, which take no LoRA here.
    """

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    embedding_modules: dict[str, str] = {}
    hf_to_vllm_mapper = HF_TO_VLLM

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: BeamConfig = vllm_config.model_config.hf_config
        if get_pp_group().world_size > 1:
            raise NotImplementedError("beam_rl.rollout does not support pipeline parallelism; set pipeline_parallel_size=1")
        self.config = config
        self.received_checksums: dict[str, str] | None = None  # set by BeamWorkerExtension to verify a sync
        self.loaded_names: set[str] | None = None  # likewise: which parameters the sync reached
        self.update_tensor_names: set[str] | None = None  # the model's tensor names during that update
        self.update_device: torch.device | None = None  # likewise: where received tensors are fingerprinted
        self.routing_recorder = RoutingRecorder(
            vllm_config.scheduler_config.max_num_batched_tokens, config.num_hidden_layers,
            config.num_experts_per_tok, config.num_experts,
            device=torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"),
        )
        self.model = BeamModel(vllm_config=vllm_config, prefix=f"{prefix}model" if not prefix else f"{prefix}.model",
                               recorder=self.routing_recorder)
        self.lm_head = BeamLMHead(config.vocab_size, config.hidden_size, vllm_config.model_config.dtype, prefix="lm_head")
        compat.torch_gemms_on_cpu(self)
        if isinstance(vllm_config.additional_config, dict):
            # Part of vLLM's torch.compile cache key: the graphs of the fused and the plain-PyTorch builds
            # differ, and without this a BEAM_RL_FUSED_KERNELS=0 engine would load the fused build's cache.
            vllm_config.additional_config["beam_rl_fused_kernels"] = ops.use_fused_kernels()
            vllm_config.additional_config[LINEAR_PRECISION_KEY] = linear_precision(config)  # the MXFP8 build's graphs differ too
        else:
            warnings.warn("additional_config is not a dict, so beam-rl cannot add BEAM_RL_FUSED_KERNELS to vLLM's "
                          "torch.compile cache key: set VLLM_DISABLE_COMPILE_CACHE=1 (or a VLLM_CACHE_ROOT per "
                          "setting) when switching BEAM_RL_FUSED_KERNELS", stacklevel=2)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    # -- target hidden states for a drafter (EAGLE-3 / DFlash): vLLM calls these at load -----------
    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        bad = [i for i in layers if not 0 <= i <= self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"aux hidden-state layers {bad} outside 0..{self.config.num_hidden_layers} (vLLM's index i is "
                             f"the stream entering layer i; DFlash's target_layer_ids + 1)")
        self.model.aux_hidden_state_layers = tuple(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        n = self.config.num_hidden_layers
        return (2, n // 2, n - 3)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """FP32 logits (`beam_rl.model.numerics.lm_head_logits`): FP32-accumulated LM head, never rounded
        to BF16, gathered over TP ranks, vocab padding dropped, soft cap in FP32."""
        local = numerics.lm_head_logits(hidden_states, self.lm_head.weight, None)
        if get_tensor_model_parallel_world_size() > 1:
            local = tensor_model_parallel_all_gather(local)
        return numerics.softcap(local[..., : self.config.vocab_size], self.config.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.received_checksums is not None:
            weights = self._checksummed(weights)
        loaded = parameter_names(self, AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper),
                                 self.update_tensor_names)
        if self.loaded_names is not None:
            self.loaded_names |= loaded
        return loaded

    def _checksummed(self, weights):
        """Record the `tensor_checksums` fingerprint of every tensor as received (HF names), for sync
        verification, on the worker's GPU where it has one (`beam_rl.kernels.fingerprint`'s fused
        kernel): a tensor read from files into host memory is copied there first, the copy the
        loader makes anyway, so the bytes fingerprinted are the bytes loaded; one larger than
        `CHECKSUM_BATCH_BYTES` stays on the host (a whole 501B embedding on every TP rank's GPU would
        be a transient of GBs). Many tensors a batch, holding at most ~`CHECKSUM_BATCH_BYTES` of
        received tensors until their batch is done."""
        device = self.update_device
        pending, size = [], 0
        for name, tensor in weights:
            if (device is not None and device.type == "cuda" and tensor.device != device
                    and tensor.numel() * tensor.element_size() <= CHECKSUM_BATCH_BYTES):
                tensor = tensor.to(device)
            pending.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            yield name, tensor
            if size >= CHECKSUM_BATCH_BYTES:
                self.received_checksums.update(tensor_checksums(pending))
                pending, size = [], 0
        if pending:
            self.received_checksums.update(tensor_checksums(pending))

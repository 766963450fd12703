"""Beam's Megatron-Bridge 0.3.1 bridge: `BeamBridgeProvider` builds `BeamGPTModel`, `BeamBridge`
converts weights with a mapping registry made from `beam_rl.model.names.MAPPINGS`.

Import it through `beam_rl.megatron.bridge.register_bridge()` (this module needs Megatron-Bridge,
imported with the Transformer Engine stub).

`BeamBridge.provider_bridge` fills the provider with `BeamModelProvider(config).transformer_config_kwargs()`,
the same fields `BeamModelProvider.transformer_config()` builds from; a trainer then sets its own
fields on the provider (SkyRL 0.3.0's `MegatronWorker.init_configs`) and `provide()` builds
`BeamModelProvider.build_model(self)`: the model's config is the provider itself, so the trainer's
settings are the ones in force. `BeamBridgeProvider.check_beam()` sorts them:

- honoured: tensor / pipeline (and virtual) / expert / expert-tensor parallel sizes, sequence
  parallelism, the token dispatcher, `variable_seq_lengths` (megatron-core accepts it with the
  alltoall / flex dispatchers only), routing replay, load-balancing loss, expert-bias update rate,
  full activation recompute, params dtype and the mixed-precision wrapper;
- no effect on Beam's modules, accepted: `attention_backend` other than flash,
  `masked_softmax_fusion`, rotary fields and `transformer_layer_spec` (Beam's attention computes
  its own RoPE / SSMax and `provide()` always uses Beam's spec);
- refused, naming the setting: any other change to a field Beam's config defines (including
  `moe_grouped_gemm`, `moe_router_dtype`), flash attention, context parallelism, selective
  recompute, FP8 and MTP.

Mappings: replicated -> `ReplicatedMapping`, column -> `ColumnParallelMapping`, row ->
`RowParallelMapping`, glu -> `GatedMLPMapping`, `{layer}` / `{expert}` -> `*`, with three fixes
over 0.3.1: TP shards are made contiguous before collectives (a scattered dim-1 chunk view
arrives with the wrong values otherwise); routed experts keep their
SequentialMLP names and map the local expert to the global one (EP rank x experts per rank + local)
on load and export, where 0.3.1 maps only grouped-GEMM names and its EP gather parses the expert
from a `weight<N>` suffix these names lack; and a Megatron tensor without a loaded HF tensor is an
error, not a silently skipped task. Every tensor keeps its dtype: routers stay FP32. Under
`mxfp8.serving_weights()` (SkyRL's weight sync) the emulated-MXFP8 linears export the weights
their forward computes with (`_Contiguous.megatron_to_hf`), as `TrainerBackend.export(served=True)`.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from dataclasses import dataclass
from importlib.metadata import version

import torch

from beam_rl.megatron.bridge import MEGATRON_BRIDGE_VERSION, import_megatron_bridge

import_megatron_bridge()
if (_found := version("megatron-bridge")) != MEGATRON_BRIDGE_VERSION:
    # The fixes below override 0.3.1 internals (param_mapping collectives, the EP gather).
    raise ImportError(f"beam_rl.megatron.bridge_model is written against megatron-bridge {MEGATRON_BRIDGE_VERSION}, "
                      f"found {_found}; pip install --no-deps megatron-bridge=={MEGATRON_BRIDGE_VERSION}")

from megatron.bridge.models.conversion import auto_bridge  # noqa: E402
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry  # noqa: E402
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge, register_bridge_implementation  # noqa: E402
from megatron.bridge.models.conversion.param_mapping import (  # noqa: E402
    ColumnParallelMapping,
    GatedMLPMapping,
    ReplicatedMapping,
    RowParallelMapping,
)
from megatron.bridge.models.conversion.utils import persistent_buffers  # noqa: E402
from megatron.bridge.models.gpt_provider import GPTModelProvider  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig as CoreTransformerConfig  # noqa: E402

from beam_rl.megatron import mxfp8  # noqa: E402
from beam_rl.megatron.layers import BeamGPTModel  # noqa: E402
from beam_rl.megatron.provider import BeamModelProvider  # noqa: E402
from beam_rl.model.config import BeamConfig  # noqa: E402
from beam_rl.model.modeling import BeamForCausalLM, register_auto  # noqa: E402
from beam_rl.model.names import MAPPINGS, Mapping  # noqa: E402

ARCH = "BeamForCausalLM"

# Provider fields a trainer may set; every other field of `BeamModelProvider.transformer_config_kwargs()`
# is part of Beam's definition and must keep the value Beam's config gives it.
TRAINER_FIELDS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "sequence_parallel", "moe_token_dispatcher_type", "moe_enable_routing_replay",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_bias_update_rate",
    "gradient_accumulation_fusion", "masked_softmax_fusion", "use_cpu_initialization", "init_method_std",
    "params_dtype", "bf16",  # checked against beam_mode
})
# Where SkyRL 0.3.0 sets a field (for error messages); others come from transformer_config_kwargs.
_SKYRL_KEYS = {
    name: f"trainer.policy.megatron_config.{name}"
    for name in ("moe_grouped_gemm", "moe_router_dtype", "moe_router_score_function", "moe_router_enable_expert_bias",
                 "context_parallel_size", "mtp_num_layers")
}


def _skyrl_key(name: str) -> str:
    return _SKYRL_KEYS.get(name, f"trainer.policy.megatron_config.transformer_config_kwargs.{name}")


@dataclass
class BeamBridgeProvider(GPTModelProvider):
    """Megatron-Bridge provider of Beam: a `GPTModelProvider` (hence a `TransformerConfig`) holding
    Beam's fields plus the trainer's, whose `provide()` returns `BeamGPTModel` with Beam's layer spec."""

    beam: BeamConfig | None = None
    """The checkpoint's config (`BeamBridge.provider_bridge` sets it)."""
    beam_mode: str = "bf16"
    """`BeamModelProvider.mode`; params_dtype / bf16 must match it (SkyRL: transformer_config_kwargs.beam_mode)."""
    beam_attention_dtype: str = "fp32"
    """`BeamModelProvider.attention_dtype` (SkyRL: transformer_config_kwargs.beam_attention_dtype)."""

    def beam_provider(self) -> BeamModelProvider:
        if self.beam is None:
            raise ValueError("BeamBridgeProvider.beam is not set; build the provider with "
                             "AutoBridge.from_hf_pretrained(path).to_megatron_provider() after register_bridge()")
        return BeamModelProvider(self.beam, mode=self.beam_mode, attention_dtype=self.beam_attention_dtype)

    def check_beam(self) -> None:
        """Raise ValueError naming the first setting that Beam's model cannot honour (module docstring)."""
        beam = self.beam_provider()
        expected = beam.transformer_config_kwargs()
        for name, want in expected.items():
            if name not in TRAINER_FIELDS and getattr(self, name) != want:
                raise ValueError(f"BeamBridgeProvider.{name}={getattr(self, name)!r}, but Beam's config defines it as "
                                 f"{want!r}; set it back to that (SkyRL: {_skyrl_key(name)})")
        if (self.params_dtype, bool(self.bf16)) != (beam.params_dtype, beam.params_dtype == torch.bfloat16):
            raise ValueError(f"beam_mode={self.beam_mode!r} builds {beam.params_dtype} parameters but the provider has "
                             f"params_dtype={self.params_dtype}, bf16={self.bf16}; set them to match "
                             f"(SkyRL: trainer.bf16={'true' if beam.params_dtype == torch.bfloat16 else 'false'})")
        backend = getattr(self.attention_backend, "name", self.attention_backend)
        if backend == "flash":
            raise ValueError("attention_backend=flash: Beam's attention (sliding window, SSMax, output gate) is "
                             "beam-rl's module and has no FlashAttention path; set trainer.flash_attn=false")
        if self.context_parallel_size != 1:
            raise ValueError(f"context_parallel_size={self.context_parallel_size}: Beam's attention has no context "
                             f"parallelism; set {_skyrl_key('context_parallel_size')}=1")
        if self.recompute_granularity not in (None, "full"):
            raise ValueError(f"recompute_granularity={self.recompute_granularity!r}: Beam's decoder layer recomputes "
                             f"whole layers only; set {_skyrl_key('recompute_granularity')}=full (or null)")
        if self.fp8 is not None:
            raise ValueError(f"fp8={self.fp8!r}: Beam's MXFP8 runs emulated; set fp8=None and beam_mode='mxfp8-emulated'")
        if self.mtp_num_layers:
            raise ValueError(f"mtp_num_layers={self.mtp_num_layers}: Beam has no MTP heads; set "
                             f"{_skyrl_key('mtp_num_layers')}=0 (or leave it unset)")

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> BeamGPTModel:
        """`BeamGPTModel` of this pipeline stage with this (finalised) provider as its config."""
        self.check_beam()
        return self.beam_provider().build_model(self, pre_process, post_process, vp_stage, parallel_output=self.parallel_output)


# -- mappings from MAPPINGS ----------------------------------------------------------------------
class _Contiguous:
    """0.3.1 scatters `torch.chunk` views (non-contiguous for dim-1 splits) and gathers without
    `.contiguous()`; collectives need contiguous tensors."""

    def scatter_to_tp_ranks(self, splits, *args, **kwargs):
        return super().scatter_to_tp_ranks(None if splits is None else [s.contiguous() for s in splits], *args, **kwargs)

    def gather_from_tp_ranks(self, tensor):
        return super().gather_from_tp_ranks(tensor.contiguous())

    def broadcast_tensor_to_tp_ranks(self, tensor, src_rank: int = 0):
        return super().broadcast_tensor_to_tp_ranks(tensor.contiguous(), src_rank)

    def megatron_to_hf(self, megatron_weights, megatron_module):
        """Under `mxfp8.serving_weights()` (weight sync), an emulated-MXFP8 linear's weight leaves as its
        forward computes with it: this rank's shard quantised and dequantised before the gather."""
        if (megatron_weights is not None and mxfp8.serving() and mxfp8.is_mxfp8_linear(megatron_module)
                and str(self.megatron_param).endswith(".weight")):
            megatron_weights = mxfp8.mxfp8_fake_quant(megatron_weights)
        return super().megatron_to_hf(megatron_weights, megatron_module)


class _Expert:
    """A routed expert's weight under SequentialMLP names: Megatron name with the LOCAL expert, HF
    name with the GLOBAL one (EP rank x experts per rank + local); export all-gathers the local
    expert over EP and names each rank's copy. `ROW` / `NUM_EXPERTS` are set per subclass."""

    ROW: Mapping
    NUM_EXPERTS: int | None = None
    layer: int
    local: int

    def _global(self, local: int) -> int:
        if self.ep_size == 1:
            return local
        if self.NUM_EXPERTS is None:
            raise ValueError("expert parallelism needs the expert count: build tasks through BeamBridge.build_conversion_tasks")
        return self.ep_rank * (self.NUM_EXPERTS // self.ep_size) + local

    def resolve(self, captures):
        layer, local = (int(c) for c in captures)
        names = [p.format(layer=layer, expert=self._global(local)) for p in self.ROW.hf]
        resolved = type(self)(self.ROW.megatron.format(layer=layer, expert=local), *names)
        resolved.layer, resolved.local = layer, local
        return resolved

    def gather_from_ep_ranks(self, weights, megatron_module, hf_param_name):
        if self.ep_size == 1:
            return {str(hf_param_name): weights}
        parts = [torch.empty_like(weights) for _ in range(self.ep_size)]
        torch.distributed.all_gather(parts, weights.contiguous(), group=self.ep_group)
        mine = [p.format(layer=self.layer, expert=self._global(self.local)) for p in self.ROW.hf]
        pattern = self.ROW.hf[mine.index(hf_param_name)]
        per_rank = self.NUM_EXPERTS // self.ep_size
        return {pattern.format(layer=self.layer, expert=r * per_rank + self.local): t for r, t in enumerate(parts)}


_KINDS = {"replicated": ReplicatedMapping, "column": ColumnParallelMapping, "row": RowParallelMapping,
          "glu": GatedMLPMapping}


def _wildcards(pattern: str) -> str:
    return pattern.replace("{layer}", "*").replace("{expert}", "*")


def mapping_registry(num_experts: int | None = None) -> MegatronMappingRegistry:
    """One Megatron-Bridge mapping per row of `MAPPINGS`; `num_experts` is needed with EP > 1."""
    out = []
    for row in MAPPINGS:
        if row.shard not in _KINDS:
            raise ValueError(f"MAPPINGS row {row.megatron!r}: shard kind {row.shard!r} has no Megatron-Bridge mapping")
        base = _KINDS[row.shard]
        if "{expert}" in row.megatron:
            cls = type(f"BeamExpert{base.__name__}", (_Expert, _Contiguous, base), {"ROW": row, "NUM_EXPERTS": num_experts})
        else:
            cls = type(f"Beam{base.__name__}", (_Contiguous, base), {})
        out.append(cls(_wildcards(row.megatron), *map(_wildcards, row.hf)))
    return MegatronMappingRegistry(*out)


@MegatronModelBridge.register_bridge(source=BeamForCausalLM, target=GPTModel, provider=BeamBridgeProvider, model_type="beam")
class BeamBridge(MegatronModelBridge):
    """HF `BeamForCausalLM` <-> Megatron `BeamGPTModel`."""

    def provider_bridge(self, hf_pretrained) -> BeamBridgeProvider:
        config = hf_pretrained.config
        if not isinstance(config, BeamConfig):
            raise TypeError(f"BeamBridge needs beam-rl's BeamConfig, got {type(config).__name__}; call "
                            f"beam_rl.megatron.bridge.register_bridge() before AutoBridge.from_hf_pretrained")
        beam = BeamModelProvider(config).transformer_config_kwargs()
        provider = BeamBridgeProvider(
            beam=config,
            **beam,
            vocab_size=config.vocab_size,
            should_pad_vocab=False,  # Beam's checkpoint rows are the vocabulary
            seq_length=config.max_position_embeddings,
            # Megatron-Bridge reads tying from the config: GPTModelProvider's default (True) would drop lm_head.
            share_embeddings_and_output_weights=False,
            # SkyRL computes log-probs from this rank's vocabulary shard over the TP group
            # (`from_parallel_logits_to_logprobs`): whole rows on every rank would count each
            # token TP times.
            parallel_output=True,
            position_embedding_type="none",
            mtp_num_layers=None,
        )
        # GPTModelProvider changes some megatron-core defaults (attention_softmax_in_fp32, ...): restore
        # them, so that the model's config is BeamModelProvider's until the trainer sets its fields.
        for f in dataclasses.fields(CoreTransformerConfig):
            if f.name not in beam and f.default is not dataclasses.MISSING and getattr(provider, f.name) != f.default:
                setattr(provider, f.name, f.default)
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        return mapping_registry(getattr(self, "_num_experts", None))

    def build_conversion_tasks(self, hf_pretrained, megatron_model):
        """Megatron-Bridge's tasks (with the expert count that EP naming needs); raises KeyError if a
        tensor of this rank got none."""
        self._num_experts = hf_pretrained.config.num_experts
        tasks = super().build_conversion_tasks(hf_pretrained, megatron_model)
        models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
        covered = {t.param_name for t in tasks if t is not None and t.megatron_module is not None}
        own = {self._unwrap_name(n) for m in models for n, _ in itertools.chain(m.named_parameters(), persistent_buffers(m))
               if "_extra_state" not in n and not self._is_adapter_param_name(n)}
        if own - covered or None in tasks:
            raise KeyError(f"Megatron tensors without an HF tensor: {sorted(own - covered)[:5]} "
                           f"({tasks.count(None)} without a mapping); add the row to beam_rl.model.names.MAPPINGS "
                           f"or check the checkpoint")
        return tasks


def register() -> None:
    """transformers' Auto classes and `transformers.BeamForCausalLM` (Megatron-Bridge looks the
    architecture up there); idempotent."""
    register_auto()
    # transformers.processing_utils re-executes transformers/__init__ into a new module object, so
    # Megatron-Bridge's `transformers` may not be sys.modules' one: set the class on both.
    for module in {id(m): m for m in (auto_bridge.transformers, sys.modules["transformers"])}.values():
        current = getattr(module, ARCH, None)
        if current is None:
            setattr(module, ARCH, BeamForCausalLM)
        elif current is not BeamForCausalLM:
            # A transformers with its own Beam: route its class to this bridge too.
            register_bridge_implementation(source=current, target=GPTModel, bridge_class=BeamBridge)


register()

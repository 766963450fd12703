"""Beam's MoE block for vLLM: FP32 router + grouped sigmoid top-k (ours, exact) feeding the
experts; and the dense SwiGLU MLP.

Routing is computed by `beam_rl.routing` (the reference; identical ids by construction).
- On GPU the experts are vLLM's FusedMoE (Triton grouped GEMMs, TP/EP sharding, LoRA), which
  takes our routing as a custom routing function; vLLM's router base class publishes the ids to
  its routed-experts capturer (R3) exactly as for its own models. Its expert GEMMs and weighted
  combine round differently from the reference (a documented source of difference).
- On CPU the experts are `CPUExperts`: the reference's arithmetic (BF16 GEMMs per expert, FP32
  SwiGLU, FP32 combine), bit-identical to `beam_rl.modeling`. vLLM's CPU fused-MoE kernel rounds
  differently and pre-packs its weights only at first load, which breaks in-place weight reload.
`RoutingRecorder` captures ids for runners without vLLM's capturer (vLLM's CPU runner).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.platforms import current_platform

from beam_rl import numerics
from beam_rl.config import BeamConfig
from beam_rl.rollout import ops
from beam_rl.rollout.capture import RoutingRecorder
from beam_rl.rollout.compat import make_fused_moe


class BeamDenseMLP(nn.Module):
    def __init__(self, config: BeamConfig, quant_config=None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(ops.silu_and_mul(gate_up))
        return out


class BeamRouterGate(nn.Module):
    """`mlp.gate.weight` [E, hidden] and `mlp.gate.e_score_correction_bias` [E], both FP32,
    replicated on every rank (vLLM builds the model under a BF16 default dtype: explicit FP32).
    The router GEMM itself runs in `ops.route`, fused with the top-k on CUDA."""

    def __init__(self, config: BeamConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False)


class CPUExperts(nn.Module):
    """Routed experts computed like the reference: w13 [E, 2F, hidden] (gate rows, then up rows),
    w2 [E, hidden, F], loaded from the released per-expert names. Loading goes through each
    parameter's `weight_loader`, so vLLM's in-place `reload_weights` can track and replay it."""

    def __init__(self, config: BeamConfig):
        super().__init__()
        E, F_, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.ffn = F_
        self.w13_weight = nn.Parameter(torch.empty(E, 2 * F_, H), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(E, H, F_), requires_grad=False)
        self.w13_weight.weight_loader = self._load_expert
        self.w2_weight.weight_loader = self._load_expert

    def _load_expert(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int, proj: str) -> None:
        rows = {"gate_proj": slice(0, self.ffn), "up_proj": slice(self.ffn, 2 * self.ffn), "down_proj": slice(None)}
        param.data[expert_id, rows[proj]].copy_(loaded_weight)

    def load_weights(self, weights):
        """Names relative to `mlp.experts`: `{e}.{gate,up,down}_proj.weight`."""
        loaded = set()
        for name, tensor in weights:
            expert, proj, _ = name.split(".", 2)
            if proj not in ("gate_proj", "up_proj", "down_proj"):
                raise KeyError(f"unexpected expert tensor mlp.experts.{name}")
            param_name = "w2_weight" if proj == "down_proj" else "w13_weight"
            param = getattr(self, param_name)  # looked up each time: reloading swaps the objects
            param.weight_loader(param, tensor, int(expert), proj)
            loaded.add(param_name)
        return loaded

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _cpu_experts(x, self.w13_weight, self.w2_weight, weights, ids)


@torch.library.custom_op("beam_rl::cpu_experts", mutates_args=())
def _cpu_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The reference's expert loop (a custom op: its data-dependent loop stays out of torch.compile)."""
    ffn = w2.shape[2]
    expert_out = x.new_zeros(x.shape[0], ids.shape[1], x.shape[1])  # (T, top_k, hidden)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[token]
        gate = F.linear(xe, w13[e, :ffn])
        up = F.linear(xe, w13[e, ffn:])
        expert_out[token, slot] = F.linear(numerics.silu_and_mul(gate, up), w2[e])
    return numerics.moe_combine(expert_out, weights)


@_cpu_experts.register_fake
def _(x, w13, w2, weights, ids):
    return torch.empty_like(x)


class BeamMoE(nn.Module):
    def __init__(self, config: BeamConfig, layer_idx: int, recorder: RoutingRecorder | None,
                 quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.recorder = recorder
        self.gate = BeamRouterGate(config)
        self.use_fused_moe = not current_platform.is_cpu()
        if self.use_fused_moe:
            self.experts = make_fused_moe(
                num_experts=config.num_experts,
                top_k=config.num_experts_per_tok,
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size,
                renormalize=config.norm_topk_prob,
                quant_config=quant_config,
                custom_routing_function=self._route,
                reduce_results=True,
                prefix=f"{prefix}.experts",
            )
        else:
            self.experts = CPUExperts(config)

    def _route(self, hidden_states, gating_output=None, topk=None, renormalize=None):
        """vLLM's custom-routing hook: (FP32 weights incl. routed scaling, int32 expert ids).
        Routing is computed from the hidden states by `ops.route` (router GEMM + top-k fused on
        CUDA); the config fixes top_k and renormalisation."""
        weights, ids = ops.route(hidden_states, self.gate.weight, self.gate.e_score_correction_bias, self.config)
        if self.recorder is not None:
            self.recorder.record(self.layer_idx, ids)
        return weights, ids.to(torch.int32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_fused_moe:
            # vLLM hands `router_logits` to our custom routing function untouched (TP, no DP/EP
            # gather); the fused router kernel computes the FP32 logits itself, so pass x.
            return self.experts(hidden_states=x, router_logits=x)
        return self.experts(x, *self._route(x))

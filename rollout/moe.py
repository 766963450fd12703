"""Beam's MoE block for vLLM: FP32 router + grouped sigmoid top-k (ours, exact) feeding the
experts; and the dense SwiGLU MLP.

Routing is computed by `beam_rl.model.routing` (the reference; identical ids by construction).
- On GPU the experts are vLLM's FusedMoE (Triton grouped GEMMs, TP/EP sharding, LoRA), which
  takes our routing as a custom routing function; vLLM's router base class publishes the ids to
  its routed-experts capturer (R3) exactly as for its own models. Its expert GEMMs and weighted
  combine round differently from the reference (a documented source of difference).
- On CPU the experts are `ReferenceExperts`: the reference's arithmetic (BF16 GEMMs per expert, FP32
  SwiGLU, FP32 combine), bit-identical to `beam_rl.model.modeling`. vLLM's CPU fused-MoE kernel rounds
  differently and pre-packs its weights only at first load, which breaks in-place weight reload.
  With `enable_expert_parallel=True` each rank holds only its contiguous slice of the experts
  (FusedMoE's linear placement) and the FP32 partial combines are all-reduced before the one
  rounding (see `ReferenceExperts`). A GPU engine serving an MXFP8 trainer uses them too.
`RoutingRecorder` captures ids for runners without vLLM's capturer (vLLM's CPU runner).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.platforms import current_platform

from beam_rl.model import numerics
from beam_rl.model.config import BeamConfig
from beam_rl.rollout import ops
from beam_rl.rollout.capture import RoutingRecorder
from beam_rl.rollout.compat import make_fused_moe
from beam_rl.rollout.linear import linear_precision, lora_enabled, mxfp8_inputs, reduce_in_fp32, round_like


def expert_parallel_layout() -> tuple[int, int]:
    """(ep_size, ep_rank) of this rank, derived as vLLM's FusedMoE does
    (`FusedMoEParallelConfig.make`, identical in vLLM 0.26 and 0.32): expert parallelism is on when
    the engine's parallel config enables it and there is more than one TP x PCP x DP rank; the EP
    rank is then the TP rank flattened across DP and PCP, and the EP group (`get_ep_group()`)
    spans exactly those ranks. (1, 0) without expert parallelism."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_dp_group, get_pcp_group, get_tensor_model_parallel_rank

    pc = get_current_vllm_config().parallel_config
    tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
    pcp = getattr(pc, "prefill_context_parallel_size", 1)
    if not (pc.enable_expert_parallel and tp * dp * pcp > 1):
        return 1, 0
    tp_rank = get_tensor_model_parallel_rank() if tp > 1 else 0
    dp_rank = get_dp_group().rank_in_group if dp > 1 else 0
    pcp_rank = get_pcp_group().rank_in_group if pcp > 1 else 0
    return dp * pcp * tp, dp_rank * pcp * tp + pcp_rank * tp + tp_rank


def _check_reference_expert_parallel(ep_rank: int) -> None:
    """What `ReferenceExperts` supports with EP: TP x EP only (every rank sees the same tokens, so an
    all-reduce of the partial sums suffices; DP / PCP would need FusedMoE's token dispatch), linear
    placement, no EPLB."""
    from vllm.config import get_current_vllm_config

    pc = get_current_vllm_config().parallel_config
    if pc.data_parallel_size * getattr(pc, "prefill_context_parallel_size", 1) > 1:
        raise NotImplementedError("beam_rl.rollout on CPU: expert parallelism needs data_parallel_size=1 and "
                                  "prefill_context_parallel_size=1 (experts are sharded over the TP ranks only)")
    if getattr(pc, "enable_eplb", False):
        raise NotImplementedError("beam_rl.rollout on CPU: expert parallelism without EPLB only")
    if getattr(pc, "expert_placement_strategy", "linear") != "linear":
        raise NotImplementedError(f"beam_rl.rollout on CPU: expert_placement_strategy='linear' only, "
                                  f"not {pc.expert_placement_strategy!r}")
    from vllm.distributed import get_ep_group

    if get_ep_group().rank_in_group != ep_rank:  # the all-reduce group must be the one we sharded over
        raise RuntimeError(f"EP group rank {get_ep_group().rank_in_group} != FusedMoE's EP rank {ep_rank}")


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
        reduce_in_fp32(self.down_proj, lora_enabled=lora_enabled())
        self.mxfp8 = linear_precision(config) == "mxfp8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(mxfp8_inputs(x, self.mxfp8))
        out, _ = self.down_proj(mxfp8_inputs(ops.silu_and_mul(gate_up), self.mxfp8))
        return round_like(out, x)


class BeamRouterGate(nn.Module):
    """`mlp.gate.weight` [E, hidden] and `mlp.gate.e_score_correction_bias` [E], both FP32,
    replicated on every rank (vLLM builds the model under a BF16 default dtype: explicit FP32).
    The router GEMM itself runs in `ops.route`, fused with the top-k on CUDA."""

    def __init__(self, config: BeamConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False)


class ReferenceExperts(nn.Module):
    """Routed experts computed like the reference: w13 [E_local, 2F, hidden] (gate rows, then up
    rows), w2 [E_local, hidden, F], loaded from the released per-expert names. Loading goes through
    each parameter's `weight_loader`, so vLLM's in-place `reload_weights` can track and replay it.

    The experts of vLLM's CPU runner, and of a GPU engine serving an MXFP8 trainer (FusedMoE's
    Triton kernels cannot quantise the SwiGLU output between their two GEMMs). On the GPU without
    expert parallelism they run as two grouped GEMMs over the rows sorted by expert
    (`_grouped_expert_outputs`: no host sync, so CUDA graphs capture them); the per-expert loop of
    the CPU and of expert parallelism reads expert ids on the host, so a GPU engine with EP runs eager.

    Numerics: each expert's GEMMs in the model dtype (BF16 outputs, FP32 SwiGLU), then
    sum_k weight[t, k] * expert_out[t, k] with FP32 products and FP32 sums, rounded once to the
    model dtype (`numerics.moe_combine`).
    - Without expert parallelism (`ep_size == 1`) every rank holds all E experts and computes
      exactly the reference's arithmetic (`beam_rl::reference_experts`): bit-identical to
      `beam_rl.model.modeling`, as before.
    - With `enable_expert_parallel=True` (TP x EP; see `expert_parallel_layout`) rank r holds the
      contiguous experts [r * E / ep_size, (r + 1) * E / ep_size) (FusedMoE's linear placement;
      any remainder goes to the first ranks), the weight loader skips the others, and forward
      computes the FP32 weighted sum of its local experts' outputs for every token
      (`beam_rl::reference_experts_partial`; 0 where a token's experts are elsewhere), all-reduces it in
      FP32 over the EP group and rounds once. The per-expert outputs and products are the
      reference's; only the FP32 sum over k is reassociated (local partial sums, then the sum
      across ranks), a last-bit FP32 difference before the single rounding.
    - Serving an MXFP8 trainer (`linear_precision(config) == "mxfp8"`), both GEMMs' inputs (the
      token's hidden state, the SwiGLU output) are quantised as the trainer's expert linears
      quantise them (`beam_rl.model.mxfp8`).
    """

    def __init__(self, config: BeamConfig):
        super().__init__()
        self.mxfp8 = linear_precision(config) == "mxfp8"
        E, F_, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.ffn = F_
        self.num_experts = E
        self.ep_size, self.ep_rank = expert_parallel_layout()
        if self.ep_size > 1:
            _check_reference_expert_parallel(self.ep_rank)
            if self.ep_size > E:
                raise ValueError(f"expert parallel size {self.ep_size} exceeds the {E} experts")
            from vllm.config import get_current_vllm_config

            if not current_platform.is_cpu() and not get_current_vllm_config().model_config.enforce_eager:
                raise ValueError("MXFP8 serving with expert parallelism on a GPU computes the experts in a per-expert loop that "
                                 "reads expert ids on the host, which CUDA graphs cannot capture: set enforce_eager=True")
        base, rem = divmod(E, self.ep_size)
        self.num_local_experts = base + (1 if self.ep_rank < rem else 0)
        self.first_expert = self.ep_rank * base + min(self.ep_rank, rem)
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * F_, H), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, H, F_), requires_grad=False)
        self.w13_weight.weight_loader = self._load_expert
        self.w2_weight.weight_loader = self._load_expert

    def _load_expert(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int, proj: str) -> None:
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another EP rank's expert (copies nothing, so layerwise reload counts nothing)
        rows = {"gate_proj": slice(0, self.ffn), "up_proj": slice(self.ffn, 2 * self.ffn), "down_proj": slice(None)}
        param.data[local, rows[proj]].copy_(loaded_weight)

    def load_weights(self, weights):
        """Names relative to `mlp.experts`: `{e}.{gate,up,down}_proj.weight` (all E experts; each
        rank keeps its own)."""
        loaded = set()
        for name, tensor in weights:
            expert, proj, _ = name.split(".", 2)
            if proj not in ("gate_proj", "up_proj", "down_proj"):
                raise KeyError(f"unexpected expert tensor mlp.experts.{name}")
            if not 0 <= int(expert) < self.num_experts:
                raise KeyError(f"expert {expert} out of range (E={self.num_experts}): mlp.experts.{name}")
            param_name = "w2_weight" if proj == "down_proj" else "w13_weight"
            param = getattr(self, param_name)  # looked up each time: reloading swaps the objects
            param.weight_loader(param, tensor, int(expert), proj)
            loaded.add(param_name)
        return loaded

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return _reference_experts(x, self.w13_weight, self.w2_weight, weights, ids, self.mxfp8)
        from vllm.distributed import get_ep_group

        partial = _reference_experts_partial(x, self.w13_weight, self.w2_weight, weights, ids, self.first_expert, self.mxfp8)
        return get_ep_group().all_reduce(partial).to(x.dtype)


def _expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, first: int,
                    mxfp8: bool) -> torch.Tensor:
    """(T, top_k, hidden) outputs of the experts in [first, first + w13.shape[0]) in x's dtype, 0
    in the slots routed elsewhere: the reference's per-expert loop (MXFP8 inputs when `mxfp8`)."""
    ffn = w2.shape[2]
    expert_out = x.new_zeros(x.shape[0], ids.shape[1], x.shape[1])  # (T, top_k, hidden)
    x = mxfp8_inputs(x, mxfp8)  # per token along hidden: the same blocks whichever expert reads it
    for e in ids.unique().tolist():
        local = e - first
        if not 0 <= local < w13.shape[0]:
            continue
        token, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[token]
        gate = F.linear(xe, w13[local, :ffn])
        up = F.linear(xe, w13[local, ffn:])
        expert_out[token, slot] = F.linear(mxfp8_inputs(numerics.silu_and_mul(gate, up), mxfp8), w2[local])
    return expert_out


def _grouped_expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                            mxfp8: bool) -> torch.Tensor:
    """`_expert_outputs` of all E experts as two grouped GEMMs (`torch._grouped_mm`) over the
    (token, slot) rows sorted by expert: every row a BF16 GEMM with FP32 accumulation rounded once,
    as the loop's `F.linear` (the accumulation order is the library's), with no host sync (CUDA
    graphs capture it)."""
    T, k = ids.shape
    ffn = w2.shape[2]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows = mxfp8_inputs(x, mxfp8)[order // k]
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)
    h = mxfp8_inputs(numerics.silu_and_mul(gate_up[:, :ffn], gate_up[:, ffn:]), mxfp8)
    out = torch.empty_like(rows)
    out[order] = torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)
    return out.view(T, k, x.shape[1])


@torch.library.custom_op("beam_rl::reference_experts", mutates_args=())
def _reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       mxfp8: bool) -> torch.Tensor:
    """The reference's expert arithmetic and combine (a custom op: its data-dependent shapes stay out
    of torch.compile): the per-expert loop on CPU, grouped GEMMs on the GPU."""
    outputs = _grouped_expert_outputs(x, w13, w2, ids, mxfp8) if x.is_cuda else _expert_outputs(x, w13, w2, ids, 0, mxfp8)
    return numerics.moe_combine(outputs, weights)


@_reference_experts.register_fake
def _(x, w13, w2, weights, ids, mxfp8):
    return torch.empty_like(x)


@torch.library.custom_op("beam_rl::reference_experts_partial", mutates_args=())
def _reference_experts_partial(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                               ids: torch.Tensor, first_expert: int, mxfp8: bool) -> torch.Tensor:
    """This EP rank's share of the combine, NOT rounded: `numerics.moe_combine_fp32` over the local
    experts (non-local slots are 0 and add exactly nothing)."""
    return numerics.moe_combine_fp32(_expert_outputs(x, w13, w2, ids, first_expert, mxfp8), weights)


@_reference_experts_partial.register_fake
def _(x, w13, w2, weights, ids, first_expert, mxfp8):
    return x.new_empty(x.shape, dtype=torch.float32)


class BeamMoE(nn.Module):
    def __init__(self, config: BeamConfig, layer_idx: int, recorder: RoutingRecorder | None,
                 quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.recorder = recorder
        self.gate = BeamRouterGate(config)
        # FusedMoE cannot quantise between its two GEMMs: an MXFP8-serving engine computes the experts
        # as the reference does, on the GPU too
        self.use_fused_moe = not current_platform.is_cpu() and linear_precision(config) == "bf16"
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
            self.experts = ReferenceExperts(config)

    def _route(self, hidden_states, gating_output=None, topk=None, renormalize=None):
        """vLLM's custom-routing hook: (FP32 weights incl. routed scaling, int32 expert ids).
        Routing is computed from the hidden states by `ops.route` (router GEMM + top-k fused on
        CUDA); the config fixes top_k and renormalisation."""
        weights, ids = ops.route(hidden_states, self.gate.weight, self.gate.e_score_correction_bias, self.config)
        if self.recorder is not None:
            self.recorder.record(self.layer_idx, ids)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_fused_moe:
            # vLLM hands `router_logits` to our custom routing function untouched (TP, no DP/EP
            # gather); the fused router kernel computes the FP32 logits itself, so pass x.
            return self.experts(hidden_states=x, router_logits=x)
        return self.experts(x, *self._route(x))

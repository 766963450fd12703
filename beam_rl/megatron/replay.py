"""R3 (Rollout Routing Replay) on Megatron-Core's `RouterReplay`.

Expert ids come batch-first, `[batch, tokens, moe_layers, top_k]` (the reference model's
`.routed_experts`; rollouts via `beam_rl.r3.RolloutBatch.to_trainer`), any integer dtype.
Megatron's routers see tokens sequence-major, `[s * b]` (hidden states are [s, b, h]), and with
sequence parallelism only this TP rank's slice of s; `to_router_order` produces exactly that, per
MoE layer of this pipeline stage (each router's global layer number picks its row). The replayed
ids are used for the forward and, with `replay_backward`, for the activation recompute in the
backward pass; gate weights are recomputed from this model's own router scores (Megatron gathers
its scores at the replayed ids), so the router keeps its gradient.

Checks, each naming the mismatching field: rank 4, batch, tokens, moe_layers, top_k, integer
dtype, ids in [0, num_experts), no expert repeated within a token. Nothing is truncated or
broadcast.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from beam_rl.model.config import BeamConfig


class ReplayError(ValueError):
    """Replayed expert ids do not fit the model or batch; the message names the field."""


_ROUTERS: "weakref.WeakKeyDictionary[torch.nn.Module, list[TopKRouter]]" = weakref.WeakKeyDictionary()


def model_routers(model: torch.nn.Module) -> list[TopKRouter]:
    """This stage's routers in layer order (found once per model: a walk over beam-mini's ~8500
    modules costs milliseconds of host time, and every replayed micro-batch asks several times)."""
    if model not in _ROUTERS:
        _ROUTERS[model] = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return _ROUTERS[model]


def validate_routed_experts(ids: torch.Tensor, config: BeamConfig, batch: int, tokens: int) -> torch.Tensor:
    """Check [batch, tokens, moe_layers, top_k] ids against the config and batch; returns int64."""
    if isinstance(ids, np.ndarray):
        ids = torch.from_numpy(ids)
    if ids.dim() != 4:
        raise ReplayError(f"routed_experts must be [batch, tokens, moe_layers, top_k]; got rank {ids.dim()} shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ReplayError(f"routed_experts must hold integer expert ids; got dtype {ids.dtype}")
    expected = {"batch": batch, "tokens": tokens, "moe_layers": config.num_moe_layers, "top_k": config.num_experts_per_tok}
    for (field, want), got in zip(expected.items(), ids.shape):
        if got != want:
            raise ReplayError(f"routed_experts {field} = {got}, expected {want} (shape {tuple(ids.shape)}; no truncation or broadcasting)")
    ids = ids.long()
    if ids.numel():
        srt = ids.sort(dim=-1).values
        repeats = (srt[..., 1:] == srt[..., :-1]).any(dim=-1)
        lo, hi, repeated = torch.stack([srt[..., 0].min(), srt[..., -1].max(), repeats.any().long()]).tolist()  # one host sync
        if lo < 0 or hi >= config.num_experts:
            raise ReplayError(f"routed_experts ids must lie in [0, {config.num_experts}); got [{lo}, {hi}]")
        if repeated:
            dup = repeats.nonzero()
            b, t, layer = (int(v) for v in dup[0])
            raise ReplayError(f"routed_experts repeats an expert within a token (batch {b}, token {t}, moe layer {layer})")
    return ids


def to_router_order(ids: torch.Tensor, sp_rank: int = 0, sp_size: int = 1) -> list[torch.Tensor]:
    """[B, T, L, K] -> per MoE layer [(T / sp_size) * B, K], sequence-major, this SP rank's slice."""
    B, T, L, K = ids.shape
    if T % sp_size:
        raise ReplayError(f"tokens = {T} is not divisible by the sequence-parallel size {sp_size}; pad the batch")
    chunk = T // sp_size
    ids = ids[:, sp_rank * chunk : (sp_rank + 1) * chunk]  # (B, T/sp, L, K)
    per_layer = ids.permute(2, 1, 0, 3).reshape(L, chunk * B, K)  # (L, s*b, K) sequence-major
    return [per_layer[i].contiguous() for i in range(L)]


def _replayers(model):
    routers = model_routers(model)
    if not routers:
        return []
    for r in routers:
        if r.router_replay is None:
            raise ReplayError("the model was built without RouterReplay; build it with BeamModelProvider(routing_replay=True)")
        if r.config.moe_router_fusion:
            raise ReplayError("moe_router_fusion=True skips RouterReplay; set it to False")
    return routers


def set_replay(model: torch.nn.Module, routed_experts, config: BeamConfig, batch: int, tokens: int) -> None:
    """Queue one micro-batch's ids for this model's routers and switch them to REPLAY_FORWARD."""
    from megatron.core import parallel_state

    ids = validate_routed_experts(torch.as_tensor(routed_experts) if not isinstance(routed_experts, torch.Tensor) else routed_experts, config, batch, tokens)
    routers = _replayers(model)
    sp = bool(routers) and routers[0].config.sequence_parallel
    sp_rank = parallel_state.get_tensor_model_parallel_rank() if sp else 0
    sp_size = parallel_state.get_tensor_model_parallel_world_size() if sp else 1
    per_layer = to_router_order(ids, sp_rank, sp_size)
    moe_ids = config.moe_layer_ids
    for router in routers:
        layer = router.layer_number - 1  # global 0-based
        if layer not in moe_ids:
            raise ReplayError(f"router at layer {layer} is not a MoE layer of the config (mlp_layer_types)")
        router.router_replay.set_target_indices(per_layer[moe_ids.index(layer)].to(router.weight.device))
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def replay_backward(model: torch.nn.Module) -> None:
    """Before backward with activation recompute: recomputed forwards pop the queued ids in order."""
    for router in _replayers(model):
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def record(model: torch.nn.Module) -> None:
    """Let the routers choose and remember their choice (read with `recorded_experts`)."""
    for router in _replayers(model):
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)


def recorded_experts(model: torch.nn.Module, batch: int, tokens: int) -> torch.Tensor:
    """The ids recorded by the last forward, as [batch, tokens, moe_layers of this stage, top_k]."""
    per_layer = [r.router_replay.get_recorded_indices() for r in _replayers(model)]
    if any(p is None for p in per_layer):
        raise ReplayError("nothing recorded: call record(model) before the forward")
    stacked = torch.stack(per_layer)  # (L, s*b, K)
    return stacked.view(len(per_layer), tokens, batch, -1).permute(2, 1, 0, 3)


def clear_replay(model: torch.nn.Module) -> None:
    """Drop queued / recorded ids and return the routers to normal routing."""
    for router in model_routers(model):
        if router.router_replay is None:
            continue
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()

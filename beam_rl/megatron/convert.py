"""HF <-> Megatron weights for Beam: a declarative name table, TP/EP shard functions, loading and
a streaming HF-named export for weight sync.

Names come from `beam_rl.model.weights.checkpoint_tensors` (the released HF names); each row of
`beam_rl.model.names.MAPPINGS` maps HF name pattern(s) to one Megatron parameter with `{layer}` /
`{expert}` wildcards and says how it is sharded:

- `replicated`: norms, Q/K norm weights, router weight and expert bias (FP32);
- `column`: split dim 0 over TP (q/k/v/gate projections, gate bias per head, vocab rows of the
  embedding and the LM head);
- `row`: split dim 1 over TP (o_proj, down projections);
- `glu`: two HF tensors (gate_proj, up_proj) -> Megatron's fused fc1; TP rank r holds
  [gate_r; up_r] (Megatron's stride-2 layout).

Experts are split over EP: global expert e lives on EP rank e // (E / ep) as local expert
e % (E / ep). Within a rank, expert weights are sharded by the expert-TP rank / size (Megatron's
`expert_tensor_parallel_size`, ETP) with the same glu / row rules, while attention, dense MLP and
embeddings follow TP: with ETP = 1 (`BeamModelProvider`'s default) every rank holds whole experts.
`Layout.from_parallel_state()` reads all of this from Megatron's process groups. Layers are local
to a pipeline stage: HF layer = `layer_offset` + Megatron layer. Conversion copies bits: HF -> Megatron -> HF is
exact (router tensors stay FP32).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

import torch

from beam_rl.model.config import BeamConfig
from beam_rl.model.names import mapping_for
from beam_rl.model.weights import checkpoint_tensors


# -- shard functions: pure tensor ops ------------------------------------------------------------
def shard(tensors: tuple[torch.Tensor, ...], kind: str, rank: int, size: int) -> torch.Tensor:
    """The rank-th of `size` shards of the Megatron tensor built from the HF tensor(s)."""
    if kind == "replicated":
        return tensors[0]
    if kind == "glu":
        gate, up = tensors
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    dim = {"column": 0, "row": 1}[kind]
    full = tensors[0]
    if full.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {full.shape[dim]} is not divisible by the parallel size {size}")
    return full.chunk(size, dim=dim)[rank]


def unshard(shards: list[torch.Tensor], kind: str) -> tuple[torch.Tensor, ...]:
    """Inverse of `shard`: the HF tensor(s) from all ranks' shards (in rank order)."""
    if kind == "replicated":
        return (shards[0],)
    if kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    return (torch.cat(shards, dim={"column": 0, "row": 1}[kind]),)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: TP / EP / expert-TP rank and size, and the pipeline stage's layers."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    layer_offset: int = 0
    num_layers: int | None = None  # layers on this stage (None: all)
    etp_rank: int | None = None
    etp_size: int | None = None
    """Expert TP rank / size. None: the TP rank / size, as Megatron does when
    expert_tensor_parallel_size is unset; `load_hf_into_model` / `export_hf` resolve None against the
    model (ETP = 1 there: whole experts, rank 0). `from_parallel_state()` fills them in."""

    def __post_init__(self):
        if (self.etp_size is None) != (self.etp_rank is None):
            raise ValueError("Layout: give both etp_rank and etp_size, or neither (experts follow TP)")
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"), (self.ep_rank, self.ep_size, "ep"),
                                 (self.etp_rank or 0, self.etp_size or 1, "etp")):
            if not 0 <= rank < size:
                raise ValueError(f"Layout: {what}_rank={rank} outside {what}_size={size}")

    @classmethod
    def from_parallel_state(cls, layer_offset: int = 0, num_layers: int | None = None) -> Layout:
        """This rank's layout from Megatron's initialised model-parallel state."""
        from megatron.core import parallel_state as ps

        return cls(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                   ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                   etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
                   layer_offset=layer_offset, num_layers=num_layers)

    @property
    def expert_tp(self) -> tuple[int, int]:
        """(rank, size) that expert weights are sharded by."""
        return (self.tp_rank, self.tp_size) if self.etp_size is None else (self.etp_rank, self.etp_size)

    def for_model(self, model: torch.nn.Module) -> Layout:
        """This layout with the expert TP checked against (or, when None, taken from) the model's
        `expert_tensor_parallel_size`; only ETP = 1 or ETP = TP can be taken without a rank."""
        config = getattr(getattr(model, "module", model), "config", None)
        etp = getattr(config, "expert_tensor_parallel_size", None)
        if etp is None or etp == self.expert_tp[1]:
            return self
        if self.etp_size is None and etp == 1:
            return replace(self, etp_rank=0, etp_size=1)
        raise ValueError(
            f"the model has expert_tensor_parallel_size={etp} but the Layout shards experts {self.expert_tp[1]} ways; "
            f"use Layout.from_parallel_state() or pass etp_rank / etp_size"
        )

    def local_layer(self, layer: int) -> int | None:
        local = layer - self.layer_offset
        if local < 0 or (self.num_layers is not None and local >= self.num_layers):
            return None
        return local

    def local_expert(self, expert: int, num_experts: int) -> int | None:
        per_rank = num_experts // self.ep_size
        return expert % per_rank if expert // per_rank == self.ep_rank else None


def hf_to_megatron(hf: dict[str, torch.Tensor], config: BeamConfig, layout: Layout = Layout()) -> dict[str, torch.Tensor]:
    """This rank's Megatron state (names of `BeamGPTModel.state_dict()`) from full HF tensors."""
    specs = checkpoint_tensors(config)
    missing = [n for n in specs if n not in hf]
    extra = [n for n in hf if n not in specs]
    if missing or extra:
        raise KeyError(f"HF tensors do not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    out: dict[str, torch.Tensor] = {}
    for name in specs:
        m, idx = mapping_for(name)
        if name != m.hf[0].format(**idx):
            continue  # second tensor of a GLU pair, handled with the first
        local = dict(idx)
        if "layer" in idx:
            local["layer"] = layout.local_layer(idx["layer"])
            if local["layer"] is None:
                continue
        rank, size = layout.tp_rank, layout.tp_size
        if "expert" in idx:
            local["expert"] = layout.local_expert(idx["expert"], config.num_experts)
            if local["expert"] is None:
                continue
            rank, size = layout.expert_tp
        out[m.megatron.format(**local)] = shard(tuple(hf[p.format(**idx)] for p in m.hf), m.shard, rank, size)
    return out


def load_hf_into_model(model: torch.nn.Module, hf: dict[str, torch.Tensor], config: BeamConfig, layout: Layout = Layout()) -> None:
    """Copy HF tensors into a Megatron Beam model (unwrapped or Float16Module); strict on names and
    shapes, keeps each parameter's dtype (router tensors FP32)."""
    inner = getattr(model, "module", model)
    state = hf_to_megatron(hf, config, layout.for_model(inner))
    own = {k: v for k, v in inner.state_dict().items() if not k.endswith("_extra_state") and ".lora." not in k}
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise KeyError(f"Megatron state mismatch: missing {missing[:3]}, unexpected {extra[:3]} (pipeline layout?)")
    with torch.no_grad():
        for name, t in state.items():
            if own[name].shape != t.shape:
                raise ValueError(f"{name}: Megatron shape {tuple(own[name].shape)} != converted {tuple(t.shape)}")
            own[name].copy_(t.to(own[name].dtype))


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    if group is None or torch.distributed.get_world_size(group) == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return parts


def export_hf(model: torch.nn.Module, config: BeamConfig, layout: Layout = Layout(), *, tp_group=None, ep_group=None,
              etp_group=None, transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (HF name, full tensor) from a Megatron Beam model, in checkpoint order, one tensor
    at a time (weight sync). TP / EP / expert-TP shards are all-gathered over `tp_group` /
    `ep_group` / `etp_group` (Megatron's get_expert_tensor_parallel_group(); not needed with
    ETP = 1, and `tp_group` serves when ETP = TP); every rank of those groups must iterate
    together. Layers of other pipeline stages are skipped. `transform(megatron name, local shard)`
    is applied to each rank's shard before the gather (what that rank's forward computes with)."""
    inner = getattr(model, "module", model)
    layout = layout.for_model(inner)
    etp_size = layout.expert_tp[1]
    if etp_size == 1:
        etp_group = None
    elif etp_group is None:
        if layout.etp_size is not None and etp_size != layout.tp_size:
            raise ValueError(f"export_hf: expert TP {etp_size} != TP {layout.tp_size}; pass etp_group")
        etp_group = tp_group
    own = dict(inner.named_parameters())
    own.update(inner.named_buffers())
    per_rank = config.num_experts // layout.ep_size
    done: set[str] = set()
    for name in checkpoint_tensors(config):
        if name in done:
            continue
        m, idx = mapping_for(name)
        local = dict(idx)
        if "layer" in idx:
            local["layer"] = layout.local_layer(idx["layer"])
            if local["layer"] is None:
                continue
        if "expert" in idx:
            # Every EP rank holds expert e % per_rank; all-gather it and pick the owner's copy.
            local["expert"] = idx["expert"] % per_rank
            t = _local(own, m.megatron.format(**local), transform)
            t = _gather(t, ep_group)[idx["expert"] // per_rank]
            group = etp_group
        else:
            t = _local(own, m.megatron.format(**local), transform)
            group = tp_group
        tensors = unshard(_gather(t, group), m.shard) if m.shard != "replicated" else (t,)
        for pattern, tensor in zip(m.hf, tensors):
            hf_name = pattern.format(**idx)
            done.add(hf_name)
            yield hf_name, tensor


def _local(own: dict, name: str, transform) -> torch.Tensor:
    t = own[name].detach()
    return t if transform is None else transform(name, t)


def iter_to_dict(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in items}

"""Packed Q/K/V/output-gate projection: one [q; k; v; gate] weight per tensor-parallel rank, one GEMM.

Rows per rank: its q heads, its kv heads (k, then v), its gate heads (gate has q's width). With
tp_size <= num_kv_heads each rank owns num_kv_heads / tp_size kv heads; with more ranks than kv
heads every kv head is replicated on tp_size / num_kv_heads consecutive ranks (vLLM's convention).
`split_qkv_gate` turns the GEMM output [..., width] back into per-head views without copying.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QKVGateLayout:
    """Head counts of the whole model and the tensor-parallel size; sizes are per rank."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1

    def __post_init__(self):
        if self.num_heads % self.tp_size:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by tp_size={self.tp_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        big, small = max(self.tp_size, self.num_kv_heads), min(self.tp_size, self.num_kv_heads)
        if big % small:
            raise ValueError(f"tp_size={self.tp_size} and num_kv_heads={self.num_kv_heads} must divide one another")

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """Row counts (q, k, v, gate) of one rank's packed weight."""
        q = self.heads_per_rank * self.head_dim
        kv = self.kv_heads_per_rank * self.head_dim
        return q, kv, kv, q

    @property
    def width(self) -> int:
        return sum(self.sizes)

    def kv_heads(self, rank: int) -> range:
        """The kv heads rank `rank` holds."""
        if self.tp_size <= self.num_kv_heads:
            return range(rank * self.kv_heads_per_rank, (rank + 1) * self.kv_heads_per_rank)
        head = rank // (self.tp_size // self.num_kv_heads)
        return range(head, head + 1)


def _rows(w: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    return w[heads.start * head_dim : heads.stop * head_dim]


def pack_qkv_gate(q_w, k_w, v_w, gate_w, layout: QKVGateLayout, rank: int = 0) -> torch.Tensor:
    """Rank `rank`'s packed [q; k; v; gate] weight [width, hidden] from the full (unsharded) weights."""
    d, hidden = layout.head_dim, q_w.shape[1]
    expect = {"q": (q_w, layout.num_heads), "k": (k_w, layout.num_kv_heads), "v": (v_w, layout.num_kv_heads),
              "gate": (gate_w, layout.num_heads)}
    for name, (w, heads) in expect.items():
        if w.shape != (heads * d, hidden):
            raise ValueError(f"{name} weight has shape {tuple(w.shape)}; expected {(heads * d, hidden)}")
    if not 0 <= rank < layout.tp_size:
        raise ValueError(f"rank {rank} is outside tp_size={layout.tp_size}")
    hp = layout.heads_per_rank
    q_heads = range(rank * hp, (rank + 1) * hp)
    kv_heads = layout.kv_heads(rank)
    return torch.cat([_rows(q_w, q_heads, d), _rows(k_w, kv_heads, d), _rows(v_w, kv_heads, d),
                      _rows(gate_w, q_heads, d)], dim=0)


def split_qkv_gate(out: torch.Tensor, layout: QKVGateLayout):
    """Views (q [..., H_r, D], k [..., KV_r, D], v [..., KV_r, D], gate [..., H_r, D]) of a packed GEMM output."""
    if out.shape[-1] != layout.width:
        raise ValueError(f"packed output width {out.shape[-1]} != layout width {layout.width}")
    d = layout.head_dim
    parts = torch.split(out, list(layout.sizes), dim=-1)
    return tuple(p.unflatten(-1, (p.shape[-1] // d, d)) for p in parts)


def unpack_qkv_gate(packed: torch.Tensor, layout: QKVGateLayout):
    """Inverse of `pack_qkv_gate` for one rank: (q_w, k_w, v_w, gate_w) row blocks of that rank."""
    if packed.shape[0] != layout.width:
        raise ValueError(f"packed weight has {packed.shape[0]} rows; layout expects {layout.width}")
    return tuple(torch.split(packed, list(layout.sizes), dim=0))


def unshard_qkv_gate(shards: list[torch.Tensor], layout: QKVGateLayout):
    """Full (q_w, k_w, v_w, gate_w) from every rank's packed weight (replicated kv heads taken once)."""
    if len(shards) != layout.tp_size:
        raise ValueError(f"got {len(shards)} shards for tp_size={layout.tp_size}")
    per_rank = [unpack_qkv_gate(s, layout) for s in shards]
    q = torch.cat([p[0] for p in per_rank])
    gate = torch.cat([p[3] for p in per_rank])
    seen, ks, vs = set(), [], []
    for rank, p in enumerate(per_rank):
        heads = layout.kv_heads(rank)
        if heads.start not in seen:
            seen.add(heads.start)
            ks.append(p[1])
            vs.append(p[2])
    return q, torch.cat(ks), torch.cat(vs), gate

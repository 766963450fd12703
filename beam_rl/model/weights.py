"""Beam's checkpoint tensors as data: every released HF name with its shape and storage dtype.

One table serves the checkpoint loader (missing / extra / wrongly-shaped tensors), the memory
planner (parameter counts come from here, not from a model instance) and the engines' weight
maps. Shapes use symbolic sizes resolved from a `BeamConfig`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from beam_rl.model.config import BeamConfig

# Per-layer tensors under `model.layers.{i}.`; sizes are keys of `_sizes()`.
ATTENTION_TENSORS: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("hidden",),
    "post_attention_layernorm.weight": ("hidden",),
    "pre_feedforward_layernorm.weight": ("hidden",),
    "post_feedforward_layernorm.weight": ("hidden",),
    "self_attn.q_proj.weight": ("q_width", "hidden"),
    "self_attn.k_proj.weight": ("kv_width", "hidden"),
    "self_attn.v_proj.weight": ("kv_width", "hidden"),
    "self_attn.gate_proj.weight": ("q_width", "hidden"),
    "self_attn.gate_bias": ("heads",),
    "self_attn.o_proj.weight": ("hidden", "q_width"),
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
}
DENSE_MLP_TENSORS: dict[str, tuple[str, ...]] = {
    "mlp.gate_proj.weight": ("d_ff", "hidden"),
    "mlp.up_proj.weight": ("d_ff", "hidden"),
    "mlp.down_proj.weight": ("hidden", "d_ff"),
}
ROUTER_TENSORS: dict[str, tuple[str, ...]] = {
    "mlp.gate.weight": ("experts", "hidden"),
    "mlp.gate.e_score_correction_bias": ("experts",),
}
# Per expert under `model.layers.{i}.mlp.experts.{e}.`
EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "gate_proj.weight": ("moe_d_ff", "hidden"),
    "up_proj.weight": ("moe_d_ff", "hidden"),
    "down_proj.weight": ("hidden", "moe_d_ff"),
}
GLOBAL_TENSORS: dict[str, tuple[str, ...]] = {
    "model.embed_tokens.weight": ("vocab", "hidden"),
    "model.norm.weight": ("hidden",),
    "lm_head.weight": ("vocab", "hidden"),
}
# Kept in FP32 whatever the model dtype (router weight, accumulation and logits are FP32).
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # embedding | lm_head | norm | attention | dense_mlp | router | expert
    layer: int | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.name.endswith(FP32_SUFFIXES) else model_dtype


def _sizes(config: BeamConfig) -> dict[str, int]:
    return {
        "hidden": config.hidden_size,
        "q_width": config.num_attention_heads * config.head_dim,
        "kv_width": config.num_key_value_heads * config.head_dim,
        "heads": config.num_attention_heads,
        "head_dim": config.head_dim,
        "d_ff": config.intermediate_size,
        "moe_d_ff": config.moe_intermediate_size,
        "experts": config.num_experts,
        "vocab": config.vocab_size,
    }


def _kind(suffix: str) -> str:
    if "norm" in suffix:
        return "norm"
    return "attention" if suffix.startswith("self_attn.") else "dense_mlp"


def checkpoint_tensors(config: BeamConfig) -> dict[str, TensorSpec]:
    """Every tensor a Beam checkpoint of this config holds, by released HF name, in file order."""
    size = _sizes(config)
    specs: dict[str, TensorSpec] = {}

    def add(name: str, dims: tuple[str, ...], kind: str, layer=None, expert=None) -> None:
        specs[name] = TensorSpec(name, tuple(size[d] for d in dims), kind, layer, expert)

    add("model.embed_tokens.weight", GLOBAL_TENSORS["model.embed_tokens.weight"], "embedding")
    for i, mlp_type in enumerate(config.mlp_layer_types):
        prefix = f"model.layers.{i}."
        for suffix, dims in ATTENTION_TENSORS.items():
            add(prefix + suffix, dims, _kind(suffix), i)
        if mlp_type == "dense":
            for suffix, dims in DENSE_MLP_TENSORS.items():
                add(prefix + suffix, dims, "dense_mlp", i)
            continue
        for suffix, dims in ROUTER_TENSORS.items():
            add(prefix + suffix, dims, "router", i)
        for e in range(config.num_experts):
            for suffix, dims in EXPERT_TENSORS.items():
                add(f"{prefix}mlp.experts.{e}.{suffix}", dims, "expert", i, e)
    add("model.norm.weight", GLOBAL_TENSORS["model.norm.weight"], "norm")
    add("lm_head.weight", GLOBAL_TENSORS["lm_head.weight"], "lm_head")
    return specs


def tensor_checksum(t: torch.Tensor) -> str:
    """16 hex digits fingerprinting a tensor's dtype, shape and raw bytes (`tensor_checksums` of one)."""
    return tensor_checksums([("", t)])[""]


# splitmix64's constants as signed int64 (torch has no uint64 arithmetic); products wrap mod 2**64
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_BATCH_WORDS = 1 << 25
"""Words hashed per batch: bounds the int64 temporaries (~4 x 256 MiB)."""


def tensor_checksums(named, word_sums=None) -> dict[str, str]:
    """{name: fingerprint} of (name, tensor) pairs, computed where each tensor lives (GPU tensors on
    the GPU: no copy to the host), many tensors per kernel launch.

    The fingerprint of a tensor is sha256 (16 hex digits) of its dtype, shape and the sum mod 2**64
    of splitmix64(word_i xor i * golden) over its raw bytes read as 32-bit (else 16-, else 8-bit)
    words. A change of any one word always changes the sum (each word's mix is a bijection); any
    other change escapes it with probability ~2**-64: it fingerprints what a sync received, it is
    not a cryptographic hash. Integer arithmetic only, so the value is the same on every device
    and for every batching.

    `word_sums` computes those sums for a list of (name, words) on one device: `hashed_word_sums`
    (this definition, in int64 PyTorch ops) by default; `beam_rl.kernels.fingerprint` passes its fused
    kernel, which returns the same integers."""
    sums: dict[str, int] = {}
    meta: dict[str, tuple] = {}
    by_device: dict[torch.device, list] = {}
    for name, t in named:
        words = _words(t)
        meta[name] = (t.dtype, tuple(t.shape), words.element_size())
        by_device.setdefault(words.device, []).append((name, words))
    for items in by_device.values():
        sums.update((word_sums or hashed_word_sums)(items))
    return {name: hashlib.sha256(f"{dtype}|{shape}|{w}|{sums[name]:016x}".encode()).hexdigest()[:16]
            for name, (dtype, shape, w) in meta.items()}


def hashed_word_sums(items: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """{name: sum mod 2**64 of splitmix64(word_i xor i * golden)} of (name, words) pairs on one
    device (`words` as `_words` returns them), in batches of at most `_BATCH_WORDS` words."""
    sums = {name: 0 for name, _ in items}
    for batch in _batches(items):
        for name, total in _hash_batch(batch).items():
            sums[name] = (sums[name] + total) % 2**64
    return sums


def _words(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as a flat view of the widest integer words that divide them."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if raw.numel() % size == 0:
            try:
                return raw.view(dtype)
            except RuntimeError:  # storage offset not aligned to the word
                return raw.clone().view(dtype)
    return raw


def _batches(items):
    """Pieces (name, words, offset of the piece in its tensor) grouped into batches of at most
    `_BATCH_WORDS` words."""
    batch, size = [], 0
    for name, words in items:
        for start in range(0, max(words.numel(), 1), _BATCH_WORDS):
            piece = words[start:start + _BATCH_WORDS]
            if batch and size + piece.numel() > _BATCH_WORDS:
                yield batch
                batch, size = [], 0
            batch.append((name, piece, start))
            size += piece.numel()
    if batch:
        yield batch


def _hash_batch(batch) -> dict[str, int]:
    """{name: sum mod 2**64 of the mixed words} over one batch (a name may have several pieces).
    In-place int64 work on two batch-sized buffers; the per-piece sums come from one cumulative
    sum (integer: exact, whatever the order of the additions)."""
    device = batch[0][1].device
    n = sum(piece.numel() for _, piece, _ in batch)
    x = torch.empty(n + 1, dtype=torch.int64, device=device)
    x[0] = 0
    index = torch.empty(n, dtype=torch.int64, device=device)
    torch.arange(n, out=index)
    ends, at = [], 0
    for _, piece, start in batch:
        x[1 + at:1 + at + piece.numel()].copy_(piece)  # sign-extends int32 / int16, zero-extends uint8
        if at != start:
            index[at:at + piece.numel()] -= at - start  # the word's index in its own tensor
        at += piece.numel()
        ends.append(at)
    words = x[1:]
    words ^= index.mul_(_GOLDEN)
    tmp = index  # reused for the shifts
    for shift, factor in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(words, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1  # logical shift: torch's >> is arithmetic
        words ^= tmp
        if factor is not None:
            words *= factor
    x.cumsum_(0)
    bounds = x[torch.tensor([0, *ends], device=device)].tolist()
    totals: dict[str, int] = {}
    for (name, _, _), lo, hi in zip(batch, bounds[:-1], bounds[1:]):
        totals[name] = (totals.get(name, 0) + hi - lo) % 2**64
    return totals

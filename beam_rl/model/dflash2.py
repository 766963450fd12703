"""DFlash2, Beam's block drafter: the plain-PyTorch reference (the oracle of the vLLM drafter and of
drafter training).

One draft step proposes K tokens for a request in one forward pass. Its block has B = 1 + K rows:
row 0 the anchor (the last verified token), rows 1..K `mask_token_id`, at positions a..a+K.

- Context path (once per verified target token, positions < a): the target's residual streams after
  the 0-based layers `target_layer_ids`, concatenated [C, n*H] -> `fc` -> `hidden_norm` -> each draft
  layer's k/v projections, `k_norm` and NeoX RoPE at the token's position (no conv, no input norm).
- Query path (the block), per layer, Qwen3-shaped plus two dynamic block convolutions:
      a = input_layernorm(res);          d = attention_conv.kernel_projection(a)
      res += conv(attn(conv(a, base[0], d[0])), base[1], d[1])
      a = post_attention_layernorm(res); d = mlp_conv.kernel_projection(a)
      res += conv(mlp(conv(a, base[0], d[0])), base[1], d[1])
  then `norm`, the target's LM head and its FP32 soft cap. Attention is non-causal inside the block
  and sliding-window over the context: row j sees context positions c with a+j-(w-1) <= c < a.
- Selector and walk: per mask row the top `selector_top_k` candidates of the unary (soft-capped)
  logits; the edge score of candidate i after predecessor token t is
      E = u[i] + <A[t] * z, B[c_i]>,   z = hidden_projection(h)
  (A, B the predecessor / successor codebooks; A[t] * z and the dot rounded to BF16, the sum in FP32);
  the predecessor of row 1 is the anchor. Decoding is a greedy left-to-right walk (argmax, or a Gumbel
  sample of softmax(E / T)); the proposal distribution of each walked row is softmax(E / T) over its
  candidates (0 elsewhere), which rejection sampling needs.

Numerics: BF16 activations with FP32 norms (`numerics.rms_norm`), FP32 attention scores and softmax,
every projection rounded once; the convolution sums its taps in FP32 and rounds once. Attention can
round as a rollout engine's kernels do (`DFlash2Drafter.attention_numerics`, as the target's
`BeamForCausalLM.attention_numerics`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from beam_rl.model import numerics

if TYPE_CHECKING:
    from pathlib import Path


@dataclass(frozen=True)
class DFlash2Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    sliding_window: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 64
    selector_top_k: int = 16
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] = field(default=())

    def __post_init__(self):
        def need(ok, key, msg):
            if not ok:
                raise ValueError(f"dflash2 config {key}: {msg}")

        need(self.hidden_size % self.conv_group_size == 0, "dflash_config.conv_group_size",
             f"{self.conv_group_size} must divide hidden_size={self.hidden_size}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"{self.num_key_value_heads} must divide num_attention_heads={self.num_attention_heads}")
        need(len(self.target_layer_ids) >= 1, "dflash_config.target_layer_ids", "name at least one target layer")
        need(0 <= self.mask_token_id < self.vocab_size, "dflash_config.mask_token_id", f"must be a token id below vocab_size={self.vocab_size}")
        need(self.conv_kernel_size >= 1 and self.selector_top_k >= 1 and self.selector_rank >= 1, "dflash_config",
             "conv_kernel_size, selector_top_k and selector_rank must be >= 1")
        need(all(t == "sliding_attention" for t in self.layer_types), "layer_types",
             f"every draft layer is sliding-window attention, got {list(self.layer_types)}")

    @property
    def num_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_dict(cls, d: dict) -> "DFlash2Config":
        """The released drafter config (top-level keys + `dflash_config`)."""
        if d.get("is_causal", False):
            raise ValueError("dflash2 config is_causal: the drafter's attention is non-causal; it must be false")
        dc = d.get("dflash_config")
        if not isinstance(dc, dict):
            raise ValueError("dflash2 config dflash_config: missing; it holds target_layer_ids, conv_kernel_size, ...")
        if dc.get("causal", False):
            raise ValueError("dflash2 config dflash_config.causal: the drafter's attention is non-causal; it must be false")
        rope = d.get("rope_parameters") or {}
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "sliding_window")
        missing = [k for k in keys if k not in d] + [f"dflash_config.{k}" for k in ("target_layer_ids", "mask_token_id") if k not in dc]
        if missing:
            raise ValueError(f"dflash2 config: missing {missing}")
        return cls(**{k: d[k] for k in keys}, target_layer_ids=tuple(dc["target_layer_ids"]), mask_token_id=dc["mask_token_id"],
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
                   max_position_embeddings=d.get("max_position_embeddings", 4096),
                   **{k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                                         "final_logit_softcapping") if k in dc},
                   layer_types=tuple(d.get("layer_types", ())))


def block_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group_size: int, block: int | None = None) -> torch.Tensor:
    """The dynamic block convolution: x [R, H] (rows of consecutive blocks of `block` rows; one block
    when None), base [t, H], delta [R, t, G] -> with p = r mod block,
    out[r, c] = sum_{j < t, j <= p} (base[j, c] + delta[r, j, c // group_size]) * x[r - j, c],
    taps never crossing a block's first row; FP32 sum over j in order, rounded once to x's dtype."""
    R, H = x.shape
    block = R if block is None else block
    xf = x.float()
    taps = base.float()[None] + delta.float().repeat_interleave(group_size, dim=-1)  # (R, t, H)
    out = torch.zeros(R, H, dtype=torch.float32, device=x.device)
    p = torch.arange(R, device=x.device) % block
    for j in range(base.shape[0]):
        if j < R:
            term = taps[j:, j] * xf[: R - j]
            out[j:] += torch.where((p[j:] >= j)[:, None], term, torch.zeros((), device=x.device))
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return numerics.rms_norm(x, self.weight, self.eps)


class BlockConv(nn.Module):
    """`base_kernel` [2, t, H] (input and output convolutions) + `kernel_projection` H -> 2*t*G.
    Identity at initialisation: base tap 0 is 1, every other tap and the projection are 0."""

    def __init__(self, c: DFlash2Config):
        super().__init__()
        self.t, self.g, self.G = c.conv_kernel_size, c.conv_group_size, c.num_groups
        base = torch.zeros(2, self.t, c.hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(c.hidden_size, 2 * self.t * self.G, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def deltas(self, a: torch.Tensor) -> torch.Tensor:
        return self.kernel_projection(a).view(a.shape[0], 2, self.t, self.G)

    def conv(self, x, which: int, delta, block: int | None = None) -> torch.Tensor:
        return block_conv(x, self.base_kernel[which], delta[:, which], self.g, block)


class DraftAttention(nn.Module):
    attention_kernel = numerics.AttentionNumerics()  # the spec; `DFlash2Drafter.attention_numerics` sets an engine's

    def __init__(self, c: DFlash2Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _rope(self, x, positions):
        cache = numerics.rope_cos_sin_cache(int(positions.max()) + 1, self.c.head_dim, self.c.rope_theta).to(x.device)
        return numerics.apply_rope(x, positions, cache)

    def keys_values(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> k, v [T, KV, D]: k normed and rotated at `positions`."""
        T, c = h.shape[0], self.c
        k = self.k_norm(self.k_proj(h).view(T, c.num_key_value_heads, c.head_dim))
        return self._rope(k, positions), self.v_proj(h).view(T, c.num_key_value_heads, c.head_dim)

    def forward(self, u, positions, ctx_k, ctx_v, ctx_positions) -> torch.Tensor:
        """Block rows u [B, H] at `positions` over the context (in the window) and the whole block."""
        B, c = u.shape[0], self.c
        q = self._rope(self.q_norm(self.q_proj(u).view(B, c.num_attention_heads, c.head_dim)), positions)
        k_blk, v_blk = self.keys_values(u, positions)
        k, v = torch.cat([ctx_k, k_blk]), torch.cat([ctx_v, v_blk])
        anchor = positions[0]
        lo = positions[:, None] - (c.sliding_window - 1)  # row j sees context c with a+j-(w-1) <= c < a
        ctx_visible = (ctx_positions[None, :] >= lo) & (ctx_positions[None, :] < anchor)
        visible = torch.cat([ctx_visible, torch.ones(B, B, dtype=torch.bool, device=u.device)], dim=1)  # (B, C+B)
        groups = c.num_attention_heads // c.num_key_value_heads
        kf, vf = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), kf) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        kernel = self.attention_kernel
        if kernel.probs == "exact":
            probs = torch.softmax(scores, dim=-1)
        else:  # P rounded to BF16 before P.V, normalised by the sum of the unrounded P (`numerics.attention`)
            e = torch.exp(scores - scores.amax(-1, keepdim=True))
            probs = e.to(torch.bfloat16).float() / e.sum(-1, keepdim=True)
        out = numerics.round_to(torch.einsum("hqk,khd->qhd", probs, vf), u.dtype, kernel.output_rounding)
        return self.o_proj(out.reshape(B, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: DFlash2Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(numerics.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    def __init__(self, c: DFlash2Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c)
        self.attention_conv = BlockConv(c)
        self.mlp_conv = BlockConv(c)

    def forward(self, res: torch.Tensor, attend, block: int | None = None) -> torch.Tensor:
        """res [R, H], rows of consecutive blocks of `block` rows (one block when None); `attend(u)`
        the attention of the convolved rows u (the reference's over explicit context keys, vLLM's
        over its paged KV cache)."""
        a = self.input_layernorm(res)
        d = self.attention_conv.deltas(a)
        o = attend(self.attention_conv.conv(a, 0, d, block))
        res = (res.float() + self.attention_conv.conv(o, 1, d, block).float()).to(res.dtype)
        a = self.post_attention_layernorm(res)
        d = self.mlp_conv.deltas(a)
        o = self.mlp(self.mlp_conv.conv(a, 0, d, block))
        return (res.float() + self.mlp_conv.conv(o, 1, d, block).float()).to(res.dtype)


class CandidateSelector(nn.Module):
    def __init__(self, c: DFlash2Config):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(c.vocab_size, c.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(c.vocab_size, c.selector_rank))
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)

    def pair_scores(self, z: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """<A[t] * z, B[c]> for z [..., r], predecessor tokens [..., P] and candidate tokens [..., k]
        -> [..., P, k] (the leading dims broadcast): A[t] * z rounded to BF16, the dot (FP32
        accumulation) rounded to BF16, returned in FP32."""
        az = (self.predecessor_codebook[predecessors].float() * z.float()[..., None, :]).to(torch.bfloat16).float()
        return (az @ self.successor_codebook[candidates].float().transpose(-1, -2)).to(torch.bfloat16).float()

    def edge_scores(self, z: torch.Tensor, unary: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """E [P, k] of one row: its candidates' unary logits [k] + `pair_scores` after each
        predecessor token, summed in FP32."""
        return unary.float()[None] + self.pair_scores(z, predecessors, candidates)


@dataclass
class Draft:
    tokens: torch.Tensor
    """[K] the walked tokens."""
    candidates: torch.Tensor
    """[K, k] each mask row's candidate tokens (top-k of the unary logits)."""
    scores: torch.Tensor
    """[K, k] the walked edge scores of each row (after its walked predecessor), FP32."""
    choice: torch.Tensor
    """[K] the index into each row's candidates that the walk took."""

    def proposal(self, temperature: float, vocab_size: int) -> torch.Tensor:
        """[K, V] the proposal distribution of each walked row: softmax(scores / T) on its candidates, 0 elsewhere."""
        return proposal_probs(self.scores, self.candidates, torch.tensor(temperature), vocab_size)


def batched_edge_scores(selector: CandidateSelector, z: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                        anchors: torch.Tensor) -> torch.Tensor:
    """E [N, K, k, k] of N drafts at once: E[n, p, q, i] = unary[n, p, i] + <A[pred] * z[n, p], B[candidates[n, p, i]]>,
    the predecessor being candidate q of row p-1 (anchors[n] for the first row, the same for every q);
    the rounding of `CandidateSelector.pair_scores`, the sum in FP32."""
    N, K, k = candidates.shape
    preds = torch.cat([anchors.to(candidates.dtype)[:, None, None].expand(N, 1, k), candidates[:, :-1]], dim=1)
    return unary.float()[:, :, None, :] + selector.pair_scores(z, preds, candidates)


def edge_scores(selector: CandidateSelector, z: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                anchor: int) -> torch.Tensor:
    """E [K, k, k] of one draft (`batched_edge_scores` with N = 1)."""
    return batched_edge_scores(selector, z[None], unary[None], candidates[None], torch.tensor([anchor]))[0]


def batched_walk(E: torch.Tensor, candidates: torch.Tensor, temperature: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy left-to-right walk of N drafts over E [N, K, k, k]: row 0 from its (anchor)
    predecessor, each next row from the candidate just taken. `temperature` None: argmax; else [N]:
    a Gumbel sample of softmax(E / T) per draft (argmax where T <= 0).
    Returns (tokens [N, K], walked scores [N, K, k] in FP32, choice [N, K])."""
    N, K, k = candidates.shape
    rows = torch.arange(N, device=E.device)
    prev = torch.zeros(N, dtype=torch.long, device=E.device)
    choice = torch.empty(N, K, dtype=torch.long, device=E.device)
    scores = torch.empty(N, K, k, dtype=torch.float32, device=E.device)
    for p in range(K):
        s = E[rows, p, prev]
        if temperature is None:
            idx = s.argmax(-1)
        else:
            t = temperature.float().to(E.device)
            u = torch.rand(N, k, generator=generator, device=E.device).clamp_min(1e-20)
            sampled = (s / t.clamp_min(1e-6)[:, None] - torch.log(-torch.log(u))).argmax(-1)
            idx = torch.where(t > 0, sampled, s.argmax(-1))
        choice[:, p], scores[:, p], prev = idx, s, idx
    return candidates.gather(2, choice[:, :, None])[:, :, 0], scores, choice


def proposal_probs(scores: torch.Tensor, candidates: torch.Tensor, temperature: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., V] the proposal distribution of each walked row: softmax(scores / T) on its candidates
    (scores, candidates [..., k]; T broadcast over the leading dims), 0 elsewhere."""
    t = temperature.float().clamp_min(1e-6)
    q = torch.softmax(scores / t, dim=-1)
    out = torch.zeros(*scores.shape[:-1], vocab_size, dtype=torch.float32, device=scores.device)
    return out.scatter(-1, candidates, q)


def walk(E: torch.Tensor, candidates: torch.Tensor, *, temperature: float = 1.0, sample: bool = False,
         generator: torch.Generator | None = None) -> Draft:
    """The walk of one draft over E [K, k, k] (`batched_walk` with N = 1)."""
    t = torch.tensor([temperature]) if sample else None
    tokens, scores, choice = batched_walk(E[None], candidates[None], t, generator)
    return Draft(tokens[0], candidates, scores[0], choice[0])


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling of one verify step (what vLLM's rejection sampler does per request):
    target_probs [K+1, V] (row k: the target's distribution after the draft prefix d_<k),
    draft_tokens [K], draft_probs [K, V] (row k: the proposal d_k was drawn from). Draft token k is
    accepted with probability min(1, p_k(d_k) / q_k(d_k)); at the first rejection one token is drawn
    from normalise(max(0, p_k - q_k)) and the step ends; with every draft accepted a bonus token is
    drawn from p_K. Returns the emitted tokens (1 to K+1); each is distributed as the target's
    distribution after the tokens before it, whatever the proposals."""
    out: list[int] = []
    for k in range(draft_tokens.shape[0]):
        d = int(draft_tokens[k])
        p, q = target_probs[k].double(), draft_probs[k].double()
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q[d]) < float(p[d]):
            out.append(d)
            continue
        residual = (p - q).clamp_min(0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[-1].double(), 1, generator=generator)))
    return out


class DFlash2Drafter(nn.Module):
    """The drafter's own weights (names as released, without a `model.` prefix); the embedding and
    LM head are the target's, passed to `propose`."""

    def __init__(self, c: DFlash2Config):
        super().__init__()
        self.config = c
        n = len(c.target_layer_ids)
        self.fc = nn.Linear(n * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = CandidateSelector(c)

    @contextlib.contextmanager
    def attention_numerics(self, kernel: numerics.AttentionNumerics):
        """Within the block, every draft layer's attention rounds as `kernel` (how a rollout engine
        reporting `attention_numerics == kernel` computes it); the spec again afterwards."""
        with numerics.attention_kernels((layer.self_attn for layer in self.layers), kernel):
            yield self

    def context(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """target_hidden [C, n*H] (the residual streams after `target_layer_ids`, concatenated in that
        order) at `positions` -> each layer's context (k, v) [C, KV, D]."""
        h = self.hidden_norm(self.fc(target_hidden))
        return [layer.self_attn.keys_values(h, positions) for layer in self.layers]

    def propose(self, ctx: list[tuple[torch.Tensor, torch.Tensor]], ctx_positions: torch.Tensor, anchor: int,
                anchor_position: int, num_tokens: int, embed: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block of `anchor` + `num_tokens` mask rows -> (final hidden [B, H], FP32 soft-capped logits [B, V])."""
        c = self.config
        ids = torch.tensor([anchor] + [c.mask_token_id] * num_tokens)
        positions = torch.arange(anchor_position, anchor_position + 1 + num_tokens)
        res = F.embedding(ids, embed)
        for layer, (k, v) in zip(self.layers, ctx):
            res = layer(res, lambda u, layer=layer, k=k, v=v: layer.self_attn(u, positions, k, v, ctx_positions))
        h = self.norm(res)
        return h, numerics.lm_head_logits(h, lm_head, c.final_logit_softcapping)

    def draft(self, ctx, ctx_positions, anchor: int, anchor_position: int, num_tokens: int, embed, lm_head, *,
              temperature: float = 1.0, sample: bool = False, generator: torch.Generator | None = None) -> Draft:
        """One draft step: the block's logits, each mask row's top-k candidates, the edge scores and the walk."""
        h, logits = self.propose(ctx, ctx_positions, anchor, anchor_position, num_tokens, embed, lm_head)
        unary, candidates = logits[1:].topk(self.config.selector_top_k, dim=-1)
        z = self.candidate_selector.hidden_projection(h[1:])
        E = edge_scores(self.candidate_selector, z, unary, candidates, anchor)
        return walk(E, candidates, temperature=temperature, sample=sample, generator=generator)


# -- training and acceptance (the reference of `beam-rl train-drafter`) -----------------------------
def target_hidden_states(target, ids: torch.Tensor, layer_ids: tuple[int, ...],
                         routed_experts: torch.Tensor | None = None) -> torch.Tensor:
    """The reference target's residual streams after the 0-based layers `layer_ids` for one sequence
    ids [T], concatenated in that order: [T, n*H] (what the drafter's context path reads). With
    `routed_experts` [T, moe_layers, top_k] the MoE layers replay those experts (R3: as an engine
    routed the sequence, whose router may break near-ties the other way)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = [target.model.layers[l].register_forward_hook(lambda m, a, out, l=l: captured.__setitem__(l, out[0][0]))
             for l in layer_ids]
    try:
        with torch.no_grad():
            target(ids[None], routed_experts=None if routed_experts is None else routed_experts[None])
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([captured[l] for l in layer_ids], dim=-1)


def block_loss(drafter: DFlash2Drafter, hidden: torch.Tensor, ids: torch.Tensor, anchors: list[int], num_tokens: int,
               embed: torch.Tensor, lm_head: torch.Tensor, *, gamma: float = 7.0, alpha: float = 0.5) -> tuple[torch.Tensor, dict]:
    """Distillation loss of one sequence (ids [T], target hidden [T, n*H]) over blocks anchored at
    `anchors` (each with a+num_tokens < T): row k's cross-entropy to the token at a+k weighted by
    exp(-(k-1)/gamma), plus alpha times the selector's K-way cross-entropy over the edge scores of
    the unary top-K (the gold token injected where missing, the predecessor teacher-forced to the
    gold token at a+k-1). Returns (loss, {"token_ce", "selector_ce", "top1"})."""
    c, K = drafter.config, num_tokens
    positions = torch.arange(ids.shape[0])
    ctx = drafter.context(hidden, positions)
    w = torch.exp(-torch.arange(K, dtype=torch.float32) / gamma)
    token_ce, sel_ce, top1 = [], [], []
    for a in anchors:
        gold = ids[a + 1 : a + 1 + K]
        h, logits = drafter.propose([(k[:a], v[:a]) for k, v in ctx], positions[:a], int(ids[a]), a, K, embed, lm_head)
        ce = F.cross_entropy(logits[1:], gold, reduction="none")
        token_ce.append((w * ce).sum() / w.sum())
        top1.append((logits[1:].argmax(-1) == gold).float())
        cands = logits[1:].detach().topk(c.selector_top_k, dim=-1).indices.clone()
        missing = ~(cands == gold[:, None]).any(-1)
        cands[missing, -1] = gold[missing]
        target_idx = (cands == gold[:, None]).float().argmax(-1)
        z = drafter.candidate_selector.hidden_projection(h[1:])
        preds = torch.cat([ids[a : a + 1], gold[:-1]])
        scores = torch.stack([drafter.candidate_selector.edge_scores(z[p], logits[1 + p].gather(0, cands[p]), preds[p : p + 1], cands[p])[0]
                              for p in range(K)])
        sel_ce.append(F.cross_entropy(scores, target_idx))
    token_ce, sel_ce = torch.stack(token_ce).mean(), torch.stack(sel_ce).mean()
    return token_ce + alpha * sel_ce, {"token_ce": token_ce.item(), "selector_ce": sel_ce.item(),
                                      "top1": torch.stack(top1).mean(0).tolist()}


def accepted_lengths(drafter: DFlash2Drafter, hidden: torch.Tensor, ids: torch.Tensor, anchors: list[int], num_tokens: int,
                     embed: torch.Tensor, lm_head: torch.Tensor) -> list[int]:
    """Per anchor, how many of the greedy walk's tokens a greedy target accepts: the leading run equal
    to the target's own continuation ids[a+1:] (ids being the target's greedy generation)."""
    positions = torch.arange(ids.shape[0])
    ctx = drafter.context(hidden, positions)
    out = []
    for a in anchors:
        with torch.no_grad():
            d = drafter.draft([(k[:a], v[:a]) for k, v in ctx], positions[:a], int(ids[a]), a, num_tokens, embed, lm_head)
        gold = ids[a + 1 : a + 1 + num_tokens]
        same = (d.tokens[: len(gold)] == gold).long()
        out.append(int(same.cumprod(0).sum()))
    return out


# -- the released format -----------------------------------------------------------------------------
ARCHITECTURE = "DFlash2BeamDraftModel"
MODEL_TYPE = "beam_dflash2"
WEIGHTS_FILE = "model.safetensors"


class DFlash2HFConfig(PretrainedConfig):
    """The drafter's config.json as transformers (and so vLLM) reads it, `model_type: "beam_dflash2"`
    (the vLLM plugin registers it); `DFlash2Config.from_dict` validates its fields.

    It also states the drafter's non-causal attention as `dflash_config.causal: false`: vLLM's DFlash
    proposer takes a drafter's causality from its config, vLLM 0.32 from `is_causal`, vLLM 0.26 only
    from `dflash_config.causal` and otherwise takes every sliding-window layer as causal (all of
    DFlash2's are). Without it vLLM 0.26 ran the block causally: outputs stayed exact (verification
    decides them), but each mask row saw only the rows before it and fewer drafts were accepted."""

    model_type = MODEL_TYPE

    def __init__(self, **kwargs):
        kwargs.setdefault("architectures", [ARCHITECTURE])
        dflash = dict(kwargs.get("dflash_config") or {})
        if dflash.get("causal") or kwargs.get("is_causal"):
            raise ValueError("dflash2 config is_causal / dflash_config.causal: the drafter's attention is non-causal; "
                             "they must be false or absent")
        kwargs["dflash_config"] = {**dflash, "causal": False}
        kwargs.setdefault("is_causal", False)
        super().__init__(**kwargs)


def config_dict(c: DFlash2Config) -> dict:
    """`c` as the released drafter's config.json (top-level keys + `dflash_config`)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings, "sliding_window": c.sliding_window,
        "vocab_size": c.vocab_size, "layer_types": ["sliding_attention"] * c.num_hidden_layers, "is_causal": False,
        "torch_dtype": "bfloat16",
        "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "conv_kernel_size": c.conv_kernel_size,
                          "conv_group_size": c.conv_group_size, "selector_rank": c.selector_rank,
                          "selector_top_k": c.selector_top_k, "mask_token_id": c.mask_token_id,
                          "final_logit_softcapping": c.final_logit_softcapping},
    }


def save_drafter(drafter: DFlash2Drafter, out) -> "Path":
    """config.json + model.safetensors (BF16, the released names) in `out`."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}, str(out / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_dict(drafter.config), indent=1) + "\n")
    return out


def load_drafter(path, dtype: torch.dtype = torch.bfloat16) -> DFlash2Drafter:
    """A saved drafter; every released tensor must be there with its shape (named if not)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(path)
    drafter = DFlash2Drafter(DFlash2Config.from_dict(json.loads((path / "config.json").read_text())))
    state = load_file(str(path / WEIGHTS_FILE))
    own = drafter.state_dict()
    if set(state) != set(own):
        raise ValueError(f"{path / WEIGHTS_FILE}: tensors differ from the drafter's: missing {sorted(set(own) - set(state))[:5]}, "
                         f"unexpected {sorted(set(state) - set(own))[:5]}")
    bad = [k for k in own if state[k].shape != own[k].shape]
    if bad:
        raise ValueError(f"{path / WEIGHTS_FILE}: {bad[0]} has shape {tuple(state[bad[0]].shape)}, the config gives {tuple(own[bad[0]].shape)}")
    drafter.load_state_dict(state)
    return drafter.to(dtype)

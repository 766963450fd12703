"""Rollout Routing Replay (R3), rollout side -> trainer side.

The rollout engine reports, per request, the prompt and generated token ids, the sampled tokens'
log-probs and the experts every token was routed to in every MoE layer. `RolloutSample` holds one
request; `RolloutBatch` a validated list of them; `RolloutBatch.to_trainer` builds the trainer's
right-padded micro-batch (`TrainerBatch`), whose `routed_experts` go straight to
`beam_rl.megatron.logprobs.sequence_logprobs(..., routed_experts=...)` (which validates them
against the model once more and hands them to Megatron's `RouterReplay`).

Token order. A request of P prompt and G generated tokens is the sequence s = prompt + output
(N = P + G tokens). The engine fed s[0..N-2] forward (the last sampled token never passes through
the model), so it recorded N - 1 routing rows: row t = the experts of token s[t], prompt tokens
included (prefill). In the trainer row b holds s at positions 0..N-1 followed by padding; routing
row t of the request is routing row t of the trainer; row N - 1 (whose output predicts nothing
inside the sequence) and padding rows get experts 0..K-1 (`pad_routed_experts`). The
rollout log-prob of output token j is the log-prob of s[P + j] given s[:P + j], i.e. trainer
log-prob column P + j - 1 (`sequence_logprobs` puts log p(s[t + 1] | s[:t + 1]) at column t).

Compactness: ids stay in vLLM's capture dtype in the samples (`rollout_id_dtype`: uint8 for <= 256
experts) and as narrow in `TrainerBatch.routed_experts` (`trainer_id_dtype`); they widen to int64
only inside the trainer's replay.

This module is the contract between the engines: it imports neither the rollout plugin nor the
Megatron trainer.
Dense-layer rows are dropped by layer type when a sample is made from vLLM's all-layer array.

Packing (several sequences in one row) is not offered: the Megatron Beam attention sees one
sequence per row (`packed_seq_params` raises), so the trainer consumes right-padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from beam_rl.errors import InputError
from beam_rl.model.config import BeamConfig


class R3Error(InputError):
    """Rollout payload that does not fit the model or itself; the message names request and field."""


def rollout_id_dtype(num_experts: int) -> np.dtype:
    """Expert-id dtype of a rollout sample: vLLM's routing-capture format, uint8 for <= 256
    experts, else uint16 (`routed_experts_capturer`)."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def trainer_id_dtype(num_experts: int) -> torch.dtype:
    """Expert-id dtype of `TrainerBatch.routed_experts`: the rollout dtype where torch computes
    with it (uint8), else int32, which holds every uint16 id (torch has no uint16 arithmetic on CPU)."""
    return torch.uint8 if rollout_id_dtype(num_experts) == np.uint8 else torch.int32


def padding_routes(rows: int, tokens: int, moe_layers: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, tokens, moe_layers, top_k] of experts 0..top_k-1, what rows without routing replay (padding,
    a sequence's last token: their outputs predict nothing)."""
    return torch.arange(top_k, dtype=dtype).expand(rows, tokens, moe_layers, top_k).clone()


def pad_routed_experts(per_sequence: list[torch.Tensor], tokens: int, config: BeamConfig, *, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Stack per-sequence [T_i, L, K] ids into the right-padded batch layout [B, tokens, L, K]
    (padding rows get experts 0..K-1; padded tokens never influence real ones)."""
    K, L = config.num_experts_per_tok, config.num_moe_layers
    out = padding_routes(len(per_sequence), tokens, L, K, dtype)
    for i, ids in enumerate(per_sequence):
        ids = torch.as_tensor(ids)
        if ids.dim() != 3 or ids.shape[1:] != (L, K) or ids.shape[0] > tokens:
            raise R3Error(f"sequence {i}: routed experts shape {tuple(ids.shape)}; expected [<= {tokens}, {L}, {K}]")
        out[i, : ids.shape[0]] = ids.to(dtype)
    return out


def _int_array(x, what: str, where: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise R3Error(f"{where}: {what} must be 1-D; got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise R3Error(f"{where}: {what} must hold integer token ids; got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


@dataclass(frozen=True)
class RolloutSample:
    """One finished rollout request (the engine's outputs, untouched apart from dropping dense rows)."""

    prompt_ids: np.ndarray
    """[P] int64 prompt token ids (P >= 1)."""
    output_ids: np.ndarray
    """[G] int64 generated token ids (G >= 1)."""
    logprobs: np.ndarray
    """[G] float32: the engine's log-prob of each generated token (vLLM raw_logprobs)."""
    routed_experts: np.ndarray
    """[P + G - 1, moe_layers, top_k] expert ids of every token the engine fed forward, compact
    dtype (uint8 for <= 256 experts)."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @classmethod
    def from_vllm(cls, output, routed: np.ndarray, config: BeamConfig, index: int = 0) -> "RolloutSample":
        """From a vLLM `RequestOutput` (first completion, `logprobs=0` or more) and its routing
        array [P + G - 1, num_hidden_layers, top_k] (`beam_rl.rollout.routing.fetch_captured_routing`)."""
        where = f"request {index}"
        comp = output.outputs[0]
        if comp.logprobs is None:
            raise R3Error(f"{where}: no log-probs in the vLLM output; sample with SamplingParams(logprobs=0)")
        out_ids = list(comp.token_ids)
        if len(comp.logprobs) != len(out_ids):
            raise R3Error(f"{where}: {len(comp.logprobs)} log-prob entries for {len(out_ids)} generated tokens")
        lps = []
        for j, (tok, entry) in enumerate(zip(out_ids, comp.logprobs)):
            if tok not in entry:
                raise R3Error(f"{where}: generated token {j} (id {tok}) has no log-prob entry")
            lps.append(entry[tok].logprob)
        routed = np.asarray(routed)
        if routed.ndim != 3 or routed.shape[1] != config.num_hidden_layers:
            raise R3Error(
                f"{where}: vLLM routed_experts shape {routed.shape}; expected [tokens - 1, num_hidden_layers="
                f"{config.num_hidden_layers}, top_k={config.num_experts_per_tok}]"
            )
        moe = routed[:, config.moe_layer_ids]  # by layer type, never by value
        return cls(
            prompt_ids=np.asarray(output.prompt_token_ids, dtype=np.int64),
            output_ids=np.asarray(out_ids, dtype=np.int64),
            logprobs=np.asarray(lps, dtype=np.float32),
            routed_experts=np.ascontiguousarray(moe),
        )

    def validate(self, config: BeamConfig, index: int = 0) -> None:
        """Refuse anything that does not fit `config` or this request, naming request, field and layer."""
        where = f"request {index}"
        prompt = _int_array(self.prompt_ids, "prompt_ids", where)
        output = _int_array(self.output_ids, "output_ids", where)
        if len(prompt) < 1:
            raise R3Error(f"{where}: prompt_ids is empty; a rollout needs at least one prompt token")
        if len(output) < 1:
            raise R3Error(f"{where}: output_ids is empty; nothing was generated to compare")
        for name, ids in (("prompt_ids", prompt), ("output_ids", output)):
            if ids.min() < 0 or ids.max() >= config.vocab_size:
                raise R3Error(f"{where}: {name} must lie in [0, vocab_size={config.vocab_size}); got [{ids.min()}, {ids.max()}]")
        lp = np.asarray(self.logprobs)
        if lp.dtype.kind != "f":
            raise R3Error(f"{where}: logprobs must be floating point; got dtype {lp.dtype}")
        if lp.shape != (len(output),):
            raise R3Error(f"{where}: logprobs shape {lp.shape}; expected [{len(output)}] (one per generated token)")
        if not np.isfinite(lp).all() or (lp > 1e-6).any():
            bad = int(np.flatnonzero(~np.isfinite(lp) | (lp > 1e-6))[0])
            raise R3Error(f"{where}: logprobs[{bad}] = {lp[bad]} is not a finite log-probability (<= 0)")
        self._validate_routing(config, where)

    def _validate_routing(self, config: BeamConfig, where: str) -> None:
        r = self.routed_experts
        if not isinstance(r, np.ndarray):
            raise R3Error(f"{where}: routed_experts must be a numpy array; got {type(r).__name__}")
        want_dtype = rollout_id_dtype(config.num_experts)
        if r.dtype != want_dtype:
            raise R3Error(
                f"{where}: routed_experts dtype {r.dtype}; expected compact {want_dtype} for num_experts="
                f"{config.num_experts} (convert with .astype(np.{want_dtype}) after checking the range)"
            )
        L, K = config.num_moe_layers, config.num_experts_per_tok
        if r.ndim != 3:
            raise R3Error(f"{where}: routed_experts must be [tokens - 1, moe_layers, top_k]; got shape {r.shape}")
        rows = self.num_tokens - 1
        if r.shape[0] != rows:
            raise R3Error(
                f"{where}: routed_experts has {r.shape[0]} token rows; prompt {len(self.prompt_ids)} + output "
                f"{len(self.output_ids)} tokens need {rows} (every token but the last is routed)"
            )
        if r.shape[1] != L:
            raise R3Error(
                f"{where}: routed_experts has {r.shape[1]} layers; the config has {L} MoE layers "
                f"{config.moe_layer_ids} (drop dense layers by type: RolloutSample.from_vllm)"
            )
        if r.shape[2] != K:
            raise R3Error(f"{where}: routed_experts top_k = {r.shape[2]}; config num_experts_per_tok = {K}")
        if r.size == 0:
            return
        over = np.argwhere(r >= config.num_experts)
        if len(over):
            t, layer, _ = over[0]
            raise R3Error(
                f"{where}: expert id {int(r[t, layer].max())} >= num_experts={config.num_experts} at token {t}, "
                f"MoE layer {layer} (model layer {config.moe_layer_ids[layer]})"
            )
        srt = np.sort(r, axis=-1)
        dup = np.argwhere((srt[..., 1:] == srt[..., :-1]).any(axis=-1))
        if len(dup):
            t, layer = dup[0]
            raise R3Error(
                f"{where}: token {t} repeats an expert in MoE layer {layer} (model layer "
                f"{config.moe_layer_ids[layer]}): {r[t, layer].tolist()}"
            )


def length_sorted_micro_batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Indices of `lengths` in micro-batches of at most `size`, shortest first: each micro-batch is
    padded to its own longest sequence, so sorting pads far less than the arrival order (a DAPO step
    of the math suite, micro-batches of 64: 1.38x its real tokens computed in arrival order, 1.06x
    sorted). The order changes no loss that sums over the batch (token means divide by the whole
    batch's count)."""
    if size < 1:
        raise R3Error(f"micro-batch size must be >= 1, got {size}")
    order = sorted(range(len(lengths)), key=lambda i: (int(lengths[i]), i))
    return [order[s : s + size] for s in range(0, len(order), size)]


def prompt_grouped_micro_batches(prompts: Sequence[bytes], prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                                 size: int) -> list[list[int]]:
    """Indices in micro-batches of at most `size` that keep the requests of one prompt together (a
    group larger than `size` is cut into pieces of `size`), groups in order of their packed width (the
    prompt once plus every response), shortest first: packed, each group is one row, and a micro-batch
    pads to its widest."""
    if size < 1:
        raise R3Error(f"micro-batch size must be >= 1, got {size}")
    groups: dict[bytes, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    pieces = [g[s:s + size] for g in groups.values() for s in range(0, len(g), size)]
    pieces.sort(key=lambda g: (int(prompt_lengths[g[0]]) + sum(int(response_lengths[i]) for i in g), g[0]))
    out: list[list[int]] = []
    for piece in pieces:
        if out and len(out[-1]) + len(piece) <= size:
            out[-1].extend(piece)
        else:
            out.append(list(piece))
    return out


def prompt_routing_disagreement(samples: Sequence["RolloutSample"]) -> float:
    """Of the prompt tokens of every request after the first of its prompt, the fraction whose routing
    (any MoE layer) differs from the first request's routing of the same token: what a trainer that
    computes a shared prompt once and replays its first request's routing leaves unreplayed. Each
    request prefilled its prompt itself, and BF16 kernels that round by batch shape can flip a near-tie."""
    first: dict[bytes, np.ndarray] = {}
    differ = total = 0
    for s in samples:
        P = len(s.prompt_ids)
        rows = s.routed_experts[:P]
        ref = first.setdefault(s.prompt_ids.tobytes(), rows)
        if ref is not rows:
            differ += int((ref != rows).reshape(P, -1).any(axis=1).sum())
            total += P
    return differ / total if total else 0.0


@dataclass(frozen=True)
class TrainerBatch:
    """One right-padded micro-batch in the trainer's token order (see the module docstring)."""

    indices: tuple[int, ...]
    """Request index (in the RolloutBatch) of each row."""
    input_ids: torch.Tensor
    """[B, T] int64, prompt + output, right-padded with 0."""
    lengths: torch.Tensor
    """[B] int64 real tokens per row (P + G)."""
    prompt_lengths: torch.Tensor
    """[B] int64."""
    rollout_logprobs: torch.Tensor
    """[B, T - 1] float32: the engine's log-prob of input_ids[:, t + 1] at column t; 0 off `mask`."""
    mask: torch.Tensor
    """[B, T - 1] bool: generated-token columns (the ones `sequence_logprobs` marks)."""
    routed_experts: torch.Tensor
    """[B, T, moe_layers, top_k] ids in `trainer_id_dtype` (uint8 for <= 256 experts) for the trainer's replay."""
    routed_rows: torch.Tensor = field(repr=False)
    """[B, T] bool: rows the engine actually routed (t < P + G - 1), for routing comparisons."""


@dataclass(frozen=True)
class RolloutBatch:
    """Validated rollout requests of one model config."""

    samples: tuple[RolloutSample, ...]
    config: BeamConfig

    def __post_init__(self):
        if not self.samples:
            raise R3Error("RolloutBatch needs at least one sample")
        for i, s in enumerate(self.samples):
            if not isinstance(s, RolloutSample):
                raise R3Error(f"request {i}: expected a RolloutSample, got {type(s).__name__}")
            s.validate(self.config, i)

    @classmethod
    def from_vllm(cls, outputs: Sequence, routed: Sequence[np.ndarray], config: BeamConfig) -> "RolloutBatch":
        if len(outputs) != len(routed):
            raise R3Error(f"{len(outputs)} vLLM outputs but {len(routed)} routing arrays")
        return cls(tuple(RolloutSample.from_vllm(o, r, config, i) for i, o, r in zip(range(len(outputs)), outputs, routed)), config)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    def to_trainer(self, indices: Sequence[int] | None = None, *, pad_to_multiple: int = 1) -> TrainerBatch:
        """Right-padded trainer micro-batch of the requests `indices` (all by default); the padded
        width is rounded up to `pad_to_multiple` (e.g. the sequence-parallel size)."""
        indices = tuple(range(len(self.samples))) if indices is None else tuple(int(i) for i in indices)
        if not indices:
            raise R3Error("to_trainer needs at least one request index")
        for i in indices:
            if not 0 <= i < len(self.samples):
                raise R3Error(f"request index {i} is out of range for a batch of {len(self.samples)}")
        if pad_to_multiple < 1:
            raise R3Error(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
        samples = [self.samples[i] for i in indices]
        B = len(samples)
        T = max(s.num_tokens for s in samples)
        T = -(-T // pad_to_multiple) * pad_to_multiple
        input_ids = torch.zeros(B, T, dtype=torch.long)
        rollout_lp = torch.zeros(B, T - 1, dtype=torch.float32)
        lengths = torch.tensor([s.num_tokens for s in samples])
        prompt_lengths = torch.tensor([len(s.prompt_ids) for s in samples])
        for b, s in enumerate(samples):
            P, N = len(s.prompt_ids), s.num_tokens
            input_ids[b, :P] = torch.from_numpy(s.prompt_ids)
            input_ids[b, P:N] = torch.from_numpy(s.output_ids)
            rollout_lp[b, P - 1 : N - 1] = torch.from_numpy(np.asarray(s.logprobs, dtype=np.float32))
        cols = torch.arange(1, T)[None]  # target position of column t
        mask = (cols >= prompt_lengths[:, None]) & (cols < lengths[:, None])
        routed = pad_routed_experts([torch.from_numpy(s.routed_experts) for s in samples], T, self.config,
                                    dtype=trainer_id_dtype(self.config.num_experts))
        routed_rows = torch.arange(T)[None] < (lengths - 1)[:, None]
        return TrainerBatch(indices, input_ids, lengths, prompt_lengths, rollout_lp, mask, routed, routed_rows)

    def micro_batches(self, size: int, rows: Sequence[int] | None = None, *, pad_to_multiple: int = 1,
                      keep_prompt_groups: bool = False):
        """`to_trainer` micro-batches of at most `size` of the requests `rows` (all by default),
        shortest first (`length_sorted_micro_batches`: each pads to its own longest request);
        `keep_prompt_groups`: requests with one prompt in one micro-batch where they fit
        (`prompt_grouped_micro_batches`), for a trainer that computes a shared prompt once."""
        rows = list(range(len(self.samples))) if rows is None else list(rows)
        if keep_prompt_groups:
            parts = prompt_grouped_micro_batches([self.samples[i].prompt_ids.tobytes() for i in rows],
                                                 [len(self.samples[i].prompt_ids) for i in rows],
                                                 [len(self.samples[i].output_ids) for i in rows], size)
        else:
            parts = length_sorted_micro_batches([self.samples[i].num_tokens for i in rows], size)
        for part in parts:
            yield self.to_trainer([rows[i] for i in part], pad_to_multiple=pad_to_multiple)

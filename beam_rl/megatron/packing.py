"""Shared-prompt packing: the rows of a micro-batch that share a prompt compute it once.

A DAPO step trains on groups of samples of one prompt (the math suite: 16 samples, prompts of ~185
tokens, answers of ~26). Right-padded, every row computes its prompt again, and the LM head and the
log-softmax run at every position although only the positions before a response token give a
log-prob: ~88% of a micro-batch's tokens are prompt copies. Packed, a group is one row: its prompt
once, then each member's response after it, at the positions the response had in its own sequence
(P, P + 1, ...) and in a segment of its own (`segments`: 0 the prompt, k the k-th member).
`BeamSelfAttention` shows a token a key iff the key is earlier in the row, within the window by
position, and in the prompt or the token's own segment: the keys its own sequence had. So every token
computes what it computed unpacked, up to the order of sums over more or fewer rows, and the LM head
runs only at the rows whose logits give a log-prob (`BeamGPTModel`'s `logit_rows`).

R3: the packed prompt replays the first member's routing of it. Every member prefilled the same
prompt in its own request; the copies' routing can differ only where batch-shape-dependent BF16
kernels flip a near-tie, and the step's measured trainer-rollout gap covers that.

A row with no prompt twin is a group of one: packed exactly as it was, apart from the LM head rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from beam_rl.r3 import padding_routes


@dataclass(frozen=True)
class PackedBatch:
    """A right-padded micro-batch [B, T] packed into [R, S] rows (R <= B)."""

    input_ids: torch.Tensor
    """[R, S] int64, right-padded with 0."""
    positions: torch.Tensor
    """[R, S] int64: each token's position in its own sequence; padding repeats the row's last."""
    segments: torch.Tensor
    """[R, S] int32: 0 the shared prompt, k >= 1 the k-th member's response (padding: the last member's)."""
    lengths: torch.Tensor
    """[R] real tokens per packed row."""
    routed_experts: torch.Tensor | None
    """[R, S, moe_layers, top_k] ids to replay, None without R3."""
    logit_rows: torch.Tensor
    """[n] rows of the sequence-first flattened hidden states ([S * R]: column * R + row) whose logits give
    a log-prob (a prompt's last row once, although each member's first token reads it)."""
    gather_rows: torch.Tensor
    """[m] for every log-prob of the unpacked layout: its row in `logit_rows`' logits."""
    targets: torch.Tensor
    """[m] the token each log-prob is of."""
    out_index: torch.Tensor
    """[m] its flat index in the unpacked [B, T - 1] log-prob layout."""
    unpacked_shape: tuple[int, int]
    """(B, T - 1)."""

    def to(self, device) -> "PackedBatch":
        moved = {f: getattr(self, f).to(device) for f in ("input_ids", "positions", "segments", "lengths", "logit_rows",
                                                           "gather_rows", "targets", "out_index")}
        routed = None if self.routed_experts is None else self.routed_experts.to(device)
        return PackedBatch(**moved, routed_experts=routed, unpacked_shape=self.unpacked_shape)


def prompt_groups(input_ids: torch.Tensor, prompt_lengths: torch.Tensor) -> list[list[int]]:
    """Rows of [B, T] `input_ids` with identical prompts, in order of first appearance."""
    groups: dict[bytes, list[int]] = {}
    ids, plen = input_ids.cpu(), prompt_lengths.cpu().tolist()
    for b, p in enumerate(plen):
        groups.setdefault(ids[b, :p].numpy().tobytes(), []).append(b)  # 8 bytes a token: the length is in the key
    return list(groups.values())


def pack_shared_prompts(input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor,
                        routed_experts: torch.Tensor | None = None) -> PackedBatch:
    """Pack a right-padded batch (CPU tensors, `sequence_logprobs`' layout: log-probs at columns
    [P - 1, N - 1)) by shared prompt; see the module docstring."""
    B, T = input_ids.shape
    ids, lens, plens = input_ids.cpu(), lengths.cpu().tolist(), prompt_lengths.cpu().tolist()
    for b in range(B):
        if not 1 <= plens[b] <= lens[b] <= T:
            raise ValueError(f"row {b}: prompt length {plens[b]} and length {lens[b]} must satisfy 1 <= P <= N <= {T}")
    groups = prompt_groups(ids, prompt_lengths)
    widths = [plens[g[0]] + sum(lens[b] - plens[b] for b in g) for g in groups]
    R, S = len(groups), max(widths)
    packed = torch.zeros(R, S, dtype=torch.long)
    positions = torch.zeros(R, S, dtype=torch.long)
    segments = torch.zeros(R, S, dtype=torch.int32)
    routed = None
    if routed_experts is not None:
        routed = padding_routes(R, S, routed_experts.shape[2], routed_experts.shape[3], routed_experts.dtype)
        src_routed = routed_experts.cpu()
    logit_flat: list[torch.Tensor] = []  # sequence-first flat rows ([S * R]: column * R + row) of the needed logits
    gather, targets, out = [], [], []
    needed = 0  # logit rows so far
    for r, group in enumerate(groups):
        first, P = group[0], plens[group[0]]
        packed[r, :P] = ids[first, :P]
        positions[r, :P] = torch.arange(P)
        if routed is not None:
            routed[r, :P] = src_routed[first, :P]
        prompt_logit = needed  # the prompt's last row: every member's first response token reads it
        logit_flat.append(torch.tensor([(P - 1) * R + r]))
        needed += 1
        col = P
        for k, b in enumerate(group, start=1):
            N = lens[b]
            G = N - P
            packed[r, col:col + G] = ids[b, P:N]
            positions[r, col:col + G] = torch.arange(P, N)
            segments[r, col:col + G] = k
            if routed is not None:
                routed[r, col:col + G] = src_routed[b, P:N]
            if G:
                # unpacked column t (P - 1 <= t < N - 1) is the log-prob of token t + 1: t = P - 1 reads the
                # prompt's last row, t >= P the member's row col + t - P (its last token's logits are not needed)
                logit_flat.append(torch.arange(col, col + G - 1) * R + r)
                gather.append(torch.cat([torch.tensor([prompt_logit]), torch.arange(needed, needed + G - 1)]))
                needed += G - 1
                targets.append(ids[b, P:N])
                out.append(b * (T - 1) + torch.arange(P - 1, N - 1))
            col += G
        # padding comes after every real token, so no real token sees it whatever its position: the last
        # token's position (within the model's range) and segment
        positions[r, col:] = positions[r, col - 1]
        segments[r, col:] = segments[r, col - 1]
    empty = torch.zeros(0, dtype=torch.long)
    return PackedBatch(
        input_ids=packed, positions=positions, segments=segments, lengths=torch.tensor(widths),
        routed_experts=routed, logit_rows=torch.cat(logit_flat),
        gather_rows=torch.cat(gather) if gather else empty, targets=torch.cat(targets).long() if targets else empty,
        out_index=torch.cat(out) if out else empty, unpacked_shape=(B, T - 1))

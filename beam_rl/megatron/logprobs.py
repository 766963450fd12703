"""Per-token log-probs of given sequences from the Megatron Beam model (with or without R3).

Batch layout: right-padded `input_ids` [B, T] with `lengths` [B] (real tokens per row) and
`prompt_lengths` [B]; positions are 0..T-1 per row (padding sits after every real token, so causal
attention keeps it out of real tokens; it is masked from MoE bookkeeping with `padding_mask`).
Replayed ids use the same layout, [B, T, moe_layers, top_k] (`beam_rl.r3.pad_routed_experts`).

logprob[b, t] = log p(input_ids[b, t + 1] | input_ids[b, :t + 1]) for t + 1 in
[prompt_length, length) (mask true there). Temperature, as vLLM applies it:
- `mode="raw"` (vLLM's default `logprobs_mode="raw_logprobs"`): log_softmax of the raw FP32
  (soft-capped) logits, temperature-independent. The trainer-vs-rollout gap compares THIS quantity.
- `mode="processed"`: log_softmax(logits / T) in FP32 (vLLM's "processed_logprobs", the
  sampling distribution; also what a DAPO loss at temperature T uses).
"""

from __future__ import annotations

import torch

from beam_rl.model.config import BeamConfig
from beam_rl.megatron import replay as r3
from beam_rl.megatron.fused import cuda_compiled
from beam_rl.megatron.packing import PackedBatch

MODES = ("raw", "processed")


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, mode: str = "raw") -> torch.Tensor:
    """FP32 log p(targets) from logits [rows, tokens, V] or [tokens, V] (targets: their leading shape);
    `mode` as in the module docstring."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose 'raw' (vLLM raw_logprobs) or 'processed' (logits / temperature)")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    temperature = temperature if mode == "processed" else 1.0
    if logits.dim() not in (2, 3) or targets.shape != logits.shape[:-1]:
        raise ValueError(f"logits [rows, tokens, V] or [tokens, V] with targets of their leading shape expected; "
                         f"got logits {tuple(logits.shape)}, targets {tuple(targets.shape)}")
    if logits.dim() == 2:
        # as one row: the compiled kernel always sees rank 3. A call of another rank recompiles with
        # every dimension dynamic, the targets column's 1 included, and squeeze's backward then
        # guards on it (GuardOnDataDependentSymNode: packed then unpacked log-probs in one process)
        return _logprobs_fused(logits[None], targets[None, :, None], temperature)[0]
    # targets as a column [..., 1]: its token dimensions are then marked unbacked with the logits'
    # (`fused.compiled_on`: all but the last), where [B, T] would pin T to the first batch's width
    return _logprobs_fused(logits, targets.unsqueeze(-1), temperature)


def _logprobs(logits: torch.Tensor, target_column: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, target_column.long()).squeeze(-1)


_logprobs_fused = cuda_compiled(_logprobs)  # CUDA: one fused pass over the [tokens, vocab] logits each way


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    config: BeamConfig,
    lengths: torch.Tensor | None = None,
    prompt_lengths: torch.Tensor | None = None,
    temperature: float = 1.0,
    mode: str = "raw",
    routed_experts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (logprobs [B, T-1] FP32, mask [B, T-1] bool); see the module docstring.

    `routed_experts` [B, T, moe_layers, top_k] replays those experts (R3); the routers are left
    in REPLAY_BACKWARD afterwards so a following `.backward()` with activation recompute replays
    too; call `replay.clear_replay(model)` after the backward."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens]; got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    device = input_ids.device
    lengths = torch.full((B,), T, device=device) if lengths is None else torch.as_tensor(lengths, device=device)
    prompt_lengths = torch.ones(B, dtype=torch.long, device=device) if prompt_lengths is None else torch.as_tensor(prompt_lengths, device=device)
    if lengths.shape != (B,) or prompt_lengths.shape != (B,):
        raise ValueError(f"lengths and prompt_lengths must have shape [{B}]")
    # one host sync for every check
    lo, hi, bad_prompt, padded = torch.stack([lengths.min(), lengths.max(), ((prompt_lengths < 1) | (prompt_lengths > lengths)).any(),
                                              (lengths < T).any()]).tolist()
    if hi > T or lo < 1:
        raise ValueError(f"lengths must lie in [1, {T}] (the padded width); got {lengths.tolist()}")
    if bad_prompt:
        raise ValueError("prompt_lengths must lie in [1, lengths]")
    positions = torch.arange(T, device=device).expand(B, T)
    padding_mask = positions >= lengths[:, None]  # True = padding
    if routed_experts is not None:
        r3.set_replay(model, routed_experts, config, B, T)
    else:
        r3.clear_replay(model)
    logits = model(input_ids, positions, None, padding_mask=padding_mask if padded else None)
    if routed_experts is not None:
        r3.replay_backward(model)
    lp = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature=temperature, mode=mode)
    target_pos = positions[:, 1:]
    mask = (target_pos >= prompt_lengths[:, None]) & (target_pos < lengths[:, None])
    return lp, mask


def packed_sequence_logprobs(
    model: torch.nn.Module,
    packed: PackedBatch,
    *,
    config: BeamConfig,
    temperature: float = 1.0,
    mode: str = "raw",
) -> torch.Tensor:
    """`sequence_logprobs`' log-probs [B, T-1] (0 off its mask) of the batch `packed` was packed from
    (`beam_rl.megatron.packing.pack_shared_prompts`, on the model's device): one forward over the
    packed rows, logits only at the rows that give a log-prob. With `packed.routed_experts` the
    routers replay them and stay in REPLAY_BACKWARD, as in `sequence_logprobs`."""
    R, S = packed.input_ids.shape
    padding_mask = torch.arange(S, device=packed.input_ids.device)[None] >= packed.lengths[:, None]
    if packed.routed_experts is not None:
        r3.set_replay(model, packed.routed_experts, config, R, S)
    else:
        r3.clear_replay(model)
    logits = model(packed.input_ids, packed.positions, packed.segments, padding_mask=padding_mask,
                   logit_rows=packed.logit_rows)
    if packed.routed_experts is not None:
        r3.replay_backward(model)
    logits = logits.reshape(-1, logits.shape[-1]).index_select(0, packed.gather_rows)
    lp = logprobs_from_logits(logits, packed.targets, temperature=temperature, mode=mode)
    B, W = packed.unpacked_shape
    return torch.zeros(B * W, dtype=lp.dtype, device=lp.device).index_copy(0, packed.out_index, lp).view(B, W)

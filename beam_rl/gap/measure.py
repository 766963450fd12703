"""The measurement of `beam-rl gap`: the log-prob gap between the vLLM rollout and the Megatron
trainer, R3 on and off.

1. Checkpoint: `--checkpoint DIR`, or `--preset NAME` (a seeded random checkpoint in a temp dir).
2. Prompts: `--prompts FILE` (JSON list of token-id lists, or JSONL of lists), or the built-in set:
   `--num-prompts` seeded random prompts of `--min-prompt-len`..`--max-prompt-len` tokens.
3. Rollout: vLLM samples `--max-tokens` tokens per prompt at temperature 1 (`ignore_eos`, so every
   sequence has exactly that many), recording sampled-token raw log-probs and routed experts
   (prompt tokens included) -> `beam_rl.r3.RolloutBatch`.
4. Trainer: the Megatron Beam model of the mode recomputes every sequence's log-probs twice, with
   the rollout's experts replayed (R3 on) and with its own routing (R3 off), in right-padded
   micro-batches.

Modes (`TRAIN_MODES`): `bf16` (BF16 full fine-tuning weights), `lora` (a seeded random LoRA adapter
with non-zero B on both sides: the trainer's adapter, served by vLLM from the PEFT directory the
trainer saved), `mxfp8` (Megatron with emulated MXFP8 linears vs a rollout serving the same quantised weights and
quantising the same activations, `EngineSettings.linear_precision`). The engines are
reached through `beam_rl.engines`; the router tap and the adapter's B are the Megatron trainer's
own modules (`MegatronTrainer.model`).

Statistics per side (`GapStats`): delta = logprob(trainer) - logprob(rollout) over generated
tokens; mean and max |delta|; extreme-token fraction |delta| > ln 2; router disagreement = fraction
of routed (token, MoE layer) pairs whose trainer top-k SET differs from the rollout's (measured on
the routers' own output, so with R3 on it checks that replay happened); per-sequence KL estimates
of KL(rollout || trainer) from the rollout's samples: k1 = sum_t -delta_t and k3 = sum_t
(exp(delta_t) - 1 - delta_t), averaged over sequences.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from beam_rl.engines import TRAIN_MODES, Adapter, EngineSettings, RolloutEngine, Sampling, TrainerBackend, build_trainer, start_rollout_engine
from beam_rl.engines.base import check_engine_serves
from beam_rl.errors import InputError
from beam_rl.gap.options import MODES, GapOptions

if TYPE_CHECKING:  # numpy loads lazily
    import numpy as np

    from beam_rl.model.config import BeamConfig
    from beam_rl.r3 import RolloutBatch

LN2 = math.log(2.0)


@dataclass
class GapStats:
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    mean_logprob_diff: float
    extreme_token_fraction: float
    router_disagreement: float
    seq_kl_k1: float
    seq_kl_k3: float
    num_tokens: int
    num_sequences: int
    num_routed_pairs: int


# -- inputs -------------------------------------------------------------------------------------

def default_prompts(config: BeamConfig, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Seeded random prompts of variable length (a tokenizer-free model needs no text)."""
    import torch

    if not 1 <= min_len <= max_len:
        raise InputError(f"need 1 <= --min-prompt-len ({min_len}) <= --max-prompt-len ({max_len})")
    g = torch.Generator().manual_seed(seed + 1)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, config.vocab_size, (L,), generator=g).tolist() for L in lens]


def load_prompts(path: str, config: BeamConfig) -> list[list[int]]:
    text = Path(path).read_text()
    try:
        prompts = json.loads(text)
    except json.JSONDecodeError:
        prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise InputError(f"--prompts {path}: expected a non-empty JSON list (or JSONL) of non-empty token-id lists")
    for i, p in enumerate(prompts):
        if not all(isinstance(t, int) and 0 <= t < config.vocab_size for t in p):
            raise InputError(f"--prompts {path}: prompt {i} has a token outside [0, vocab_size={config.vocab_size})")
    return prompts


def _build_checkpoint(preset: str, seed: int, out: Path) -> Path:
    import torch

    from beam_rl.model.checkpoint import save_checkpoint
    from beam_rl.model.modeling import build_model
    from beam_rl.model.presets import get_preset

    return save_checkpoint(build_model(get_preset(preset), seed=seed, dtype=torch.bfloat16), out)


# -- rollout and trainer ------------------------------------------------------------------------

def engine_settings(checkpoint: str, opts: GapOptions, max_model_len: int) -> EngineSettings:
    """The rollout engine of the measurement: routing captured, LoRA for mode lora."""
    return EngineSettings(
        model=str(checkpoint), seed=opts.seed, max_model_len=max_model_len, max_num_seqs=min(64, max(opts.num_prompts, 1)),
        lora_rank=opts.lora_rank if TRAIN_MODES[opts.mode].lora else None, gpu_memory_utilization=opts.gpu_memory_utilization,
        linear_precision=TRAIN_MODES[opts.mode].precision)


def rollout(engine: RolloutEngine, prompts: list[list[int]], opts: GapOptions, lora_dir: Path | None) -> RolloutBatch:
    """Sample at temperature 1 (exactly `max_tokens` per sequence): tokens, raw log-probs, routing."""
    sampling = Sampling(max_tokens=opts.max_tokens, min_tokens=opts.max_tokens, ignore_eos=True, seed=opts.seed)
    adapter = Adapter("beam-rl-gap", 1, str(lora_dir)) if lora_dir is not None else None
    return engine.generate(prompts, sampling, adapter=adapter, progress=opts.progress)


def build_gap_trainer(checkpoint: str, config: BeamConfig, opts: GapOptions) -> TrainerBackend:
    """The trainer of the mode, weights loaded (plus the seeded random adapter for lora)."""
    import torch

    from beam_rl.model.checkpoint import read_tensors

    trainer = build_trainer(config, dict(read_tensors(checkpoint, config)), mode=opts.mode, seed=opts.seed,
                            attention=opts.trainer_attention)
    trainer.model.eval()
    if TRAIN_MODES[opts.mode].lora:
        trainer.add_lora(opts.lora_rank, opts.lora_alpha, seed=opts.seed)  # A: PEFT's kaiming init
        from beam_rl.megatron.lora import adapter_of

        g = torch.Generator().manual_seed(opts.seed + 2)
        with torch.no_grad():
            for ad in filter(None, map(adapter_of, trainer.model.modules())):
                for b in ad.B:
                    b.copy_(torch.randn(b.shape, generator=g) * opts.lora_b_std)
                # The rollout computes with the adapter as it receives it, in BF16 (vLLM casts
                # LoRA weights to the model dtype): make the adapter BF16-exact so both sides
                # hold the same values (a trainer keeps FP32 masters and syncs rounded ones).
                for w in (*ad.A, *ad.B):
                    w.copy_(w.to(torch.bfloat16).float())
    return trainer


class _RouterTap:
    """Collects every router's routing map [s*b, E] (the SET of experts each token used)."""

    def __init__(self, model):
        from beam_rl.megatron.replay import model_routers

        self.maps: list = []  # routing maps [s*b, E] (bool tensors)
        self.handles = [r.register_forward_hook(lambda m, i, o: self.maps.append(o[1].detach())) for r in model_routers(model)]

    def pop(self) -> list:
        maps, self.maps = self.maps, []
        return maps

    def close(self):
        for h in self.handles:
            h.remove()


def recompute(model, batch: RolloutBatch, *, replay: bool, micro_batch: int, progress: bool = True, desc: str = ""):
    """Trainer log-prob deltas per sequence (float64 arrays, generated tokens) and the routing
    disagreement counts (differing pairs, routed pairs)."""
    import torch

    from tqdm import tqdm

    from beam_rl.megatron import replay as r3
    from beam_rl.megatron.logprobs import sequence_logprobs

    config = batch.config
    device = next(model.parameters()).device
    E = config.num_experts
    deltas: list[np.ndarray] = [None] * len(batch)
    differ = pairs = 0
    tap = _RouterTap(model)
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        for tb in tqdm(list(batch.micro_batches(micro_batch)), desc=desc, disable=not progress, file=sys.stderr):
            B, T = tb.input_ids.shape
            lp, mask = sequence_logprobs(
                model, tb.input_ids.to(device), config=config, lengths=tb.lengths.to(device),
                prompt_lengths=tb.prompt_lengths.to(device), routed_experts=tb.routed_experts.to(device) if replay else None,
            )
            r3.clear_replay(model)
            if not torch.equal(mask.cpu(), tb.mask):
                raise RuntimeError("trainer mask differs from the rollout alignment (r3.TrainerBatch.mask)")
            delta = (lp.cpu().double() - tb.rollout_logprobs.double())
            for b, idx in enumerate(tb.indices):
                deltas[idx] = delta[b][tb.mask[b]].numpy()
            maps = tap.pop()
            if len(maps) != config.num_moe_layers:
                raise RuntimeError(f"tapped {len(maps)} router outputs; expected {config.num_moe_layers} MoE layers")
            rollout_set = torch.zeros(B, T, config.num_moe_layers, E, dtype=torch.bool)
            rollout_set.scatter_(-1, tb.routed_experts.long(), True)
            trainer_set = torch.stack([m.cpu().view(T, B, E).transpose(0, 1) for m in maps], dim=2)  # (B, T, L, E)
            diff = (trainer_set != rollout_set).any(-1) & tb.routed_rows[..., None]
            differ += int(diff.sum())
            pairs += int(tb.routed_rows.sum()) * config.num_moe_layers
    finally:
        tap.close()
        torch.set_grad_enabled(grad)
    return deltas, differ, pairs


def gap_stats(deltas: list[np.ndarray], differ: int, pairs: int) -> GapStats:
    import numpy as np

    flat = np.concatenate(deltas)
    a = np.abs(flat)
    k1 = [float(-d.sum()) for d in deltas]
    k3 = [float((np.expm1(d) - d).sum()) for d in deltas]
    return GapStats(
        mean_abs_logprob_diff=float(a.mean()), max_abs_logprob_diff=float(a.max()), mean_logprob_diff=float(flat.mean()),
        extreme_token_fraction=float((a > LN2).mean()), router_disagreement=differ / max(pairs, 1),
        seq_kl_k1=float(np.mean(k1)), seq_kl_k3=float(np.mean(k3)), num_tokens=int(a.size),
        num_sequences=len(deltas), num_routed_pairs=pairs,
    )


# -- the run ------------------------------------------------------------------------------------

def run_gap(opts: GapOptions, *, engine: RolloutEngine | None = None) -> dict:
    """The whole measurement; returns the report dict (`r3_on`, `r3_off`, and the set-up).
    `engine`: a rollout engine already running on the same checkpoint (tests share one); else one
    is started and shut down here. The trainer defines attention as the engine reports computing it."""
    import numpy as np

    from beam_rl.engines.base import checksums_of
    from beam_rl.model.checkpoint import load_config, read_tensors, verify_checkpoint
    from beam_rl.model.presets import get_preset

    if opts.mode not in MODES:
        raise InputError(f"--mode {opts.mode!r}; choose one of {MODES}")
    if (opts.checkpoint is None) == (opts.preset is None):
        raise InputError("give exactly one of --checkpoint DIR or --preset NAME")
    if opts.micro_batch < 1 or opts.max_tokens < 1 or opts.num_prompts < 1:
        raise InputError("--micro-batch, --max-tokens and --num-prompts must be >= 1")
    with tempfile.TemporaryDirectory(prefix="beam-rl-gap-") as tmp:
        tmp = Path(tmp)
        if opts.preset is not None:
            get_preset(opts.preset)  # names the bad preset before any work
            checkpoint = str(_build_checkpoint(opts.preset, opts.seed, tmp / opts.preset))
        else:
            checkpoint = opts.checkpoint
        config = load_config(checkpoint)
        prompts = load_prompts(opts.prompts, config) if opts.prompts else default_prompts(
            config, opts.num_prompts, opts.min_prompt_len, opts.max_prompt_len, opts.seed)
        max_len = max(len(p) for p in prompts) + opts.max_tokens
        if max_len > config.max_position_embeddings:
            raise InputError(f"prompt + --max-tokens = {max_len} exceeds max_position_embeddings={config.max_position_embeddings}")
        lora = TRAIN_MODES[opts.mode].lora

        verify_checkpoint(checkpoint)  # every tensor checked before an engine starts on the directory
        if engine is not None:
            check_engine_serves(engine, opts.mode)
        trainer, lora_dir, served = None, None, None
        if lora:  # the adapter must exist before vLLM samples with it
            trainer = build_gap_trainer(checkpoint, config, opts)
            lora_dir = tmp / "adapter"
            trainer.save_adapter(lora_dir, base=checkpoint)
        elif opts.mode == "mxfp8":  # the rollout serves the weights the trainer computes with, as `beam-rl dapo` syncs them
            trainer = build_gap_trainer(checkpoint, config, opts)
            served = trainer.export(served=True)
        own_engine = engine is None
        if own_engine:
            engine = start_rollout_engine(engine_settings(checkpoint, opts, max_model_len=max_len + 1))
        try:
            if served is not None:
                engine.load_weights(served, checksums_of(served.items()))
            batch = rollout(engine, prompts, opts, lora_dir)
            attention = engine.attention_numerics
        finally:
            if own_engine:
                engine.shutdown()
            elif served is not None:  # a caller's engine gets its checkpoint's weights back
                original = dict(read_tensors(checkpoint, config))
                engine.load_weights(original, checksums_of(original.items()))
        if trainer is None:  # after the engine: an in-process engine's shutdown tears down torch.distributed's default group
            trainer = build_gap_trainer(checkpoint, config, opts)
        trainer.set_attention_numerics(attention)  # as this engine computed attention
        report: dict = {"mode": opts.mode, "bound": opts.bound, "checkpoint": opts.checkpoint or f"preset:{opts.preset}",
                        "num_sequences": len(batch), "max_tokens": opts.max_tokens,
                        "prompt_tokens": int(sum(len(s.prompt_ids) for s in batch.samples)),
                        "engine_attention": asdict(attention), "trainer_attention": opts.trainer_attention}
        raw: dict = {}
        for key, replay in (("r3_on", True), ("r3_off", False)):
            deltas, differ, pairs = recompute(trainer.model, batch, replay=replay, micro_batch=opts.micro_batch,
                                              progress=opts.progress, desc=f"trainer {key}")
            raw[key] = np.concatenate(deltas)
            report[key] = asdict(gap_stats(deltas, differ, pairs))
        if lora:
            report["lora_effect_mean_abs_logprob"] = lora_effect(trainer.model, batch, opts)
    if opts.histogram:
        from beam_rl.gap.report import write_histogram

        write_histogram(raw, opts.histogram, title=f"beam-rl gap: {report['checkpoint']}, mode {opts.mode}")
        report["histogram"] = opts.histogram
    return report


def lora_effect(model, batch: RolloutBatch, opts: GapOptions) -> float:
    """Mean |logprob(with adapter) - logprob(without)| on the trainer, R3 on: how far an engine
    that ignored the adapter would be off (proof that the rollout applied it)."""
    import numpy as np

    from beam_rl.megatron.lora import ExpertLoRA, LoRAAdapter

    adapters = [m for m in model.modules() if isinstance(m, (LoRAAdapter, ExpertLoRA))]  # what holds each scaling
    with_lora, _, _ = recompute(model, batch, replay=True, micro_batch=opts.micro_batch, progress=False)
    saved = [a.scaling for a in adapters]
    try:
        for a in adapters:
            a.scaling = 0.0
        without, _, _ = recompute(model, batch, replay=True, micro_batch=opts.micro_batch, progress=False)
    finally:
        for a, s in zip(adapters, saved):
            a.scaling = s
    return float(np.abs(np.concatenate(with_lora) - np.concatenate(without)).mean())



"""`GapOptions`: every option of `beam-rl gap`, declared once. The CLI flags are built from these
fields (`add_arguments`), so a default or help text lives in one place."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from beam_rl.engines import TRAIN_MODES, TRAINER_ATTENTIONS
from beam_rl.gap.bounds import BOUNDS

MODES = sorted(TRAIN_MODES)
"""Trainer modes the gap is measured for: bf16 (BF16 weights), lora (a seeded random LoRA adapter
on both sides), mxfp8 (Megatron with emulated MXFP8 linears vs a BF16 rollout serving the same quantised weights)."""


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class GapOptions:
    checkpoint: str | None = _opt(None, "Beam checkpoint directory (HF format)", group="source")
    preset: str | None = _opt(None, "seeded random checkpoint of a preset (temp dir)", group="source")
    mode: str = _opt("bf16", "trainer numerics", choices=MODES)
    trainer_attention: str = _opt("auto", "trainer attention: as the engine reports computing it, FlashAttention's algorithm (CUDA), or auto (flash on CUDA, engine elsewhere)",
                                  choices=list(TRAINER_ATTENTIONS))
    prompts: str | None = _opt(None, "JSON list / JSONL of token-id lists (default: built-in seeded prompts)")
    num_prompts: int = _opt(16, "built-in prompts")
    min_prompt_len: int = _opt(8, "built-in prompt length, shortest")
    max_prompt_len: int = _opt(48, "built-in prompt length, longest")
    max_tokens: int = _opt(64, "generated tokens per sequence (ignore_eos: exactly this many)")
    seed: int = _opt(0, "seed of checkpoint, prompts, adapter and sampling")
    micro_batch: int = _opt(8, "sequences per trainer forward")
    lora_rank: int = _opt(8, "LoRA rank (mode lora)")
    lora_alpha: float = _opt(16.0, "LoRA alpha (mode lora)")
    lora_b_std: float = _opt(0.05, "std of the random LoRA B (PEFT initialises B = 0, which would test nothing)")
    gpu_memory_utilization: float = _opt(0.4, "vLLM's share of GPU memory (the trainer shares the GPU); ignored on CPU")
    histogram: str | None = _opt(None, "write a PNG histogram of |delta| (R3 on and off) here", metavar="PATH.png")
    progress: bool = _opt(True, "progress bars", flag="--no-progress")

    @property
    def bound(self) -> float:
        return BOUNDS[self.mode].launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per `GapOptions` field (`--checkpoint` / `--preset` exclusive and required)."""
    from beam_rl.model.presets import PRESETS

    source = p.add_mutually_exclusive_group(required=True)
    for f in fields(GapOptions):
        meta = f.metadata
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        target = source if meta.get("group") == "source" else p
        if f.type == "bool" or isinstance(f.default, bool):
            target.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true", help=f"no {meta['help']}"
                                if f.default else meta["help"])
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        kw = dict(dest=f.name, type=kind, help=meta["help"] + ("" if f.default in (None, MISSING) else f" (default {f.default})"))
        if "choices" in meta or f.name == "preset":
            kw["choices"] = meta.get("choices") or sorted(PRESETS)
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        target.add_argument(flag, default=f.default, **kw)


def from_args(args: argparse.Namespace) -> GapOptions:
    return GapOptions(**{f.name: getattr(args, f.name) for f in fields(GapOptions)})

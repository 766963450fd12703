"""Run checkpoints: `RUN_DIR/checkpoints/step_NNNNNN/` written atomically (temp dir + rename).

A checkpoint holds `hf/` (the trainer's weights as an HF checkpoint: BF16 parameters, FP32 router)
and `trainer.pt`: step, FP32 master weights and AdamW state, LoRA adapters, the data order's
position, the Python / NumPy / torch RNG states and the base of the vLLM sampling seeds. A
directory without the final name is incomplete and ignored; `latest()` returns the newest complete
one, which `--resume` continues from with results identical to an uninterrupted run.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(run_dir: Path, step: int, hf_tensors: dict[str, torch.Tensor], config, trainer_state: dict) -> Path:
    """Write checkpoint `step` atomically; returns its directory."""
    from beam_rl.model.checkpoint import atomic_directory

    final = checkpoint_dir(run_dir, step)
    with atomic_directory(final) as tmp:
        (tmp / "hf").mkdir()
        save_file({k: v.contiguous() for k, v in hf_tensors.items()}, tmp / "hf" / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp / "hf")
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer.pt")
    return final


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "trainer.pt").exists())
    return done[-1] if done else None


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / "trainer.pt", weights_only=False)

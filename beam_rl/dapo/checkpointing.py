"""Run checkpoints: `RUN_DIR/checkpoints/step_NNNNNN/` written atomically (temp dir + rename).

A checkpoint holds `hf/` (the trainer's weights as an HF checkpoint: BF16 parameters, FP32 router),
`trainer.pt` (step, run id, FP32 master weights and AdamW state, LoRA adapters, the data order's
position, the Python / NumPy / torch RNG states and the base of the vLLM sampling seeds) and
`checksums.json` (the run id and the sha256 of every file, written last). A directory without the final name is
incomplete and ignored; `latest()` returns the newest checkpoint of the run whose files still match
their checksums, falling back past damaged ones, and `--resume` continues from it with results
identical to an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

PREFIX = "step_"
CHECKSUMS = "checksums.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:06d}"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(run_dir: Path, step: int, hf_tensors: dict[str, torch.Tensor], config, trainer_state: dict) -> Path:
    """Write checkpoint `step` atomically, its checksums last; returns its directory."""
    from beam_rl.model.checkpoint import atomic_directory

    final = checkpoint_dir(run_dir, step)
    with atomic_directory(final) as tmp:
        (tmp / "hf").mkdir()
        save_file({k: v.contiguous() for k, v in hf_tensors.items()}, tmp / "hf" / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp / "hf")
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer.pt")
        record = {"run_id": trainer_state.get("run_id"), "files": _file_checksums(tmp)}
        (tmp / CHECKSUMS).write_text(json.dumps(record, indent=1))
    return final


def prune(run_dir: Path, keep: int, newest: Path) -> list[Path]:
    """Delete the checkpoints older than the `keep` newest up to `newest`, which `save` has just
    written whole (atomically, checksums last); returns the deleted directories."""
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name <= newest.name)
    old = done[:-keep] if keep < len(done) else []
    for p in old:
        shutil.rmtree(p)
    return old


def _file_checksums(root: Path) -> dict[str, str]:
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name != CHECKSUMS):
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        out[str(f.relative_to(root))] = h.hexdigest()
    return out


def damage(ckpt: Path, run_id: str | None = None) -> str | None:
    """Why checkpoint `ckpt` cannot be resumed from (None: it is intact and belongs to `run_id`)."""
    ckpt = Path(ckpt)
    try:
        record = json.loads((ckpt / CHECKSUMS).read_text())
        want, owner = dict(record["files"]), record["run_id"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        return f"no readable {CHECKSUMS} ({type(e).__name__})"
    have = _file_checksums(ckpt)
    bad = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
    if bad:
        return f"file(s) {bad[:3]} differ from the checksums written with the checkpoint"
    if run_id is not None and owner != run_id:
        return f"it belongs to run {owner}, not to this directory's run {run_id}"
    return None


def latest(run_dir: Path, run_id: str | None = None, log=None) -> Path | None:
    """The newest checkpoint directory that is intact and belongs to `run_id` (when given), or None;
    damaged ones are skipped, each reported through `log`."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / CHECKSUMS).exists())
    for ckpt in reversed(done):
        why = damage(ckpt, run_id)
        if why is None:
            return ckpt
        if log is not None:
            log(f"--resume: skipping checkpoint {ckpt.name}: {why}")
    return None


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / "trainer.pt", weights_only=False)

"""HF-format Beam checkpoint files: save, and strict reads of config and tensors.

A checkpoint directory holds `config.json` and safetensors files with the released tensor names
(`beam_rl.model.weights`), sharded with a `model.safetensors.index.json` when large. Loading refuses a
missing, extra or wrongly-shaped tensor, naming it; router tensors are kept FP32.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from beam_rl.model.config import BeamConfig
from beam_rl.model.weights import checkpoint_tensors

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint does not match its config; the message names the tensor(s)."""


@contextmanager
def atomic_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp directory beside `final`; when the block succeeds it replaces `final`
    in one rename, when it fails it is removed: readers see the old directory or the new one."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def save_checkpoint(model, path: str | os.PathLike, max_shard_bytes: int = 4 << 30) -> Path:
    """Write `model`'s config.json + safetensors (sharded above `max_shard_bytes`) atomically to `path`
    (any module with a `BeamConfig` `.config` and the released tensor names in its state dict)."""
    path = Path(path)
    specs = checkpoint_tensors(model.config)
    state = model.state_dict()
    if set(state) != set(specs):
        raise CheckpointError(f"model state does not match the Beam tensor table: {sorted(set(state) ^ set(specs))[:5]}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name in specs:
        t = state[name].detach().contiguous().cpu()
        if shards[-1] and shard_bytes + t.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += t.nbytes
    with atomic_directory(path) as tmp:
        model.config.save_pretrained(tmp)
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE_NAME, metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / fname, metadata={"format": "pt"})
                weight_map.update({name: fname for name in shard})
            total = sum(t.nbytes for shard in shards for t in shard.values())
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return path


def checkpoint_files(path: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> safetensors file of a checkpoint directory (single file or indexed shards)."""
    path = Path(path)
    if (path / INDEX_NAME).exists():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    if (path / SINGLE_NAME).exists():
        with safe_open(path / SINGLE_NAME, framework="pt") as f:
            return {name: path / SINGLE_NAME for name in f.keys()}
    raise CheckpointError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME}; is this a Beam checkpoint directory?")


def checked_tensor_files(path: str | os.PathLike, config: BeamConfig) -> tuple[dict[Path, list[str]], dict]:
    """(the checkpoint's tensor names grouped by safetensors file, `config`'s tensor specs), after
    checking that the names are exactly `config`'s; `check_shape` then checks each tensor as read."""
    files = checkpoint_files(path)
    specs = checkpoint_tensors(config)
    missing = [n for n in specs if n not in files]
    extra = [n for n in files if n not in specs]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        if extra:
            parts.append(f"unexpected {len(extra)} tensor(s), e.g. {extra[:3]}")
        raise CheckpointError(f"{path}: " + "; ".join(parts) + " (does config.json match the weights?)")
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    return by_file, specs


def check_shape(path, name: str, shape, spec) -> None:
    if tuple(shape) != spec.shape:
        raise CheckpointError(f"{path}: tensor {name} has shape {tuple(shape)}, config expects {spec.shape}")


def read_tensors(path: str | os.PathLike, config: BeamConfig):
    """Yield (name, tensor) of a checkpoint after checking names and shapes against `config`."""
    by_file, specs = checked_tensor_files(path, config)
    for fname, names in by_file.items():
        with safe_open(fname, framework="pt") as f:
            for name in names:
                t = f.get_tensor(name)
                check_shape(path, name, t.shape, specs[name])
                yield name, t


def load_config(path: str | os.PathLike) -> BeamConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json")
    return BeamConfig.from_json_file(str(cfg_file))


#END


def load_state_dict(path: str | os.PathLike, config: BeamConfig, *, dtype=torch.bfloat16, device="cpu") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors checked against `config`, each in its storage dtype (`dtype` for
    BF16-stored tensors; router tensors FP32) on `device`."""
    specs = checkpoint_tensors(config)
    return {name: t.to(device=device, dtype=specs[name].dtype(dtype)) for name, t in read_tensors(path, config)}

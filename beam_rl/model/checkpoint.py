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

from beam_rl.errors import InputError
from beam_rl.model.config import BeamConfig, BeamConfigError, check_checkpoint_dict
from beam_rl.model.weights import checkpoint_tensors

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(InputError):
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
    """Write `model`'s config.json + safetensors atomically to `path` (any module with a `BeamConfig`
    `.config` and the released tensor names in its state dict); see `save_tensors`."""
    return save_tensors(model.state_dict(), model.config, path, max_shard_bytes)


def save_tensors(state: dict[str, torch.Tensor], config: BeamConfig, path: str | os.PathLike,
                 max_shard_bytes: int = 4 << 30) -> Path:
    """Write `config` and the released-name tensors `state` as a checkpoint at `path`, atomically,
    sharded above `max_shard_bytes`; refuses a tensor set that is not exactly the config's."""
    path = Path(path)
    specs = checkpoint_tensors(config)
    if set(state) != set(specs):
        raise CheckpointError(f"model state does not match the Beam tensor table: {sorted(set(state) ^ set(specs))[:5]}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name in specs:
        t = state[name].detach().contiguous().cpu()
        check_shape(path, name, t.shape, specs[name])
        if shards[-1] and shard_bytes + t.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += t.nbytes
    with atomic_directory(path) as tmp:
        config.save_pretrained(tmp)
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
        try:
            weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path / INDEX_NAME}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from None
        return {name: path / fname for name, fname in weight_map.items()}
    if (path / SINGLE_NAME).exists():
        try:
            with safe_open(path / SINGLE_NAME, framework="pt") as f:
                return {name: path / SINGLE_NAME for name in f.keys()}
        except Exception as e:
            raise CheckpointError(f"{path / SINGLE_NAME}: cannot be read as safetensors ({type(e).__name__}: {e}); "
                                  "is the file complete?") from None
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


def check_values(path, name: str, t: torch.Tensor, spec) -> None:
    """A tensor as stored: floating point, FP32 where Beam keeps FP32 (router weight and expert
    bias: never converted from a narrower dtype), and finite everywhere."""
    if not t.dtype.is_floating_point:
        raise CheckpointError(f"{path}: tensor {name} is stored as {t.dtype}; Beam weights are floating point")
    if spec.dtype(t.dtype) == torch.float32 and t.dtype != torch.float32:
        raise CheckpointError(f"{path}: tensor {name} is stored as {t.dtype}; router tensors must be stored in FP32 "
                              f"(re-export the checkpoint without casting them)")
    if t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise CheckpointError(f"{path}: tensor {name} holds {bad} non-finite value(s) (NaN or inf); refusing to load it")


def read_tensors(path: str | os.PathLike, config: BeamConfig):
    """Yield (name, tensor) of a checkpoint after checking names, shapes, storage dtypes and
    finiteness against `config` (`check_shape`, `check_values`)."""
    by_file, specs = checked_tensor_files(path, config)
    for fname, names in by_file.items():
        try:
            f = safe_open(fname, framework="pt")
        except Exception as e:  # a truncated or foreign file: name it
            raise CheckpointError(f"{fname}: cannot be read as safetensors ({type(e).__name__}: {e}); is the file complete?") from None
        with f:
            for name in names:
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{fname}: tensor {name} cannot be read ({type(e).__name__}: {e}); is the file complete?") from None
                check_shape(path, name, t.shape, specs[name])
                check_values(path, name, t, specs[name])
                yield name, t


def load_config(path: str | os.PathLike) -> BeamConfig:
    """The checkpoint's config.json, strictly checked (`check_checkpoint_dict`, then `validate_beam`)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json; is this a Beam checkpoint directory?")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    check_checkpoint_dict(data, str(cfg_file))
    try:
        return BeamConfig(**data)
    except BeamConfigError as e:
        raise BeamConfigError(f"{cfg_file}: {e}") from None


#END


def load_state_dict(path: str | os.PathLike, config: BeamConfig, *, dtype=torch.bfloat16, device="cpu") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors checked against `config`, each in its storage dtype (`dtype` for
    BF16-stored tensors; router tensors FP32) on `device`."""
    specs = checkpoint_tensors(config)
    return {name: t.to(device=device, dtype=specs[name].dtype(dtype)) for name, t in read_tensors(path, config)}


def verify_checkpoint(path: str | os.PathLike) -> BeamConfig:
    """Read a whole checkpoint once (config, every tensor's name, shape, dtype and values) and return
    its config: what a command checks before it starts an engine on the directory."""
    config = load_config(path)
    for _ in read_tensors(path, config):
        pass
    return config

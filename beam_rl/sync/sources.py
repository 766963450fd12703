"""What to push: a Beam HF checkpoint directory, a Megatron checkpoint (converted on the fly to an
HF directory the servers read), or a PEFT LoRA adapter directory. Each becomes a `WeightUpdate`
carrying the sender's `tensor_checksum` of every tensor.

Megatron checkpoints: Megatron-Core's `torch` format (`--ckpt-format torch`), TP1 / PP1 / EP1:
`DIR/latest_checkpointed_iteration.txt` + `DIR/iter_NNNNNNN/mp_rank_00/model_optim_rng.pt`, or an
`iter_*` / `mp_rank_00` directory, or the `.pt` file itself; its `model` entry holds the Megatron
state dict (`beam_rl.model.names.MAPPINGS` names). The Beam `config.json` must sit in the
checkpoint directory (or a parent) or be given with `--config`. The `.pt` is a pickle: load only
checkpoints you trust.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from beam_rl.errors import InputError
from beam_rl.model.checkpoint import INDEX_NAME, SINGLE_NAME, atomic_directory, load_config, read_tensors
from beam_rl.model.config import BeamConfig
from beam_rl.megatron.convert import export_hf
from beam_rl.model.names import PEFT_CONFIG, mapping_for
from beam_rl.sync.base import WeightUpdate
from beam_rl.model.weights import checkpoint_tensors, tensor_checksum


class SourceError(InputError):
    """The source cannot be used; the message names the path and the fix."""


def full_update(path: str | os.PathLike) -> WeightUpdate:
    """A Beam HF checkpoint directory, read strictly against its config.json, with checksums."""
    path = Path(path).resolve()
    if not (path / "config.json").exists():
        raise SourceError(f"{path}: no config.json; --hf / --previous must be Beam HF checkpoint directories")
    config = load_config(path)
    checksums, manifest, nbytes = {}, {}, 0
    for name, t in read_tensors(path, config):  # names, shapes, FP32 routers and finite values checked
        checksums[name] = tensor_checksum(t)
        manifest[name] = _shape_dtype(t)
        nbytes += t.nbytes
    return WeightUpdate(kind="full", path=str(path), checksums=checksums, nbytes=nbytes, manifest=manifest)


def _shape_dtype(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape), str(t.dtype).removeprefix("torch.")


def lora_update(path: str | os.PathLike, name: str) -> WeightUpdate:
    path = Path(path).resolve()
    if not (path / PEFT_CONFIG).exists():
        raise SourceError(f"{path}: no {PEFT_CONFIG}; --lora must be a PEFT adapter directory")
    if not name:
        raise SourceError("--lora-name is required with --lora (the name requests use as `model`)")
    nbytes = sum(f.stat().st_size for f in path.glob("adapter_model.*"))
    return WeightUpdate(kind="lora", path=str(path), nbytes=nbytes, lora_name=name)


# -- Megatron -------------------------------------------------------------------------------------
def _megatron_file(path: Path) -> Path:
    if path.is_file():
        return path
    if (path / "latest_checkpointed_iteration.txt").exists():
        it = (path / "latest_checkpointed_iteration.txt").read_text().strip()
        path = path / ("release" if it == "release" else f"iter_{int(it):07d}")
    ranks = sorted(p for p in path.glob("mp_rank_*") if p.is_dir())
    if len(ranks) > 1:
        raise SourceError(f"{path}: {len(ranks)} model-parallel ranks ({[r.name for r in ranks][:4]}); on-the-fly "
                          "conversion reads TP1/PP1/EP1 checkpoints: save with TP=PP=EP=1 or sync from an exported HF dir (--hf)")
    if ranks:
        path = ranks[0]
    pt = path / "model_optim_rng.pt"
    if pt.exists():
        return pt
    if any(path.glob("*.distcp")) or (path / ".metadata").exists():
        raise SourceError(f"{path}: a torch_dist (distributed) checkpoint; save with --ckpt-format torch or export HF weights (--hf)")
    raise SourceError(f"{path}: no model_optim_rng.pt found; is this a Megatron checkpoint (--ckpt-format torch)?")


def _find_config(path: Path, config: str | None) -> BeamConfig:
    if config:
        return load_config(Path(config).parent if Path(config).is_file() else config)
    for d in [path, *path.parents][:4]:
        d = d if d.is_dir() else d.parent
        if (d / "config.json").exists():
            return load_config(d)
    raise SourceError(f"{path}: no Beam config.json in the checkpoint directory or its parents; pass --config")


class _StateView:
    """A state dict shaped like a module for `export_hf` (names -> tensors, no buffers)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def named_parameters(self):
        return iter(self._state.items())

    def named_buffers(self):
        return iter(())


def read_megatron_state(path: str | os.PathLike, config: BeamConfig) -> dict[str, torch.Tensor]:
    """The Megatron state dict of a TP1 checkpoint, checked against the names `config` implies."""
    pt = _megatron_file(Path(path))
    blob = torch.load(pt, map_location="cpu", weights_only=False, mmap=True)
    state = blob.get("model", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict):
        raise SourceError(f"{pt}: expected a dict with a 'model' state dict")
    state = {k.removeprefix("module."): v for k, v in state.items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state") and ".lora." not in k}
    want = set()
    for name in checkpoint_tensors(config):
        m, idx = mapping_for(name)
        want.add(m.megatron.format(**idx))
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise SourceError(f"{pt}: Megatron state does not match config.json: missing {missing[:3]}, unexpected {extra[:3]}")
    return state


SERVE_CHOICES = ("weights", "mxfp8")
"""`beam-rl sync --serve`: the checkpoint's weights as they are, or as an MXFP8 trainer computes with
them (`beam_rl.megatron.mxfp8.serve_hf_weight`: each quantised linear's weight quantised and
dequantised), which is what an MXFP8 run's rollout must serve for its R3 gap to hold."""


def _serve_transform(serve: str):
    if serve not in SERVE_CHOICES:
        raise SourceError(f"--serve {serve!r}: choose one of {', '.join(SERVE_CHOICES)}")
    if serve == "weights":
        return lambda name, t: t
    from beam_rl.megatron.mxfp8 import serve_hf_weight

    return serve_hf_weight


def _write_hf(out_dir: Path, cfg: BeamConfig, items, source: Path, dtype: torch.dtype, max_shard_bytes: int) -> WeightUpdate:
    """HF-named tensors into an HF checkpoint at `out_dir` (atomically, streamed into shards), with
    the checksums of what was written."""
    specs = checkpoint_tensors(cfg)
    checksums, manifest, nbytes, weight_map = {}, {}, 0, {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_files = 0, []
    with atomic_directory(out_dir) as tmp:

        def flush():
            nonlocal shard, shard_bytes
            fname = f"shard-{len(shard_files):05d}.safetensors"
            save_file(shard, tmp / fname, metadata={"format": "pt"})
            shard_files.append(fname)
            weight_map.update({n: fname for n in shard})
            shard, shard_bytes = {}, 0

        cfg.save_pretrained(tmp)
        for name, t in items:
            t = t.detach().to(specs[name].dtype(dtype)).contiguous()
            if not bool(torch.isfinite(t).all()):
                raise SourceError(f"{source}: tensor {name} holds non-finite values (NaN or inf); refusing to sync it")
            if shard and shard_bytes + t.nbytes > max_shard_bytes:
                flush()
            shard[name] = t
            shard_bytes += t.nbytes
            checksums[name] = tensor_checksum(t)
            manifest[name] = _shape_dtype(t)
            nbytes += t.nbytes
        flush()
        if len(shard_files) == 1:
            os.replace(tmp / shard_files[0], tmp / SINGLE_NAME)
        else:
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": nbytes}, "weight_map": weight_map}, indent=1))
    return WeightUpdate(kind="full", path=str(out_dir), checksums=checksums, nbytes=nbytes, manifest=manifest)


def megatron_update(path: str | os.PathLike, out_dir: str | os.PathLike, *, config: str | None = None,
                    dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 4 << 30, serve: str = "weights") -> WeightUpdate:
    """Convert a Megatron checkpoint into an HF checkpoint at `out_dir` (atomically, streaming one
    tensor at a time into shards; `serve`: `SERVE_CHOICES`) and return its update, with checksums
    of what was written."""
    path, out_dir = Path(path).resolve(), Path(out_dir).resolve()
    transform = _serve_transform(serve)
    cfg = _find_config(path, config)
    state = read_megatron_state(path, cfg)
    return _write_hf(out_dir, cfg, ((n, transform(n, t)) for n, t in export_hf(_StateView(state), cfg)), path, dtype,
                     max_shard_bytes)


def served_update(path: str | os.PathLike, out_dir: str | os.PathLike, *, serve: str,
                  max_shard_bytes: int = 4 << 30) -> WeightUpdate:
    """An HF checkpoint as `serve` (`SERVE_CHOICES`) serves it, written to `out_dir` (the servers load
    that copy; the checkpoint itself keeps the trainer's unquantised weights)."""
    path, out_dir = Path(path).resolve(), Path(out_dir).resolve()
    if not (path / "config.json").exists():
        raise SourceError(f"{path}: no config.json; --hf must be a Beam HF checkpoint directory")
    if out_dir == path:
        raise SourceError(f"--staging {out_dir} is the checkpoint itself; give another directory")
    transform = _serve_transform(serve)
    cfg = load_config(path)
    return _write_hf(out_dir, cfg, ((n, transform(n, t)) for n, t in read_tensors(path, cfg)), path, torch.bfloat16,
                     max_shard_bytes)

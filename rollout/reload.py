"""Client side of in-place weight reload for an in-process `vllm.LLM` running beam-rl's model.

`reload_weights(llm, path)` reloads a checkpoint directory into every worker
(`BeamWorkerExtension.beam_reload_weights`: vLLM's layerwise reload, per-tensor checksums as
received, every parameter must receive data; `load_weights(llm, tensors)` the same from tensors in
this process's memory) and then drops the engine's prefix cache: vLLM's
`reload_weights` leaves it in place (0.26 and 0.32), and with prefix caching on (vLLM's default)
the next request whose prompt shares a cached block would read KV computed with the old weights.
"""

from __future__ import annotations

import os

import torch


def reload_weights(llm, path: str | os.PathLike) -> list[dict[str, str]]:
    """Reload `path` in place; returns each worker's {HF name: checksum as received}."""
    return _drop_prefix_cache(llm, llm.collective_rpc("beam_reload_weights", args=(str(path),)), str(path))


def load_weights(llm, tensors: dict[str, torch.Tensor], *, layerwise: bool | None = None) -> list[dict[str, str]]:
    """Load in-memory tensors in place (`BeamWorkerExtension.beam_load_weights`). The engine core
    must run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `collective_rpc` then passes the
    tensors by reference; across processes it would serialise them. `layerwise` None: vLLM's
    layerwise reload on CPU (its linear layers pre-pack their weights), direct loading into the
    parameters on CUDA (Beam's unquantized GPU layers keep the loaded layout; the H200 benchmark
    checks that both leave identical parameters)."""
    from vllm.v1.engine.core_client import InprocClient

    if not isinstance(llm.llm_engine.engine_core, InprocClient):
        raise RuntimeError("load_weights needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 when "
                           "the engine starts); use reload_weights with a checkpoint directory otherwise")
    if layerwise is None:
        layerwise = not torch.cuda.is_available()
    return _drop_prefix_cache(llm, llm.collective_rpc("beam_load_weights", args=(list(tensors.items()), layerwise)),
                              f"{len(tensors)} in-memory tensors")


def _drop_prefix_cache(llm, received, what: str):
    if llm.reset_prefix_cache() is False:
        raise RuntimeError(f"reloaded {what}, but vLLM could not drop its prefix cache (requests still running?); "
                           "cached prompt KV would mix old and new weights")
    return received

"""Client side of in-place weight reload for an in-process `vllm.LLM` running beam-rl's model.

`reload_weights(llm, path)` reloads a checkpoint directory into every worker
(`BeamWorkerExtension.beam_reload_weights`: vLLM's layerwise reload, per-tensor checksums as
received, every parameter must receive data) and then drops the engine's prefix cache: vLLM's
`reload_weights` leaves it in place (0.26 and 0.32), and with prefix caching on (vLLM's default)
the next request whose prompt shares a cached block would read KV computed with the old weights.
"""

from __future__ import annotations

import os


def reload_weights(llm, path: str | os.PathLike) -> list[dict[str, str]]:
    """Reload `path` in place; returns each worker's {HF name: checksum as received}."""
    received = llm.collective_rpc("beam_reload_weights", args=(str(path),))
    if llm.reset_prefix_cache() is False:
        raise RuntimeError(f"reloaded {path}, but vLLM could not drop its prefix cache (requests still running?); "
                           "cached prompt KV would mix old and new weights")
    return received

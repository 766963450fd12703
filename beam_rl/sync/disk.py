"""Disk strategy: the server reloads a checkpoint directory it can read (shared filesystem).

`beam_reload_weights` (BeamWorkerExtension, via `/collective_rpc`) runs vLLM's layerwise
`reload_weights` in every worker and returns the `tensor_checksum` of every tensor as received;
with tensor parallelism each worker reads the full checkpoint, so every worker's map must equal
the sender's.
"""

from __future__ import annotations

import time

from beam_rl.sync.base import ServerClient, ServerReport, SyncError, WeightSyncStrategy, WeightUpdate, compare_checksums, register_strategy


@register_strategy("disk")
class DiskReloadStrategy(WeightSyncStrategy):
    def apply(self, server: ServerClient, update: WeightUpdate) -> ServerReport:
        if update.kind != "full":
            raise SyncError(f"{server.url}: the disk strategy loads full checkpoints, not {update.kind!r} updates")
        t0 = time.perf_counter()
        results = server.collective_rpc("beam_reload_weights", update.path)
        seconds = time.perf_counter() - t0
        if not results:
            raise SyncError(f"{server.url}: beam_reload_weights returned nothing (is the worker extension "
                            "--worker-extension-cls beam_rl.rollout.worker.BeamWorkerExtension loaded?)")
        for rank, received in enumerate(results):
            if not isinstance(received, dict):
                raise SyncError(f"{server.url}: worker {rank} returned {str(received)[:200]!r} instead of checksums")
            compare_checksums(f"{server.url} (worker {rank})", update.checksums, received)
        return ServerReport(server.url, seconds, update.nbytes * len(results))

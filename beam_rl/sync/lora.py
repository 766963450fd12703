"""LoRA strategy: hot-load a PEFT adapter directory under a name (`/v1/load_lora_adapter`).

An adapter already served under that name is replaced in place (`load_inplace`); its previous
path, read from `/v1/models` before the update, is what a rollback reloads (an adapter that did
not exist is unloaded instead). Verification: the server lists the name with the new path as its
root. vLLM's LoRA manager loads the tensors itself, so there are no per-tensor checksums here.
"""

from __future__ import annotations

import time

from beam_rl.sync.base import ServerClient, ServerReport, SyncError, WeightSyncStrategy, WeightUpdate, register_strategy


@register_strategy("lora")
class LoraHotLoadStrategy(WeightSyncStrategy):
    def apply(self, server: ServerClient, update: WeightUpdate) -> ServerReport:
        if update.kind != "lora" or not update.lora_name:
            raise SyncError(f"{server.url}: the lora strategy needs a LoRA update with a name (--lora-name)")
        served = server.models()
        t0 = time.perf_counter()
        server.load_lora(update.lora_name, update.path, inplace=update.lora_name in served)
        seconds = time.perf_counter() - t0
        root = server.models().get(update.lora_name, {}).get("root")
        if root != update.path:
            raise SyncError(f"{server.url}: after loading, adapter {update.lora_name!r} is served from {root!r}, not {update.path!r}")
        return ServerReport(server.url, seconds, update.nbytes)

    def rollback(self, server: ServerClient, previous: WeightUpdate) -> None:
        if previous.path:
            self.apply(server, previous)
        elif previous.lora_name in server.models():
            server.unload_lora(previous.lora_name)

    @staticmethod
    def previous(server: ServerClient, name: str) -> WeightUpdate:
        """What the server serves under `name` now (path "" when nothing)."""
        root = server.models().get(name, {}).get("root") or ""
        return WeightUpdate(kind="lora", path=root, lora_name=name)

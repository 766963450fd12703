"""NCCL strategy (GPUs): broadcast tensors from the trainer to every server's workers.

Planned on vLLM's weight-transfer API (dev-mode routes `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`, backend `nccl`): the sender
joins a process group with the servers' workers, streams `beam_rl.megatron.convert.export_hf`
tensors, and each worker returns the checksums of what it received, as the disk strategy does.
Not implemented yet: this machine has no GPUs to validate it on.
"""

from __future__ import annotations

from beam_rl.sync.base import ServerClient, ServerReport, WeightSyncStrategy, WeightUpdate, register_strategy


@register_strategy("nccl")
class NcclBroadcastStrategy(WeightSyncStrategy):
    def apply(self, server: ServerClient, update: WeightUpdate) -> ServerReport:
        raise NotImplementedError("--strategy nccl is not implemented yet; use --strategy disk (servers read a "
                                  "checkpoint directory on a shared filesystem)")

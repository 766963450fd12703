"""`beam_gloo`: vLLM's weight-transfer protocol over a gloo process group, for CPU engines.

vLLM's weight-transfer API (`init_weight_transfer_engine` -> `start_weight_update` ->
`update_weights` -> `finish_weight_update`, as `LLM` methods and dev-mode HTTP routes) ships NCCL
and CUDA-IPC backends only. This engine keeps everything of vLLM's NCCL backend (its init / update
dataclasses, rank layout, layerwise reload into the model's own `load_weights`) and replaces only
the transport: the sender (rank 0) broadcasts each tensor over gloo, unpacked, in `update_info`
order. It is what `beam-rl sync --strategy gloo` talks to, so CPU servers (and CI) run the same
client code as `--strategy nccl` on GPUs.

Start an engine with `weight_transfer_config={"backend": "beam_gloo"}` (CLI:
`--weight-transfer-config '{"backend": "beam_gloo"}'`); `beam_rl.rollout.register()` registers
the name in every vLLM process.
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from beam_rl.rollout import GLOO_WEIGHT_TRANSFER as BACKEND


def worker_rank(parallel_config, rank_offset: int) -> int:
    """This worker's rank in the sender + workers group, laid out as vLLM's NCCL backend does
    (`nccl_common.worker_init_process_group`, identical in vLLM 0.26 and 0.32)."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank + rank_offset


class GlooGroup:
    """A gloo process group outside torch.distributed's global state, with the one collective the
    protocol uses."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.pg = stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend="gloo")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        self.pg.broadcast(tensor, src).wait()

    def destroy(self) -> None:  # vLLM 0.32's shutdown_weight_transfer_engine calls it
        self.pg = None


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    def init_transfer_engine(self, init_info) -> None:
        self.model_update_group = GlooGroup(init_info.master_address, init_info.master_port,
                                            worker_rank(self.parallel_config, init_info.rank_offset), init_info.world_size)

    def receive_weights(self, update_info) -> None:
        if self.model_update_group is None:
            raise RuntimeError(f"{BACKEND}: call init_weight_transfer_engine before update_weights")
        if getattr(update_info, "packed", False) or getattr(self, "packed", False):
            raise ValueError(f"{BACKEND}: packed transfers are not supported; send packed=false")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
            self.model_update_group.broadcast(weight, src=0)
            self.model.load_weights([(name, weight)])

    def update_weights(self, update_info) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises without an accelerator
        self.receive_weights(self.parse_update_info(update_info))


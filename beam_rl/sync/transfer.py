"""Weight sync through vLLM's weight-transfer API: tensors travel by broadcast, not through files.

The sender (this process) is rank 0 of a process group with every worker of one server (ranks
1..W, vLLM's layout for `rank_offset=1`); the workers receive each tensor and load it with the
model's own `load_weights` inside vLLM's layerwise reload, while `BeamWorkerExtension` records the
checksum of every tensor as received and which parameters nothing reached. Per server and update:

    GET  /get_world_size                      W = the server's TP x PP x DP workers
    POST /init_weight_transfer_engine  ||  sender joins the group (both block until all joined)
    POST /collective_rpc beam_begin_weight_update
    POST /start_weight_update
    POST /update_weights {names, dtype_names, shapes}  ||  sender broadcasts the tensors in that order
    POST /finish_weight_update
    POST /collective_rpc beam_end_weight_update -> per worker {checksums, not_loaded}: compared

Transfers are unpacked (one broadcast per tensor): vLLM 0.26 and 0.32 put the `packed` options in
different messages, and unpacked needs neither, so one body works on both. The sender streams the
checkpoint tensor by tensor (read, move to the transport's device, broadcast), so it holds one
tensor at a time. The server's HTTP calls run in the calling thread and the sender's collectives
in a daemon thread: a server that dies mid-way fails its HTTP call at once and the sync reports it,
instead of the sender waiting on a peer that is gone.

Backends (the servers must run the matching `--weight-transfer-config`):
- `nccl`: vLLM's own NCCL engine, `'{"backend": "nccl"}'`; the sender needs a CUDA device of its
  own (NCCL refuses two ranks on one GPU) reachable from the servers' GPUs.
- `gloo`: beam-rl's `beam_gloo` engine (`beam_rl.rollout.weight_transfer`),
  `'{"backend": "beam_gloo"}'`; CPU servers and CI: the same protocol with a CPU transport.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from beam_rl.model.checkpoint import load_config
from beam_rl.rollout import GLOO_WEIGHT_TRANSFER
from beam_rl.sync.base import ServerClient, ServerReport, SyncError, WeightSyncStrategy, WeightUpdate, compare_checksums, register_strategy

_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
                       "U8": "uint8", "BOOL": "bool"}


def checkpoint_manifest(path: str | Path) -> list[tuple[str, str, list[int], Path]]:
    """(HF name, torch dtype name, shape, file) of every tensor of a checkpoint directory, grouped
    by file, without reading tensor data; names and shapes checked as `read_tensors` checks them."""
    from safetensors import safe_open

    from beam_rl.model.checkpoint import check_shape, checked_tensor_files

    by_file, specs = checked_tensor_files(path, load_config(path))
    out = []
    for fname, names in by_file.items():
        with safe_open(fname, framework="pt") as f:
            for name in names:
                sl = f.get_slice(name)
                shape = list(sl.get_shape())
                check_shape(path, name, shape, specs[name])
                out.append((name, _SAFETENSORS_DTYPES[sl.get_dtype()], shape, fname))
    return out


def stream_tensors(manifest: list[tuple[str, str, list[int], Path]]) -> Iterator[torch.Tensor]:
    """The manifest's tensors in its order, one file open at a time."""
    from safetensors import safe_open

    i = 0
    while i < len(manifest):
        fname = manifest[i][3]
        with safe_open(fname, framework="pt") as f:
            while i < len(manifest) and manifest[i][3] == fname:
                yield f.get_tensor(manifest[i][0])
                i += 1


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Collective:
    """The sender's side of one blocking exchange, in a daemon thread (see the module docstring)."""

    def __init__(self, fn: Callable[[], object]):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            self.error = e

    def join(self, url: str, what: str, timeout_s: float):
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise SyncError(f"{url}: the server finished {what} but the sender's side did not within {timeout_s:.0f} s")
        if self.error is not None:
            raise SyncError(f"{url}: sender side of {what} failed: {type(self.error).__name__}: {self.error}") from self.error
        return self.result


class WeightTransferStrategy(WeightSyncStrategy):
    """A full checkpoint into one paused server through vLLM's weight-transfer API."""

    vllm_backend = ""
    """`weight_transfer_config.backend` the servers must run."""

    def __init__(self, master_address: str = "127.0.0.1"):
        self.master_address = master_address
        """Address of this process that the servers' workers can reach (the group's rendezvous)."""

    # transport: subclasses
    def device(self) -> torch.device:
        raise NotImplementedError

    def join_group(self, port: int, world_size: int):
        raise NotImplementedError

    def broadcast(self, group, tensors: Iterator[torch.Tensor]) -> None:
        raise NotImplementedError

    # protocol
    def apply(self, server: ServerClient, update: WeightUpdate) -> ServerReport:
        if update.kind != "full":
            raise SyncError(f"{server.url}: the {self.name} strategy sends full checkpoints, not {update.kind!r} updates")
        device = self.device()
        manifest = checkpoint_manifest(update.path)
        t0 = time.perf_counter()
        workers = server.world_size()
        port = _free_port(self.master_address)
        init_info = {"master_address": self.master_address, "master_port": port, "rank_offset": 1, "world_size": 1 + workers}
        joining = _Collective(lambda: self.join_group(port, 1 + workers))
        server.init_weight_transfer(init_info, backend=self.vllm_backend)
        group = joining.join(server.url, "init_weight_transfer_engine", server.timeout_s)
        server.collective_rpc("beam_begin_weight_update")
        server.start_weight_update()
        sending = _Collective(lambda: self.broadcast(group, (t.to(device) for t in stream_tensors(manifest))))
        try:
            server.update_weights({"names": [m[0] for m in manifest], "dtype_names": [m[1] for m in manifest],
                                   "shapes": [m[2] for m in manifest]})
            sending.join(server.url, "update_weights", server.timeout_s)
        except SyncError:
            try:  # puts back the old tensors of layers that received nothing; the caller rolls back the rest
                server.finish_weight_update()
            except SyncError:
                pass
            raise
        server.finish_weight_update()
        reports = server.collective_rpc("beam_end_weight_update")
        seconds = time.perf_counter() - t0
        if not reports:
            raise SyncError(f"{server.url}: beam_end_weight_update returned nothing (is --worker-extension-cls "
                            "beam_rl.rollout.worker.BeamWorkerExtension loaded?)")
        for rank, rep in enumerate(reports):
            compare_checksums(f"{server.url} (worker {rank})", update.checksums, rep["checksums"])
            if rep["not_loaded"]:
                raise SyncError(f"{server.url} (worker {rank}): {len(rep['not_loaded'])} parameter(s) received no data, "
                                f"e.g. {rep['not_loaded'][:3]}")
        return ServerReport(server.url, seconds, update.nbytes * len(reports))


@register_strategy("nccl")
class NcclTransferStrategy(WeightTransferStrategy):
    vllm_backend = "nccl"

    def device(self) -> torch.device:
        if not torch.cuda.is_available():
            raise SyncError("--strategy nccl needs a CUDA device in the sending process; use --strategy gloo (CPU) or disk")
        return torch.device("cuda", torch.cuda.current_device())

    def join_group(self, port: int, world_size: int):
        from vllm.distributed.weight_transfer.nccl_common import trainer_init  # vLLM 0.26 and 0.32: rank 0, current device

        comm = trainer_init({"master_address": self.master_address, "master_port": port, "world_size": world_size})
        if getattr(comm, "disabled", False):  # no libnccl: its broadcasts would silently do nothing
            raise SyncError("vLLM's PyNcclCommunicator is disabled in this process (NCCL library not found); "
                            "use --strategy gloo or disk")
        return comm

    def broadcast(self, group, tensors: Iterator[torch.Tensor]) -> None:
        stream = torch.cuda.current_stream()
        for t in tensors:
            group.broadcast(t.contiguous(), src=0, stream=stream)  # freed tensors are reused only after this stream's ops
        stream.synchronize()


@register_strategy("gloo")
class GlooTransferStrategy(WeightTransferStrategy):
    vllm_backend = GLOO_WEIGHT_TRANSFER

    def device(self) -> torch.device:
        return torch.device("cpu")

    def join_group(self, port: int, world_size: int):
        from beam_rl.rollout.weight_transfer import GlooGroup

        return GlooGroup(self.master_address, port, 0, world_size)

    def broadcast(self, group, tensors: Iterator[torch.Tensor]) -> None:
        for t in tensors:
            group.broadcast(t.contiguous(), src=0)

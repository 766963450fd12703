"""`MegatronTrainer`: the `TrainerBackend` on the Megatron-Core Beam model (one process, TP1),
with FP32-master AdamW, R3 log-probs, the loss-agnostic update and the HF-named export.

Modes (`beam_rl.engines.base.TRAIN_MODES`): 'bf16' (BF16 parameters, FP32 master weights and Adam
state), 'lora' (frozen BF16 base, FP32 PEFT adapters), 'mxfp8' (emulated MXFP8 linears off
Blackwell, FP32 master). Attention: 'auto' (flash on CUDA, engine elsewhere), 'engine' (as the
rollout engine reports computing it) or 'flash' (FlashAttention's algorithm on CUDA,
`beam_rl.megatron.attention.trainer_attention_dtype`).
"""

from __future__ import annotations

import torch

from beam_rl.engines.base import TRAIN_MODES, TrainerBackend, TrainLoss
from beam_rl.errors import InputError
from beam_rl.megatron import replay as r3
from beam_rl.megatron.logprobs import packed_sequence_logprobs, sequence_logprobs
from beam_rl.megatron.packing import pack_shared_prompts
from beam_rl.model.config import BeamConfig
from beam_rl.model.numerics import AttentionNumerics
from beam_rl.r3 import TrainerBatch, length_sorted_micro_batches

# `BeamModelProvider.mode` of each training precision (no MXFP8 tensor cores on Hopper: emulated)
PROVIDER_MODES = {"bf16": "bf16", "mxfp8": "mxfp8-emulated"}


class MasterAdamW:
    """AdamW on FP32 master copies of BF16 parameters (FP32 parameters are stepped in place);
    gradients are clipped by global norm, parameters rounded back once per step."""

    def __init__(self, params, *, lr: float, betas=(0.9, 0.98), weight_decay: float = 0.0, grad_clip: float = 0.0):
        self.params = list(params)
        self.master = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.grad_clip = grad_clip
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=tuple(betas), weight_decay=weight_decay)

    def step(self) -> float:
        """Apply accumulated gradients; returns the global gradient norm before clipping."""
        for p, m in zip(self.params, self.master):
            if m is not p:
                m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
                p.grad = None
            elif m.grad is None:
                m.grad = torch.zeros_like(m)
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip if self.grad_clip > 0 else float("inf"))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._copy_back()
        return float(norm)

    @torch.no_grad()
    def _copy_back(self):
        """Each BF16 parameter = its FP32 master rounded to nearest, in one multi-tensor copy."""
        low = [(p, m) for p, m in zip(self.params, self.master) if m is not p]
        if low:
            torch._foreach_copy_([p for p, _ in low], [m for _, m in low])

    def state_dict(self) -> dict:
        return {"master": [m.detach().clone() for m in self.master], "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        saved = state["master"]
        shapes, want = [tuple(t.shape) for t in saved], [tuple(m.shape) for m in self.master]
        if shapes != want:  # checked before any copy: a mismatched tensor would broadcast into another's place
            first = next((i for i, (a, b) in enumerate(zip(shapes, want)) if a != b), min(len(shapes), len(want)))
            raise InputError(
                f"the checkpoint's optimizer state does not fit this model: {len(shapes)} trained tensors against "
                f"{len(want)}, first difference at tensor {first} ({shapes[first] if first < len(shapes) else 'none'} "
                f"saved, {want[first] if first < len(want) else 'none'} here). It was written for other trained "
                "parameters (another train.mode or LoRA layout; LoRA's expert adapters are one stacked tensor per "
                "layer and linear since this version): resume with the version and recipe that wrote it, or start the run again")
        with torch.no_grad():
            for m, t in zip(self.master, saved):
                m.copy_(t)
        self.opt.load_state_dict(state["opt"])
        self._copy_back()


class MegatronTrainer(TrainerBackend):
    """The Megatron Beam model being trained, with R3 log-probs and the optimizer update."""

    def __init__(self, config: BeamConfig, hf_tensors: dict, *, mode: str = "bf16", recompute: bool = False, seed: int = 1234,
                 attention: str = "auto", share_prompts: bool = True):
        from beam_rl.megatron.attention import trainer_attention_dtype
        from beam_rl.megatron.cpu import init_single_process
        from beam_rl.megatron.provider import BeamModelProvider

        if mode not in TRAIN_MODES:
            raise ValueError(f"train.mode={mode!r}; choose from {sorted(TRAIN_MODES)}")
        init_single_process(seed=seed)
        self.config, self.mode, self.attention = config, TRAIN_MODES[mode], attention
        # rows of a micro-batch with one prompt compute it once, logits only where a log-prob is read
        # (`beam_rl.megatron.packing`)
        self.share_prompts = share_prompts
        # attention as the spec until the rollout engine reports how it computes it (`set_attention_numerics`)
        self.model = BeamModelProvider(config, mode=PROVIDER_MODES[self.mode.precision], recompute=recompute,
                                       attention_dtype=trainer_attention_dtype(AttentionNumerics(), attention)).provide_loaded(hf_tensors).train()
        self.optimizer: MasterAdamW | None = None
        self.lora_settings: tuple[int, float] | None = None

    def set_attention_numerics(self, kernel: AttentionNumerics) -> None:
        from beam_rl.megatron.attention import set_attention_numerics

        set_attention_numerics(self.model, kernel, self.attention)

    def add_lora(self, r: int, alpha: float, seed: int, *, experts: bool = False, merged: bool = False) -> None:
        from beam_rl.megatron.lora import DEFAULT_TARGETS, EXPERT_TARGETS, add_lora

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            add_lora(self.model, r=r, alpha=alpha, targets=DEFAULT_TARGETS + EXPERT_TARGETS if experts else DEFAULT_TARGETS,
                     merged=merged)
        self.lora_settings = (r, alpha)

    def make_optimizer(self, *, lr, betas=(0.9, 0.98), weight_decay=0.0, grad_clip=0.0) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = MasterAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, grad_clip=grad_clip)

    def optimizer_state(self) -> dict:
        return self._need_optimizer().state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self._need_optimizer().load_state_dict(state)

    def _need_optimizer(self) -> MasterAdamW:
        if self.optimizer is None:
            raise RuntimeError("call make_optimizer() first")
        return self.optimizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- log-probs -----------------------------------------------------------------------------
    def _response_logprobs(self, ids, lengths, prompt_lengths, routed_experts=None, **kwargs) -> torch.Tensor:
        """Log-probs [B, T-1] on the model's device of a right-padded CPU batch, 0 off the response
        (`sequence_logprobs`' layout and mask): packed by shared prompt on the host, then moved
        (`share_prompts`), or every row as it is; `kwargs`: temperature, mode."""
        if self.share_prompts:
            packed = pack_shared_prompts(ids, lengths, prompt_lengths, routed_experts).to(self.device)
            return packed_sequence_logprobs(self.model, packed, config=self.config, **kwargs)
        d = self.device
        lp, mask = sequence_logprobs(self.model, ids.to(d), config=self.config, lengths=lengths.to(d),
                                     prompt_lengths=prompt_lengths.to(d),
                                     routed_experts=None if routed_experts is None else routed_experts.to(d), **kwargs)
        return lp * mask

    def logprobs(self, mb: TrainerBatch, *, temperature: float = 1.0, replay: bool = True, grad: bool = False) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            lp = self._response_logprobs(mb.input_ids, mb.lengths, mb.prompt_lengths, mb.routed_experts if replay else None,
                                         temperature=temperature, mode="processed")
        if not grad:
            r3.clear_replay(self.model)
        return lp

    def fixed_weights(self):
        from beam_rl.megatron.lora import fixed_parameters

        return fixed_parameters()

    # -- one optimizer update ----------------------------------------------------------------
    def step(self, batches: list[TrainerBatch], loss: TrainLoss, *, temperature: float, replay: bool = True) -> dict[str, float]:
        optimizer = self._need_optimizer()
        sums: dict[str, float] = {}
        loss_total = 0.0
        with self.fixed_weights():  # the micro-batches see the same weights; the optimizer steps after them
            for i, mb in enumerate(batches):
                lp = self.logprobs(mb, temperature=temperature, replay=replay, grad=True)
                value, metrics = loss(lp, i)
                value.backward()
                r3.clear_replay(self.model)
                loss_total += value.item()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
        sums["loss"] = loss_total
        sums["grad_norm"] = optimizer.step()
        return sums

    def supervised_step(self, ids, lengths, prompt_lengths, micro_batch_size: int | None = None) -> float:
        optimizer = self._need_optimizer()
        d = self.device
        # the response-token count of the whole batch: every micro-batch's sum is divided by it, so the
        # accumulated gradient is the one batch's mean
        positions = torch.arange(1, ids.shape[1])
        tokens = ((positions[None] >= prompt_lengths[:, None]) & (positions[None] < lengths[:, None])).sum().clamp_min(1)
        total = torch.zeros((), device=d)
        for part in length_sorted_micro_batches(lengths.tolist(), micro_batch_size or ids.shape[0]):
            sl = torch.tensor(part)
            width = int(lengths[sl].max())  # each micro-batch padded to its own longest sequence
            # packed, distinct prompts keep their rows and the LM head runs at response rows only
            loss = -self._response_logprobs(ids[sl, :width], lengths[sl], prompt_lengths[sl]).sum() / tokens.to(d)
            loss.backward()
            total += loss.detach()
        optimizer.step()
        return float(total)  # one host sync a step

    # -- weights out ---------------------------------------------------------------------------
    def export(self, *, merged: bool = True, on_device: bool = False, served: bool = False) -> dict[str, torch.Tensor]:
        from beam_rl.megatron.convert import export_hf
        from beam_rl.megatron.lora import merged_transform
        from beam_rl.megatron.mxfp8 import served_weights

        transform = served_weights(self.model) if served else None
        if self.lora_settings and merged:
            transform = merged_transform(self.model, then=transform)
        items = export_hf(self.model, self.config, transform=transform)
        if on_device:
            return {k: v.detach().contiguous() for k, v in items}
        return {k: v.detach().contiguous().cpu().clone() for k, v in items}

    def save_adapter(self, path, base: str = "") -> dict[str, torch.Tensor]:
        from beam_rl.megatron.lora import save_peft_adapter

        if self.lora_settings is None:
            raise RuntimeError("the trainer has no LoRA adapters; call add_lora first")
        r, alpha = self.lora_settings
        return save_peft_adapter(self.model, path, self.config, r=r, alpha=alpha, base_model_name_or_path=base)

    def load_adapter(self, path) -> None:
        from beam_rl.megatron.lora import load_peft_adapter

        load_peft_adapter(self.model, path)

"""The trainer side of the loop: the Megatron Beam policy, its FP32-master AdamW, R3 log-probs,
the DAPO update and the HF-named export for weight sync.

Modes (registry `MODES`): 'bf16' (BF16 parameters, FP32 master weights and Adam state), 'lora'
(frozen BF16 base, FP32 PEFT adapters), 'mxfp8' (emulated MXFP8 linears off Blackwell, FP32 master).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from beam_rl.model.config import BeamConfig
from beam_rl.dapo.loss import LossSettings, policy_loss
from beam_rl.megatron import replay as r3
from beam_rl.megatron.logprobs import sequence_logprobs


@dataclass(frozen=True)
class Mode:
    provider_mode: str
    """BeamModelProvider.mode of the trainer."""
    lora: bool
    """Train PEFT adapters instead of the weights."""


MODES = {"bf16": Mode("bf16", False), "lora": Mode("bf16", True), "mxfp8": Mode("mxfp8-emulated", False)}


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
        for p, m in zip(self.params, self.master):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict:
        return {"master": [m.detach().clone() for m in self.master], "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
        self.opt.load_state_dict(state["opt"])
        self._copy_back()


class Policy:
    """The Megatron Beam model being trained, with R3 log-probs and the DAPO update."""

    def __init__(self, config: BeamConfig, hf_tensors: dict, *, mode: str = "bf16", recompute: bool = False):
        from beam_rl.megatron.attention import trainer_attention_dtype
        from beam_rl.megatron.cpu import init_single_process
        from beam_rl.megatron.provider import BeamModelProvider

        if mode not in MODES:
            raise ValueError(f"train.mode={mode!r}; choose from {sorted(MODES)}")
        init_single_process()
        self.config, self.mode = config, MODES[mode]
        # attention as this machine's rollout is predicted to compute it; the loop sets what the engine reports
        self.model = BeamModelProvider(config, mode=self.mode.provider_mode, recompute=recompute,
                                       attention_dtype=trainer_attention_dtype()).provide_loaded(hf_tensors).train()
        self.optimizer: MasterAdamW | None = None
        self.lora_settings: tuple[int, float] | None = None

    def set_attention_dtype(self, attention_dtype: str) -> None:
        """Define attention as the rollout engine computes it (`trainer_attention_dtype` of the engine's
        `engine_attention_isa`, once it runs)."""
        from beam_rl.megatron.attention import set_attention_dtype

        set_attention_dtype(self.model, attention_dtype)

    def add_lora(self, r: int, alpha: float, seed: int) -> None:
        from beam_rl.megatron.lora import add_lora

        with torch.random.fork_rng():
            torch.manual_seed(seed)
            add_lora(self.model, r=r, alpha=alpha)
        self.lora_settings = (r, alpha)

    def make_optimizer(self, *, lr, betas=(0.9, 0.98), weight_decay=0.0, grad_clip=0.0) -> MasterAdamW:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = MasterAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, grad_clip=grad_clip)
        return self.optimizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to_device(self, mb):
        """The micro-batch with its tensors on the model's device (a no-op on CPU)."""
        import dataclasses

        if self.device.type == "cpu":
            return mb
        return dataclasses.replace(mb, **{f.name: getattr(mb, f.name).to(self.device) for f in dataclasses.fields(mb)
                                          if isinstance(getattr(mb, f.name), torch.Tensor)})

    # -- log-probs -----------------------------------------------------------------------------
    def logprobs(self, mb, *, temperature: float, replay: bool = True, grad: bool = False) -> torch.Tensor:
        """[B, T-1] log-probs of an `r3.TrainerBatch`-like micro-batch (R3 replay of its experts)."""
        with torch.set_grad_enabled(grad):
            lp, _ = sequence_logprobs(
                self.model, mb.input_ids, config=self.config, lengths=mb.lengths, prompt_lengths=mb.prompt_lengths,
                temperature=temperature, mode="processed", routed_experts=mb.routed_experts if replay else None,
            )
        if not grad:
            r3.clear_replay(self.model)
        return lp

    # -- one optimizer update ----------------------------------------------------------------
    def update(self, micro_batches: list, old_lp: list, adv: list, loss_mask: list, settings: LossSettings,
               loss_name: str, temperature: float) -> dict:
        """One optimizer step over `micro_batches` (gradient accumulation, token-level normaliser
        over the whole mini-batch); returns loss metrics."""
        if self.optimizer is None:
            raise RuntimeError("call make_optimizer() before update()")
        total_tokens = float(sum(m.sum() for m in loss_mask)) or 1.0
        normalizer = total_tokens if settings.loss_agg == "token_mean" else float(sum((m.sum(-1) > 0).sum() for m in loss_mask)) or 1.0
        sums: dict[str, float] = {}
        loss_total = 0.0
        for mb, old, a, m in zip(micro_batches, old_lp, adv, loss_mask):
            lp = self.logprobs(mb, temperature=temperature, grad=True)
            loss, metrics = policy_loss(loss_name, lp, old, a, m, settings, rollout_logprobs=mb.rollout_logprobs, normalizer=normalizer)
            loss.backward()
            r3.clear_replay(self.model)
            loss_total += loss.item()
            w = float(m.sum()) / total_tokens
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * w
        sums["loss"] = loss_total
        sums["grad_norm"] = self.optimizer.step()
        return sums

    def supervised_step(self, ids, lengths, prompt_lengths) -> float:
        """Teacher-forced NLL of the response tokens (warm start), one optimizer step."""
        d = self.device
        lp, mask = sequence_logprobs(self.model, ids.to(d), config=self.config, lengths=lengths.to(d), prompt_lengths=prompt_lengths.to(d))
        loss = -(lp * mask).sum() / mask.sum().clamp_min(1)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    # -- weights out ---------------------------------------------------------------------------
    def hf_tensors(self, merged: bool = True) -> dict[str, torch.Tensor]:
        """Full HF-named weights (LoRA deltas merged when `merged` and adapters exist)."""
        from beam_rl.megatron.convert import export_hf
        from beam_rl.megatron.lora import export_merged

        items = export_hf(self.model, self.config)
        if self.lora_settings and merged:
            items = export_merged(items, self.model)
        return {k: v.detach().contiguous().cpu().clone() for k, v in items}

    def save_adapter(self, path, base: str = "") -> None:
        from beam_rl.megatron.lora import save_peft_adapter

        r, alpha = self.lora_settings
        save_peft_adapter(self.model, path, self.config, r=r, alpha=alpha, base_model_name_or_path=base)

    def load_adapter(self, path) -> None:
        from beam_rl.megatron.lora import load_peft_adapter

        load_peft_adapter(self.model, path)

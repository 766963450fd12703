"""`beam_dapo` policy loss for SkyRL: SkyRL's loss signature around `beam_rl.dapo.loss.dapo_loss`.

SkyRL 0.3.0 calls a registered policy loss as
`fn(log_probs, old_log_probs, advantages, config=AlgorithmConfig, loss_mask=, rollout_logprobs=)`,
all [batch, response tokens], and expects `(loss, metrics)` where loss is the SUM over the
micro-batch: the trainer has already divided each advantage by the mini-batch normaliser of
`trainer.algorithm.loss_reduction` (`token_mean`: the number of loss tokens of the mini-batch;
`apply_loss_reduction_to_advantages_minibatch`). DAPO's per-token surrogate is linear in the
advantage, so `dapo_loss(..., normalizer=1.0)` (a plain sum) on those advantages is exactly
beam-rl's token-mean loss over the mini-batch. Nothing of the math is restated here.

Config mapping (SkyRL key -> `LossSettings`):
  trainer.algorithm.eps_clip_low / eps_clip_high            -> eps_low / eps_high (clip-higher)
  trainer.algorithm.off_policy_correction.tis_ratio_type=token
    with token_tis_ratio_clip_high                          -> tis_cap (truncated IS, per token)
KL is not part of this loss: SkyRL adds its own KL term when `use_kl_loss=true` (DAPO: false).
Every other off-policy correction option is refused, naming the key.
"""

from __future__ import annotations

import torch

from beam_rl.dapo.loss import LossSettings, dapo_loss

NAME = "beam_dapo"
"""`trainer.algorithm.policy_loss_type` that selects this loss."""

_UNSUPPORTED_CORRECTIONS = (
    "sequence_mask_metric",
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
    "token_mask_is_threshold_low",
    "token_mask_is_threshold_high",
)


def settings_from_skyrl(config) -> LossSettings:
    """`LossSettings` from SkyRL's `AlgorithmConfig` (or anything with the same attributes)."""
    tis_cap = None
    opc = getattr(config, "off_policy_correction", None)
    if opc is not None:
        kind = getattr(opc, "tis_ratio_type", None)
        if kind == "token":
            tis_cap = float(opc.token_tis_ratio_clip_high)
        elif kind is not None:
            raise ValueError(
                f"trainer.algorithm.off_policy_correction.tis_ratio_type={kind!r}: policy_loss_type={NAME!r} "
                "implements per-token truncated importance sampling only; use 'token' or null"
            )
        for key in _UNSUPPORTED_CORRECTIONS:
            if getattr(opc, key, None) is not None:
                raise ValueError(f"trainer.algorithm.off_policy_correction.{key} is not supported by policy_loss_type={NAME!r}; set it to null")
    # normalizer=1.0 turns 'token_mean' into the plain sum SkyRL expects (see the module docstring).
    return LossSettings(eps_low=float(config.eps_clip_low), eps_high=float(config.eps_clip_high), loss_agg="token_mean",
                        tis_cap=tis_cap, kl_coef=0.0)


def beam_dapo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config,
    loss_mask: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SkyRL policy-loss signature -> `beam_rl.dapo.loss.dapo_loss` (sum over tokens)."""
    settings = settings_from_skyrl(config)
    if loss_mask is None:
        loss_mask = torch.ones_like(log_probs, dtype=torch.bool)
    loss, metrics = dapo_loss(log_probs, old_log_probs, advantages, loss_mask, settings,
                              rollout_logprobs=rollout_logprobs, normalizer=1.0)
    # SkyRL logs `clip_ratio` for every PPO-style loss; keep beam-rl's split low/high too.
    metrics["clip_ratio"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    return loss, metrics

"""Beam as a vLLM model plugin (installed as `beam_rl.rollout`).

`register()` is the `vllm.general_plugins` entry point: it runs in every vLLM process (engine
core, workers, Ray actors) and may run more than once. It registers beam-rl's `BeamConfig` and the
DFlash2 drafter's config with transformers, beam-rl's `BeamForCausalLM` and `DFlash2BeamDraftModel`
(`beam_rl.rollout.dflash2`) with vLLM's model registry, and the `beam_gloo`
weight-transfer backend (`beam_rl.rollout.weight_transfer`) with vLLM's weight-transfer factory.

Which Beam runs is explicit: `BEAM_RL_VLLM_MODEL=beam_rl` (default) installs ours, replacing the
`BeamForCausalLM` that vLLM >= 0.33 ships (with a log line saying so); `BEAM_RL_VLLM_MODEL=upstream`
keeps vLLM's own and registers nothing (an error if this vLLM has none).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("beam_rl.rollout")

MODEL_ENV = "BEAM_RL_VLLM_MODEL"
ARCH = "BeamForCausalLM"
GLOO_WEIGHT_TRANSFER = "beam_gloo"  # the weight-transfer backend name of `beam_rl.rollout.weight_transfer`


def register() -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from beam_rl.model.config import BeamConfig
    from beam_rl.model.dflash2 import ARCHITECTURE as DFLASH2_ARCH
    from beam_rl.model.dflash2 import MODEL_TYPE as DFLASH2_MODEL_TYPE
    from beam_rl.model.dflash2 import DFlash2HFConfig

    choice = os.environ.get(MODEL_ENV, "beam_rl")
    if choice not in ("beam_rl", "upstream"):
        raise ValueError(f"{MODEL_ENV}={choice!r}: use 'beam_rl' (beam-rl's model) or 'upstream' (vLLM's own Beam)")
    has_upstream = ARCH in ModelRegistry.get_supported_archs() and not _is_ours(ModelRegistry)
    if choice == "upstream":
        if not has_upstream:
            raise RuntimeError(f"{MODEL_ENV}=upstream, but this vLLM has no {ARCH} of its own (it arrived in vLLM 0.33)")
        logger.info("beam_rl.rollout: keeping vLLM's own %s (%s=upstream)", ARCH, MODEL_ENV)
        return
    from beam_rl.rollout.compat import check_version

    check_version()
    AutoConfig.register("beam", BeamConfig, exist_ok=True)
    if has_upstream:
        logger.warning("beam_rl.rollout: replacing vLLM's own %s with beam-rl's (set %s=upstream to keep it)", ARCH, MODEL_ENV)
    ModelRegistry.register_model(ARCH, "beam_rl.rollout.model:BeamForCausalLM")
    AutoConfig.register(DFLASH2_MODEL_TYPE, DFlash2HFConfig, exist_ok=True)
    ModelRegistry.register_model(DFLASH2_ARCH, "beam_rl.rollout.dflash2:DFlash2BeamDraftModel")
    _register_weight_transfer()


def _is_ours(registry) -> bool:
    try:
        model = registry.models[ARCH]  # _LazyRegisteredModel or class
    except (AttributeError, KeyError):
        return False
    return "beam_rl" in str(getattr(model, "module_name", getattr(model, "__module__", "")))


def _register_weight_transfer() -> None:
    """`GLOO_WEIGHT_TRANSFER` as a weight-transfer backend name in this process (lazy: the engine module is
    imported only when an engine is configured with it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if GLOO_WEIGHT_TRANSFER not in WeightTransferEngineFactory._registry:  # plugins may load twice in a process
        WeightTransferEngineFactory.register_engine(GLOO_WEIGHT_TRANSFER, "beam_rl.rollout.weight_transfer",
                                                    "GlooWeightTransferEngine")

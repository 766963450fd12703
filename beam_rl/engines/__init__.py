"""The engines behind one small interface (`base`): `start_rollout_engine` gives a running
`RolloutEngine` (vLLM), `build_trainer` a `TrainerBackend` (Megatron-Core). Loops, `gap`, `eval`
and the benchmarks reach engines only through these two calls and the interface's types."""

from __future__ import annotations

from beam_rl.engines.base import (
    TRAIN_MODES,
    TRAINER_ATTENTIONS,
    Adapter,
    Completion,
    EngineSettings,
    RolloutEngine,
    Sampling,
    TrainerBackend,
    TrainMode,
)


def start_rollout_engine(settings: EngineSettings) -> RolloutEngine:
    """A vLLM engine on `settings.model` running beam-rl's Beam plugin."""
    from beam_rl.engines.vllm import VLLMEngine

    return VLLMEngine(settings)


def start_vllm(settings: EngineSettings):
    """The bare `vllm.LLM` a `start_rollout_engine` engine runs on (the same process layout and
    arguments), for a checkpoint that need not be Beam's: benchmark peers."""
    from beam_rl.engines.vllm import start_llm

    return start_llm(settings)


def build_trainer(config, hf_tensors: dict, *, mode: str = "bf16", recompute: bool = False, seed: int = 1234,
                  attention: str = "auto", share_prompts: bool = True) -> TrainerBackend:
    """The Megatron-Core Beam model of `config` with `hf_tensors` loaded, in training mode `mode`
    (`TRAIN_MODES`), in this process (TP1); `attention` one of `TRAINER_ATTENTIONS`; `share_prompts`:
    rows of a micro-batch with one prompt compute it once (`beam_rl.megatron.packing`)."""
    from beam_rl.engines.megatron import MegatronTrainer

    return MegatronTrainer(config, hf_tensors, mode=mode, recompute=recompute, seed=seed, attention=attention,
                           share_prompts=share_prompts)


__all__ = ["TRAIN_MODES", "TRAINER_ATTENTIONS", "Adapter", "Completion", "EngineSettings", "RolloutEngine", "Sampling", "TrainMode", "TrainerBackend",
           "build_trainer", "start_rollout_engine", "start_vllm"]

"""beam-rl's DAPO inside SkyRL 0.3.0: the same functions, registered into SkyRL's registries.

`register()` adds, under these names (select them in the SkyRL config):
  trainer.algorithm.policy_loss_type=beam_dapo      -> beam_rl.skyrl.loss (beam_rl.dapo.loss.dapo_loss)
  trainer.algorithm.advantage_estimator=beam_grpo   -> beam_rl.skyrl.advantages (beam_rl.dapo.advantages.group_normalized)
  environment.env_class=beam_arithmetic             -> beam_rl.skyrl.env (beam_rl.tasks.arithmetic.integer_reward)
  environment.env_class=beam_math                   -> beam_rl.skyrl.env (the math suite's math-verify reward)
and `beam_rl.skyrl.trainer` adds the soft overlong punishment (beam_rl.dapo.overlong) to the
training rollouts. SkyRL is imported only lazily; without it the error names the install command
(`beam_rl.skyrl._compat.INSTALL`). `worker_setup` is the Ray setup hook of a run (patches,
environment, Beam's Megatron-Bridge bridge). Launch: `beam-rl launch` (`beam_rl.skyrl.launch`);
details: docs/skyrl.md.
"""

from __future__ import annotations

from beam_rl.skyrl._compat import INSTALL, SkyRLMissing, skyrl_gym_module, skyrl_module
from beam_rl.skyrl.advantages import NAME as ADVANTAGE_NAME
from beam_rl.skyrl.env import MATH_NAME as MATH_ENV_NAME
from beam_rl.skyrl.env import NAME as ENV_NAME
from beam_rl.skyrl.loss import NAME as LOSS_NAME

__all__ = ["ADVANTAGE_NAME", "ENV_NAME", "INSTALL", "LOSS_NAME", "SkyRLMissing", "register", "register_beam_bridge",
           "register_env", "worker_setup"]

ENV_ENTRY_POINTS = {ENV_NAME: "beam_rl.skyrl.env:BeamArithmeticEnv", MATH_ENV_NAME: "beam_rl.skyrl.env:BeamMathEnv"}


def register_env() -> None:
    """Register `beam_arithmetic` and `beam_math` with skyrl-gym in this process (idempotent)."""
    gym = skyrl_gym_module()
    for name, entry_point in ENV_ENTRY_POINTS.items():
        if name not in gym.registry:
            gym.register(id=name, entry_point=entry_point)


def register() -> dict[str, str]:
    """Register the loss, the advantage estimator and the environment with SkyRL (idempotent).

    Call it in the driver before SkyRL's `validate_cfg` / `initialize_ray`: SkyRL's registries
    publish local entries to a named Ray actor (`sync_registries`), from which its workers read.
    """
    from beam_rl.skyrl.advantages import beam_grpo_advantage
    from beam_rl.skyrl.loss import beam_dapo_policy_loss

    ppo = skyrl_module("skyrl.backends.skyrl_train.utils.ppo_utils")
    if LOSS_NAME not in ppo.PolicyLossRegistry.list_available():
        ppo.PolicyLossRegistry.register(LOSS_NAME, beam_dapo_policy_loss)
    if ADVANTAGE_NAME not in ppo.AdvantageEstimatorRegistry.list_available():
        ppo.AdvantageEstimatorRegistry.register(ADVANTAGE_NAME, beam_grpo_advantage)
    register_env()
    return {"policy_loss_type": LOSS_NAME, "advantage_estimator": ADVANTAGE_NAME, "env_class": ENV_NAME}


def register_beam_bridge() -> None:
    """Beam's Megatron-Bridge bridge (`beam_rl.megatron.bridge.register_bridge`); idempotent. SkyRL
    builds and exports every Megatron model through Megatron-Bridge."""
    try:
        from beam_rl.megatron.bridge import register_bridge
    except ImportError as exc:
        raise SkyRLMissing(f"a SkyRL run on Beam needs Beam's Megatron-Bridge bridge (beam_rl.megatron.bridge) and "
                           f"megatron-bridge 0.3.1: {exc}") from exc
    register_bridge()


def worker_setup() -> None:
    """Ray `worker_process_setup_hook` of a Beam run: SkyRL's Python 3.11 import fix, the
    environment, the SkyRL patches (`beam_rl.skyrl.patches.apply_all`, each applied when SkyRL
    imports its target) and Beam's bridge, registered right before SkyRL's Megatron worker module
    imports (it imports Megatron-Bridge): processes that never train load neither."""
    from beam_rl.skyrl.imports import before_import
    from beam_rl.skyrl.patches import MEGATRON_WORKER, apply_all

    skyrl_module("skyrl.backends")
    register_env()
    apply_all()
    before_import(MEGATRON_WORKER, register_beam_bridge)

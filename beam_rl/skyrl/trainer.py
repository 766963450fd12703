"""SkyRL's PPO trainer and experiment with the Beam DAPO reward shaping.

`RayPPOTrainer.generate` produces the training rollouts only (evaluation calls the generator
directly), and dynamic sampling runs on its output; overriding it puts the soft overlong
penalty (`beam_rl.skyrl.shaping`) exactly where beam-rl's own loop adds it. Everything else is
SkyRL's trainer unchanged. Classes are built on first use (importing SkyRL's trainer imports
Ray, vLLM client code and the training backends).
"""

from __future__ import annotations

from functools import lru_cache

from beam_rl.skyrl._compat import skyrl_module
from beam_rl.skyrl.shaping import overlong_shaped_rewards


@lru_cache(maxsize=1)
def trainer_class():
    RayPPOTrainer = skyrl_module("skyrl.train.trainer").RayPPOTrainer

    class BeamDAPOTrainer(RayPPOTrainer):
        async def generate(self, input_batch):
            out = await super().generate(input_batch)
            a = self.cfg.trainer.algorithm
            if getattr(a, "soft_overlong_punishment", False):
                out["rewards"] = overlong_shaped_rewards(out["rewards"], out["response_ids"],
                                                         self.cfg.generator.sampling_params.max_generate_length,
                                                         a.overlong_cache_length, a.overlong_penalty_factor)
            return out

    return BeamDAPOTrainer


@lru_cache(maxsize=1)
def experiment_class():
    BasePPOExp = skyrl_module("skyrl.train.entrypoints.main_base").BasePPOExp

    class BeamDAPOExp(BasePPOExp):
        def get_trainer(self, *args, **kwargs):
            return trainer_class()(*args, **kwargs)

    return BeamDAPOExp

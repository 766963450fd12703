"""SkyRL's PPO trainer and experiment with the Beam DAPO reward shaping.

`RayPPOTrainer.generate` produces the training rollouts only (evaluation calls the generator
directly), and dynamic sampling runs on its output; overriding it puts the soft overlong
penalty (`beam_rl.skyrl.shaping`) exactly where beam-rl's own loop adds it, and a batch without the
routes R3 replays is refused. Everything else is SkyRL's trainer unchanged. Every payload SkyRL's
tracker logs (training steps and evaluations) is also appended to `trainer.log_path/metrics.jsonl`,
one JSON object per call with its `step`, whatever `trainer.logger` is. Classes are built on first
use (importing SkyRL's trainer imports Ray, vLLM client code and the training backends).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from beam_rl.skyrl._compat import skyrl_module
from beam_rl.skyrl.shaping import overlong_shaped_rewards


def _plain(value):
    """A tracker value as JSON: numbers (tensors, numpy scalars) as floats, NaN/inf as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f if math.isfinite(f) else None


class MetricsFile:
    """Wraps a SkyRL `Tracking`: each `log(data, step)` goes to the tracker and, as one line, to `path`."""

    def __init__(self, tracker, path: str | Path):
        self.tracker, self.path = tracker, Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, data, step, commit=False):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": int(step), **_plain(dict(data))}) + "\n")
        self.tracker.log(data, step=step, commit=commit)

    def __getattr__(self, name):
        return getattr(self.tracker, name)


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

        def convert_to_training_input(self, generator_output, uids):
            # R3 on and a batch without routes would train with the routers choosing their own
            # experts, silently: refuse it (SkyRL 0.3.0's dynamic-sampling filter dropped them
            # before beam_rl.skyrl.patches.keep_routes_through_filter).
            replay = getattr(self.cfg.trainer.policy.megatron_config, "moe_enable_routing_replay", False)
            if replay and generator_output.get("rollout_expert_indices") is None:
                raise RuntimeError(
                    "trainer.policy.megatron_config.moe_enable_routing_replay is true but the training batch carries "
                    "no rollout_expert_indices: set generator.inference_engine.enable_return_routed_experts=true, "
                    "and check that beam_rl.skyrl.patches were applied in this process (beam_rl.skyrl.worker_setup)")
            return super().convert_to_training_input(generator_output, uids)

    return BeamDAPOTrainer


@lru_cache(maxsize=1)
def experiment_class():
    BasePPOExp = skyrl_module("skyrl.train.entrypoints.main_base").BasePPOExp

    class BeamDAPOExp(BasePPOExp):
        def get_tracker(self):
            return MetricsFile(super().get_tracker(), Path(self.cfg.trainer.log_path) / "metrics.jsonl")

        def get_trainer(self, *args, **kwargs):
            return trainer_class()(*args, **kwargs)

    return BeamDAPOExp

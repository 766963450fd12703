"""The built-in tasks as skyrl-gym environments: `beam_arithmetic` (scored by
`beam_rl.tasks.arithmetic.integer_reward`) and `beam_math` (the math suite, scored by
`beam_rl.tasks.math_suite.answer_rewards`: math-verify, as `beam-rl dapo` and `beam-rl eval` grade).

Single turn. The dataset row (see `beam_rl.skyrl.data`) names its environment in `env_class` and
carries the answer in `reward_spec.ground_truth`; SkyRL hands `step` the decoded response text. The
text is encoded back with the task tokenizer and closed with `</s>` (a response that SkyRL scores
ended with a stop; a response truncated at the length cap gets reward 0 through
`generator.zero_reward_on_non_stop=true`, as both rewards give 0 without `</s>`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from beam_rl.skyrl._compat import skyrl_gym_module
from beam_rl.tasks.arithmetic import Tokenizer, integer_reward

NAME = "beam_arithmetic"
"""`environment.env_class` (and each data row's `env_class`) of the arithmetic task."""
MATH_NAME = "beam_math"
"""The same for the math suite."""


@lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    return Tokenizer()


def _finished_ids(text: str) -> list[int]:
    tok = _tokenizer()
    ids = tok.encode(text)
    if not ids or ids[-1] != tok.eos_id:
        ids.append(tok.eos_id)
    return ids


def response_reward(text: str, answer: int) -> float:
    """`integer_reward` of a finished response given as text."""
    return integer_reward(_finished_ids(text), int(answer), _tokenizer())


def math_response_reward(text: str, answer: int) -> float:
    """The math suite's reward of a finished response given as text."""
    from beam_rl.tasks.math_suite import answer_rewards

    return answer_rewards([int(answer)], [_finished_ids(text)], _tokenizer())[0]


REWARDS = {NAME: response_reward, MATH_NAME: math_response_reward}


@lru_cache(maxsize=None)
def _env_class(name: str):
    BaseTextEnv = skyrl_gym_module("skyrl_gym.envs.base_text_env").BaseTextEnv
    reward = REWARDS[name]

    class BeamTaskEnv(BaseTextEnv):
        """One step: reward = the task's reward of (response, ground_truth); done."""

        def __init__(self, env_config: Any = None, extras: dict | None = None):
            super().__init__()
            extras = extras or {}
            spec = extras.get("reward_spec") or {}
            if "ground_truth" not in spec:
                raise ValueError(f"env_class={name!r}: each data row needs reward_spec.ground_truth (the integer answer); "
                                 "write the data with `python -m beam_rl.skyrl.data`")
            self.answer = int(spec["ground_truth"])

        def step(self, action: str):
            return {"observations": [], "reward": reward(action, self.answer), "done": True, "metadata": {}}

    BeamTaskEnv.__module__ = __name__
    BeamTaskEnv.__qualname__ = BeamTaskEnv.__name__ = CLASS_NAMES[name]
    return BeamTaskEnv


CLASS_NAMES = {NAME: "BeamArithmeticEnv", MATH_NAME: "BeamMathEnv"}
"""The environment class of each name, an attribute of this module (skyrl-gym's entry point
`beam_rl.skyrl.env:<class>`). A class, not a factory function: SkyRL aggregates each environment's
metrics through `entry_point.aggregate_metrics` (`skyrl_gym.metrics.aggregate_for_environment`)."""


def __getattr__(attr: str):
    # The classes subclass skyrl-gym's BaseTextEnv, so they are built on first access: importing this
    # module needs no SkyRL.
    for name, class_name in CLASS_NAMES.items():
        if attr == class_name:
            return _env_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")

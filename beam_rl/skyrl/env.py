"""`beam_arithmetic`: the built-in arithmetic task as a skyrl-gym environment, scored by
`beam_rl.tasks.arithmetic.integer_reward`.

Single turn. The dataset row (see `beam_rl.skyrl.data`) carries the answer in
`reward_spec.ground_truth`; SkyRL hands `step` the decoded response text. The text is encoded
back with the task tokenizer and closed with `</s>` (a response that SkyRL scores ended with a
stop; a response truncated at the length cap gets reward 0 through
`generator.zero_reward_on_non_stop=true`, as `integer_reward` gives 0 without `</s>`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from beam_rl.skyrl._compat import skyrl_gym_module
from beam_rl.tasks.arithmetic import Tokenizer, integer_reward

NAME = "beam_arithmetic"
"""`environment.env_class` (and each data row's `env_class`) that selects this environment."""


@lru_cache(maxsize=1)
def _tokenizer() -> Tokenizer:
    return Tokenizer()


def response_reward(text: str, answer: int) -> float:
    """`integer_reward` of a finished response given as text."""
    tok = _tokenizer()
    ids = tok.encode(text)
    if not ids or ids[-1] != tok.eos_id:
        ids.append(tok.eos_id)
    return integer_reward(ids, int(answer), tok)


@lru_cache(maxsize=1)
def _env_class():
    BaseTextEnv = skyrl_gym_module("skyrl_gym.envs.base_text_env").BaseTextEnv

    class BeamArithmeticEnv(BaseTextEnv):
        """One step: reward = integer_reward(response, ground_truth); done."""

        def __init__(self, env_config: Any = None, extras: dict | None = None):
            super().__init__()
            extras = extras or {}
            spec = extras.get("reward_spec") or {}
            if "ground_truth" not in spec:
                raise ValueError(f"env_class={NAME!r}: each data row needs reward_spec.ground_truth (the integer answer); "
                                 "write the data with `python -m beam_rl.skyrl.data`")
            self.answer = int(spec["ground_truth"])

        def step(self, action: str):
            return {"observations": [], "reward": response_reward(action, self.answer), "done": True, "metadata": {}}

    BeamArithmeticEnv.__module__ = __name__
    return BeamArithmeticEnv


def make_env(env_config: Any = None, extras: dict | None = None, **kwargs):
    """skyrl-gym entry point (`skyrl_gym.make(NAME, env_config=..., extras=...)`)."""
    return _env_class()(env_config=env_config, extras=extras)

"""DAPO's soft overlong punishment on SkyRL generator output, through
`beam_rl.dapo.overlong.soft_overlong_penalty`.

Applied to the training rollouts right after generation, before SkyRL's dynamic sampling, as
beam-rl's own loop does (a group's rewards include the penalty when its informativeness is
judged). L_max is `generator.sampling_params.max_generate_length`; the response length counts
every generated token, `</s>` included.
"""

from __future__ import annotations

from beam_rl.dapo.overlong import soft_overlong_penalty


def overlong_shaped_rewards(rewards: list, response_ids: list[list[int]], max_len: int, cache_length: int,
                            penalty_factor: float = 1.0) -> list[float]:
    """Each outcome reward plus the soft overlong penalty of its response."""
    if rewards and isinstance(rewards[0], list):
        raise ValueError("soft overlong punishment needs one outcome reward per response (got token-level rewards); "
                         "set trainer.algorithm.soft_overlong_punishment=false")
    if len(rewards) != len(response_ids):
        raise ValueError(f"{len(rewards)} rewards for {len(response_ids)} responses")
    return [float(r) + soft_overlong_penalty(len(ids), max_len, cache_length, penalty_factor) for r, ids in zip(rewards, response_ids)]

"""DAPO's overlong reward shaping.

Soft overlong punishment (DAPO eq. 13), with L_max = `max_len` and L_cache = `cache_length`:
    0                                    if |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max   (times penalty_factor)
    -1                                   if |y| > L_max                       (times penalty_factor)
added to the task reward. Overlong filtering: responses truncated at the cap (no end token) are
masked out of the loss.
"""

from __future__ import annotations


def soft_overlong_penalty(length: int, max_len: int, cache_length: int, penalty_factor: float = 1.0) -> float:
    """Penalty (<= 0) for a response of `length` tokens."""
    if cache_length <= 0:
        return -penalty_factor if length > max_len else 0.0
    expected = max_len - cache_length
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / cache_length * penalty_factor
    return -penalty_factor


def overlong_keep(truncated: list[bool], filtering: bool) -> list[bool]:
    """Whether each response carries loss: with filtering on, truncated responses do not."""
    return [not (filtering and t) for t in truncated]

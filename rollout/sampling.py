"""Seeded sampling in one launch per step: vLLM's `random_sample` with counter-based noise.

vLLM (0.26 through 0.32) samples on CUDA as argmax(probs / q), q ~ Exp(1), and fills q of a request
that has its own seed with one `q[i].exponential_(generator=...)` per row, from the host, on every
step (its own TODO: "This can be slow because we handle each request one by one"). The DAPO loop
seeds every request (a resumed run replays its rollouts), so at 512 rows that is 512 launches a
decode step. `counter_seeded_random_sample` fills every seeded row with one launch of
`beam_rl.kernels.seeded_noise`: row i's noise is a function of (its generator's seed, how many
tokens it has sampled, vocabulary id).

The draw index is the generator's own Philox offset / 4, read and advanced by 4 as an
`exponential_` of one row advances it; vLLM rewinds that offset by 4 when it discards a sampled
token (a chunked prefill's), so the index stays "tokens this request has kept": the same seed gives
the same tokens however the scheduler batches or chunks the request. CPU generators have no offset;
a per-generator count stands in (vLLM's CPU sampler does not call `random_sample`; this is for
tests and other callers).

Rows without a seed keep vLLM's draw from the engine's generator. The sequences differ from those
of vLLM's per-row generators for the same seeds (another random stream), not in distribution.
`install()` puts it in place of vLLM's `random_sample` in this process; `uninstall()` restores it.
"""

from __future__ import annotations

import weakref

import torch

from beam_rl.kernels.seeded_noise import as_int64, fill_exponential_noise_

# Philox offset advance of one `exponential_` of a vocabulary row, as vLLM's rewind assumes
PHILOX_OFFSET_PER_DRAW = 4

_cpu_draws: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vllm_random_sample = None


def draw_index(generator: torch.Generator) -> int:
    """The index of this draw from `generator` (0 for its first), advancing it by one draw."""
    if generator.device.type == "cpu":
        index = _cpu_draws.get(generator, 0)
        _cpu_draws[generator] = index + 1
        return index
    offset = generator.get_offset()
    generator.set_offset(offset + PHILOX_OFFSET_PER_DRAW)
    return offset // PHILOX_OFFSET_PER_DRAW


def counter_seeded_random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                                 use_fp64_gumbel: bool = False) -> torch.Tensor:
    """vLLM's `random_sample(probs, generators, use_fp64_gumbel)`, the seeded rows' noise from
    `fill_exponential_noise_` in one launch. FP64 noise (`use_fp64_gumbel`) goes to vLLM's own."""
    if not generators or use_fp64_gumbel:
        return _vllm_random_sample(probs, generators, use_fp64_gumbel)
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    rows = list(generators)
    keys = torch.tensor([rows, [as_int64(g.initial_seed()) for g in generators.values()],
                         [draw_index(g) for g in generators.values()]], dtype=torch.int64)
    if probs.is_cuda:
        keys = keys.pin_memory().to(probs.device, non_blocking=True)
    fill_exponential_noise_(q, keys[0], keys[1], keys[2])
    from vllm.v1.sample.ops.topk_topp_sampler import sample_with_exponential_noise

    return sample_with_exponential_noise(probs, q)


def installed() -> bool:
    from vllm.v1.sample.ops import topk_topp_sampler

    return topk_topp_sampler.random_sample is counter_seeded_random_sample


def install() -> None:
    """Use `counter_seeded_random_sample` for vLLM's sampling in this process (idempotent)."""
    global _vllm_random_sample
    from vllm.v1.sample.ops import topk_topp_sampler

    if not installed():
        _vllm_random_sample = topk_topp_sampler.random_sample
        topk_topp_sampler.random_sample = counter_seeded_random_sample


def uninstall() -> None:
    """vLLM's own `random_sample` again in this process."""
    from vllm.v1.sample.ops import topk_topp_sampler

    if installed():
        topk_topp_sampler.random_sample = _vllm_random_sample

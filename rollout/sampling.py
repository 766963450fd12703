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

Speculative decoding draws twice more per seeded request and step with drafts, again one host call
per request in vLLM: the uniforms that accept or reject its draft tokens (`generate_uniform_probs`)
and the noise of its recovered-token row (`sample_recovered_tokens`). `counter_seeded_uniform_probs`
and `counter_seeded_sample_recovered_tokens` draw both for every seeded request in one launch each,
each request's draws at the next draw indices of its generator (uniform, then recovered), so a
request's accept / reject decisions depend only on its seed and history, as vLLM's do.

Rows without a seed keep vLLM's draw from the engine's generator. The sequences differ from those
of vLLM's per-row generators for the same seeds (another random stream), not in distribution.
`install()` puts all three in place of vLLM's functions in this process; `uninstall()` restores them.
"""

from __future__ import annotations

import weakref

import torch

from beam_rl.kernels.seeded_noise import as_int64, fill_exponential_noise_, fill_uniform_noise_

# Philox offset advance of one `exponential_` of a vocabulary row, as vLLM's rewind assumes
PHILOX_OFFSET_PER_DRAW = 4

_cpu_draws: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vllm: dict[str, object] = {}
"""vLLM's own functions while ours are installed: "random_sample", "generate_uniform_probs",
"sample_recovered_tokens"."""


def draw_index(generator: torch.Generator) -> int:
    """The index of this draw from `generator` (0 for its first), advancing it by one draw."""
    if generator.device.type == "cpu":
        index = _cpu_draws.get(generator, 0)
        _cpu_draws[generator] = index + 1
        return index
    offset = generator.get_offset()
    generator.set_offset(offset + PHILOX_OFFSET_PER_DRAW)
    return offset // PHILOX_OFFSET_PER_DRAW


def _keys(rows: list[int], generators: list[torch.Generator], device: torch.device) -> torch.Tensor:
    """int64 [3, n] on `device`: rows, seeds, and each generator's next draw index (advancing it)."""
    keys = torch.tensor([rows, [as_int64(g.initial_seed()) for g in generators], [draw_index(g) for g in generators]],
                        dtype=torch.int64)
    if device.type == "cuda":
        keys = keys.pin_memory().to(device, non_blocking=True)
    return keys


def counter_seeded_random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                                 use_fp64_gumbel: bool = False) -> torch.Tensor:
    """vLLM's `random_sample(probs, generators, use_fp64_gumbel)`, the seeded rows' noise from
    `fill_exponential_noise_` in one launch. FP64 noise (`use_fp64_gumbel`) goes to vLLM's own."""
    if not generators or use_fp64_gumbel:
        return _vllm["random_sample"](probs, generators, use_fp64_gumbel)
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    fill_exponential_noise_(q, *_keys(list(generators), list(generators.values()), probs.device))
    from vllm.v1.sample.ops.topk_topp_sampler import sample_with_exponential_noise

    return sample_with_exponential_noise(probs, q)


def _seeded_with_drafts(num_draft_tokens: list[int], generators: dict[int, torch.Generator]) -> list[int]:
    """The batch rows that draw in rejection sampling from their own generator: seeded, with drafts
    (vLLM draws nothing for a request without drafts)."""
    return [i for i, n in enumerate(num_draft_tokens) if n > 0 and i in generators]


def counter_seeded_uniform_probs(num_tokens: int, num_draft_tokens: list[int], generators: dict[int, torch.Generator],
                                 device: torch.device) -> torch.Tensor:
    """vLLM's `generate_uniform_probs`: FP64 [num_tokens] uniforms, one per draft token (request i's
    `num_draft_tokens[i]` in a row). A seeded request with drafts takes its uniforms from
    `fill_uniform_noise_` (exact multiples of 2^-24 inside (0, 1): never 0, the reason vLLM draws in
    FP64), all in one launch; requests without drafts draw nothing, as in vLLM."""
    rows = _seeded_with_drafts(num_draft_tokens, generators)
    if not rows:
        return _vllm["generate_uniform_probs"](num_tokens, num_draft_tokens, generators, device)
    uniform = torch.rand((num_tokens,), dtype=torch.float64, device=device)
    counts = [num_draft_tokens[i] for i in rows]
    noise = torch.empty((len(rows), max(counts)), dtype=torch.float32, device=device)
    fill_uniform_noise_(noise, *_keys(list(range(len(rows))), [generators[i] for i in rows], device))
    starts = [0]
    for n in num_draft_tokens[:-1]:
        starts.append(starts[-1] + n)
    where = torch.tensor([[starts[i] + j for i, n in zip(rows, counts) for j in range(n)],
                          [k for k, n in enumerate(counts) for _ in range(n)],
                          [j for n in counts for j in range(n)]], dtype=torch.int64)
    if device.type == "cuda":
        where = where.pin_memory().to(device, non_blocking=True)
    uniform[where[0]] = noise[where[1], where[2]].double()
    return uniform


def counter_seeded_sample_recovered_tokens(max_spec_len: int, num_draft_tokens: list[int],
                                           cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                                           draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                                           sampling_metadata, device: torch.device,
                                           use_fp64_gumbel: bool = False) -> torch.Tensor:
    """vLLM's `sample_recovered_tokens`: each draft position's recovered token, argmax of its residual
    distribution over the request's Exp(1) noise row, by vLLM's own kernel; a seeded request's row
    with drafts from `fill_exponential_noise_`, all in one launch. FP64 noise goes to vLLM's own."""
    generators = sampling_metadata.generators
    rows = _seeded_with_drafts(num_draft_tokens, generators)
    if not rows or use_fp64_gumbel:
        return _vllm["sample_recovered_tokens"](max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
                                                draft_probs, target_probs, sampling_metadata, device, use_fp64_gumbel)
    q = torch.empty((len(num_draft_tokens), target_probs.shape[-1]), dtype=torch.float32, device=device)
    if len(rows) != len(num_draft_tokens):
        q.exponential_()
    fill_exponential_noise_(q, *_keys(rows, [generators[i] for i in rows], device))
    from beam_rl.rollout.compat import sample_recovered_tokens

    recovered = torch.empty_like(draft_token_ids)
    sample_recovered_tokens(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, q.reciprocal(),
                            max_spec_len)
    return recovered


_OURS = {"random_sample": counter_seeded_random_sample, "generate_uniform_probs": counter_seeded_uniform_probs,
         "sample_recovered_tokens": counter_seeded_sample_recovered_tokens}


def _modules():
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    return {"random_sample": topk_topp_sampler, "generate_uniform_probs": rejection_sampler,
            "sample_recovered_tokens": rejection_sampler}


def installed() -> bool:
    return all(getattr(module, name) is _OURS[name] for name, module in _modules().items())


def install() -> None:
    """Use the counter-seeded draws for vLLM's sampling and rejection sampling in this process (idempotent)."""
    for name, module in _modules().items():
        if getattr(module, name) is not _OURS[name]:
            _vllm[name] = getattr(module, name)
            setattr(module, name, _OURS[name])


def uninstall() -> None:
    """vLLM's own functions again in this process."""
    for name, module in _modules().items():
        if getattr(module, name) is _OURS[name]:
            setattr(module, name, _vllm[name])

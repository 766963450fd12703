"""The CPU routing capture (`beam_rl.rollout.capture`) under speculative decoding's schedule: rows
are filed by position, so a rejected draft token's routing is overwritten by the token that
replaces it, and rows past the request's end are cut by `fetch_captured_routing`'s length."""

import numpy as np
import torch

from beam_rl.rollout.capture import RequestRouting, RoutingRecorder

L, K = 3, 2  # layers, top-k


def routing_of(token: int, position: int) -> torch.Tensor:
    """A deterministic stand-in for the experts a token picks at a position (what a forward computes)."""
    return torch.tensor([[(token * 7 + position * 3 + layer * 5 + j) % 16 for j in range(K)] for layer in range(L)])


def step(recorder, routing, req, tokens, positions):
    """One model step of one request: every fed token's routing written, then filed by position."""
    recorder.enabled = True
    for layer in range(L):
        recorder.record(layer, torch.stack([routing_of(t, p)[layer] for t, p in zip(tokens, positions)]))
    routing.file_step([req], [len(tokens)], torch.tensor(positions))


def test_rejected_drafts_never_reach_the_reported_routing():
    recorder = RoutingRecorder(max_tokens=16, num_layers=L, top_k=K, num_experts=16)
    routing = RequestRouting(recorder)
    prompt = [5, 6, 7]
    step(recorder, routing, "r", prompt, [0, 1, 2])  # prefill; samples 10 at position 3
    # verify: 10 and the drafts 11, 12, 13 at positions 3..6; 11 accepted, 12 rejected (the target says 20)
    step(recorder, routing, "r", [10, 11, 12, 13], [3, 4, 5, 6])
    # next: the corrected 20 at position 5 and new drafts 21, 22; all accepted, bonus 30; the request stops
    step(recorder, routing, "r", [20, 21, 22], [5, 6, 7])
    final = prompt + [10, 11, 20, 21, 22, 30]  # the last sampled token (30) never passes through the model
    arr = routing.pop("r")
    need = len(final) - 1
    kept = arr[:need]  # what fetch_captured_routing keeps
    expected = np.stack([routing_of(t, p).numpy() for p, t in enumerate(final[:-1])])
    assert np.array_equal(kept, expected.astype(kept.dtype))
    rejected = {(12, 5), (13, 6)}
    assert not any(np.array_equal(kept[p], routing_of(t, p).numpy()) for t, p in rejected)

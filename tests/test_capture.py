"""The routing capture (`beam_rl.rollout.capture`), driven as the worker extension drives it:
rows are filed by position, the last write of a position winning, so a rejected draft token's
routing is overwritten by the token that replaces it (speculative decoding's schedule) and a
recomputed prompt's by its recompute; rows past the request's end are cut by
`fetch_captured_routing`'s length; requests sharing steps are split apart."""

import numpy as np
import pytest
import torch

from beam_rl.rollout.capture import RequestRouting, RoutingRecorder

L, K = 3, 2  # layers, top-k


def routing_of(token: int, position: int) -> torch.Tensor:
    """A deterministic stand-in for the experts a token picks at a position (what a forward computes)."""
    return torch.tensor([[(token * 7 + position * 3 + layer * 5 + j) % 16 for j in range(K)] for layer in range(L)])


def step(recorder, routing, req, tokens, positions):
    """One model step of one request: every fed token's routing written, then filed by position."""
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
    arr = routing.pop_many(["r"])["r"]
    need = len(final) - 1
    kept = arr[:need]  # what fetch_captured_routing keeps
    expected = np.stack([routing_of(t, p).numpy() for p, t in enumerate(final[:-1])])
    assert np.array_equal(kept, expected.astype(kept.dtype))
    rejected = {(12, 5), (13, 6)}
    assert not any(np.array_equal(kept[p], routing_of(t, p).numpy()) for t, p in rejected)


def test_requests_sharing_steps_get_their_own_rows_and_the_rest_stay():
    """Three requests batched over steps as a scheduler would (prefills of different lengths, then
    decodes; "b" preempted and recomputed from position 0): each popped array equals its own
    routing by position; popping some leaves the others' rows intact."""
    recorder = RoutingRecorder(max_tokens=16, num_layers=L, top_k=K, num_experts=16)
    routing = RequestRouting(recorder)
    seqs = {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8, 9, 10, 11], "c": [12, 13, 14, 15]}
    schedule = [  # per step: [(request, first position, count)]
        [("a", 0, 3), ("b", 0, 2)],
        [("a", 3, 1), ("b", 2, 1), ("c", 0, 2)],
        [("a", 4, 1), ("c", 2, 1)],  # b preempted
        [("b", 0, 4), ("a", 5, 1), ("c", 3, 1)],  # b recomputed (its routing rewritten)
    ]
    recompute = 100  # the recompute's tokens route differently (as another batch shape might)
    for i, entries in enumerate(schedule):
        rows, positions = [], []
        for req, first, count in entries:
            for p in range(first, first + count):
                token = seqs[req][p] + (recompute if (req == "b" and i == 3) else 0)
                rows.append(routing_of(token, p))
                positions.append(p)
        for layer in range(L):
            recorder.record(layer, torch.stack([r[layer] for r in rows]))
        routing.file_step([e[0] for e in entries], [e[2] for e in entries], torch.tensor(positions))

    def expected(req):
        extra = recompute if req == "b" else 0
        n = {"a": 6, "b": 4, "c": 4}[req]
        return np.stack([routing_of(seqs[req][p] + extra, p).numpy() for p in range(n)]).astype(np.uint8)

    first = routing.pop_many(["a", "c", "missing"])
    assert set(first) == {"a", "c"} and routing.known() == ["b"]
    for req in ("a", "c"):
        assert first[req].dtype == np.uint8 and np.array_equal(first[req], expected(req))
    assert np.array_equal(routing.pop_many(["b"])["b"], expected("b"))
    assert routing.known() == [] and routing.pop_many(["a"]) == {}


def test_a_popped_request_id_filed_again_gets_its_own_rows():
    """The request-row array is reused while the batch keeps its ids; popping resets it, so an id
    vLLM reuses after its request was popped (same batch order) files into a fresh entry."""
    recorder = RoutingRecorder(max_tokens=16, num_layers=L, top_k=K, num_experts=16)
    routing = RequestRouting(recorder)
    for position in range(3):  # "r" and "s" decode together: the same batch each step
        step_rows = [routing_of(1, position), routing_of(2, position)]
        for layer in range(L):
            recorder.record(layer, torch.stack([r[layer] for r in step_rows]))
        routing.file_step(["r", "s"], [1, 1], torch.tensor([position, position]))
    first = routing.pop_many(["r", "s"])
    assert np.array_equal(first["s"], np.stack([routing_of(2, p).numpy() for p in range(3)]))
    for layer in range(L):
        recorder.record(layer, torch.stack([routing_of(3, 0)[layer], routing_of(4, 0)[layer]]))
    routing.file_step(["r", "s"], [1, 1], torch.tensor([0, 0]))
    again = routing.pop_many(["r", "s"])
    assert np.array_equal(again["r"], routing_of(3, 0).numpy()[None]) and np.array_equal(again["s"], routing_of(4, 0).numpy()[None])


def test_a_count_per_request_is_required():
    routing = RequestRouting(RoutingRecorder(max_tokens=4, num_layers=L, top_k=K, num_experts=16))
    with pytest.raises(ValueError, match=r"one count per request \(2\)"):
        routing.file_step(["a", "b"], [1], torch.tensor([0]))


def test_popped_requests_leave_nothing_behind():
    """A long run files and pops requests by the million: nothing of a popped request stays."""
    recorder = RoutingRecorder(max_tokens=4, num_layers=L, top_k=K, num_experts=16)
    routing = RequestRouting(recorder)
    for n in range(50):
        for layer in range(L):
            recorder.record(layer, routing_of(n, 0)[layer][None])
        routing.file_step([f"req-{n}"], [1], torch.tensor([0]))
        assert np.array_equal(routing.pop_many([f"req-{n}"])[f"req-{n}"], routing_of(n, 0).numpy()[None])
    assert routing.request_index == {} and routing.request_ids == {} and routing.steps == []

"""Shared-prompt packing (`beam_rl.megatron.packing`): the layout, the Megatron Beam model's log-probs
and gradients packed against the same rows unpacked (beam-tiny on CPU, R3 replay, responses that cross
the sliding window, groups interleaved in the batch, a group of one), and micro-batches that keep a
prompt's requests together."""

import pytest
import torch

pytest.importorskip("megatron.core")

from beam_rl.megatron import replay as r3  # noqa: E402
from beam_rl.megatron.cpu import init_single_process  # noqa: E402
from beam_rl.megatron.logprobs import packed_sequence_logprobs, sequence_logprobs  # noqa: E402
from beam_rl.megatron.packing import pack_shared_prompts, prompt_groups  # noqa: E402
from beam_rl.megatron.provider import BeamModelProvider  # noqa: E402
from beam_rl.model.modeling import build_model  # noqa: E402
from beam_rl.r3 import pad_routed_experts, prompt_grouped_micro_batches  # noqa: E402


def _batch(vocab: int):
    """Three prompts (20, 7, 12 tokens) with 3, 1 and 2 responses (beam-tiny's window is 16: the
    25- and 30-token responses cross it), the groups' rows interleaved."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for P, responses in ((20, (9, 25, 3)), (7, (30,)), (12, (18, 1))):
        prompt = torch.randint(1, vocab, (P,), generator=g)
        rows += [(P, torch.cat([prompt, torch.randint(1, vocab, (G,), generator=g)])) for G in responses]
    rows = [rows[i] for i in (0, 3, 1, 4, 2, 5)]
    T = max(len(r) for _, r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for b, (_, r) in enumerate(rows):
        ids[b, : len(r)] = r
    return ids, torch.tensor([len(r) for _, r in rows]), torch.tensor([P for P, _ in rows])


def test_layout_puts_each_response_after_its_prompt_at_its_own_positions():
    ids = torch.tensor([[5, 6, 7, 1, 2, 0], [5, 6, 7, 3, 4, 8], [9, 9, 4, 0, 0, 0]])
    lengths, prompts = torch.tensor([5, 6, 3]), torch.tensor([3, 3, 2])
    assert prompt_groups(ids, prompts) == [[0, 1], [2]]
    p = pack_shared_prompts(ids, lengths, prompts)
    assert p.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4, 8], [9, 9, 4, 0, 0, 0, 0, 0]]
    assert p.positions.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 2, 2, 2, 2, 2]]
    assert p.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1]]
    assert p.lengths.tolist() == [8, 3] and p.unpacked_shape == (3, 5)
    # every unpacked log-prob (row b, column t: of token t + 1) reads the packed row that predicts it
    R = 2
    got = {}
    for k, (i, tgt) in enumerate(zip(p.gather_rows.tolist(), p.targets.tolist())):
        flat = int(p.logit_rows[i])
        got[divmod(int(p.out_index[k]), 5)] = ((flat % R, flat // R), tgt)
    assert got == {
        (0, 2): ((0, 2), 1), (0, 3): ((0, 3), 2),  # the prompt's last row predicts each member's first token
        (1, 2): ((0, 2), 3), (1, 3): ((0, 5), 4), (1, 4): ((0, 6), 8),
        (2, 1): ((1, 1), 4),
    }
    assert p.logit_rows.numel() == 5  # the prompt's last row once for both members


def test_layout_refuses_lengths_outside_the_batch():
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="row 0: prompt length 5 and length 3"):
        pack_shared_prompts(ids, torch.tensor([3]), torch.tensor([5]))


@pytest.mark.parametrize("mode,dtype,recompute", [("fp32", torch.float32, False), ("fp32", torch.float32, True),
                                                   ("bf16", torch.bfloat16, False)])
def test_packed_logprobs_and_gradients_are_the_unpacked_ones(tiny_config, mode, dtype, recompute):
    """R3 on (the reference model's routing). FP32 (with and without full activation recompute): log-probs
    within 1e-5, gradients within 1e-5 of each tensor's largest. BF16 on CPU: log-probs identical;
    gradients within 3% of each tensor's largest, the BF16 gradients' own spread (the same rows in another
    order differ by ~0.7%)."""
    init_single_process()
    ids, lengths, prompts = _batch(tiny_config.vocab_size)
    ref = build_model(tiny_config, seed=0, dtype=dtype)
    model = BeamModelProvider(tiny_config, mode=mode, recompute=recompute).provide_loaded(ref.state_dict()).train()
    with torch.no_grad():
        routed = pad_routed_experts([ref(ids[b : b + 1, : lengths[b]]).routed_experts[0] for b in range(len(ids))],
                                    ids.shape[1], tiny_config)

    def grads():
        out = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    lp, mask = sequence_logprobs(model, ids, config=tiny_config, lengths=lengths, prompt_lengths=prompts, routed_experts=routed)
    (lp * mask).sum().backward()
    r3.clear_replay(model)
    unpacked = grads()
    packed = pack_shared_prompts(ids, lengths, prompts, routed)
    assert packed.input_ids.shape[0] == 3 and packed.logit_rows.numel() == int(mask.sum()) - 3  # 3 members share a last prompt row
    plp = packed_sequence_logprobs(model, packed, config=tiny_config)
    (plp * mask).sum().backward()
    r3.clear_replay(model)
    shared = grads()
    assert bool((plp[~mask] == 0).all())
    if dtype == torch.bfloat16:
        assert torch.equal(plp[mask], lp[mask])
    else:
        torch.testing.assert_close(plp[mask], lp[mask], atol=1e-5, rtol=0)
    bound = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert shared.keys() == unpacked.keys()
    for name, g in unpacked.items():
        worst = float((shared[name] - g).abs().max() / g.abs().max().clamp_min(1e-30))
        assert worst <= bound, (name, worst)


def test_segment_ids_must_be_shaped_like_the_positions_and_boolean_masks_are_ignored(tiny_config):
    """Integer segment ids of another shape are refused by name; a boolean mask (SkyRL passes Transformer
    Engine's padding mask in that slot) changes nothing, as before packing existed."""
    init_single_process()
    model = BeamModelProvider(tiny_config, mode="fp32").provide_loaded(build_model(tiny_config, seed=0).state_dict())
    ids, pos = torch.arange(1, 7)[None], torch.arange(6)[None]
    with torch.no_grad():
        with pytest.raises(ValueError, match="integer segment ids shaped like the positions"):
            model(ids, pos, torch.zeros(1, 5, dtype=torch.int32))
        plain = model(ids, pos, None)
        assert torch.equal(model(ids, pos, torch.ones(1, 1, 6, 6, dtype=torch.bool)), plain)
        assert torch.equal(model(ids, pos, torch.zeros(1, 6, dtype=torch.int32)), plain)  # one segment: the plain rule


def test_micro_batches_keep_a_prompts_requests_together():
    prompts = [b"a", b"b", b"a", b"c", b"b", b"a", b"c"]
    plen = [4, 10, 4, 2, 10, 4, 2]
    resp = [5, 1, 5, 3, 1, 5, 3]
    parts = prompt_grouped_micro_batches(prompts, plen, resp, 4)
    assert parts == [[3, 6, 1, 4], [0, 2, 5]]  # packed widths 8, 12, 19: shortest first, no group split
    # 'a' cut at 2: pieces of width 14 and 9
    assert prompt_grouped_micro_batches(prompts, plen, resp, 2) == [[3, 6], [5], [1, 4], [0, 2]]
    assert sorted(i for p in prompt_grouped_micro_batches(prompts, plen, resp, 5) for i in p) == list(range(7))


def test_flash_block_mask_with_segments_is_each_members_own_attention():
    """FlexAttention's block mask over a packed row (prompt, then two responses at the positions they had
    in their own sequences): each response token's output is its own sequence's attention (the FP64 spec,
    within BF16 P and output rounding), with and without the window."""
    from beam_rl.megatron.attention import flash_attention
    from beam_rl.model import numerics

    gen = torch.Generator().manual_seed(1)
    H, KV, D, P, lens = 4, 2, 16, 20, (14, 25)
    S = P + sum(lens)
    q, k, v = (torch.randn(1, n, S, D, generator=gen).to(torch.bfloat16) for n in (H, KV, KV))
    positions = torch.cat([torch.arange(P)] + [torch.arange(P, P + n) for n in lens])[None]
    segments = torch.cat([torch.zeros(P, dtype=torch.int32)] + [torch.full((n,), i + 1, dtype=torch.int32)
                                                                 for i, n in enumerate(lens)])[None]
    for window in (None, 16):
        got = flash_attention(q, k, v, positions, window, segments=segments)
        start = P
        for n in lens:
            own = torch.cat([torch.arange(P), torch.arange(start, start + n)])  # the member's own sequence
            qs, ks, vs = (t[0][:, own].transpose(0, 1) for t in (q, k, v))
            want = numerics.attention(qs, ks, vs, positions[0, own], positions[0, own], window).transpose(0, 1)[:, P:]
            err = (got[0, :, start:start + n].float() - want.float()).abs().max().item()
            assert err <= 2e-2, (window, n, err)  # BF16 P and output vs the FP64 spec
            start += n


def test_prompt_routing_disagreement_counts_differing_prompt_rows(tiny_config):
    import numpy as np

    from beam_rl.r3 import RolloutSample, prompt_routing_disagreement

    L, K = tiny_config.num_moe_layers, tiny_config.num_experts_per_tok

    def sample(prompt, routed):
        return RolloutSample(prompt_ids=np.array(prompt), output_ids=np.array([7, 8]), logprobs=np.zeros(2),
                             routed_experts=routed)

    base = np.tile(np.arange(K, dtype=np.int16), (5, L, 1))  # 3 prompt + 2 output tokens - 1 = 4 rows; one spare
    other = base.copy()
    other[1, L - 1, 0] = K  # a prompt row routed differently in the last MoE layer
    other[3, 0, 0] = K  # a response row: not the prompt's
    samples = [sample([1, 2, 3], base[:4]), sample([1, 2, 3], other[:4]), sample([4, 5, 6], other[:4])]
    assert prompt_routing_disagreement(samples) == pytest.approx(1 / 3)  # 1 of the second request's 3 prompt rows
    assert prompt_routing_disagreement(samples[:1] + samples[2:]) == 0.0

"""R3 payloads: rollout samples -> the trainer's right-padded token order, and strict validation.

Hand-built samples (routing and log-probs from the reference model, so replay on the Megatron
model must reproduce the rollout's log-probs exactly up to FP32 rounding)."""

import numpy as np
import pytest
import torch

from beam_rl.r3 import R3Error, RolloutBatch, RolloutSample


def make_sample(config, prompt_len, output_len, seed):
    g = np.random.default_rng(seed)
    n = prompt_len + output_len
    routed = np.stack([np.stack([g.permutation(config.num_experts)[: config.num_experts_per_tok]
                                 for _ in range(config.num_moe_layers)]) for _ in range(n - 1)]).astype(np.uint8)
    return RolloutSample(
        prompt_ids=g.integers(0, config.vocab_size, prompt_len),
        output_ids=g.integers(0, config.vocab_size, output_len),
        logprobs=-g.random(output_len).astype(np.float32) - 0.1,
        routed_experts=routed,
    )


def test_padded_alignment_hand_built(tiny_config):
    K, L = tiny_config.num_experts_per_tok, tiny_config.num_moe_layers
    a, b = make_sample(tiny_config, 3, 4, 0), make_sample(tiny_config, 5, 1, 1)  # 7 and 6 tokens
    tb = RolloutBatch((a, b), tiny_config).to_trainer(pad_to_multiple=4)
    assert tb.input_ids.shape == (2, 8) and tb.indices == (0, 1)
    assert tb.input_ids[0].tolist() == list(a.prompt_ids) + list(a.output_ids) + [0]
    assert tb.input_ids[1].tolist() == list(b.prompt_ids) + list(b.output_ids) + [0, 0]
    assert tb.lengths.tolist() == [7, 6] and tb.prompt_lengths.tolist() == [3, 5]
    # column t holds log p(token t + 1): output token j of a request with P prompt tokens sits at P + j - 1
    assert tb.mask.tolist() == [[False, False, True, True, True, True, False], [False] * 4 + [True, False, False]]
    assert tb.rollout_logprobs[0, 2:6].tolist() == a.logprobs.tolist()
    assert tb.rollout_logprobs[1, 4].item() == b.logprobs[0]
    assert tb.rollout_logprobs[~tb.mask].abs().sum() == 0
    # routing row t = token t (prompt tokens included); the last token and padding get 0..K-1
    assert tb.routed_experts.dtype == torch.uint8 and tb.routed_experts.shape == (2, 8, L, K)
    assert np.array_equal(tb.routed_experts[0, :6].numpy(), a.routed_experts)
    assert np.array_equal(tb.routed_experts[1, :5].numpy(), b.routed_experts)
    filler = torch.arange(K, dtype=torch.uint8).expand(L, K)
    for row, t in ((0, 6), (0, 7), (1, 5), (1, 6), (1, 7)):
        assert torch.equal(tb.routed_experts[row, t], filler)
    assert tb.routed_rows.tolist() == [[True] * 6 + [False] * 2, [True] * 5 + [False] * 3]


def test_micro_batches_cover_every_request_once_shortest_first(tiny_config):
    """Micro-batches take the requests by length (ties in order), each padded to its own longest:
    3 padding tokens here where the arrival order has 7; every request once, every generated token
    masked in once."""
    prompts, outputs = [2, 3, 4, 5, 6], [6, 1, 2, 4, 1]
    batch = RolloutBatch(tuple(make_sample(tiny_config, p, o, i) for i, (p, o) in enumerate(zip(prompts, outputs))), tiny_config)
    mbs = list(batch.micro_batches(2))
    assert [m.indices for m in mbs] == [(1, 2), (4, 0), (3,)]  # 4, 6, 7, 8, 9 tokens
    assert [m.input_ids.shape[1] for m in mbs] == [6, 8, 9]
    assert sum(int(m.mask.sum()) for m in mbs) == batch.num_generated_tokens
    assert [m.indices for m in batch.micro_batches(2, rows=[3, 0, 4])] == [(4, 0), (3,)]
    with pytest.raises(R3Error, match="out of range"):
        batch.to_trainer([5])
    with pytest.raises(R3Error, match="micro-batch size must be >= 1, got 0"):
        list(batch.micro_batches(0))


def bad(change):
    def make(config):
        s = make_sample(config, 4, 3, 7)
        return RolloutSample(**{**s.__dict__, **change(s, config)})
    return make


@pytest.mark.parametrize("make, message", [
    (bad(lambda s, c: {"routed_experts": s.routed_experts.astype(np.int64)}), "request 1: routed_experts dtype int64; expected compact uint8"),
    (bad(lambda s, c: {"routed_experts": s.routed_experts[:-1]}), "request 1: routed_experts has 5 token rows; prompt 4 \\+ output 3 tokens need 6"),
    (bad(lambda s, c: {"routed_experts": np.zeros((6, c.num_hidden_layers, c.num_experts_per_tok), np.uint8)}),
     "request 1: routed_experts has 6 layers; the config has 5 MoE layers"),
    (bad(lambda s, c: {"routed_experts": s.routed_experts[..., :-1]}), "request 1: routed_experts top_k = 3"),
    (bad(lambda s, c: {"routed_experts": s.routed_experts[0]}), "request 1: routed_experts must be \\[tokens - 1, moe_layers, top_k\\]"),
    (bad(lambda s, c: {"routed_experts": np.where(np.arange(5)[None, :, None] == 2, s.routed_experts + 16, s.routed_experts).astype(np.uint8)}),
     "request 1: expert id .* >= num_experts=16 at token 0, MoE layer 2 \\(model layer 3\\)"),
    (bad(lambda s, c: {"routed_experts": np.concatenate([s.routed_experts[..., :1]] * 2 + [s.routed_experts[..., 2:]], -1)}),
     "request 1: token 0 repeats an expert in MoE layer 0 \\(model layer 1\\)"),
    (bad(lambda s, c: {"logprobs": s.logprobs[:-1]}), "request 1: logprobs shape \\(2,\\); expected \\[3\\]"),
    (bad(lambda s, c: {"logprobs": np.array([-1.0, 0.5, -1.0], np.float32)}), "request 1: logprobs\\[1\\] = 0.5"),
    (bad(lambda s, c: {"logprobs": s.logprobs.astype(np.int32)}), "request 1: logprobs must be floating point"),
    (bad(lambda s, c: {"output_ids": np.array([], np.int64), "logprobs": np.array([], np.float32)}), "request 1: output_ids is empty"),
    (bad(lambda s, c: {"prompt_ids": np.array([1, 2, 3, 512])}), "request 1: prompt_ids must lie in \\[0, vocab_size=512\\)"),
    (bad(lambda s, c: {"output_ids": s.output_ids.astype(np.float32)}), "request 1: output_ids must hold integer token ids"),
])
def test_validation_names_request_and_field(tiny_config, make, message):
    good = make_sample(tiny_config, 2, 2, 0)
    with pytest.raises(R3Error, match=message):
        RolloutBatch((good, make(tiny_config)), tiny_config)


def test_uint16_for_more_than_256_experts(tiny_config):
    from beam_rl.r3 import rollout_id_dtype, trainer_id_dtype

    assert rollout_id_dtype(256) == np.uint8 and rollout_id_dtype(257) == np.uint16
    assert trainer_id_dtype(256) == torch.uint8 and trainer_id_dtype(257) == torch.int32


def test_trainer_batch_keeps_ids_above_255(tiny_config):
    """Above 256 experts the rollout ids are uint16 and the trainer batch holds them unchanged."""
    cfg = tiny_config.__class__(**{**tiny_config.to_dict(), "num_experts": 512, "n_group": 4, "topk_group": 2})
    L, K = cfg.num_moe_layers, cfg.num_experts_per_tok
    routed = np.stack([np.arange(K, dtype=np.uint16) + 500 - 7 * t for t in range(4)])[:, None].repeat(L, 1)
    sample = RolloutSample(np.array([1, 2, 3]), np.array([4, 5]), np.array([-0.5, -0.25], np.float32), routed)
    batch = RolloutBatch((sample,), cfg).to_trainer()
    assert batch.routed_experts.dtype == torch.int32
    assert torch.equal(batch.routed_experts[0, :4], torch.from_numpy(routed.astype(np.int32)))


def test_from_vllm_drops_dense_rows_by_type(tiny_config):
    """vLLM's all-layer routing array loses its dense-layer rows by layer type, never by value."""
    from types import SimpleNamespace

    L, K = tiny_config.num_hidden_layers, tiny_config.num_experts_per_tok
    routed = np.stack([np.random.default_rng(t).permutation(tiny_config.num_experts)[:K] for t in range(9 * L)])
    routed = routed.reshape(9, L, K).astype(np.uint8)
    out_ids = [7, 8, 9, 10]
    completion = SimpleNamespace(token_ids=out_ids, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in out_ids])
    output = SimpleNamespace(prompt_token_ids=[1, 2, 3, 4, 5, 6], outputs=[completion])
    sample = RolloutSample.from_vllm(output, routed, tiny_config)
    assert np.array_equal(sample.routed_experts, routed[:, tiny_config.moe_layer_ids])
    sample.validate(tiny_config)
    with pytest.raises(R3Error, match="num_hidden_layers"):
        RolloutSample.from_vllm(output, routed[:, 1:], tiny_config)


def test_replayed_trainer_batch_reproduces_rollout_logprobs(tiny_config):
    """Rollout = the FP32 reference model (its tokens' log-probs and routing); the trainer = the
    FP32 Megatron model fed `to_trainer()`'s batch with R3: identical up to FP32 rounding, for
    variable-length prompts and outputs in one padded batch."""
    pytest.importorskip("megatron.core")
    from beam_rl.model.modeling import build_model
    from beam_rl.megatron.cpu import init_single_process
    from beam_rl.megatron.logprobs import sequence_logprobs
    from beam_rl.megatron.provider import BeamModelProvider
    from beam_rl.megatron.replay import clear_replay

    init_single_process()
    ref = build_model(tiny_config, seed=0, dtype=torch.float32)
    meg = BeamModelProvider(tiny_config, mode="fp32").provide_loaded(ref.state_dict()).eval()
    g = torch.Generator().manual_seed(3)
    samples = []
    for P, G in ((5, 30), (19, 4), (2, 12)):  # longest crosses the 16-token window
        ids = torch.randint(0, tiny_config.vocab_size, (1, P + G), generator=g)
        with torch.no_grad():
            out = ref(ids)
        lp = torch.log_softmax(out.logits[0, P - 1 : -1].float(), -1).gather(-1, ids[0, P:, None])[:, 0]
        samples.append(RolloutSample(ids[0, :P].numpy(), ids[0, P:].numpy(), lp.numpy(),
                                     out.routed_experts[0, :-1].to(torch.uint8).numpy()))
    tb = RolloutBatch(tuple(samples), tiny_config).to_trainer()
    with torch.no_grad():
        lp, mask = sequence_logprobs(meg, tb.input_ids, config=tiny_config, lengths=tb.lengths,
                                     prompt_lengths=tb.prompt_lengths, routed_experts=tb.routed_experts)
    clear_replay(meg)
    assert torch.equal(mask, tb.mask)
    assert (lp - tb.rollout_logprobs)[mask].abs().max() < 1e-4

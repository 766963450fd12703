"""beam-rl's engine on the GPU as the DAPO loop runs it: async scheduling, CUDA graphs, beam-rl's
routing capture next to vLLM's own in one engine, and in-memory weight updates. Skips cleanly
without CUDA. On the H200: `bash scripts/h200_campaign.sh rollout_gpu`.

- The capture returns exactly vLLM's arrays for every request, including requests that stop
  early on a stop token (async scheduling has already run one more forward for them), with the
  engine's CUDA graphs on (the model records inside every graph).
- The loop's in-memory update (direct into the parameters on CUDA) leaves the parameters a file
  update through vLLM's layerwise machinery and a file reload leave; greedy generation is the same
  after a reload and after an in-memory update; a wrong fingerprint stops the update; fingerprints
  are the same computed on the GPU and on the CPU.
- Counter-seeded sampling (`beam_rl.rollout.sampling`, on by default): the same seeds give the same
  tokens again, and a request's tokens do not depend on the requests beside it; vLLM's per-row
  generators give other tokens from the same seeds, at the same distribution (mean log-prob).
- The MXFP8 rollout's experts (grouped GEMMs) replay in a CUDA graph and equal the per-expert loop.
"""

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from beam_rl.engines import EngineSettings, Sampling, start_rollout_engine  # noqa: E402
from beam_rl.engines.base import checksums_of  # noqa: E402
from beam_rl.model.checkpoint import load_config, read_tensors, save_checkpoint  # noqa: E402
from beam_rl.model.modeling import build_model  # noqa: E402
from beam_rl.model.presets import get_preset  # noqa: E402
from beam_rl.rollout.reload import load_weights  # noqa: E402
from beam_rl.rollout.routing import fetch_captured_routing  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    config = get_preset("beam-mini")
    out = []
    for seed in (0, 1):
        save_checkpoint(build_model(config, seed=seed, dtype=torch.bfloat16), root / f"seed{seed}")
        out.append(str(root / f"seed{seed}"))
    return out


@pytest.fixture(scope="module")
def engine(checkpoints):
    e = start_rollout_engine(EngineSettings(
        model=checkpoints[0], max_model_len=160, max_num_seqs=64, enforce_eager=False, capture_routing=True,
        gpu_memory_utilization=0.4, engine_args={"enable_return_routed_experts": True}))
    assert e.llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    return e


def _prompts(vocab: int, n: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (int(torch.randint(8, 96, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_capture_equals_vllms_under_async_scheduling_and_cuda_graphs(engine):
    from vllm import SamplingParams

    vocab = engine.config.vocab_size
    prompts = _prompts(vocab, 48)
    # frequent stop tokens: many requests finish early, after async scheduling ran their next forward
    stops = list(range(0, vocab, 97))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, stop_token_ids=stops, detokenize=False)
              for i in range(len(prompts))]
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = fetch_captured_routing(engine.llm, outs)
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    assert stopped >= 8, f"only {stopped} requests stopped early"
    for o, a in zip(outs, ours):
        theirs = np.asarray(o.outputs[0].routed_experts)
        assert a.shape == theirs.shape and np.array_equal(a, theirs), o.request_id
    print(f"\ncapture: {len(outs)} requests ({stopped} stopped early), {sum(a.shape[0] for a in ours)} rows, "
          "identical to vLLM's routed_experts")


def test_counter_seeded_sampling_reproduces_per_request(engine):
    from vllm import SamplingParams

    assert engine.llm.collective_rpc("beam_counter_seeded_sampling", args=(True,)) == [True]
    prompts = _prompts(engine.config.vocab_size, 48)

    def run(ps, seeds):
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=32, logprobs=0, detokenize=False) for s in seeds]
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        fetch_captured_routing(engine.llm, outs)  # consume the capture
        return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].cumulative_logprob for o in outs]

    seeds = list(range(100, 148))
    first, lp_ours = run(prompts, seeds)
    assert run(prompts, seeds)[0] == first
    # every third request alone, in reverse order: other batch rows, other batch size
    picked = list(range(0, 48, 3))[::-1]
    assert run([prompts[i] for i in picked], [seeds[i] for i in picked])[0] == [first[i] for i in picked]
    engine.set_counter_seeded_sampling(False)
    try:
        theirs, lp_theirs = run(prompts, seeds)
    finally:
        engine.set_counter_seeded_sampling(True)
    assert theirs != first
    ours_mean = sum(lp_ours) / sum(len(t) for t in first)
    theirs_mean = sum(lp_theirs) / sum(len(t) for t in theirs)
    assert abs(ours_mean - theirs_mean) < 0.25 * abs(theirs_mean), (ours_mean, theirs_mean)
    print(f"\ncounter-seeded sampling: reproducible per request; mean log-prob per token {ours_mean:.3f} "
          f"(vLLM's per-row generators {theirs_mean:.3f})")


def test_in_memory_update_equals_the_file_updates(engine, checkpoints):
    config = load_config(checkpoints[1])
    tensors = {n: t.cuda() for n, t in read_tensors(checkpoints[1], config)}
    engine.load_weights(tensors, checksums_of(tensors.items()))
    direct = engine.llm.collective_rpc("beam_parameter_checksums")[0]
    load_weights(engine.llm, tensors, layerwise=True)
    assert engine.llm.collective_rpc("beam_parameter_checksums")[0] == direct
    engine.update_weights(checkpoints[1], checksums_of(read_tensors(checkpoints[1], config)))
    assert engine.llm.collective_rpc("beam_parameter_checksums")[0] == direct
    prompts = _prompts(config.vocab_size, 8)
    greedy = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = engine.generate(prompts, greedy)
    engine.load_weights(tensors, checksums_of(tensors.items()))
    again = engine.generate(prompts, greedy)
    assert [s.output_ids.tolist() for s in got.samples] == [s.output_ids.tolist() for s in again.samples]
    sent = checksums_of(tensors.items())
    sent["lm_head.weight"] = "0" * 16
    from beam_rl.sync.base import SyncError

    with pytest.raises(SyncError, match="lm_head.weight"):
        engine.load_weights(tensors, sent)
    cpu = {n: t.cpu() for n, t in list(tensors.items())[:50]}
    assert checksums_of(cpu.items()) == {n: v for n, v in checksums_of(tensors.items()).items() if n in cpu}


@pytest.mark.parametrize("mxfp8", [False, True])
def test_mxfp8_experts_grouped_under_cuda_graphs(mxfp8):
    """The MXFP8 rollout's experts on the GPU (`ReferenceExperts`: grouped GEMMs, no host sync) at
    beam-mini's shapes: captured in a CUDA graph and replayed on new routing, they equal the
    per-expert loop of the CPU path run on the GPU, row by row within one BF16 rounding of the row
    (the GEMMs' accumulation order is the library's)."""
    from beam_rl.rollout.moe import _expert_outputs, _grouped_expert_outputs

    config = get_preset("beam-mini")
    E, F, H, k, T = config.num_experts, config.moe_intermediate_size, config.hidden_size, config.num_experts_per_tok, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * F, H, generator=g, device="cuda") / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, generator=g, device="cuda") / F**0.5).to(torch.bfloat16)
    x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
    _grouped_expert_outputs(x, w13, w2, ids, mxfp8)  # warm-up outside the graph (library handles, allocations)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _grouped_expert_outputs(x, w13, w2, ids, mxfp8)
    ids.copy_(torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)]))  # new routing, same buffers
    x.copy_(torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16))
    graph.replay()
    want = _expert_outputs(x, w13, w2, ids, 0, mxfp8)
    bound = 2**-7 * want.float().abs().amax(-1, keepdim=True)
    assert ((out.float() - want.float()).abs() <= bound).all(), (out.float() - want.float()).abs().max().item()

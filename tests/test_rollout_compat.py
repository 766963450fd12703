"""rollout.compat.parameter_names: loader-reported names spelled as the model spells its parameters
(vLLM 0.26's MoERunner drops `routed_experts.`, LoRA inserts `base_layer`)."""

import torch
from torch import nn

from beam_rl.rollout.compat import parameter_names, tensor_names


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.routed_experts = nn.Module()
        self.routed_experts.w13_weight = nn.Parameter(torch.zeros(2, 4, 3))


class _Wrapped(nn.Module):  # how LoRA keeps the original layer
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.base_layer = layer


def test_parameter_names_spells_wrappers():
    model = nn.Module()
    model.experts = _Experts()
    model.proj = nn.Linear(3, 3, bias=False)
    model.register_buffer("table", torch.zeros(2))
    assert parameter_names(model, {"experts.w13_weight", "proj.weight", "table"}) == {
        "experts.routed_experts.w13_weight", "proj.weight", "table"}
    names = tensor_names(model)  # taken once, as a weight update does for its per-tensor loads
    assert parameter_names(model, {"proj.weight"}, names) == {"proj.weight"}
    model.proj = _Wrapped(model.proj)  # wrapped after the first load, as LoRA does
    assert parameter_names(model, {"proj.weight"}) == {"proj.base_layer.weight"}  # read afresh
    assert parameter_names(model, {"nowhere.weight"}) == {"nowhere.weight"}  # unknown names pass through

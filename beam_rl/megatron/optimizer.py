"""megatron-core 0.16.1's distributed optimizer with Beam's FP32 routers: the checkpoint index of
its parameters in the order it holds them (the fix of Megatron-LM PR #5835).

Beam's router weights stay FP32 in a BF16 model, so each optimizer parameter group mixes FP32 and
BF16 parameters. `DistributedOptimizer._build_optimizer_group_ranges` records every parameter's
(group, position) in grad-buffer order; `_build_model_and_main_param_groups` then installs each
group in the inner optimizer as [FP32 shards, FP32 copies of the BF16 shards]. The two orders
differ, and every checkpoint path finds a parameter's optimizer state through the first
(`model_param_group_index_map`): the default `dp_reshardable` save stops at its shape assertion
(SkyRL's final checkpoint of a bf16 run on the H200), the model-space formats save or load another
parameter's state without an error. Training steps never read that index.

`order_groups_like_the_optimizer()` has `_build_optimizer_group_ranges` list each group's
parameters FP32 first, each kind in its grad-buffer order (a stable partition): the order
`_build_model_and_main_param_groups` installs them in, so index and optimizer agree. A group of
one dtype keeps its order. Callers: `beam_rl.megatron.bridge.register_bridge` (SkyRL's Megatron
workers build Beam through it, then megatron-core's optimizer).
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch

from beam_rl.errors import InputError

MEGATRON_CORE_VERSION = "0.16.1"
UPSTREAM_FIX = "Megatron-LM PR #5835"
_MARK = "__beam_rl_fp32_first__"


class OptimizerFixRefused(InputError):
    """The installed megatron-core is not the version the fix was written for."""


def _require_megatron_core() -> None:
    found = importlib.metadata.version("megatron-core")
    if found != MEGATRON_CORE_VERSION:
        raise OptimizerFixRefused(
            f"beam_rl.megatron.optimizer is written for megatron-core {MEGATRON_CORE_VERSION}, found {found}: "
            f"pip install --no-deps megatron-core=={MEGATRON_CORE_VERSION}, or check that {found} carries {UPSTREAM_FIX} "
            f"and drop the fix")


def order_groups_like_the_optimizer() -> None:
    """Patch `DistributedOptimizer._build_optimizer_group_ranges` (module docstring); idempotent.
    Raises OptimizerFixRefused for a megatron-core other than 0.16.1."""
    _require_megatron_core()
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    build = cls.__dict__["_build_optimizer_group_ranges"].__func__
    if getattr(build, _MARK, False):
        return

    @functools.wraps(build)
    def fp32_first(klass, param_groups, gbuf_ranges):
        _, group_ranges = build(klass, param_groups, gbuf_ranges)
        index = {}
        for group_index, group_range in enumerate(group_ranges):
            params = group_range["params"]
            group_range["params"] = [p for p in params if _fp32(p)] + [p for p in params if not _fp32(p)]
            index.update({p: (group_index, order) for order, p in enumerate(group_range["params"])})
        return index, group_ranges

    setattr(fp32_first, _MARK, True)
    cls._build_optimizer_group_ranges = classmethod(fp32_first)


def _fp32(param: torch.nn.Parameter) -> bool:
    """`_build_model_and_main_param_groups`'s split (by `param.type()`, i.e. by dtype): FP32
    parameters are optimised in place, 16-bit ones through an FP32 copy."""
    return param.dtype == torch.float32

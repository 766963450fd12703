"""Supervised warm start: teacher-forced NLL of the correct answers on the training split, so the
tiny model can sometimes answer before DAPO (an RL signal needs some correct samples)."""

from __future__ import annotations

import random

import torch


def answer_batch(task, tokenizer, problems):
    """Right-padded prompt + answer ids, lengths and prompt lengths."""
    seqs = [task.prompt_ids(p, tokenizer) + task.answer_ids(p, tokenizer) for p in problems]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tokenizer.pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in seqs])
    prompts = torch.tensor([len(task.prompt_ids(p, tokenizer)) for p in problems])
    return ids, lengths, prompts


def warm_start(policy, task, tokenizer, cfg, *, seed: int) -> list[float]:
    """`cfg.steps` AdamW steps on random training problems; returns the losses. The warm-start
    optimizer is discarded (DAPO gets a fresh one)."""
    rng = random.Random(seed)
    policy.make_optimizer(lr=cfg.lr)
    losses = []
    for _ in range(cfg.steps):
        problems = [rng.choice(task.train) for _ in range(cfg.batch_size)]
        losses.append(policy.supervised_step(*answer_batch(task, tokenizer, problems)))
    return losses


def initial_policy(recipe, config, task, tokenizer, log=print):
    """The trainer a run starts from: `recipe.model`'s checkpoint, or its seeded preset, loaded into
    `config`'s Megatron model in `recipe.train.mode`, then the recipe's warm start when it has steps
    (LoRA adapters, if any, are the caller's to add after it)."""
    import time

    from beam_rl.engines import build_trainer
    from beam_rl.model.modeling import build_model, load_checkpoint

    m = recipe.model
    base = load_checkpoint(m.checkpoint) if m.checkpoint else build_model(config, seed=m.init_seed)
    policy = build_trainer(config, base.state_dict(), mode=recipe.train.mode, recompute=recipe.train.recompute)
    del base
    losses = []
    if recipe.warm_start.steps:
        t0 = time.perf_counter()
        losses = warm_start(policy, task, tokenizer, recipe.warm_start, seed=recipe.run.seed)
        log(f"warm start: {recipe.warm_start.steps} supervised steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"({time.perf_counter() - t0:.1f} s)")
    return policy, losses


def write_warm_start(recipe, out, *, overwrite: bool = False, log=print) -> list[float]:
    """`recipe`'s supervised warm start on its task (`initial_policy`, as `beam-rl dapo` starts)
    written as a released-format checkpoint at `out`, for recipes that start from it
    (`model.checkpoint: OUT`, `warm_start.steps: 0`) and for `beam-rl launch`. Returns the losses."""
    from pathlib import Path

    from beam_rl.dapo.config import RecipeError
    from beam_rl.model.checkpoint import load_config, save_tensors
    from beam_rl.model.presets import get_preset
    from beam_rl.tasks.arithmetic import Tokenizer

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise RecipeError(f"--out {out} is not empty; pass --overwrite to replace it, or choose another --out")
    if recipe.warm_start.steps < 1:
        raise RecipeError(f"warm_start.steps is {recipe.warm_start.steps} in the recipe; set it to the number of supervised steps")
    config = load_config(recipe.model.checkpoint) if recipe.model.checkpoint else get_preset(recipe.model.preset)
    policy, losses = initial_policy(recipe, config, recipe.task.build(), Tokenizer(), log=log)
    save_tensors(policy.export(merged=False), config, out)
    log(f"checkpoint -> {out}")
    return losses

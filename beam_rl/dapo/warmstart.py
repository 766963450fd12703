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


def warm_start(policy, task, tokenizer, cfg, *, seed: int, evaluate=None, log=print,
               micro_batch_size: int | None = None) -> tuple[list[float], list[tuple[int, float]]]:
    """Up to `cfg.steps` AdamW steps on random training problems; returns the losses and the
    evaluations [(step, held-out avg@k)]. With `evaluate` (policy -> avg@k) and
    `cfg.target_heldout_avg`, every `cfg.eval_every` steps and after the last one the policy is
    evaluated, and the warm start stops at the first evaluation that reaches the target. The
    warm-start optimizer is discarded (DAPO gets a fresh one). Each step's gradient is accumulated
    over micro-batches of `micro_batch_size` sequences (the recipe's `train.micro_batch_size`)."""
    rng = random.Random(seed)
    policy.make_optimizer(lr=cfg.lr)
    losses, evals = [], []
    target = cfg.target_heldout_avg if evaluate is not None else None
    for step in range(1, cfg.steps + 1):
        problems = [rng.choice(task.train) for _ in range(cfg.batch_size)]
        losses.append(policy.supervised_step(*answer_batch(task, tokenizer, problems), micro_batch_size=micro_batch_size))
        if target is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            evals.append((step, evaluate(policy)))
            log(f"warm start step {step}: loss {losses[-1]:.3f}, held-out avg {evals[-1][1]:.3f} (target {target})")
            if evals[-1][1] >= target:
                break
    return losses, evals


def initial_policy(recipe, config, task, tokenizer, log=print, evaluate=None):
    """The trainer a run starts from: `recipe.model`'s checkpoint, or its seeded preset, loaded into
    `config`'s Megatron model in `recipe.train.mode`, then the recipe's warm start when it has steps
    (`warm_start`; `evaluate` for its target). LoRA adapters, if any, are the caller's to add after it.
    Returns (policy, losses, evaluations)."""
    import time

    from beam_rl.engines import build_trainer
    from beam_rl.model.modeling import build_model, load_checkpoint

    m = recipe.model
    base = load_checkpoint(m.checkpoint) if m.checkpoint else build_model(config, seed=m.init_seed)
    policy = build_trainer(config, base.state_dict(), mode=recipe.train.mode, recompute=recipe.train.recompute,
                           attention=recipe.train.attention)
    del base
    losses, evals = [], []
    if recipe.warm_start.steps:
        t0 = time.perf_counter()
        losses, evals = warm_start(policy, task, tokenizer, recipe.warm_start, seed=recipe.run.seed, evaluate=evaluate, log=log,
                                   micro_batch_size=recipe.train.micro_batch_size)
        log(f"warm start: {len(losses)} supervised steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"({time.perf_counter() - t0:.1f} s)")
    return policy, losses, evals


def write_warm_start(recipe, out, *, overwrite: bool = False, log=print, engine=None) -> tuple[list[float], list[tuple[int, float]]]:
    """`recipe`'s supervised warm start on its task (`initial_policy`, as `beam-rl dapo` starts)
    written as a released-format checkpoint at `out`, for recipes that start from it
    (`model.checkpoint: OUT`, `warm_start.steps: 0`) and for `beam-rl launch`. With
    `warm_start.target_heldout_avg`, a rollout engine (`engine`, else one started as `beam-rl dapo`
    starts it) evaluates the policy on its way and the warm start stops at the target; the
    evaluations are written to `out/warm_start.json`. Returns (losses, evaluations)."""
    import json
    import tempfile
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
    task, tok = recipe.task.build(), Tokenizer()
    with tempfile.TemporaryDirectory(prefix="beam-rl-warm-") as tmp:
        evaluate = None
        if recipe.warm_start.target_heldout_avg is not None:
            evaluate, stop = _evaluator(recipe, config, task, tok, Path(tmp), engine)
        try:
            policy, losses, evals = initial_policy(recipe, config, task, tok, log=log, evaluate=evaluate)
            save_tensors(policy.export(merged=False), config, out)
        finally:
            if evaluate is not None:
                stop()
    if evals:
        (out / "warm_start.json").write_text(json.dumps({"steps": len(losses), "target_heldout_avg": recipe.warm_start.target_heldout_avg,
                                                         "eval_samples": recipe.rollout.eval_samples,
                                                         "evaluations": [{"step": s, "heldout_avg": a} for s, a in evals]}, indent=1) + "\n")
    log(f"checkpoint -> {out}")
    return losses, evals


def _evaluator(recipe, config, task, tok, root, engine):
    """(policy -> held-out avg@k, stop): the policy's weights synced (verified) into a rollout engine
    each time, evaluated as `beam-rl dapo` evaluates (`heldout_avg`); the engine is started on the
    first call unless one is given, and stopped by `stop` if started here."""
    from beam_rl.dapo.loop import Job, _engine_dir, heldout_avg
    from beam_rl.engines import start_rollout_engine
    from beam_rl.engines.base import checksums_of

    held = {"engine": engine}

    def evaluate(policy) -> float:
        if held["engine"] is None:
            path, _ = _engine_dir(root, policy.export(merged=False, served=True), config)
            held["engine"] = start_rollout_engine(Job.engine_settings(recipe, path))
        else:
            tensors = policy.export(merged=False, on_device=True, served=True)
            held["engine"].load_weights(tensors, checksums_of(tensors.items()))
        return heldout_avg(held["engine"], task, tok, recipe)

    def stop() -> None:
        if engine is None and held["engine"] is not None:
            held["engine"].shutdown()

    return evaluate, stop

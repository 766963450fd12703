"""Supervised warm start: teacher-forced NLL of the correct answers on the training split, so the
tiny model can sometimes answer before DAPO (an RL signal needs some correct samples)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from beam_rl.dapo.metrics import torch_compile_seconds


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


@dataclass
class WarmStartProgress:
    """Where a warm start stands: its losses, its evaluations [(step, held-out avg@k)], the state of
    its problem sampler, and whether it is over (steps done or target reached) or was stopped early
    (`stop_after` / `stop_by`) to be resumed."""
    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    sampler: object = None
    finished: bool = False

    @property
    def step(self) -> int:
        return len(self.losses)

    def state_dict(self) -> dict:
        return {"losses": self.losses, "evals": self.evals, "sampler": self.sampler}

    @classmethod
    def from_state_dict(cls, state: dict) -> "WarmStartProgress":
        return cls(list(state["losses"]), [tuple(e) for e in state["evals"]], state["sampler"])


def warm_start(policy, task, tokenizer, cfg, *, seed: int, evaluate=None, log=print, micro_batch_size: int | None = None,
               progress: WarmStartProgress | None = None, stop_after: int | None = None,
               stop_by: float | None = None) -> WarmStartProgress:
    """Up to `cfg.steps` AdamW steps on random training problems (the policy's optimizer made by
    the caller). With `evaluate` (policy -> avg@k) and `cfg.target_heldout_avg`, every
    `cfg.eval_every` steps from `cfg.eval_from` and after the last one the policy is evaluated, and the warm start stops
    at the first evaluation that reaches the target. Each step's gradient is accumulated over
    micro-batches of `micro_batch_size` sequences (the recipe's `warm_start.micro_batch_size`, else
    `train.micro_batch_size`).
    `progress` continues an earlier call (its sampler state included, so the problems drawn are the
    uninterrupted run's); the call returns unfinished after step `stop_after`, or when the slowest
    step so far (its evaluation included, its torch.compile seconds left out) would end past
    `stop_by` (a `time.monotonic()` time)."""
    p = progress or WarmStartProgress()
    rng = random.Random(seed)
    if p.sampler is not None:
        rng.setstate(p.sampler)
    target = cfg.target_heldout_avg if evaluate is not None else None
    slowest, trained, since = 0.0, 0.0, p.step
    for step in range(p.step + 1, cfg.steps + 1):
        t0, c0 = time.monotonic(), torch_compile_seconds()
        problems = [rng.choice(task.train) for _ in range(cfg.batch_size)]
        p.losses.append(policy.supervised_step(*answer_batch(task, tokenizer, problems), micro_batch_size=micro_batch_size))
        p.sampler = rng.getstate()
        trained += time.monotonic() - t0
        if target is not None and ((step >= cfg.eval_from and step % cfg.eval_every == 0) or step == cfg.steps):
            t1 = time.monotonic()
            p.evals.append((step, evaluate(policy)))
            log(f"warm start step {step}: loss {p.losses[-1]:.3f}, held-out avg {p.evals[-1][1]:.3f} (target {target}); "
                f"{trained / (step - since):.2f} s a step, evaluation {time.monotonic() - t1:.1f} s")
            trained, since = 0.0, step
            if p.evals[-1][1] >= target:
                break
        slowest = max(slowest, time.monotonic() - t0 - (torch_compile_seconds() - c0))  # compiles are not the next step's
        if step < cfg.steps and (step == stop_after or (stop_by is not None and time.monotonic() + slowest > stop_by)):
            log(f"warm start stopped after step {step} of {cfg.steps}, to be resumed")
            return p
    p.finished = True
    return p


def initial_policy(recipe, config, task, tokenizer, log=print, evaluate=None, stop_after: int | None = None,
                   stop_by: float | None = None):
    """The trainer a run starts from: `recipe.model`'s checkpoint, or its seeded preset, loaded into
    `config`'s Megatron model in `recipe.train.mode`, then the recipe's warm start when it has steps
    (`warm_start`; `evaluate` for its target, `stop_after` / `stop_by` to stop it early). LoRA
    adapters, if any, are the caller's to add after it. Returns (policy, WarmStartProgress)."""
    from beam_rl.engines import build_trainer
    from beam_rl.model.modeling import build_model, load_checkpoint

    m = recipe.model
    base = load_checkpoint(m.checkpoint) if m.checkpoint else build_model(config, seed=m.init_seed)
    policy = build_trainer(config, base.state_dict(), mode=recipe.train.mode, recompute=recipe.train.recompute,
                           attention=recipe.train.attention,
                           share_prompts=recipe.train.share_prompts)
    del base
    progress = WarmStartProgress(finished=True)
    if recipe.warm_start.steps:
        policy.make_optimizer(lr=recipe.warm_start.lr)  # the warm start's own; DAPO makes a fresh one
        progress = _timed_warm_start(policy, task, tokenizer, recipe, evaluate, log, None, stop_after, stop_by)
    return policy, progress


def _timed_warm_start(policy, task, tokenizer, recipe, evaluate, log, progress, stop_after, stop_by) -> WarmStartProgress:
    if getattr(evaluate, "start", None) is not None:
        # The engine starts before the trainer's first (compiled) step, in the order `beam-rl dapo`
        # starts the two: started after the trainer's compiles, its in-process Inductor compile once
        # hung silently on the H200.
        evaluate.start(policy)
    t0, first = time.perf_counter(), progress.step if progress else 0
    progress = warm_start(policy, task, tokenizer, recipe.warm_start, seed=recipe.run.seed, evaluate=evaluate, log=log,
                          micro_batch_size=recipe.warm_start.micro_batch_size or recipe.train.micro_batch_size,
                          progress=progress, stop_after=stop_after, stop_by=stop_by)
    if progress.step > first:
        log(f"warm start: supervised steps {first + 1}-{progress.step}, loss {progress.losses[first]:.3f} -> "
            f"{progress.losses[-1]:.3f} ({time.perf_counter() - t0:.1f} s)")
    return progress


# What a resumed warm start must share with the one that wrote its checkpoint.
_RESUME_KEYS = (("model",), ("task",), ("warm_start",), ("run", "seed"), ("train", "mode"), ("rollout", "eval_samples"))


def write_warm_start(recipe, out, *, overwrite: bool = False, resume: bool = False, stop_after: int | None = None,
                     max_seconds: float | None = None, log=print, engine=None) -> WarmStartProgress:
    """`recipe`'s supervised warm start on its task (`initial_policy`, as `beam-rl dapo` starts)
    written as a released-format checkpoint at `out`, for recipes that start from it
    (`model.checkpoint: OUT`, `warm_start.steps: 0`) and for `beam-rl launch`. With
    `warm_start.target_heldout_avg`, a rollout engine (`engine`, else one started as `beam-rl dapo`
    starts it) evaluates the policy on its way and the warm start stops at the target; the
    evaluations are written to `out/warm_start.json`, last (what waits for the checkpoint waits for it).

    A warm start stopped early (after step `stop_after`, or before a step would end past
    `max_seconds`) leaves a resumable checkpoint in `out/checkpoints/` instead (weights, AdamW state,
    sampler state, losses, evaluations; `beam_rl.dapo.checkpointing`'s format), and `resume=True`
    continues from it with the uninterrupted run's problems and optimizer state. Returns the progress."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from beam_rl.dapo import checkpointing
    from beam_rl.dapo.config import RecipeError
    from beam_rl.model.checkpoint import load_config, save_tensors
    from beam_rl.model.presets import get_preset
    from beam_rl.tasks.arithmetic import Tokenizer

    stop_by = None if max_seconds is None else time.monotonic() + max_seconds
    out = Path(out)
    if recipe.warm_start.steps < 1:
        raise RecipeError(f"warm_start.steps is {recipe.warm_start.steps} in the recipe; set it to the number of supervised steps")
    ckpt, state = _resume_point(recipe, out, overwrite, resume, log)
    if overwrite:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        (out / "warm_start.json").unlink(missing_ok=True)
    config = load_config(recipe.model.checkpoint) if recipe.model.checkpoint else get_preset(recipe.model.preset)
    task, tok = recipe.task.build(), Tokenizer()
    with tempfile.TemporaryDirectory(prefix="beam-rl-warm-") as tmp:
        evaluate = None
        if recipe.warm_start.target_heldout_avg is not None:
            evaluate, stop = _evaluator(recipe, config, task, tok, Path(tmp), engine)
        try:
            if ckpt is None:
                policy, progress = initial_policy(recipe, config, task, tok, log=log, evaluate=evaluate, stop_after=stop_after, stop_by=stop_by)
            else:
                policy, progress = _resumed_policy(recipe, config, ckpt, state, log)
                del state  # the optimizer state, now in the policy
                progress = _timed_warm_start(policy, task, tok, recipe, evaluate, log, progress, stop_after, stop_by)
            if not progress.finished:
                from beam_rl.dapo.config import recipe_to_dict
                state = {"optimizer": policy.optimizer_state(), "warm_start": progress.state_dict(), "recipe": recipe_to_dict(recipe),
                         "run_id": None}
                path = checkpointing.save(out, progress.step, policy.export(merged=False), config, state)
                checkpointing.prune(out, 1, path)
                log(f"resumable warm start -> {path} (continue with --resume)")
                return progress
            save_tensors(policy.export(merged=False), config, out)
        finally:
            if evaluate is not None:
                stop()
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    if progress.evals:
        (out / "warm_start.json").write_text(json.dumps({"steps": progress.step, "target_heldout_avg": recipe.warm_start.target_heldout_avg,
                                                         "eval_samples": recipe.rollout.eval_samples,
                                                         "evaluations": [{"step": s, "heldout_avg": a} for s, a in progress.evals]}, indent=1) + "\n")
    log(f"checkpoint -> {out}")
    return progress


def _resume_point(recipe, out, overwrite: bool, resume: bool, log):
    """The checkpoint a resumed warm start continues from and its trainer state ((None, None): start
    at step 0), after checking that `out` may be written and that the checkpoint was written by this
    recipe's warm start."""
    from beam_rl.dapo import checkpointing
    from beam_rl.dapo.config import RecipeError, recipe_to_dict

    if overwrite and resume:
        raise RecipeError("--overwrite and --resume contradict each other: --resume continues the warm start in --out, "
                          "--overwrite discards it")
    if not resume:
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise RecipeError(f"--out {out} is not empty; pass --overwrite to replace it, --resume to continue its warm "
                              f"start, or choose another --out")
        return None, None
    if (out / "config.json").exists() and not (out / "checkpoints").exists():
        raise RecipeError(f"--resume: the warm start in {out} is finished (a checkpoint, no checkpoints/ to continue); "
                          f"pass --overwrite to run it again")
    ckpt = checkpointing.latest(out, log=log)
    if ckpt is None:
        log(f"--resume: no intact checkpoint under {out / 'checkpoints'}; starting the warm start from step 0")
        return None, None
    state = checkpointing.load_trainer_state(ckpt)
    saved, now = state["recipe"], recipe_to_dict(recipe)
    for path in _RESUME_KEYS:
        a, b = saved, now
        for k in path:
            a, b = a.get(k), b.get(k)
        if a != b:
            name = ".".join(path)
            raise RecipeError(f"--resume: {name} differs from the recipe that wrote {ckpt} ({a!r} there, {b!r} now); "
                              f"restore {name}, or pass --overwrite to start again")
    return ckpt, state


def _resumed_policy(recipe, config, ckpt, state, log):
    """The trainer and progress of the warm start that wrote checkpoint `ckpt` (trainer state `state`)."""
    from beam_rl.dapo import checkpointing
    from beam_rl.engines import build_trainer
    from beam_rl.model.checkpoint import read_tensors

    policy = build_trainer(config, dict(read_tensors(ckpt / "hf", config)), mode=recipe.train.mode, recompute=recipe.train.recompute,
                           attention=recipe.train.attention,
                           share_prompts=recipe.train.share_prompts)
    policy.make_optimizer(lr=recipe.warm_start.lr)
    policy.load_optimizer_state(state["optimizer"])
    checkpointing.set_rng_state(state["rng"])
    progress = WarmStartProgress.from_state_dict(state["warm_start"])
    log(f"resumed the warm start from {ckpt} (step {progress.step})")
    return policy, progress


def _evaluator(recipe, config, task, tok, root, engine):
    """(policy -> held-out avg@k, stop): the policy's weights synced (verified) into a rollout engine
    each time, evaluated as `beam-rl dapo` evaluates (`heldout_avg`); the engine (unless one is given)
    is started by `evaluate.start(policy)` or else on the first call, and stopped by `stop` if
    started here."""
    from beam_rl.dapo.loop import Job, _engine_dir, heldout_avg
    from beam_rl.engines import start_rollout_engine
    from beam_rl.engines.base import checksums_of

    held = {"engine": engine}

    def start(policy) -> None:
        if held["engine"] is None:
            path, _ = _engine_dir(root, policy.export(merged=False, served=True), config)
            held["engine"] = start_rollout_engine(Job.engine_settings(recipe, path))

    def evaluate(policy) -> float:
        if held["engine"] is None:
            start(policy)
        else:
            tensors = policy.export(merged=False, on_device=True, served=True)
            held["engine"].load_weights(tensors, checksums_of(tensors.items()))
        return heldout_avg(held["engine"], task, tok, recipe)

    evaluate.start = start

    def stop() -> None:
        if engine is None and held["engine"] is not None:
            held["engine"].shutdown()

    return evaluate, stop

"""The one-node DAPO loop: rollout (vLLM, routed experts captured) -> reward -> train (Megatron,
R3) -> verified weight sync into the same engine -> repeat; checkpoints, metrics, resume.

`run_dapo(recipe, run_dir, resume=..., engine=...)` is the whole job (`beam-rl dapo`). Pass `engine`
(a `RolloutEngine`) to reuse a running one (tests): the run then starts with a verified sync of its
own weights. Engines are reached through `beam_rl.engines` only.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from beam_rl.dapo import checkpointing, rundir
from beam_rl.dapo.advantages import compute_advantages
from beam_rl.dapo.config import Recipe, RecipeError, recipe_to_dict
from beam_rl.dapo.data import DataOrder, eval_seed, sampling_seed
from beam_rl.dapo.loss import LossSettings, policy_loss
from beam_rl.dapo.metrics import MetricsWriter, cuda_memory_peaks, torch_compile_seconds
from beam_rl.dapo.overlong import overlong_keep, soft_overlong_penalty
from beam_rl.dapo.sampling import DynamicSampler
from beam_rl.dapo.warmstart import initial_policy
from beam_rl.engines import TRAIN_MODES, EngineSettings, RolloutEngine, Sampling, build_trainer, start_rollout_engine
from beam_rl.engines.base import check_engine_serves, checksums_of
from beam_rl.model.checkpoint import SINGLE_NAME, atomic_directory, read_tensors
from beam_rl.model.presets import get_preset
from beam_rl.r3 import RolloutBatch, RolloutSample, prompt_routing_disagreement
from beam_rl.tasks.arithmetic import TOKENIZER_DIR, TOKENIZER_FILES, Tokenizer


def dapo_loss_fn(mbs: list, olds: list, advs: list, masks: list, settings: LossSettings, loss_name: str):
    """The `TrainerBackend.step` loss of one DAPO mini-batch: `loss_name` of `POLICY_LOSSES` with a
    token-level normaliser over the whole mini-batch, metrics weighted by each micro-batch's tokens."""
    total_tokens = float(sum(m.sum() for m in masks)) or 1.0
    if settings.loss_agg == "token_mean":
        normalizer = total_tokens
    else:
        normalizer = float(sum((m.sum(-1) > 0).sum() for m in masks)) or 1.0

    def loss(lp: torch.Tensor, i: int):
        value, metrics = policy_loss(loss_name, lp, olds[i], advs[i], masks[i], settings,
                                     rollout_logprobs=mbs[i].rollout_logprobs.to(lp.device), normalizer=normalizer)
        w = float(masks[i].sum()) / total_tokens
        return value, {k: v * w for k, v in metrics.items()}

    return loss


def update_micro_batches(batch: RolloutBatch, r: Recipe, groups: int):
    """The micro-batches of each of a step's `dapo.updates_per_step` updates: the step's `groups`
    groups of `batch` (in order, `rollout.group_size` rollouts each) split evenly between the
    updates, each update's rollouts in micro-batches of `train.micro_batch_size`, a group's kept
    together where the trainer shares their prompt (`train.share_prompts`)."""
    G = r.rollout.group_size
    return [list(batch.micro_batches(r.train.micro_batch_size, [gi * G + j for gi in mini for j in range(G)],
                                     keep_prompt_groups=r.train.share_prompts))
            for mini in np.array_split(np.arange(groups), r.dapo.updates_per_step)]


def train_groups(policy, config, r: Recipe, groups: list[Group]) -> dict:
    """The DAPO step's train phase on its kept groups: the old log-probs of every rollout (before any
    update; the ratio's denominator and the step's trainer-rollout gap), then `dapo.updates_per_step`
    optimizer updates, each on its share of the groups in micro-batches of `train.micro_batch_size`
    (a group's rollouts kept together where the trainer shares their prompt)."""
    d = r.dapo
    batch = RolloutBatch(tuple(s for g in groups for s in g.samples), config)
    adv = compute_advantages(d.advantage, torch.tensor([g.rewards for g in groups])).reshape(-1)  # (N,)
    keep = [k for g in groups for k in overlong_keep(g.truncated, d.overlong.filtering)]
    settings = LossSettings(d.eps_low, d.eps_high, d.loss_agg, d.tis_cap, d.kl_coef)
    # Old log-probs (replaying unless train.routing_replay is off; before any update): the DAPO
    # ratio's denominator and the trainer-rollout gap.
    plans = []
    gaps = []
    with policy.fixed_weights():
        for update in update_micro_batches(batch, r, len(groups)):
            mbs, olds, advs, masks = [], [], [], []
            for mb in update:
                old = policy.logprobs(mb, temperature=r.rollout.temperature, replay=r.train.routing_replay)
                dev = old.device
                gaps.append((old - mb.rollout_logprobs.to(dev)).abs()[mb.mask.to(dev)])
                keep_rows = torch.tensor([keep[i] for i in mb.indices], device=dev)
                mbs.append(mb), olds.append(old), advs.append(adv[list(mb.indices)].to(dev))
                masks.append(mb.mask.to(dev) & keep_rows[:, None])
            plans.append((mbs, olds, advs, masks))
    gap = torch.cat(gaps).float().cpu()
    out = {"mean_abs_logprob_diff": float(gap.mean()), "max_abs_logprob_diff": float(gap.max()), "train_tokens": 0}
    if r.train.share_prompts and r.train.routing_replay:
        out["prompt_routing_disagreement"] = prompt_routing_disagreement(batch.samples)
    sums: dict[str, float] = {}
    for mbs, olds, advs, masks in plans:
        m = policy.step(mbs, dapo_loss_fn(mbs, olds, advs, masks, settings, d.loss), temperature=r.rollout.temperature,
                        replay=r.train.routing_replay)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v / len(plans)
        out["train_tokens"] += int(sum(int(mb.lengths.sum()) for mb in mbs))
    out.update(sums)
    return out


class R3GapError(RuntimeError):
    """A step's mean |trainer - rollout log-prob| exceeded run.max_mean_abs_logprob_diff."""


@dataclass
class Group:
    problem_index: int
    samples: list[RolloutSample]
    rewards: list[float]
    correct: list[float]
    truncated: list[bool]


def sync_root(run_dir: Path, sync_dir: str | None, weight_bytes: int) -> tuple[Path, bool]:
    """The directory the engine's weights go through, and whether it is a temporary one to remove
    at the end (`rollout.sync_dir`)."""
    if sync_dir:
        return Path(sync_dir), False
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2.5 * weight_bytes:
        path = Path(tempfile.mkdtemp(prefix=f"{rundir.SHM_PREFIX}{run_dir.name}-", dir=shm))
        rundir.claim_shm_dir(path, run_dir)
        return path, True
    return run_dir / "engine", False


def _engine_dir(root: Path, tensors: dict, config) -> tuple[Path, dict[str, str]]:
    """Atomically write HF-named safetensors + config.json + the tokenizer to `root/weights`;
    returns the checksums of what was written (what the engine must report receiving)."""
    from safetensors.torch import save_file

    path = root / "weights"
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with atomic_directory(path) as tmp:
        save_file(tensors, tmp / SINGLE_NAME, metadata={"format": "pt"})
        config.save_pretrained(tmp)
        for f in TOKENIZER_FILES:
            shutil.copy(TOKENIZER_DIR / f, tmp / f)
    return path, checksums_of(tensors.items())


def group_requests(task, tok: Tokenizer, recipe: Recipe, problems: list, seeds: list[int | None],
                   group: int) -> tuple[list[list[int]], list[Sampling]]:
    """(prompt ids, sampling) of `group` samples of every problem's prompt (one seed each), at the
    recipe's rollout settings."""
    ro = recipe.rollout
    prompts = [task.prompt_ids(p, tok) for p in problems for _ in range(group)]
    sampling = [Sampling(max_tokens=ro.max_response_tokens, temperature=ro.temperature, seed=s,
                         stop_token_ids=(tok.eos_id,)) for s in seeds]
    return prompts, sampling


def generate_groups(engine: RolloutEngine, task, tok: Tokenizer, recipe: Recipe, problems: list, seeds: list[int],
                    group: int, adapter=None) -> RolloutBatch:
    """`group` samples of every problem's prompt (one seed each), at the recipe's rollout settings."""
    prompts, sampling = group_requests(task, tok, recipe, problems, seeds, group)
    return engine.generate(prompts, sampling, adapter=adapter)


def heldout_avg(engine: RolloutEngine, task, tok: Tokenizer, recipe: Recipe, adapter=None) -> float:
    """Held-out avg@k (k = rollout.eval_samples): every held-out problem sampled k times with the
    same seeds at every evaluation, graded by the task."""
    k, problems = recipe.rollout.eval_samples, task.heldout
    seeds = [eval_seed(recipe.run.seed, i) for i in range(len(problems) * k)]
    samples = generate_groups(engine, task, tok, recipe, problems, seeds, k, adapter).samples
    correct = task.rewards([p for p in problems for _ in range(k)], [o.output_ids.tolist() for o in samples], tok)
    return float(np.mean(correct))


class Job:
    def __init__(self, recipe: Recipe, run_dir: Path, *, resume: bool, engine: RolloutEngine | None = None, progress: bool = True,
                 log=print, engine_log: bool = False, overwrite: bool = False):
        self.r, self.run_dir, self.log, self.progress, self.engine_log = recipe, Path(run_dir), log, progress, engine_log
        self.tok = Tokenizer()
        self.task = recipe.task.build()
        self.config = get_preset(recipe.model.preset)
        if self.tok.vocab_size > self.config.vocab_size:
            raise ValueError(f"model.preset={recipe.model.preset}: vocab {self.config.vocab_size} < tokenizer {self.tok.vocab_size}")
        if recipe.warm_start.steps and recipe.warm_start.target_heldout_avg is not None:
            raise RecipeError("warm_start.target_heldout_avg: only `beam-rl warm-start` evaluates during the warm start; "
                              "write the warm start with it and start this run from its checkpoint (model.checkpoint, "
                              "warm_start.steps: 0), or set the target to null")
        self.data = DataOrder(len(self.task.train), recipe.run.seed)
        self.lora = recipe.train.mode == "lora"
        self.sync_adapter = recipe.train.serves_adapter
        self.start_step, self.timings = 0, {}
        for p in rundir.clean_leftovers(self.run_dir):
            self.log(f"removed the leftover {p} of an interrupted run")
        ckpt, state = self._claim_run_dir(resume, overwrite)
        self._build_policy(ckpt, state)
        self.metrics = MetricsWriter(self.run_dir, resume_step=self.start_step if ckpt else None)
        base_tensors = self.policy.export(merged=self.lora and recipe.train.lora.merge, served=True)
        nbytes = sum(t.numel() * t.element_size() for t in base_tensors.values())
        self.engine_root, self._remove_engine_root = sync_root(self.run_dir, recipe.rollout.sync_dir, nbytes)
        try:
            self._start_engine(recipe, base_tensors, engine)
        except BaseException:
            self.close()
            raise

    def _start_engine(self, recipe: Recipe, base_tensors: dict, engine: RolloutEngine | None) -> None:
        model_dir, sent = _engine_dir(self.engine_root, base_tensors, self.config)
        if engine is None:
            self.engine = start_rollout_engine(self.engine_settings(recipe, model_dir, self.run_dir if self.engine_log else None))
        else:
            check_engine_serves(engine, recipe.train.mode)
            self.engine = engine
            self.engine.update_weights(model_dir, sent)
        self.policy.set_attention_numerics(self.engine.attention_numerics)  # the trainer defines attention as this engine computes it
        self.log(f"rollout attention numerics: {self.engine.attention_numerics}")
        self.adapter = self._sync_adapter(self.start_step) if self.sync_adapter else None

    @staticmethod
    def engine_settings(recipe: Recipe, model_dir: Path, run_dir: Path | None = None) -> EngineSettings:
        """The rollout engine `beam-rl dapo` starts for `recipe` (weights and tokenizer in `model_dir`;
        engine logs in `run_dir/engine.log` when `run_dir` is given, else on the console)."""
        ro = recipe.rollout
        return EngineSettings(
            model=str(model_dir), tokenizer=str(model_dir), seed=recipe.run.seed, max_model_len=ro.max_model_len,
            max_num_seqs=ro.max_num_seqs, enforce_eager=ro.enforce_eager, kv_cache_gib=ro.kv_cache_gib,
            lora_rank=recipe.train.lora.r if recipe.train.serves_adapter else None,
            gpu_memory_utilization=ro.gpu_memory_utilization, gpu_kv_cache_gib=ro.gpu_kv_cache_gib, sleep_mode=ro.sleep_between_phases,
            processed_logprobs=ro.temperature != 1.0, linear_precision=TRAIN_MODES[recipe.train.mode].precision,
            log_file=str(Path(run_dir) / "engine.log") if run_dir is not None else None)

    # -- construction / resume -------------------------------------------------------------------
    def _claim_run_dir(self, resume: bool, overwrite: bool) -> tuple[Path | None, dict | None]:
        """Set `self.run_id`; returns the checkpoint to resume from and its trainer state (None, None:
        start at step 0)."""
        recipe = recipe_to_dict(self.r)
        self.run_id = rundir.run_id_of(self.run_dir) if resume else None
        if self.run_id is None:
            if resume and rundir.earlier_results(self.run_dir):
                raise RecipeError(f"--resume: {self.run_dir} holds results but no {rundir.RUN_FILE}, so nothing says which run "
                                  "they belong to; pass --overwrite to start over there, or choose another --out")
            self.run_id = rundir.start_fresh(self.run_dir, overwrite=overwrite, recipe_dict=recipe)
            return None, None
        rundir.check_same_recipe(self.run_dir, recipe)
        ckpt = checkpointing.latest(self.run_dir, self.run_id, log=self.log)
        if ckpt is None:
            self.log(f"--resume: no intact checkpoint under {self.run_dir / 'checkpoints'}; starting this run from step 0")
            return None, None
        state = checkpointing.load_trainer_state(ckpt)
        rundir.check_metrics_reach(self.run_dir, int(state["step"]))
        return ckpt, state

    def _build_policy(self, ckpt: Path | None, state: dict | None) -> None:
        r = self.r
        if ckpt is not None:
            hf = dict(read_tensors(ckpt / "hf", self.config))
            self.policy = build_trainer(self.config, hf, mode=r.train.mode, recompute=r.train.recompute,
                                        attention=r.train.attention, share_prompts=r.train.share_prompts)
        else:
            self.policy, _ = initial_policy(r, self.config, self.task, self.tok, log=self.log)
        if self.lora:
            self.policy.add_lora(r.train.lora.r, r.train.lora.alpha, seed=r.run.seed, experts=r.train.lora.experts,
                                 merged=r.train.lora.merge)
        self.policy.make_optimizer(lr=r.train.lr, betas=r.train.betas, weight_decay=r.train.weight_decay, grad_clip=r.train.grad_clip)
        if ckpt is not None:
            self.policy.load_optimizer_state(state["optimizer"])
            self.data.load_state_dict(state["data"])
            checkpointing.set_rng_state(state["rng"])
            self.start_step = int(state["step"])
            self.log(f"resumed from {ckpt} (step {self.start_step})")

    def _sync_adapter(self, step: int):
        path = self.engine_root / f"adapter_{step:06d}"
        sent = self.policy.save_adapter(path, base=str(self.engine_root / "weights"))
        adapter = self.engine.load_adapter(path, sent, step)
        old = self.engine_root / f"adapter_{step - 1:06d}"
        if step > 0 and old.exists():
            shutil.rmtree(old)
        self.adapter_bytes = sum(t.numel() * 4 for t in sent.values())
        return adapter

    # -- phases ----------------------------------------------------------------------------------
    def rollout(self, step: int) -> tuple[DynamicSampler, dict]:
        ro, d = self.r.rollout, self.r.dapo
        ol = d.overlong
        G = ro.group_size
        sampler = DynamicSampler(ro.prompts_per_step, d.max_extra_rounds, d.oversample_factor, d.dynamic_sampling)
        # generate_s: the engine's calls (scheduling, steps, outputs, routing); grade_s: the task's grading;
        # the rest of rollout_s is this loop's bookkeeping
        stats = {"generated_tokens": 0, "correct": [], "lengths": [], "generate_s": 0.0, "grade_s": 0.0}
        while (n := sampler.need()) > 0:
            idx = self.data.take(n)
            problems = [self.task.train[i] for i in idx]
            seeds = [sampling_seed(self.r.run.seed, step, sampler.rounds, i) for i in range(n * G)]
            t0 = time.perf_counter()
            samples = generate_groups(self.engine, self.task, self.tok, self.r, problems, seeds, G, self.adapter).samples
            t1 = time.perf_counter()
            graded = self.task.rewards([p for p in problems for _ in range(G)], [o.output_ids.tolist() for o in samples], self.tok)
            stats["generate_s"] += t1 - t0
            stats["grade_s"] += time.perf_counter() - t1
            groups, rewards = [], []
            for g, (i, p) in enumerate(zip(idx, problems)):
                outs = list(samples[g * G : (g + 1) * G])
                correct, rew, trunc = [], [], []
                for o, c in zip(outs, graded[g * G : (g + 1) * G]):
                    ids = o.output_ids.tolist()
                    truncated = ids[-1] != self.tok.eos_id
                    pen = soft_overlong_penalty(len(ids), ro.max_response_tokens, ol.cache_length, ol.penalty_factor) if ol.soft_punishment else 0.0
                    correct.append(c), rew.append(c + pen), trunc.append(truncated)
                    stats["generated_tokens"] += len(ids)
                    stats["lengths"].append(len(ids))
                stats["correct"] += correct
                groups.append(Group(i, outs, rew, correct, trunc))
                rewards.append(rew)
            sampler.add(groups, rewards)
        return sampler, stats

    def train(self, groups: list[Group]) -> dict:
        return train_groups(self.policy, self.config, self.r, groups)

    def sync(self, step: int) -> dict:
        t0 = time.perf_counter()
        if self.sync_adapter:
            self.adapter = self._sync_adapter(step)
            nbytes = self.adapter_bytes
        else:
            tensors = self.policy.export(merged=True, on_device=True, served=True)  # straight into the engine: no files
            self.engine.load_weights(tensors, checksums_of(tensors.items()))
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        dt = time.perf_counter() - t0
        return {"sync_s": dt, "sync_mb_per_s": nbytes / 2**20 / dt}

    def evaluate(self) -> float:
        return heldout_avg(self.engine, self.task, self.tok, self.r, self.adapter)

    def checkpoint(self, step: int) -> Path:
        state = {"optimizer": self.policy.optimizer_state(), "data": self.data.state_dict(), "recipe": recipe_to_dict(self.r),
                 "sampling_seed_base": self.r.run.seed, "run_id": self.run_id}
        path = checkpointing.save(self.run_dir, step, self.policy.export(merged=False), self.config, state)
        if self.r.run.keep_checkpoints is not None:
            checkpointing.prune(self.run_dir, self.r.run.keep_checkpoints, path)
        return path

    def _sleep(self, asleep: bool) -> None:
        """rollout.sleep_between_phases (GPU): free vLLM's memory while the trainer runs."""
        if not self.r.rollout.sleep_between_phases:
            return
        if asleep:
            self.engine.sleep()
        else:
            self.engine.wake()  # then the verified sync overwrites the weights

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None, stop_by: float | None = None, checkpoints: bool = True) -> list[dict]:
        """Steps to run.total_steps; stopped early, with a checkpoint, after step `stop_after` or when
        the slowest step so far, its torch.compile seconds left out, would end past `stop_by` (a
        `time.monotonic()` time). `checkpoints=False` writes none (the metrics still go out each step)."""
        from tqdm import tqdm

        r = self.r
        k = r.rollout.eval_samples
        history = []
        if self.start_step == 0:
            acc0 = self.evaluate()
            first = {"step": 0, f"heldout_avg{k}": acc0}
            self.metrics.write(first)
            history.append(first)
            self.log(f"step 0 (warm start): held-out avg@{k} = {acc0:.3f}")
        bar = tqdm(range(self.start_step + 1, r.run.total_steps + 1), desc="dapo", disable=not self.progress, dynamic_ncols=True)
        slowest = 0.0
        cuda_memory_peaks()  # each step's peaks are its own (the engine's start and evaluation before it are not)
        for step in bar:
            t0 = time.perf_counter()
            sampler, stats = self.rollout(step)
            t_roll = time.perf_counter() - t0
            m = {"step": step, "reward_mean": float(np.mean([x for g in sampler.kept for x in g.rewards])) if sampler.kept else 0.0,
                 "accuracy": float(np.mean(stats["correct"])), "response_length": float(np.mean(stats["lengths"])),
                 "kept_group_fraction": sampler.kept_fraction, "generation_rounds": sampler.rounds,
                 "rollout_tokens_per_s": stats["generated_tokens"] / t_roll, "rollout_s": t_roll,
                 "rollout_generate_s": stats["generate_s"], "rollout_grade_s": stats["grade_s"]}
            if sampler.kept:
                self._sleep(True)
                t1, c1 = time.perf_counter(), torch_compile_seconds()
                tr = self.train(sampler.kept)
                m["train_s"] = time.perf_counter() - t1
                m["compile_s"] = torch_compile_seconds() - c1
                m["train_tokens_per_s"] = tr.pop("train_tokens") / m["train_s"]
                m.update(tr)
                self._sleep(False)
                m.update(self.sync(step))
            else:
                self.log(f"step {step}: no informative group after {sampler.rounds} rounds; no update")
            if step % r.run.eval_every == 0 or step == r.run.total_steps:
                m[f"heldout_avg{k}"] = self.evaluate()
            m["time_s"] = time.perf_counter() - t0
            m.update(cuda_memory_peaks())
            self.metrics.write(m)
            history.append(m)
            bar.set_postfix(reward=f"{m['reward_mean']:.2f}", gap=f"{m.get('mean_abs_logprob_diff', float('nan')):.4f}")
            if "mean_abs_logprob_diff" in m and not m["mean_abs_logprob_diff"] <= r.run.max_mean_abs_logprob_diff:
                self.checkpoint(step)
                raise R3GapError(f"step {step}: mean |trainer - rollout logprob| = {m['mean_abs_logprob_diff']:.4f} > "
                                 f"run.max_mean_abs_logprob_diff = {r.run.max_mean_abs_logprob_diff}")
            # a step's torch.compile seconds are not the next step's: the first step's 67 s (beam-mini, H100;
            # 7 s for the rest of it) would end the call's part of the run a minute early
            slowest = max(slowest, m["time_s"] - m.get("compile_s", 0.0))
            out_of_time = stop_by is not None and step < r.run.total_steps and time.monotonic() + slowest > stop_by
            if checkpoints and (step % r.run.checkpoint_every == 0 or step == r.run.total_steps or step == stop_after or out_of_time):
                self.checkpoint(step)
            if (stop_after is not None and step >= stop_after) or out_of_time:
                if out_of_time:
                    self.log(f"step {step}: stopped (the next step would end past --max-seconds); "
                             + ("continue with --resume" if checkpoints else "no checkpoint (--no-checkpoints)"))
                break
        self.metrics.close()
        return history

    def close(self) -> None:
        """Remove a temporary sync directory (the engine has already loaded its contents)."""
        if getattr(self, "_remove_engine_root", False):
            shutil.rmtree(self.engine_root, ignore_errors=True)


def run_dapo(recipe: Recipe, run_dir, *, resume: bool = False, engine: RolloutEngine | None = None, stop_after: int | None = None,
             max_seconds: float | None = None, progress: bool = True, log=print, engine_log: bool = False,
             overwrite: bool = False, checkpoints: bool = True) -> list[dict]:
    """The whole job. `engine_log`: the engine this starts logs to RUN_DIR/engine.log; `overwrite`:
    replace an earlier run's results in `run_dir` (else a fresh start there is refused); `stop_after`
    / `max_seconds`: stop early with a checkpoint (`Job.run`), `max_seconds` counted from this call;
    `checkpoints=False`: none written (a machine's last call, where they cannot outlive the machine). A
    `resume` of a run that has recorded all its steps returns its metrics and starts nothing."""
    stop_by = None if max_seconds is None else time.monotonic() + max_seconds
    if resume and rundir.finished(Path(run_dir), recipe.run.total_steps):
        from beam_rl.dapo.metrics import read_metrics

        rundir.check_same_recipe(Path(run_dir), recipe_to_dict(recipe))
        log(f"--resume: {run_dir} has recorded all {recipe.run.total_steps} steps; nothing to do")
        return read_metrics(Path(run_dir))
    torch.manual_seed(recipe.run.seed)
    job = Job(recipe, Path(run_dir), resume=resume, engine=engine, progress=progress, log=log, engine_log=engine_log,
              overwrite=overwrite)
    try:
        return job.run(stop_after=stop_after, stop_by=stop_by, checkpoints=checkpoints)
    finally:
        job.close()


def summarize(history: list[dict], k: int = 8) -> dict:
    """Warm-start vs final held-out accuracy and the R3 gap over the steps."""
    key = f"heldout_avg{k}"
    evals = [(m["step"], m[key]) for m in history if key in m]
    gaps = [m["mean_abs_logprob_diff"] for m in history if "mean_abs_logprob_diff" in m]
    return {"warm_start": evals[0][1] if evals else math.nan, "final": evals[-1][1] if evals else math.nan,
            "max_step_gap": max(gaps) if gaps else math.nan, "gaps": gaps}

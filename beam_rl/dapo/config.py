"""Typed recipe config: dataclasses that mirror the recipe YAML 1:1, one docstring per field.

`load_recipe(path)` reads YAML into `Recipe`; an unknown key raises `RecipeError` naming the
dotted key and the keys that are allowed there; bad values name the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from beam_rl.errors import InputError


class RecipeError(InputError):
    """A recipe key or value is wrong; the message names the field."""


@dataclass
class RunConfig:
    seed: int = 0
    """Seeds data order, vLLM sampling seeds, LoRA init and everything else random."""
    total_steps: int = 8
    """DAPO steps (one rollout batch + `dapo.updates_per_step` optimizer updates each)."""
    checkpoint_every: int = 4
    """Write an atomic checkpoint every N steps (and always at the end)."""
    keep_checkpoints: int | None = None
    """Keep only the newest N checkpoints (older ones are deleted once a newer one is written whole);
    None keeps all. A full-model checkpoint holds the weights and the FP32 optimizer state (~16 GB
    for beam-mini in bf16)."""
    eval_every: int = 4
    """Held-out avg@k every N steps (and at step 0, the warm start, and at the end)."""
    out: str = "runs/dapo"
    """Run directory (metrics.jsonl, tb/, checkpoints/); `--out` overrides."""
    max_mean_abs_logprob_diff: float = 0.01
    """R3 budget: the run ends with an error if any step's mean |trainer - rollout logprob| exceeds it
    (0.03 is the budget for mxfp8)."""


@dataclass
class ModelConfig:
    preset: str = "beam-tiny"
    """A `beam_rl.model.presets` name; the vocabulary must hold the task tokenizer."""
    init_seed: int = 0
    """Seed of the random initial weights (ignored with `checkpoint`)."""
    checkpoint: str | None = None
    """Start from this HF checkpoint directory instead of a seeded random model."""


TASKS = ("arithmetic", "math")


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """Built-in task: 'arithmetic' (`a op b=`, the integer answer, `beam_rl.tasks.arithmetic`) or 'math'
    (the math suite: multi-step arithmetic and word problems with worked solutions, DAPO-format
    prompts, graded by math-verify; `beam_rl.tasks.math_suite`)."""
    max_operand: int = 9
    """arithmetic: operands lie in [0, max_operand]."""
    ops: str = "+"
    """arithmetic: operators to use, from '+-*'."""
    levels: str = "123"
    """math: difficulty levels to draw, from '123' (1: two steps on one-digit numbers; 2: two steps,
    operands up to 30; 3: three steps, operands up to 99)."""
    num_train: int = 20000
    """math: training problems."""
    num_heldout: int = 256
    """math: held-out problems (the avg@k evaluation)."""
    heldout_fraction: float = 0.25
    """Fraction of all problems held out for evaluation (disjoint from training)."""
    seed: int = 0
    """Seed of the train / held-out split."""

    def build(self):
        """The task this section describes (the same split wherever it is built)."""
        if self.name == "math":
            from beam_rl.tasks.math_suite import MathSuiteTask

            return MathSuiteTask(levels=tuple(int(c) for c in self.levels),
                                 num_train=self.num_train, num_heldout=self.num_heldout,
                                 heldout_fraction=self.heldout_fraction, seed=self.seed)
        from beam_rl.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(max_operand=self.max_operand, ops=self.ops, heldout_fraction=self.heldout_fraction, seed=self.seed)


@dataclass
class WarmStartConfig:
    steps: int = 20
    """Supervised steps (teacher-forced answers) before DAPO; 0 skips the warm start."""
    batch_size: int = 64
    """Problems per supervised step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    target_heldout_avg: float | None = None
    """`beam-rl warm-start` only: stop at the first evaluation whose held-out avg@k (rollout.eval_samples)
    reaches this (e.g. 0.3: a start well below the ceiling, room for RL); null: all `steps`."""
    eval_every: int = 50
    """Supervised steps between held-out evaluations when target_heldout_avg is set (a vLLM engine
    on the current weights, sampled as `beam-rl dapo` evaluates)."""
    eval_from: int = 0
    """The first step that may be evaluated (then every eval_every steps): a warm start known to
    reach its target late spends no engine time on evaluations far below it."""
    micro_batch_size: int | None = None
    """Sequences per micro-batch of a supervised step (the gradient accumulated over them); null:
    train.micro_batch_size. Supervised sequences are short, so a step's micro-batches are bound by
    kernel launches rather than arithmetic: fewer, larger ones are faster where memory allows."""


@dataclass
class RolloutConfig:
    group_size: int = 8
    """G: responses sampled per prompt."""
    prompts_per_step: int = 16
    """Groups kept for training per step (after dynamic sampling)."""
    max_response_tokens: int = 6
    """Generation cap (DAPO's max length L_max, counting </s>)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer computes log-probs at the same temperature)."""
    eval_samples: int = 8
    """k of the held-out avg@k (`heldout_avg8` is logged under this name for k = 8)."""
    max_model_len: int = 64
    """vLLM max_model_len."""
    kv_cache_gib: float = 1.0
    """CPU engines: VLLM_CPU_KVCACHE_SPACE in GiB."""
    gpu_memory_utilization: float = 0.5
    """GPU engines: fraction of GPU memory vLLM may take (the trainer shares the GPU)."""
    gpu_kv_cache_gib: float | None = None
    """GPU engines: the KV cache's size in GiB, instead of what gpu_memory_utilization leaves after
    vLLM's memory profile (set it when other runs share the GPU: they change its free memory while
    the profile reads it)."""
    sleep_between_phases: bool = False
    """GPU: put vLLM to sleep (enable_sleep_mode) while the trainer runs, wake it for rollout."""
    enforce_eager: bool = True
    """vLLM enforce_eager (no CUDA graphs / compile)."""
    max_num_seqs: int = 256
    """vLLM max_num_seqs."""
    sync_dir: str | None = None
    """Where the policy's weights are written for the engine to reload each step. Default: a
    per-run directory under /dev/shm when it has room for twice the weights (the write is atomic),
    else RUN_DIR/engine. RAM-backed, the sync skips the disk (docs/results/sync.md has the speeds)."""


@dataclass
class OverlongConfig:
    filtering: bool = False
    """Overlong filtering: truncated responses (no </s> within the cap) get no loss."""
    soft_punishment: bool = True
    """Soft overlong punishment: a linear penalty over the last `cache_length` tokens of the cap."""
    cache_length: int = 2
    """L_cache: penalty ramps from 0 at (max_response_tokens - cache_length) to -penalty_factor at the cap."""
    penalty_factor: float = 1.0
    """Penalty at the cap."""


@dataclass
class DapoConfig:
    loss: str = "dapo"
    """Policy loss from `beam_rl.dapo.loss.POLICY_LOSSES`."""
    advantage: str = "grpo"
    """Advantage estimator from `beam_rl.dapo.advantages.ADVANTAGES` (group-normalised)."""
    eps_low: float = 0.2
    """Clip-higher lower bound: ratio >= 1 - eps_low."""
    eps_high: float = 0.28
    """Clip-higher upper bound: ratio <= 1 + eps_high."""
    loss_agg: str = "token_mean"
    """'token_mean' (DAPO: every token of the batch weighs the same) or 'seq_mean_token_mean' (GRPO)."""
    kl_coef: float = 0.0
    """KL penalty weight against the rollout policy (0: no KL term, as DAPO)."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight tokens by min(pi_old_trainer / pi_rollout, cap); null = off."""
    dynamic_sampling: bool = True
    """Drop all-correct / all-wrong groups and refill by over-sampling."""
    max_extra_rounds: int = 3
    """Cap on extra generation rounds per step for dynamic sampling."""
    oversample_factor: float = 1.25
    """Each extra round samples ceil(missing groups / kept rate so far * factor) prompts: the factor
    is the margin over the expected need (`beam_rl.dapo.sampling`)."""
    updates_per_step: int = 1
    """Optimizer updates per step (the batch is split into this many mini-batches)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """Overlong filtering and soft punishment."""


@dataclass
class LoraConfig:
    r: int = 8
    """Adapter rank (vLLM max_lora_rank is set to it)."""
    alpha: float = 16.0
    """LoRA alpha (scaling alpha / r)."""
    merge: bool = False
    """Sync merged full weights instead of the adapter (the trainer then computes with those weights:
    `beam_rl.megatron.lora`)."""
    experts: bool = False
    """Adapters on every routed expert's gate/up/down projections too (RL with LoRA keeps up with full
    fine-tuning when the MLPs, in an MoE the experts, are adapted); served merged (needs merge: true)."""


@dataclass
class TrainConfig:
    mode: str = "bf16"
    """'bf16' (full fine-tuning, FP32 master weights), 'lora', or 'mxfp8' (emulated off Blackwell)."""
    lr: float = 1e-3
    """AdamW learning rate of DAPO."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0: off)."""
    micro_batch_size: int = 256
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    recompute: bool = False
    """Full activation recompute (R3 replays in the recompute too)."""
    attention: str = "auto"
    """The trainer's attention: 'engine' (as the rollout engine reports computing it: the spec in FP32
    on CUDA), 'flash' (FlashAttention's algorithm, FlexAttention kernels on CUDA: several times
    faster on long sequences) or 'auto' (flash on CUDA, engine elsewhere:
    `beam_rl.megatron.attention.trainer_attention_dtype`; `beam-rl gap --trainer-attention` measures each)."""
    share_prompts: bool = True
    """The rows of a micro-batch with one prompt (a DAPO group's samples) compute it once, packed into
    one row whose responses attend to it and to themselves only, and the LM head runs only where a
    log-prob is read (`beam_rl.megatron.packing`; micro-batches keep a group together). False: every
    row computes its own prompt, the LM head every position."""
    routing_replay: bool = True
    """R3: the trainer's routers replay the experts the rollout chose; false lets the trainer route
    for itself (the no-R3 contrast run: a larger trainer-rollout gap)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA settings (mode 'lora')."""

    @property
    def serves_adapter(self) -> bool:
        """LoRA synced to the rollout engine as a PEFT adapter (not merged into the weights)."""
        return self.mode == "lora" and not self.lora.merge


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    """Run length, checkpoints, evaluation, output."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which Beam model."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The built-in task."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """vLLM generation."""
    dapo: DapoConfig = field(default_factory=DapoConfig)
    """The DAPO algorithm."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The Megatron trainer."""

    def validate(self) -> "Recipe":
        from beam_rl.model.presets import PRESETS

        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise RecipeError(f"{key}: {msg}")

        need(self.run.total_steps >= 1, "run.total_steps", "must be >= 1")
        need(self.run.checkpoint_every >= 1, "run.checkpoint_every", "must be >= 1")
        need(self.run.keep_checkpoints is None or self.run.keep_checkpoints >= 1, "run.keep_checkpoints",
             "must be >= 1 (the newest is what --resume continues from), or null to keep all")
        need(self.run.eval_every >= 1, "run.eval_every", "must be >= 1")
        need(self.model.preset in PRESETS, "model.preset", f"unknown preset {self.model.preset!r}; choose from {sorted(PRESETS)}")
        need(self.task.name in TASKS, "task.name", f"choose one of {list(TASKS)}")
        need(self.rollout.group_size >= 2, "rollout.group_size", "needs >= 2 responses per prompt for group-normalised advantages")
        need(self.rollout.prompts_per_step >= 1, "rollout.prompts_per_step", "must be >= 1")
        need(self.rollout.max_response_tokens >= 1, "rollout.max_response_tokens", "must be >= 1")
        need(self.rollout.temperature > 0, "rollout.temperature", "must be > 0")
        need(0 <= self.dapo.eps_low < 1, "dapo.eps_low", "must lie in [0, 1)")
        need(self.dapo.eps_high >= 0, "dapo.eps_high", "must be >= 0")
        need(self.dapo.loss_agg in ("token_mean", "seq_mean_token_mean"), "dapo.loss_agg", "use 'token_mean' or 'seq_mean_token_mean'")
        need(self.dapo.tis_cap is None or self.dapo.tis_cap >= 1, "dapo.tis_cap", "must be >= 1 or null")
        need(self.dapo.updates_per_step >= 1, "dapo.updates_per_step", "must be >= 1")
        need(self.dapo.max_extra_rounds >= 0, "dapo.max_extra_rounds", "must be >= 0")
        need(0 <= self.dapo.overlong.cache_length < self.rollout.max_response_tokens, "dapo.overlong.cache_length",
             f"must lie in [0, rollout.max_response_tokens={self.rollout.max_response_tokens})")
        from beam_rl.engines.base import TRAIN_MODES, TRAINER_ATTENTIONS

        need(self.train.mode in TRAIN_MODES, "train.mode", f"choose one of {sorted(TRAIN_MODES)}")
        need(self.train.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
        need(self.warm_start.micro_batch_size is None or self.warm_start.micro_batch_size >= 1, "warm_start.micro_batch_size",
             "must be >= 1, or null for train.micro_batch_size")
        need(self.train.attention in TRAINER_ATTENTIONS, "train.attention", f"choose one of {TRAINER_ATTENTIONS} ('flash' needs CUDA)")
        need(self.run.max_mean_abs_logprob_diff > 0, "run.max_mean_abs_logprob_diff", "must be > 0")
        need(self.model.checkpoint is None or (Path(self.model.checkpoint) / "config.json").exists(), "model.checkpoint",
             f"{self.model.checkpoint} has no config.json; give a Beam checkpoint directory or leave it unset")
        if self.task.name == "arithmetic":
            need(self.task.max_operand >= 1, "task.max_operand", "must be >= 1")
            need(bool(self.task.ops) and set(self.task.ops) <= set("+-*"), "task.ops", "use characters from '+-*'")
        else:
            need(bool(self.task.levels) and set(self.task.levels) <= set("123"), "task.levels", "use digits from '123'")
            need(self.task.num_train >= 1, "task.num_train", "must be >= 1")
            need(self.task.num_heldout >= 1, "task.num_heldout", "must be >= 1")
        need(0 < self.task.heldout_fraction < 1, "task.heldout_fraction", "must lie in (0, 1)")
        need(self.warm_start.steps >= 0, "warm_start.steps", "must be >= 0")
        need(self.warm_start.batch_size >= 1, "warm_start.batch_size", "must be >= 1")
        need(self.warm_start.lr > 0, "warm_start.lr", "must be > 0")
        target = self.warm_start.target_heldout_avg
        need(target is None or 0 < target <= 1, "warm_start.target_heldout_avg", "must lie in (0, 1] or be null")
        need(self.warm_start.eval_every >= 1, "warm_start.eval_every", "must be >= 1")
        need(self.warm_start.eval_from >= 0, "warm_start.eval_from", "must be >= 0")
        need(self.rollout.eval_samples >= 1, "rollout.eval_samples", "must be >= 1 (avg@k needs k samples)")
        need(self.rollout.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0 GiB")
        need(0 < self.rollout.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must lie in (0, 1]")
        need(self.rollout.gpu_kv_cache_gib is None or self.rollout.gpu_kv_cache_gib > 0, "rollout.gpu_kv_cache_gib",
             "must be > 0 GiB, or null to size the KV cache from gpu_memory_utilization")
        need(self.rollout.max_num_seqs >= 1, "rollout.max_num_seqs", "must be >= 1")
        need(self.dapo.oversample_factor >= 1, "dapo.oversample_factor", "must be >= 1")
        need(self.dapo.overlong.penalty_factor >= 0, "dapo.overlong.penalty_factor", "must be >= 0")
        need(self.dapo.kl_coef >= 0, "dapo.kl_coef", "must be >= 0")
        need(self.train.lr > 0, "train.lr", "must be > 0")
        need(all(0 <= b < 1 for b in self.train.betas), "train.betas", "both must lie in [0, 1)")
        need(self.train.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        need(self.train.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0: off)")
        need(self.train.lora.r >= 1, "train.lora.r", "must be >= 1")
        need(self.train.lora.alpha > 0, "train.lora.alpha", "must be > 0")
        need(not self.train.lora.experts or self.train.lora.merge, "train.lora.experts",
             "expert adapters are served merged into the weights: set train.lora.merge: true too")
        from beam_rl.tasks.arithmetic import Tokenizer

        try:
            task = self.task.build()
            prompt = task.longest_prompt_tokens(Tokenizer())
        except ValueError as e:  # the task's own checks name their field
            raise RecipeError(str(e)) from None
        if self.task.name == "math":
            answer = task.longest_answer_tokens(Tokenizer())
            need(self.rollout.max_response_tokens >= answer, "rollout.max_response_tokens",
                 f"{self.rollout.max_response_tokens} < the longest worked solution ({answer} tokens): correct answers "
                 f"would be cut off; raise it to at least {answer}")
        need(prompt + self.rollout.max_response_tokens <= self.rollout.max_model_len, "rollout.max_model_len",
             f"{self.rollout.max_model_len} < the longest prompt ({prompt} tokens) + rollout.max_response_tokens "
             f"({self.rollout.max_response_tokens}); raise it to at least {prompt + self.rollout.max_response_tokens}")
        from beam_rl.dapo.advantages import ADVANTAGES
        from beam_rl.dapo.loss import POLICY_LOSSES

        need(self.dapo.loss in POLICY_LOSSES, "dapo.loss", f"choose from {sorted(POLICY_LOSSES)}")
        need(self.dapo.advantage in ADVANTAGES, "dapo.advantage", f"choose from {sorted(ADVANTAGES)}")
        return self


_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _typed(value: Any, kind: str, dotted: str) -> Any:
    """`value` checked against the field's annotation `kind` ("int", "float | None", ...)."""
    optional = kind.endswith(" | None")
    base = kind.removesuffix(" | None")
    if value is None:
        if optional:
            return None
        raise RecipeError(f"{dotted}: must not be null")
    if base == "bool":
        if not isinstance(value, bool):
            raise RecipeError(f"{dotted}: expected true/false, got {value!r}")
        return value
    if base == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise RecipeError(f"{dotted}: expected a number, a whole one; got {value!r}")
        return value
    if base == "float":
        # YAML 1.1 reads `1e-3` (no dot) as a string: take plain decimal / exponent notation as the number it is
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise RecipeError(f"{dotted}: expected a number, got {value!r}")
        return float(value)
    if base == "str":
        if not isinstance(value, str) or not value:
            raise RecipeError(f"{dotted}: expected a non-empty string, got {value!r}")
        return value
    if base.startswith("tuple[float"):
        n = base.count("float")
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise RecipeError(f"{dotted}: expected a list of {n} numbers, got {value!r}")
        return tuple(_typed(v, "float", f"{dotted}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"recipe field {dotted} has an annotation the loader does not know: {kind!r}")


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise RecipeError(f"{prefix or 'recipe'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise RecipeError(f"unknown recipe key {dotted!r}; allowed here: {sorted(fields)}")
        f = fields[key]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[key] = _build(type(default), value or {}, dotted)
        else:
            kwargs[key] = _typed(value, str(f.type), dotted)
    return cls(**kwargs)


def recipe_from_dict(data: dict) -> Recipe:
    return _build(Recipe, data or {}, "").validate()


def _merged(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section (a mapping in both is merged, anything else replaced)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_recipe(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The recipe file as a mapping, its `base:` (a recipe path relative to this file) merged under it."""
    if not path.exists():
        raise RecipeError(f"recipe {path} does not exist (see recipes/ for examples)")
    if path.resolve() in seen:
        raise RecipeError(f"recipe {path}: `base:` chain loops ({' -> '.join(str(p) for p in seen)} -> {path})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise RecipeError(f"recipe {path}:{where} is not valid YAML ({getattr(e, 'problem', None) or e})") from None
    data = data or {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: expected a mapping, got {type(data).__name__}")
    if "base" not in data:
        return data
    base = data.pop("base")
    if not isinstance(base, str) or not base:
        raise RecipeError(f"recipe {path}: base: expected the path of a recipe (relative to this file), got {base!r}")
    return _merged(_read_recipe(path.parent / base, seen + (path.resolve(),)), data)


def load_recipe(path: str | Path, *, validate: bool = True) -> Recipe:
    """A recipe file; `base: other.yaml` (relative to it) starts from that recipe, this file's keys on top.
    `validate=False` types the values but skips `Recipe.validate` (which builds the task: seconds for the
    math suite), for reading a setting of a recipe that was validated when it ran, not for running one."""
    path = Path(path)
    data = _read_recipe(path)
    try:
        return recipe_from_dict(data) if validate else _build(Recipe, data, "")
    except RecipeError as e:
        raise RecipeError(f"recipe {path}: {e}") from None


def recipe_to_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)

"""`beam-rl gap`: the log-prob gap between the vLLM rollout and the Megatron trainer, R3 on and off.

1. Checkpoint: `--checkpoint DIR`, or `--preset NAME` (a seeded random checkpoint in a temp dir).
2. Prompts: `--prompts FILE` (JSON list of token-id lists, or JSONL of lists), or the built-in set:
   `--num-prompts` seeded random prompts of `--min-prompt-len`..`--max-prompt-len` tokens.
3. Rollout: vLLM samples `--max-tokens` tokens per prompt at temperature 1 (`ignore_eos`, so every
   sequence has exactly that many), recording sampled-token raw log-probs and routed experts
   (prompt tokens included) -> `beam_rl.r3.RolloutBatch`.
4. Trainer: the Megatron Beam model of the mode recomputes every sequence's log-probs twice, with
   the rollout's experts replayed (R3 on) and with its own routing (R3 off), in right-padded
   micro-batches.

Modes (`MODES`): `bf16` (BF16 full fine-tuning weights), `lora` (a seeded random LoRA adapter with
non-zero B on both sides: Megatron's `add_lora`, vLLM `enable_lora` + `LoRARequest` of the PEFT
directory Megatron saved), `mxfp8` (Megatron with emulated MXFP8 linears vs the BF16 rollout).

Statistics per side (`GapStats`): delta = logprob(trainer) - logprob(rollout) over generated
tokens; mean and max |delta|; extreme-token fraction |delta| > ln 2; router disagreement = fraction
of routed (token, MoE layer) pairs whose trainer top-k SET differs from the rollout's (measured on
the routers' own output, so with R3 on it checks that replay happened); per-sequence KL estimates
of KL(rollout || trainer) from the rollout's samples: k1 = sum_t -delta_t and k3 = sum_t
(exp(delta_t) - 1 - delta_t), averaged over sequences.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch / numpy load lazily: `beam-rl plan` should not pay for them
    import numpy as np

    from beam_rl.model.config import BeamConfig
    from beam_rl.r3 import RolloutBatch

LN2 = math.log(2.0)


@dataclass(frozen=True)
class GapMode:
    provider_mode: str
    """`BeamModelProvider.mode` of the trainer."""
    lora: bool
    """A random LoRA adapter on both sides."""
    bound: float
    """The launch's bound on mean |delta| with R3."""


MODES: dict[str, GapMode] = {
    "bf16": GapMode("bf16", lora=False, bound=0.01),
    "lora": GapMode("bf16", lora=True, bound=0.01),
    "mxfp8": GapMode("mxfp8-emulated", lora=False, bound=0.03),
}


@dataclass
class GapOptions:
    checkpoint: str | None = None
    """Beam checkpoint directory (HF format); or `preset`."""
    preset: str | None = None
    """Build a seeded random checkpoint of this preset in a temp dir."""
    mode: str = "bf16"
    """bf16 | lora | mxfp8 (see MODES)."""
    prompts: str | None = None
    """JSON / JSONL file of token-id lists; None: the built-in seeded set."""
    num_prompts: int = 16
    min_prompt_len: int = 8
    max_prompt_len: int = 48
    max_tokens: int = 64
    """Generated tokens per sequence (ignore_eos: exactly this many)."""
    seed: int = 0
    """Seeds the checkpoint, the prompts, the adapter and vLLM's sampling."""
    micro_batch: int = 8
    """Sequences per trainer forward."""
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_b_std: float = 0.05
    """Std of the random LoRA B (PEFT initialises B = 0, which would test nothing)."""
    gpu_memory_utilization: float = 0.4
    """vLLM's share of GPU memory (the trainer shares the GPU); ignored on CPU."""
    histogram: str | None = None
    """Write a PNG histogram of |delta| (R3 on and off) here."""
    progress: bool = True


@dataclass
class GapStats:
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    mean_logprob_diff: float
    extreme_token_fraction: float
    router_disagreement: float
    seq_kl_k1: float
    seq_kl_k3: float
    num_tokens: int
    num_sequences: int
    num_routed_pairs: int


# -- inputs -------------------------------------------------------------------------------------

def default_prompts(config: BeamConfig, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Seeded random prompts of variable length (a tokenizer-free model needs no text)."""
    import torch

    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= --min-prompt-len ({min_len}) <= --max-prompt-len ({max_len})")
    g = torch.Generator().manual_seed(seed + 1)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, config.vocab_size, (L,), generator=g).tolist() for L in lens]


def load_prompts(path: str, config: BeamConfig) -> list[list[int]]:
    text = Path(path).read_text()
    try:
        prompts = json.loads(text)
    except json.JSONDecodeError:
        prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise ValueError(f"--prompts {path}: expected a non-empty JSON list (or JSONL) of non-empty token-id lists")
    for i, p in enumerate(prompts):
        if not all(isinstance(t, int) and 0 <= t < config.vocab_size for t in p):
            raise ValueError(f"--prompts {path}: prompt {i} has a token outside [0, vocab_size={config.vocab_size})")
    return prompts


def _build_checkpoint(preset: str, seed: int, out: Path) -> Path:
    import torch

    from beam_rl.model.checkpoint import save_checkpoint
    from beam_rl.model.modeling import build_model
    from beam_rl.model.presets import get_preset

    return save_checkpoint(build_model(get_preset(preset), seed=seed, dtype=torch.bfloat16), out)


# -- rollout ------------------------------------------------------------------------------------

def start_engine(checkpoint: str, config: BeamConfig, opts: GapOptions, max_model_len: int):
    """A vLLM engine with beam-rl's routing capture (CPU) or vLLM's own (CUDA)."""
    import torch

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # torch work happened in this process
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the report
    from vllm import LLM

    kwargs = dict(
        model=str(checkpoint), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        max_model_len=max_model_len, seed=opts.seed, max_num_seqs=min(64, max(opts.num_prompts, 1)),
        enable_prefix_caching=False,  # a cached prompt block is never routed, so R3 would have no rows for it
        worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension",
    )
    if MODES[opts.mode].lora:
        kwargs.update(enable_lora=True, max_lora_rank=opts.lora_rank, max_loras=1)
    cuda = torch.cuda.is_available()
    if cuda:
        kwargs.update(enable_return_routed_experts=True, gpu_memory_utilization=opts.gpu_memory_utilization)
    llm = LLM(**kwargs)
    if not cuda:
        llm.collective_rpc("beam_start_routing_capture")
    return llm


def rollout(llm, prompts: list[list[int]], config: BeamConfig, opts: GapOptions, lora_dir: Path | None) -> RolloutBatch:
    """Sample at temperature 1 and collect tokens, raw log-probs and routing as a RolloutBatch."""
    from vllm import SamplingParams

    from beam_rl.r3 import RolloutBatch
    from beam_rl.rollout.routing import fetch_routed_experts

    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=opts.max_tokens, min_tokens=opts.max_tokens,
                            ignore_eos=True, logprobs=0, seed=opts.seed, detokenize=False)
    lora_request = None
    if lora_dir is not None:
        from vllm.lora.request import LoRARequest

        lora_request = LoRARequest("beam-rl-gap", 1, str(lora_dir))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=opts.progress, lora_request=lora_request)
    return RolloutBatch.from_vllm(outs, fetch_routed_experts(llm, outs), config)


# -- trainer ------------------------------------------------------------------------------------

def build_trainer(checkpoint: str, config: BeamConfig, opts: GapOptions):
    """The Megatron model of the mode, weights loaded (plus the seeded random adapter for lora)."""
    import torch

    from beam_rl.model.checkpoint import read_tensors
    from beam_rl.megatron.attention import trainer_attention_dtype
    from beam_rl.megatron.cpu import init_single_process
    from beam_rl.megatron.provider import BeamModelProvider

    init_single_process(seed=opts.seed)
    mode = MODES[opts.mode]
    model = BeamModelProvider(config, mode=mode.provider_mode, attention_dtype=trainer_attention_dtype()).provide_loaded(
        dict(read_tensors(checkpoint, config))).eval()
    if mode.lora:
        from beam_rl.megatron.lora import add_lora

        torch.manual_seed(opts.seed)  # A: PEFT's kaiming init from the global generator
        add_lora(model, r=opts.lora_rank, alpha=opts.lora_alpha)
        g = torch.Generator().manual_seed(opts.seed + 2)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "lora"):
                    for b in m.lora.B:
                        b.copy_(torch.randn(b.shape, generator=g) * opts.lora_b_std)
                    # The rollout computes with the adapter as it receives it, in BF16 (vLLM casts
                    # LoRA weights to the model dtype): make the adapter BF16-exact so both sides
                    # hold the same values (a trainer keeps FP32 masters and syncs rounded ones).
                    for w in (*m.lora.A, *m.lora.B):
                        w.copy_(w.to(torch.bfloat16).float())
    return model


class _RouterTap:
    """Collects every router's routing map [s*b, E] (the SET of experts each token used)."""

    def __init__(self, model):
        from beam_rl.megatron.replay import model_routers

        self.maps: list = []  # routing maps [s*b, E] (bool tensors)
        self.handles = [r.register_forward_hook(lambda m, i, o: self.maps.append(o[1].detach())) for r in model_routers(model)]

    def pop(self) -> list:
        maps, self.maps = self.maps, []
        return maps

    def close(self):
        for h in self.handles:
            h.remove()


def recompute(model, batch: RolloutBatch, *, replay: bool, micro_batch: int, progress: bool = True, desc: str = ""):
    """Trainer log-prob deltas per sequence (float64 arrays, generated tokens) and the routing
    disagreement counts (differing pairs, routed pairs)."""
    import torch

    from tqdm import tqdm

    from beam_rl.megatron import replay as r3
    from beam_rl.megatron.logprobs import sequence_logprobs

    config = batch.config
    device = next(model.parameters()).device
    E = config.num_experts
    deltas: list[np.ndarray] = [None] * len(batch)
    differ = pairs = 0
    tap = _RouterTap(model)
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        for tb in tqdm(list(batch.micro_batches(micro_batch)), desc=desc, disable=not progress, file=sys.stderr):
            B, T = tb.input_ids.shape
            lp, mask = sequence_logprobs(
                model, tb.input_ids.to(device), config=config, lengths=tb.lengths.to(device),
                prompt_lengths=tb.prompt_lengths.to(device), routed_experts=tb.routed_experts.to(device) if replay else None,
            )
            r3.clear_replay(model)
            if not torch.equal(mask.cpu(), tb.mask):
                raise RuntimeError("trainer mask differs from the rollout alignment (r3.TrainerBatch.mask)")
            delta = (lp.cpu().double() - tb.rollout_logprobs.double())
            for b, idx in enumerate(tb.indices):
                deltas[idx] = delta[b][tb.mask[b]].numpy()
            maps = tap.pop()
            if len(maps) != config.num_moe_layers:
                raise RuntimeError(f"tapped {len(maps)} router outputs; expected {config.num_moe_layers} MoE layers")
            rollout_set = torch.zeros(B, T, config.num_moe_layers, E, dtype=torch.bool)
            rollout_set.scatter_(-1, tb.routed_experts.long(), True)
            trainer_set = torch.stack([m.cpu().view(T, B, E).transpose(0, 1) for m in maps], dim=2)  # (B, T, L, E)
            diff = (trainer_set != rollout_set).any(-1) & tb.routed_rows[..., None]
            differ += int(diff.sum())
            pairs += int(tb.routed_rows.sum()) * config.num_moe_layers
    finally:
        tap.close()
        torch.set_grad_enabled(grad)
    return deltas, differ, pairs


def gap_stats(deltas: list[np.ndarray], differ: int, pairs: int) -> GapStats:
    import numpy as np

    flat = np.concatenate(deltas)
    a = np.abs(flat)
    k1 = [float(-d.sum()) for d in deltas]
    k3 = [float((np.expm1(d) - d).sum()) for d in deltas]
    return GapStats(
        mean_abs_logprob_diff=float(a.mean()), max_abs_logprob_diff=float(a.max()), mean_logprob_diff=float(flat.mean()),
        extreme_token_fraction=float((a > LN2).mean()), router_disagreement=differ / max(pairs, 1),
        seq_kl_k1=float(np.mean(k1)), seq_kl_k3=float(np.mean(k3)), num_tokens=int(a.size),
        num_sequences=len(deltas), num_routed_pairs=pairs,
    )


# -- the run ------------------------------------------------------------------------------------

def run_gap(opts: GapOptions, *, llm=None) -> dict:
    """The whole measurement; returns the report dict (`r3_on`, `r3_off`, and the set-up).
    `llm`: an engine already running on the same checkpoint, with `BeamWorkerExtension` (tests share
    one); else one is started and shut down here. The trainer defines attention as the engine
    reports computing it (`engine_attention_isa`)."""
    import numpy as np
    import torch

    from beam_rl.model.checkpoint import load_config
    from beam_rl.megatron.attention import set_attention_dtype, trainer_attention_dtype
    from beam_rl.model.presets import get_preset
    from beam_rl.rollout.worker import engine_attention_isa

    if opts.mode not in MODES:
        raise ValueError(f"--mode {opts.mode!r}; choose one of {sorted(MODES)}")
    if (opts.checkpoint is None) == (opts.preset is None):
        raise ValueError("give exactly one of --checkpoint DIR or --preset NAME")
    if opts.micro_batch < 1 or opts.max_tokens < 1 or opts.num_prompts < 1:
        raise ValueError("--micro-batch, --max-tokens and --num-prompts must be >= 1")
    with tempfile.TemporaryDirectory(prefix="beam-rl-gap-") as tmp:
        tmp = Path(tmp)
        if opts.preset is not None:
            get_preset(opts.preset)  # names the bad preset before any work
            checkpoint = str(_build_checkpoint(opts.preset, opts.seed, tmp / opts.preset))
        else:
            checkpoint = opts.checkpoint
        config = load_config(checkpoint)
        prompts = load_prompts(opts.prompts, config) if opts.prompts else default_prompts(
            config, opts.num_prompts, opts.min_prompt_len, opts.max_prompt_len, opts.seed)
        max_len = max(len(p) for p in prompts) + opts.max_tokens
        if max_len > config.max_position_embeddings:
            raise ValueError(f"prompt + --max-tokens = {max_len} exceeds max_position_embeddings={config.max_position_embeddings}")
        mode = MODES[opts.mode]

        model, lora_dir = None, None
        if mode.lora:  # the adapter must exist before vLLM samples with it
            from beam_rl.megatron.lora import save_peft_adapter

            model = build_trainer(checkpoint, config, opts)
            lora_dir = save_peft_adapter(model, tmp / "adapter", config, r=opts.lora_rank, alpha=opts.lora_alpha,
                                         base_model_name_or_path=checkpoint)
        own_engine = llm is None
        if own_engine:
            llm = start_engine(checkpoint, config, opts, max_model_len=max_len + 1)
        try:
            batch = rollout(llm, prompts, config, opts, lora_dir)
            isa = engine_attention_isa(llm)
        finally:
            if own_engine:
                del llm
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        if model is None:
            model = build_trainer(checkpoint, config, opts)
        attention_dtype = trainer_attention_dtype(isa)  # as this engine computed attention
        set_attention_dtype(model, attention_dtype)
        report: dict = {"mode": opts.mode, "bound": mode.bound, "checkpoint": opts.checkpoint or f"preset:{opts.preset}",
                        "num_sequences": len(batch), "max_tokens": opts.max_tokens,
                        "prompt_tokens": int(sum(len(s.prompt_ids) for s in batch.samples)),
                        "engine_attention_isa": isa, "trainer_attention_dtype": attention_dtype}
        raw: dict = {}
        for key, replay in (("r3_on", True), ("r3_off", False)):
            deltas, differ, pairs = recompute(model, batch, replay=replay, micro_batch=opts.micro_batch,
                                              progress=opts.progress, desc=f"trainer {key}")
            raw[key] = np.concatenate(deltas)
            report[key] = asdict(gap_stats(deltas, differ, pairs))
        if mode.lora:
            report["lora_effect_mean_abs_logprob"] = lora_effect(model, batch, opts)
    if opts.histogram:
        write_histogram(raw, opts.histogram, title=f"beam-rl gap: {report['checkpoint']}, mode {opts.mode}")
        report["histogram"] = opts.histogram
    return report


def lora_effect(model, batch: RolloutBatch, opts: GapOptions) -> float:
    """Mean |logprob(with adapter) - logprob(without)| on the trainer, R3 on: how far an engine
    that ignored the adapter would be off (proof that the rollout applied it)."""
    import numpy as np

    adapters = [m.lora for m in model.modules() if hasattr(m, "lora")]
    with_lora, _, _ = recompute(model, batch, replay=True, micro_batch=opts.micro_batch, progress=False)
    saved = [a.scaling for a in adapters]
    try:
        for a in adapters:
            a.scaling = 0.0
        without, _, _ = recompute(model, batch, replay=True, micro_batch=opts.micro_batch, progress=False)
    finally:
        for a, s in zip(adapters, saved):
            a.scaling = s
    return float(np.abs(np.concatenate(with_lora) - np.concatenate(without)).mean())


def write_histogram(raw: dict[str, np.ndarray], path: str, title: str = "") -> None:
    import numpy as np

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    floor = 1e-7
    edges = np.logspace(-7, 1, 65)
    for key, color in (("r3_off", "tab:red"), ("r3_on", "tab:blue")):
        a = np.maximum(np.abs(raw[key]), floor)
        ax.hist(a, bins=edges, alpha=0.55, color=color, label=f"{key.replace('_', ' ')}: mean {np.abs(raw[key]).mean():.2e}")
    ax.axvline(LN2, color="k", ls="--", lw=1, label="ln 2 (extreme)")
    ax.set_xscale("log")
    ax.set_xlabel("|logprob(trainer) - logprob(rollout)| per generated token (values < 1e-7 at 1e-7)")
    ax.set_ylabel("tokens")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(report: dict) -> str:
    on, off = report["r3_on"], report["r3_off"]
    rows = [
        ("mean |delta logprob|", "mean_abs_logprob_diff", "{:.3e}"),
        ("max |delta logprob|", "max_abs_logprob_diff", "{:.3e}"),
        ("mean delta (signed)", "mean_logprob_diff", "{:+.3e}"),
        ("extreme tokens (|d| > ln 2)", "extreme_token_fraction", "{:.4%}"),
        ("router disagreement", "router_disagreement", "{:.4%}"),
        ("seq KL(rollout||trainer) k1", "seq_kl_k1", "{:+.3e}"),
        ("seq KL(rollout||trainer) k3", "seq_kl_k3", "{:.3e}"),
        ("generated tokens", "num_tokens", "{:d}"),
    ]
    lines = [f"beam-rl gap: {report['checkpoint']}, mode {report['mode']}, {report['num_sequences']} sequences x "
             f"{report['max_tokens']} generated tokens (+{report['prompt_tokens']} prompt tokens), temperature 1",
             f"{'':30s} {'R3 on':>12s} {'R3 off':>12s}"]
    lines += [f"{label:30s} {fmt.format(on[k]):>12s} {fmt.format(off[k]):>12s}" for label, k, fmt in rows]
    verdict = "within" if on["mean_abs_logprob_diff"] < report["bound"] else "OVER"
    lines.append(f"R3 on mean |delta| {on['mean_abs_logprob_diff']:.3e} is {verdict} the {report['mode']} bound {report['bound']}")
    if "lora_effect_mean_abs_logprob" in report:
        lines.append(f"LoRA adapter effect on the trainer (mean |delta| with vs without): {report['lora_effect_mean_abs_logprob']:.3e}")
    if "histogram" in report:
        lines.append(f"histogram: {report['histogram']}")
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------

def add_gap_parser(sub) -> None:
    from beam_rl.model.presets import PRESETS

    p = sub.add_parser("gap", help="log-prob gap between vLLM rollout and Megatron trainer, R3 on and off")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="Beam checkpoint directory")
    src.add_argument("--preset", choices=sorted(PRESETS), help="seeded random checkpoint of a preset (temp dir)")
    p.add_argument("--mode", default="bf16", choices=sorted(MODES), help="trainer numerics (default bf16)")
    p.add_argument("--prompts", help="JSON list / JSONL of token-id lists (default: built-in seeded prompts)")
    for flag, default, what in (("--num-prompts", 16, "built-in prompts"), ("--min-prompt-len", 8, "built-in prompt length"),
                                ("--max-prompt-len", 48, "built-in prompt length"), ("--max-tokens", 64, "generated tokens per sequence"),
                                ("--seed", 0, "seed of checkpoint, prompts, adapter, sampling"), ("--micro-batch", 8, "sequences per trainer forward"),
                                ("--lora-rank", 8, "LoRA rank (mode lora)")):
        p.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-b-std", type=float, default=0.05, help="std of the random LoRA B (default 0.05)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's GPU share (default 0.4)")
    p.add_argument("--histogram", metavar="PATH.png", help="write a histogram of |delta|")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_gap)


def options_from_args(args) -> GapOptions:
    return GapOptions(
        checkpoint=args.checkpoint, preset=args.preset, mode=args.mode, prompts=args.prompts, num_prompts=args.num_prompts,
        min_prompt_len=args.min_prompt_len, max_prompt_len=args.max_prompt_len, max_tokens=args.max_tokens, seed=args.seed,
        micro_batch=args.micro_batch, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_b_std=args.lora_b_std,
        gpu_memory_utilization=args.gpu_memory_utilization, histogram=args.histogram, progress=not args.no_progress,
    )


@contextlib.contextmanager
def stdout_to_stderr():
    """Point file descriptor 1 at stderr for the duration, so stdout carries only the report printed after it.

    VLLM_LOGGING_STREAM (set in `start_engine`) only counts if vllm is not imported yet, and engine-core
    processes inherit the descriptor: on the H200 (vLLM 0.26) vLLM's INFO lines came before the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def cmd_gap(args, *, llm=None) -> int:
    with stdout_to_stderr():
        report = run_gap(options_from_args(args), llm=llm)
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0

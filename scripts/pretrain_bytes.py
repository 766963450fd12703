"""Train a Beam-shaped model briefly as a byte-level language model, for measuring the R3 gap on
weights that have learned something (no Beam weights are public here).

Corpus: the Python standard library's own source files (present on every machine, the H200 image
included), read as bytes; token id = byte value (0-255), so no tokenizer is needed and the
checkpoint works with `beam-rl gap --prompts`. Files are split by a seeded shuffle into train and
held-out; training samples random `--seq`-byte windows of the training files; the held-out files
give `--num-prompts` prompts of `--min-prompt-len`..`--max-prompt-len` bytes (JSON list of id lists).

Trainer: `beam_rl.engines.megatron.MegatronTrainer` (the Megatron Beam model, BF16 with FP32-master AdamW),
teacher-forced next-byte NLL, linear warm-up, for `--steps` steps or `--seconds` of wall time.

    python scripts/pretrain_bytes.py --preset beam-mini --out /tmp/beam-mini-bytes --seconds 150 \
        --prompts-out /tmp/bytes-prompts.json
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
import time
from pathlib import Path

import torch


def corpus_files(root: Path, seed: int, heldout_fraction: float) -> tuple[list[Path], list[Path]]:
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.stat().st_size > 2048)
    if len(files) < 20:
        raise SystemExit(f"--corpus {root}: found only {len(files)} .py files larger than 2 KiB")
    random.Random(seed).shuffle(files)
    n_held = max(1, int(len(files) * heldout_fraction))
    return files[n_held:], files[:n_held]


def read_bytes(files: list[Path]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"\n".join(f.read_bytes() for f in files)), dtype=torch.uint8).long()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="beam-mini")
    ap.add_argument("--out", required=True, help="HF checkpoint directory to write")
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="directory of .py files (default: the stdlib)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--seconds", type=float, default=150.0, help="stop after this much training wall time")
    ap.add_argument("--prompts-out", help="write held-out prompts (JSON list of byte-id lists) here")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt-len", type=int, default=32)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    args = ap.parse_args(argv)

    from beam_rl.model.checkpoint import save_checkpoint
    from beam_rl.model.modeling import build_model
    from beam_rl.engines.megatron import MegatronTrainer
    from beam_rl.model.presets import get_preset

    config = get_preset(args.preset)
    if config.vocab_size < 256:
        raise SystemExit(f"--preset {args.preset}: vocab_size {config.vocab_size} < 256 byte tokens")
    train_files, held_files = corpus_files(Path(args.corpus), args.seed, 0.05)
    train, held = read_bytes(train_files), read_bytes(held_files)
    print(f"corpus {args.corpus}: {len(train_files)} train files ({train.numel() / 1e6:.1f} MB), "
          f"{len(held_files)} held-out ({held.numel() / 1e6:.1f} MB)", flush=True)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    init = build_model(config, seed=args.seed, dtype=torch.bfloat16, device=device)
    policy = MegatronTrainer(config, init.state_dict(), mode="bf16")
    del init
    policy.make_optimizer(lr=args.lr, grad_clip=1.0)
    opt = policy.optimizer
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.full((args.batch,), args.seq)
    prompt_lengths = torch.ones(args.batch, dtype=torch.long)

    def batch(data: torch.Tensor) -> torch.Tensor:
        starts = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=g)
        return torch.stack([data[s : s + args.seq] for s in starts.tolist()])

    t0, step, losses = time.perf_counter(), 0, []
    while step < args.steps and time.perf_counter() - t0 < args.seconds:
        for group in opt.opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        losses.append(policy.supervised_step(batch(train), lengths, prompt_lengths))
        step += 1
        if step % 20 == 0:
            print(f"step {step} loss {sum(losses[-20:]) / 20:.3f} nats/byte ({time.perf_counter() - t0:.0f} s)", flush=True)
    train_s = time.perf_counter() - t0

    policy.model.eval()
    with torch.no_grad():
        ids = batch(held).to(device)
        from beam_rl.megatron.logprobs import sequence_logprobs

        lp, mask = sequence_logprobs(policy.model, ids, config=config)
        heldout = float(-(lp * mask).sum() / mask.sum())

    model = build_model(config, seed=None, dtype=torch.bfloat16)
    model.load_state_dict(policy.export(), strict=True)
    save_checkpoint(model, args.out)
    summary = {"steps": step, "train_s": round(train_s, 1), "tokens": step * args.batch * args.seq,
               "final_train_loss": round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4), "heldout_loss": round(heldout, 4)}
    print(json.dumps(summary), flush=True)
    (Path(args.out) / "pretrain_bytes.json").write_text(json.dumps(summary, indent=1))

    if args.prompts_out:
        rng = random.Random(args.seed + 1)
        prompts = []
        for _ in range(args.num_prompts):
            n = rng.randint(args.min_prompt_len, args.max_prompt_len)
            s = rng.randrange(0, held.numel() - n)
            prompts.append(held[s : s + n].tolist())
        Path(args.prompts_out).write_text(json.dumps(prompts))


if __name__ == "__main__":
    main()

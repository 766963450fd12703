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

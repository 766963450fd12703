"""`python -m beam_rl.skyrl.data --recipe recipes/mini-h200.yaml --out data/skyrl-beam-arith [--tokenizer-into CKPT]`

Writes the recipe's built-in task as SkyRL prompt data: `train.parquet` / `validation.parquet`
(the recipe's `task` section, so the train / held-out split is the one `beam-rl dapo` uses), one
row per problem: `prompt` (one user message holding the task's prompt text, e.g. `3+4=`, or the
math suite's instruction and problem), `env_class` (`beam_arithmetic` / `beam_math`) and
`reward_spec.ground_truth` (the integer answer).

SkyRL renders prompts with the tokenizer's chat template; the shipped task tokenizer has none, so
`--tokenizer-into CKPT` copies it into the Beam checkpoint directory with `CHAT_TEMPLATE`, which
renders exactly `<s>` + the prompt text: the same prompt ids as the task's `prompt_ids`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from beam_rl.skyrl.env import MATH_NAME, NAME
from beam_rl.tasks.arithmetic import TOKENIZER_DIR, TOKENIZER_FILES, ArithmeticTask
from beam_rl.tasks.math_suite import MathSuiteTask

CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""Raw concatenation after <s>: no roles, nothing added for the generation prompt."""


def row(task: ArithmeticTask | MathSuiteTask, problem) -> dict:
    env = MATH_NAME if isinstance(task, MathSuiteTask) else NAME
    return {"prompt": [{"role": "user", "content": task.prompt_text(problem)}], "env_class": env,
            "reward_spec": {"method": "rule", "ground_truth": problem.answer}}


def task_from_recipe(path: str | None) -> ArithmeticTask | MathSuiteTask:
    if path is None:
        return ArithmeticTask()
    from beam_rl.dapo.config import load_recipe

    return load_recipe(path).task.build()


def write_data(task: ArithmeticTask | MathSuiteTask, out: str | Path) -> dict[str, Path]:
    import pandas as pd

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, problems in (("train", task.train), ("validation", task.heldout)):
        paths[split] = out / f"{split}.parquet"
        pd.DataFrame([row(task, p) for p in problems]).to_parquet(paths[split], index=False)
    return paths


def write_tokenizer(dst: str | Path) -> Path:
    """Copy the task tokenizer into `dst` with CHAT_TEMPLATE set."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / f, dst / f)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=1) + "\n")
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m beam_rl.skyrl.data", description="A recipe's task -> SkyRL parquet data.")
    p.add_argument("--recipe", help="beam-rl recipe whose `task` section sets the split (default: TaskConfig defaults)")
    p.add_argument("--out", required=True, help="output directory for train.parquet / validation.parquet")
    p.add_argument("--tokenizer-into", help="also write the task tokenizer (with chat template) into this checkpoint dir")
    args = p.parse_args(argv)
    task = task_from_recipe(args.recipe)
    paths = write_data(task, args.out)
    print(f"wrote {len(task.train)} train / {len(task.heldout)} validation rows: {paths['train']}, {paths['validation']}")
    if args.tokenizer_into:
        print(f"tokenizer with chat template -> {write_tokenizer(args.tokenizer_into)}")


if __name__ == "__main__":
    main()

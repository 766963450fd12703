"""The math suite: multi-step arithmetic and templated word problems with worked solutions.

Every problem has a non-negative integer answer and a worked solution of one line per step
(`7*3=21`), then `Answer: N`: tens of tokens of reasoning the model has to get right digit by
digit. Difficulty is graded by `level`:

- 1: two steps on one-digit operands;
- 2: two steps on operands up to 30;
- 3: three steps on operands up to 99;

every factor of a product past level 1 has one digit, and no result exceeds `MAX_VALUE`.

Half the problems are arithmetic expressions (`Compute 12+7*3-5.`, multiplications first, then
left to right), half are word problems from `WORD_PROBLEMS` (names, items and numbers drawn at
random; every intermediate result is a non-negative integer, divisions are exact).

Prompt (the DAPO format, shortened to keep sequences short): `<s>` + `INSTRUCTION` + the problem +
a newline. Response: the solution lines, `Answer: N`, `</s>`.

Splits: problems are drawn from one seeded stream; a problem is held out iff the SHA-256 of its
text falls in the `heldout_fraction` slice, so the splits are disjoint by construction and the
same on every machine; drawing continues until both splits are full.

Reward: 1.0 iff the response ends with `</s>` and its answer (`beam_rl.eval.grading.extract_answer`:
the last `Answer:` line, else the last `\\boxed{}`) is math-verify-equal to the gold answer, graded
in a `GradingPool` under a timeout exactly as `beam-rl eval` grades; else 0.0.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from beam_rl.tasks import TaskSplits
from beam_rl.tasks.arithmetic import Tokenizer

if TYPE_CHECKING:
    from beam_rl.eval.grading import GradingPool

INSTRUCTION = 'Solve step by step. The last line of your response should be of the form "Answer: $Answer".\n\n'
LEVELS = (1, 2, 3)
OPERAND_MAX = {1: 9, 2: 30, 3: 99}
"""Largest operand a level draws (counts, prices, pages, ...)."""
MAX_VALUE = 9999
"""Largest intermediate result or answer (four digits)."""

NAMES = (("Ann", "She"), ("Ben", "He"), ("Cara", "She"), ("Dev", "He"), ("Emma", "She"), ("Finn", "He"),
         ("Gia", "She"), ("Hugo", "He"), ("Ines", "She"), ("Jack", "He"), ("Kira", "She"), ("Liam", "He"))
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells")


@dataclass(frozen=True)
class Problem:
    text: str
    """The problem statement (without the instruction)."""
    steps: tuple[str, ...]
    """The worked solution, one `a op b=c` line per step."""
    answer: int
    level: int

    @property
    def solution(self) -> str:
        return "\n".join(self.steps) + f"\nAnswer: {self.answer}"


class _Steps:
    """Records each binary step as a solution line and returns its value (integers only)."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, a: int, op: str, b: int) -> int:
        if op == "/" and (b == 0 or a % b):
            raise _Redraw
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        if not 0 <= value <= MAX_VALUE:
            raise _Redraw
        self.lines.append(f"{a}{op}{b}={value}")
        return value


class _Redraw(Exception):
    """The drawn numbers give a negative or fractional intermediate result: draw again."""


def _expression(rng: random.Random, level: int, step: _Steps) -> tuple[str, int]:
    """An expression with two operators (levels 1 and 2) or three (level 3), evaluated multiplications
    first, then left to right."""
    hi = OPERAND_MAX[level]
    n_ops = 2 if level == 1 else level
    nums = [rng.randint(1 if level == 1 else 2, hi) for _ in range(n_ops + 1)]
    ops = [rng.choice("+-*") for _ in range(n_ops)]
    if level > 1:  # keep products in reach: every factor after a '*' has one digit
        for i, o in enumerate(ops):
            if o == "*":
                nums[i + 1] = rng.randint(2, 9)
    text = "".join(f"{n}{o}" for n, o in zip(nums, ops)) + str(nums[-1])
    vals, pending = [nums[0]], []
    for o, n in zip(ops, nums[1:]):  # multiplications first, left to right
        if o == "*":
            vals[-1] = step(vals[-1], "*", n)
        else:
            pending.append(o)
            vals.append(n)
    total = vals[0]
    for o, v in zip(pending, vals[1:]):
        total = step(total, o, v)
    return f"Compute {text}.", total


def _buy_and_give(rng, level, step):
    (name, he), item, hi = rng.choice(NAMES), rng.choice(ITEMS), OPERAND_MAX[level]
    a, b, c = rng.randint(2, hi), rng.randint(2, hi), rng.randint(1, hi)
    x = step(a, "+", b)
    y = step(x, "-", c)
    return f"{name} has {a} {item}. {he} buys {b} more and gives away {c}. How many {item} does {name} have now?", y


def _boxes_eaten(rng, level, step):
    (name, he), item, hi = rng.choice(NAMES), rng.choice(ITEMS), OPERAND_MAX[level]
    a, b = rng.randint(2, hi), rng.randint(2, 9)
    x = step(a, "*", b)
    c = rng.randint(1, x)
    y = step(x, "-", c)
    return f"{name} buys {a} boxes with {b} {item} in each box. {he} gives {c} of them to friends. How many {item} are left?", y


def _change(rng, level, step):
    (name, _), item, hi = rng.choice(NAMES), rng.choice(ITEMS), OPERAND_MAX[level]
    price, count = rng.randint(2, hi), rng.randint(2, 9)
    x = step(count, "*", price)
    paid = -(-x // 10) * 10 + rng.choice((0, 10, 50))
    y = step(paid, "-", x)
    return f"One of the {item} costs {price} dollars. {name} buys {count} of them and pays {paid} dollars. How many dollars of change does {name} get?", y


def _reading(rng, level, step):
    (name, he), hi = rng.choice(NAMES), OPERAND_MAX[level]
    a, b, c = rng.randint(2, hi), rng.randint(2, 9), rng.randint(1, hi)
    x = step(a, "*", b)
    y = step(x, "+", c)
    return f"{name} reads {a} pages a day for {b} days, then {c} pages more. How many pages does {name} read in total?", y


def _sharing(rng, level, step):
    (name, _), item, hi = rng.choice(NAMES), rng.choice(ITEMS), OPERAND_MAX[level]
    friends, each = rng.randint(2, 9), rng.randint(2, hi)
    left = rng.randint(1, friends - 1)
    total = friends * each + left
    x = step(total, "-", left)
    y = step(x, "/", friends)
    return f"{name} shares {total} {item} equally among {friends} friends and keeps the {left} left over. How many {item} does each friend get?", y


def _bags(rng, level, step):
    (name, he), item, hi = rng.choice(NAMES), rng.choice(ITEMS), OPERAND_MAX[level]
    a, bags, per = rng.randint(2, hi), rng.randint(2, 9), rng.randint(2, hi)
    x = step(bags, "*", per)
    y = step(a, "+", x)
    d = rng.randint(1, y)
    z = step(y, "-", d)
    return (f"{name} has {a} {item}. {he} buys {bags} bags with {per} {item} in each bag, then gives {d} {item} to a friend. "
            f"How many {item} does {name} have now?"), z


WORD_PROBLEMS = {1: (_buy_and_give, _boxes_eaten, _change, _reading, _sharing),
                 2: (_buy_and_give, _boxes_eaten, _change, _reading, _sharing),
                 3: (_bags,)}
"""Word-problem templates per level (level 3: three steps)."""


def draw_problem(rng: random.Random, level: int) -> Problem:
    """One problem of `level`: an expression or a word problem, drawn until every step is valid."""
    while True:
        step = _Steps()
        try:
            if rng.random() < 0.5:
                text, answer = _expression(rng, level, step)
            else:
                text, answer = rng.choice(WORD_PROBLEMS[level])(rng, level, step)
        except _Redraw:
            continue
        return Problem(text, tuple(step.lines), answer, level)


def is_heldout(text: str, heldout_fraction: float) -> bool:
    """The split of a problem, a function of its text alone."""
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64
    return h < heldout_fraction


@dataclass(frozen=True)
class MathSuiteTask(TaskSplits):
    levels: tuple[int, ...] = LEVELS
    num_train: int = 20000
    num_heldout: int = 256
    heldout_fraction: float = 0.1
    seed: int = 0
    grade_timeout_s: float = 10.0

    def __post_init__(self):
        if not self.levels or any(lv not in LEVELS for lv in self.levels):
            raise ValueError(f"task.levels={list(self.levels)}: choose from {list(LEVELS)}")
        if self.num_train < 1 or self.num_heldout < 1:
            raise ValueError(f"task.num_train={self.num_train}, task.num_heldout={self.num_heldout}: both must be >= 1")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"task.heldout_fraction must lie in (0, 1), got {self.heldout_fraction}")

    @cached_property
    def _splits(self) -> tuple[list[Problem], list[Problem]]:
        rng = random.Random(self.seed)
        train, heldout, seen = [], [], set()
        draws = repeats = 0
        while len(train) < self.num_train or len(heldout) < self.num_heldout:
            p = draw_problem(rng, self.levels[draws % len(self.levels)])
            draws += 1
            if p.text in seen:
                repeats += 1
                if repeats > 10000:  # the levels' problem space is nearly exhausted
                    raise ValueError(f"task: only {len(train)} train / {len(heldout)} held-out distinct problems at levels "
                                     f"{list(self.levels)}; lower task.num_train / task.num_heldout or add levels")
                continue
            repeats = 0
            seen.add(p.text)
            split, size = (heldout, self.num_heldout) if is_heldout(p.text, self.heldout_fraction) else (train, self.num_train)
            if len(split) < size:
                split.append(p)
        return train, heldout

    def prompt_text(self, problem: Problem) -> str:
        return INSTRUCTION + problem.text + "\n"

    def prompt_ids(self, problem: Problem, tokenizer: Tokenizer) -> list[int]:
        return [tokenizer.bos_id] + tokenizer.encode(self.prompt_text(problem))

    def answer_ids(self, problem: Problem, tokenizer: Tokenizer) -> list[int]:
        """The warm-start target: the worked solution and the answer line, then `</s>`."""
        return tokenizer.encode(problem.solution) + [tokenizer.eos_id]

    def longest_prompt_tokens(self, tokenizer: Tokenizer) -> int:
        return max(len(self.prompt_ids(p, tokenizer)) for p in self.train + self.heldout)

    def longest_answer_tokens(self, tokenizer: Tokenizer) -> int:
        return max(len(self.answer_ids(p, tokenizer)) for p in self.train + self.heldout)

    def rewards(self, problems: list[Problem], responses: list[list[int]], tokenizer: Tokenizer) -> list[float]:
        """1.0 per response that ends with `</s>` and whose answer math-verify accepts, else 0.0."""
        if len(problems) != len(responses):
            raise ValueError(f"rewards: {len(problems)} problems for {len(responses)} responses")
        return answer_rewards([p.answer for p in problems], responses, tokenizer, self.grade_timeout_s)


def answer_rewards(answers: list[int], responses: list[list[int]], tokenizer: Tokenizer, timeout_s: float = 10.0) -> list[float]:
    """The suite's reward of each response (token ids) against its gold integer answer."""
    finished = [bool(r) and r[-1] == tokenizer.eos_id for r in responses]
    texts = [tokenizer.decode(r[:-1]) if f else "" for r, f in zip(responses, finished)]
    grades = _grading_pool(timeout_s).grade([str(a) for a in answers], texts)
    return [1.0 if f and g.correct else 0.0 for f, g in zip(finished, grades)]


_POOLS: dict[float, "GradingPool"] = {}


def _grading_pool(timeout_s: float) -> "GradingPool":
    """One grading worker per process and timeout, started on first use and kept (its process is a
    daemon: it ends with this one)."""
    from beam_rl.eval.grading import GradingPool

    if timeout_s not in _POOLS:
        _POOLS[timeout_s] = GradingPool(workers=1, timeout_s=timeout_s)
    return _POOLS[timeout_s]

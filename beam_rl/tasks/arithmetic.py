"""The built-in synthetic math task: small-integer arithmetic with a verifiable integer answer.

A problem is `a op b` with operands in [0, max_operand] and `op` from `ops`; the prompt is
`<s>a+b=` and a correct response is the decimal answer followed by `</s>`. Every (a, op, b) of
the space is assigned to the train or held-out split by a seeded permutation, so the splits are
disjoint and identical on every machine. The reward is 1.0 for exactly the right integer
(leading/trailing spaces ignored), 0.0 otherwise (unparseable, wrong, or no `</s>`).
"""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path

from beam_rl.tasks import TaskSplits

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
TOKENIZER_DIR = Path(str(resources.files("beam_rl.tasks") / "tokenizer"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def text(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        return OPS[self.op](self.a, self.b)


class Tokenizer:
    """The shipped character-level tokenizer (HF `tokenizers`; built by scripts/build_tokenizer.py)."""

    def __init__(self, path: Path = TOKENIZER_DIR):
        from tokenizers import Tokenizer as HFTokenizer

        self.hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        self.bos_id = self.hf.token_to_id("<s>")
        self.eos_id = self.hf.token_to_id("</s>")
        self.pad_id = self.hf.token_to_id("<pad>")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def integer_reward(response_ids: list[int], answer: int, tokenizer: Tokenizer) -> float:
    """1.0 iff the response is the exact integer answer terminated by </s>."""
    if not response_ids or response_ids[-1] != tokenizer.eos_id:
        return 0.0
    text = tokenizer.decode(response_ids[:-1]).strip()
    try:
        return 1.0 if int(text) == answer else 0.0
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class ArithmeticTask(TaskSplits):
    max_operand: int = 9
    ops: str = "+"
    heldout_fraction: float = 0.2
    seed: int = 0

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"task.max_operand must be >= 1, got {self.max_operand}")
        bad = [o for o in self.ops if o not in OPS]
        if bad or not self.ops:
            raise ValueError(f"task.ops={self.ops!r}: use characters from {''.join(OPS)}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"task.heldout_fraction must lie in (0, 1), got {self.heldout_fraction}")

    @cached_property
    def _splits(self) -> tuple[list[Problem], list[Problem]]:
        space = [Problem(a, op, b) for op in self.ops for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]
        if "-" in self.ops:  # keep answers non-negative: the tokenizer has '-' but the split stays simple
            space = [p for p in space if p.answer >= 0]
        random.Random(self.seed).shuffle(space)
        n_held = max(1, int(round(len(space) * self.heldout_fraction)))
        return space[n_held:], space[:n_held]

    def longest_prompt_tokens(self, tokenizer: Tokenizer) -> int:
        """Tokens of the longest prompt this task can pose (operands of the most digits)."""
        return max(len(self.prompt_ids(Problem(self.max_operand, op, self.max_operand), tokenizer)) for op in self.ops)

    def prompt_text(self, problem: Problem) -> str:
        return problem.text

    def prompt_ids(self, problem: Problem, tokenizer: Tokenizer) -> list[int]:
        return [tokenizer.bos_id] + tokenizer.encode(problem.text)

    def rewards(self, problems: list[Problem], responses: list[list[int]], tokenizer: Tokenizer) -> list[float]:
        """`integer_reward` of each response against its problem's answer."""
        if len(problems) != len(responses):
            raise ValueError(f"rewards: {len(problems)} problems for {len(responses)} responses")
        return [integer_reward(r, p.answer, tokenizer) for p, r in zip(problems, responses)]

    def answer_ids(self, problem: Problem, tokenizer: Tokenizer) -> list[int]:
        return tokenizer.encode(str(problem.answer)) + [tokenizer.eos_id]

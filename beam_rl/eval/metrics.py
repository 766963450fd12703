"""avg@k, pass@k and maj@k over graded samples, per problem and overall.

For a problem with n graded samples of which c are correct:
- avg@n = c / n; the benchmark's avg@n is the mean over problems (DAPO reports avg@32 on AIME).
- pass@k = 1 - C(n - c, k) / C(n, k), the unbiased estimator (Chen et al., 2021); k = n gives
  "any sample correct".
- maj@n: the most frequent extracted answer (normalised text; samples without an answer do not
  vote; ties go to the answer seen first) is correct.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from math import comb


@dataclass(frozen=True)
class ProblemScore:
    id: str
    answer: str
    n: int
    correct: int
    avg: float
    pass_k: float
    maj_correct: bool
    maj_answer: str | None


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (k={k}, n={n}): lower --pass-k or raise --n")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def majority(keys: list[str | None], correct: list[bool]) -> tuple[str | None, bool]:
    """(winning answer key, whether it is correct); None keys do not vote."""
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return None, False
    top = max(votes.values())
    winner = next(k for k in keys if k is not None and votes[k] == top)
    return winner, correct[keys.index(winner)]


def score_problem(pid: str, answer: str, keys: list[str | None], correct: list[bool], k: int) -> ProblemScore:
    n, c = len(correct), sum(correct)
    maj_answer, maj_ok = majority(keys, correct)
    return ProblemScore(pid, answer, n, c, c / n, pass_at_k(n, c, k), maj_ok, maj_answer)


@dataclass(frozen=True)
class Summary:
    problems: int
    n: int
    k: int
    avg: float
    pass_k: float
    maj: float
    length_mean: float
    length_median: float
    length_p90: float
    length_max: int
    truncated_frac: float


def summarize(scores: list[ProblemScore], lengths: list[int], truncated: list[bool], k: int) -> Summary:
    if not scores:
        raise ValueError("no problems were scored")
    srt = sorted(lengths)
    return Summary(
        problems=len(scores),
        n=scores[0].n,
        k=k,
        avg=statistics.fmean(s.avg for s in scores),
        pass_k=statistics.fmean(s.pass_k for s in scores),
        maj=statistics.fmean(float(s.maj_correct) for s in scores),
        length_mean=statistics.fmean(lengths),
        length_median=statistics.median(lengths),
        length_p90=srt[min(len(srt) - 1, int(0.9 * len(srt)))],
        length_max=srt[-1],
        truncated_frac=sum(truncated) / len(truncated),
    )


def format_report(summary: Summary, scores: list[ProblemScore], title: str = "") -> str:
    n, k = summary.n, summary.k
    lines = [title] if title else []
    lines.append(f"{'problem':<16} {'answer':>10} {'correct':>9} {f'avg@{n}':>7} {f'pass@{k}':>7} {f'maj@{n}':>6}  majority answer")
    for s in scores:
        lines.append(f"{s.id[:16]:<16} {s.answer[:10]:>10} {f'{s.correct}/{s.n}':>9} {s.avg:7.3f} {s.pass_k:7.3f} "
                     f"{'yes' if s.maj_correct else 'no':>6}  {(s.maj_answer or '-')[:24]}")
    lines.append(
        f"{summary.problems} problems x {n} samples: avg@{n} {summary.avg:.4f} | pass@{k} {summary.pass_k:.4f} | "
        f"maj@{n} {summary.maj:.4f}"
    )
    lines.append(
        f"response tokens: mean {summary.length_mean:.1f}, median {summary.length_median:g}, p90 {summary.length_p90}, "
        f"max {summary.length_max}; hit max tokens {100 * summary.truncated_frac:.1f}%"
    )
    return "\n".join(lines)

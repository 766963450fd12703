"""Evaluation problems: a Hugging Face dataset id, a local JSONL / parquet file, or the built-in
sample. Every source becomes a list of `Problem(id, problem, answer)`.

Column names differ between AIME 2025 uploads (`math-ai/aime25`: problem/answer/id,
`opencompass/AIME2025`: question/answer, split into `AIME2025-I` / `AIME2025-II` configs), so the
problem and answer columns are looked up in the alias tables below; an unknown layout is an error
that lists the columns found and the `--problem-key` / `--answer-key` flags that override the
lookup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from beam_rl.errors import InputError

PROBLEM_KEYS = ("problem", "question", "prompt", "Problem", "Question", "input")
ANSWER_KEYS = ("answer", "solution_answer", "ground_truth", "Answer", "final_answer", "target", "expected_answer")
ID_KEYS = ("id", "ID", "problem_id", "idx", "unique_id")

BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).with_name("sample.jsonl")
# Known AIME 2025 hub datasets: (configs to concatenate, split). Others load with split "test"
# (or the only split there is).
HUB_LAYOUTS: dict[str, tuple[tuple[str | None, ...], str]] = {
    "math-ai/aime25": ((None,), "test"),
    "opencompass/AIME2025": (("AIME2025-I", "AIME2025-II"), "test"),
}


class DataError(InputError):
    """The problem source cannot be read as problem/answer rows; the message says how to fix it."""


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str


def _pick(columns, wanted: str | None, aliases: tuple[str, ...], role: str, flag: str, source: str) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise DataError(f"{source}: {flag} {wanted!r} is not a column; columns are {sorted(columns)}")
        return wanted
    for key in aliases:
        if key in columns:
            return key
    raise DataError(
        f"{source}: no {role} column (looked for {list(aliases)}); columns are {sorted(columns)}. "
        f"Name it with {flag}."
    )


def rows_to_problems(rows: list[dict], source: str, problem_key: str | None = None, answer_key: str | None = None) -> list[Problem]:
    """Problems from dict rows, picking columns by alias (or the given keys)."""
    if not rows:
        raise DataError(f"{source}: no rows")
    columns = set(rows[0])
    pk = _pick(columns, problem_key, PROBLEM_KEYS, "problem", "--problem-key", source)
    ak = _pick(columns, answer_key, ANSWER_KEYS, "answer", "--answer-key", source)
    ik = next((k for k in ID_KEYS if k in columns), None)
    problems = []
    for i, row in enumerate(rows):
        problem, answer = row.get(pk), row.get(ak)
        if problem is None or str(problem).strip() == "":
            raise DataError(f"{source}: row {i} has an empty {pk!r}")
        if answer is None or str(answer).strip() == "":
            raise DataError(f"{source}: row {i} has an empty {ak!r}")
        pid = str(row[ik]) if ik is not None and row.get(ik) is not None else str(i)
        problems.append(Problem(pid, str(problem), str(answer).strip()))
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):  # ids repeated across configs (AIME I / II both count from 0)
        problems = [Problem(f"{i}:{p.id}", p.problem, p.answer) for i, p in enumerate(problems)]
    return problems


def _read_local(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e})") from e
        return rows
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of rows")
        return data
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet")


def _read_hub(dataset_id: str, split: str | None) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"loading {dataset_id!r} from the hub needs `datasets` (pip install -e '.[eval]')") from e
    configs, default_split = HUB_LAYOUTS.get(dataset_id, ((None,), None))
    rows: list[dict] = []
    for config in configs:
        if split or default_split:
            ds = datasets.load_dataset(dataset_id, config, split=split or default_split)
        else:
            dd = datasets.load_dataset(dataset_id, config)
            if len(dd) != 1:
                raise DataError(f"{dataset_id}: splits {list(dd)}; choose one with --split")
            ds = next(iter(dd.values()))
        rows.extend(ds.to_list())
    return rows


def load_problems(source: str, *, split: str | None = None, problem_key: str | None = None,
                  answer_key: str | None = None, limit: int | None = None) -> list[Problem]:
    """`source`: "builtin", a path to .jsonl/.json/.parquet, or a hub dataset id ("owner/name")."""
    path = BUILTIN_PATH if source == BUILTIN else Path(source)
    if path.exists():
        rows = _read_local(path)
    elif source.count("/") == 1 and not source.startswith((".", "/")) and Path(source).suffix == "":
        rows = _read_hub(source, split)
    else:
        raise DataError(f"{source}: no such file, and not a hub dataset id like 'math-ai/aime25'")
    problems = rows_to_problems(rows, source, problem_key, answer_key)
    return problems[:limit] if limit else problems

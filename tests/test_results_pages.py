"""The results pages are rendered from docs/bench/, and the docs state results, not a diary of work periods."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
WORK_PERIOD = re.compile(r"\bsessions?\b", re.IGNORECASE)
ORDINAL_PERIOD = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth)"
                            r"[- ]session\b", re.IGNORECASE)
LETTERED_RUN = re.compile(r"\brun [A-Z]\b")
# a bench file named after a work period, a lettered run or a commit (7-40 hex digits with at least one digit)
BAD_BENCH_NAME = re.compile(r"session|run_[a-z]|(?<![0-9a-z])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9a-z])",
                            re.IGNORECASE)


def test_pages_are_what_the_data_renders():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "render_results.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def _text_files():
    for path in sorted(DOCS.rglob("*")):
        if path.is_file() and path.suffix in {".md", ".json", ".jsonl", ".txt"}:
            yield path
    yield ROOT / "README.md"


def test_docs_narrate_no_work_periods_or_lettered_runs():
    found = []
    for path in _text_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern in (WORK_PERIOD, ORDINAL_PERIOD, LETTERED_RUN):
                match = pattern.search(line)
                if match:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_bench_files_are_named_by_what_they_measure():
    bad = [str(p.relative_to(ROOT)) for p in (DOCS / "bench").rglob("*") if BAD_BENCH_NAME.search(p.name)]
    assert not bad, bad

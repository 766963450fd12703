"""Grading with math-verify, with a per-answer timeout enforced from outside the grader.

math-verify's own timeouts use `signal.alarm`, which only works in a main thread and can fire
inside unrelated code. Here both of its timeouts are off; each answer is graded in a worker
process of `GradingPool`, and a worker that runs past `timeout_s` on one answer is killed and
replaced (that answer is graded incorrect, `timed_out=True`). An answer that is a canonical integer
literal against an integer gold answer is graded in-process (`integer_verdict`: math-verify's verdict
on such a pair, without its parse: a worker takes about 3 ms an answer, 6 s for the math suite's
2048 held-out completions).

Extraction (DAPO's format first): the last `Answer:` line of the response; failing that, the
last `\\boxed{...}`; failing that, no answer (incorrect).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import re
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

_ANSWER_LINE = re.compile(r"(?im)^\s*\**\s*answer\s*\**\s*:\s*(.+?)\s*$")
_INTEGER = re.compile(r"-?[1-9][0-9]*|0")


@dataclass(frozen=True)
class Grade:
    extracted: str | None  # the answer text taken from the response (None: nothing found)
    correct: bool
    timed_out: bool = False
    error: str | None = None


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_answer(response: str) -> str | None:
    """The answer a response gives: last `Answer:` line, else last `\\boxed{}`, else None."""
    lines = _ANSWER_LINE.findall(response)
    if lines:
        ans = lines[-1].strip()
        boxed = _last_boxed(ans)
        ans = boxed if boxed is not None else ans
        ans = ans.strip().strip("$").strip().rstrip(".").strip()
        return ans or None
    return _last_boxed(response)


def normalize(answer: str | None) -> str | None:
    """Key for majority voting: whitespace, `$` and a trailing period removed."""
    if answer is None:
        return None
    return re.sub(r"\s+", "", answer).strip("$").rstrip(".") or None


def integer_verdict(gold: str, extracted: str | None) -> bool | None:
    """math-verify's verdict where both answers are canonical integer literals (`-?[1-9][0-9]*|0`):
    two such literals are equal numbers iff they are equal strings, so no parse is needed (an
    integer-answer task grades almost every response here, in-process); None for anything else."""
    if extracted is None or not (_INTEGER.fullmatch(gold) and _INTEGER.fullmatch(extracted)):
        return None
    return gold == extracted


def verify_answer(gold: str, extracted: str | None) -> bool:
    """math-verify equivalence of the extracted answer and the gold answer, no signal timeouts."""
    if extracted is None:
        return False
    verdict = integer_verdict(gold, extracted)
    return verdict if verdict is not None else math_verify_equal(gold, extracted)


def math_verify_equal(gold: str, extracted: str) -> bool:
    """math-verify's parse and verify of both answers (as LaTeX, then the answer as plain text),
    falling back to equal normalized strings."""
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${extracted}$", parsing_timeout=None)
    if not pred_parsed:
        pred_parsed = parse(extracted, parsing_timeout=None)
    if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return True
    return normalize(gold) == normalize(extracted)


def _worker(conn) -> None:
    import logging

    import math_verify  # noqa: F401  (import before saying ready: the timeout covers grading only)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": this pool enforces it

    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        idx, gold, extracted = msg
        try:
            conn.send((idx, verify_answer(gold, extracted), None))
        except Exception as e:  # a grader crash grades that answer incorrect, with the reason
            conn.send((idx, False, f"{type(e).__name__}: {e}"))


class GradingPool:
    """Worker processes grading (gold, extracted) pairs, each answer under a wall-clock timeout."""

    def __init__(self, workers: int = 2, timeout_s: float = 10.0):
        if workers < 1 or timeout_s <= 0:
            raise ValueError("GradingPool needs workers >= 1 and timeout_s > 0 (--grade-workers, --grade-timeout)")
        if importlib.util.find_spec("math_verify") is None:
            raise RuntimeError("math-verify is not installed: the math task and `beam-rl eval` grade answers with it "
                               "(pip install math-verify; on the H200, the kit of scripts/gpu_kit_math.txt)")
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")  # never fork a process that may hold vLLM / OpenMP threads
        self.workers = workers
        self._workers: list = []  # started on first use (in parallel): nothing to grade, no start-up cost
        self.killed = 0

    def _launch(self):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child,), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    @staticmethod
    def _ready(worker):
        proc, conn = worker
        try:
            # the pipe or the process's exit, whichever comes first: a worker that dies at start is
            # reported at once, not after the whole timeout
            if wait([conn, proc.sentinel], 120) and conn.poll() and conn.recv() == "ready":
                return worker
        except EOFError:
            pass
        proc.join(1)
        if proc.exitcode is not None:
            raise RuntimeError(f"a grading worker exited at start (exit code {proc.exitcode}; its traceback is above; "
                               "is the calling script guarded by `if __name__ == '__main__':`?)")
        proc.kill()
        raise RuntimeError("a grading worker did not start within 120 s")

    def _start(self):
        return self._ready(self._launch())

    def grade(self, golds: list[str], responses: list[str]) -> list[Grade]:
        extracted = [extract_answer(r) for r in responses]
        results: list[Grade | None] = [None] * len(responses)
        todo = []
        for i, (g, e) in enumerate(zip(golds, extracted)):
            verdict = integer_verdict(g, e)
            if e is None or verdict is not None:
                results[i] = Grade(e, bool(verdict))
            else:
                todo.append(i)
        todo.reverse()
        if todo and not self._workers:
            self._workers = [self._ready(w) for w in [self._launch() for _ in range(self.workers)]]
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (answer index, deadline)
        while todo or busy:
            for slot in range(len(self._workers)):
                if slot not in busy and todo:
                    if self._workers[slot] is None:  # killed earlier; replace only when there is work
                        self._workers[slot] = self._start()
                    i = todo.pop()
                    self._workers[slot][1].send((i, golds[i], extracted[i]))
                    busy[slot] = (i, time.monotonic() + self.timeout_s)
            conns = {self._workers[s][1]: s for s in busy}
            next_deadline = min(d for _, d in busy.values())
            for conn in wait(list(conns), timeout=max(0.0, next_deadline - time.monotonic())):
                slot = conns[conn]
                try:
                    i, ok, err = conn.recv()
                except EOFError:  # the worker died on this answer
                    i = busy[slot][0]
                    ok, err = False, "grading worker died"
                    self._kill(slot)
                results[i] = Grade(extracted[i], ok, False, err)
                del busy[slot]
            now = time.monotonic()
            for slot, (i, deadline) in list(busy.items()):
                if now >= deadline:
                    results[i] = Grade(extracted[i], False, True, f"grading exceeded {self.timeout_s:g} s")
                    self._kill(slot)
                    self.killed += 1
                    del busy[slot]
        return results  # type: ignore[return-value]

    def _kill(self, slot: int) -> None:
        proc, conn = self._workers[slot]
        proc.kill()
        proc.join()
        conn.close()
        self._workers[slot] = None

    def close(self) -> None:
        for proc, conn in filter(None, self._workers):
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

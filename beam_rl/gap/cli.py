"""`beam-rl gap` on the command line: flags from `GapOptions`, the report on stdout."""

from __future__ import annotations

import contextlib
import json
import os
import sys

from beam_rl.gap.options import add_arguments, from_args


def add_gap_parser(sub) -> None:
    p = sub.add_parser("gap", help="log-prob gap between vLLM rollout and Megatron trainer, R3 on and off")
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=cmd_gap)


@contextlib.contextmanager
def stdout_to_stderr():
    """Point file descriptor 1 at stderr for the duration, so stdout carries only the report printed after it.

    VLLM_LOGGING_STREAM only counts if vllm is not imported yet, and engine-core processes inherit
    the descriptor, so vLLM's INFO lines would otherwise come before the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def cmd_gap(args, *, engine=None) -> int:
    from beam_rl.gap.measure import run_gap
    from beam_rl.gap.report import format_report

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the report
    with stdout_to_stderr():
        report = run_gap(from_args(args), engine=engine)
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0

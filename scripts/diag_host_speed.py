"""Host CPU speed, vCPU by vCPU: `bench_rollout.python_probe_ms` (fixed CPython work) pinned to each
CPU of this process's affinity in turn, for several passes (alternating order), printed as a table
and one JSON line:

    python scripts/diag_host_speed.py [--passes 3] [--json OUT.json]

Why: on the lent H200 the same fixed work took ~6.5 ms on a vCPU in one pass and ~12-15 ms on the same
vCPU a few seconds later, with no steal time, on every vCPU. A fixed set of fast vCPUs that `--cpus`
could pick would show here as CPUs that are fast in every pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import python_probe_ms  # noqa: E402


def sweep(cpus: list[int], passes: int, repeats: int = 5) -> dict[int, list[float]]:
    """{cpu: [probe ms of each pass]}; the process's affinity is restored afterwards."""
    if passes < 1:
        raise ValueError(f"passes={passes}: must be >= 1")
    original = os.sched_getaffinity(0)
    missing = set(cpus) - original
    if missing:
        raise ValueError(f"CPUs {sorted(missing)} are not in this process's affinity {sorted(original)}")
    probes: dict[int, list[float]] = {c: [] for c in cpus}
    try:
        for p in range(passes):
            for c in cpus if p % 2 == 0 else cpus[::-1]:
                os.sched_setaffinity(0, {c})
                time.sleep(0.005)  # let the scheduler move this thread onto the CPU
                probes[c].append(python_probe_ms(repeats))
    finally:
        os.sched_setaffinity(0, original)
    return probes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    probes = sweep(sorted(os.sched_getaffinity(0)), args.passes)
    print("| cpu | probe ms by pass | median |")
    print("|---|---|---|")
    for c, values in probes.items():
        print(f"| {c} | " + ", ".join(f"{v:.2f}" for v in values) + f" | {statistics.median(values):.2f} |")
    result = dict(pid=os.getpid(), seconds=time.time() - t0, probe_ms={str(c): v for c, v in probes.items()})
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast the host runs the work a host-bound decode step is made of, with fixed workloads whose
time depends on the host only, never on the build:

- `python_probe_ms`: a fixed CPython workload (objects, attributes, calls, hashing);
- `host_speed`: that probe and a PyTorch-dispatch probe, plus the CPU model and its MHz;
- `cpu_jiffies`: the steal and total clock ticks of some CPUs, from /proc/stat;
- `sweep`: the python probe pinned to each CPU in turn, over several passes (whether some CPUs are
  fast in every pass, i.e. worth pinning a benchmark to with `--cpus`).
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import time


class _ProbeItem:
    __slots__ = ("key", "size")

    def __init__(self, key, size):
        self.key, self.size = key, size


def python_probe_ms(repeats: int = 3) -> float:
    """Median ms of a fixed CPython workload (20000 small objects into a dict, then summed: object
    creation, attribute access, calls and hashing, like vLLM's scheduler and input preparation)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        table = {}
        for i in range(20000):
            table[f"req-{i % 4096}"] = _ProbeItem(i, i % 97)
        sum(item.size for item in table.values() if item.key % 3)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def cpu_jiffies(cpus: set[int]) -> tuple[int, int] | None:
    """(steal, total) clock ticks of these CPUs since boot, from /proc/stat; None where it is unreadable.
    Steal is the time the hypervisor ran something else while this VM's vCPU wanted to run: on a lent
    VM, the direct measure of a host slowed by its neighbours."""
    try:
        with open("/proc/stat") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    steal = total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            steal += ticks[7]
            total += sum(ticks)
    return steal, total


def host_speed(repeats: int = 7) -> dict:
    """How fast this process's host runs the kind of work a host-bound decode step is made of, measured
    after the timed runs on the same pinned CPUs (no engine work in flight): `python_probe_ms`
    (`python_probe_ms()`, median of `repeats`), and `torch_probe_us`, median host us of one CPU-tensor
    slice + view + empty (PyTorch's dispatcher, like the `aten::slice`/`copy_` calls of a step). Same
    work every process, so a ratio between processes or machines is a ratio of host speed; also the CPU
    model (`cpu_model`) and its mean MHz (`cpu_mhz_mean`)."""
    import torch

    x = torch.zeros(64, 64)
    torch_us = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(2000):
            x[1:9].view(-1)
            torch.empty(8)
        torch_us.append((time.perf_counter() - t) * 1e6 / 2000)
    return dict(python_probe_ms=python_probe_ms(repeats), torch_probe_us=statistics.median(torch_us), **cpu_info())


def cpu_info() -> dict:
    """{cpu_model, cpu_mhz_mean} from /proc/cpuinfo (None where it says nothing); {} without it."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
        model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        mhz = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([0-9.]+)$", info, re.M)]
        return dict(cpu_model=model.group(1).strip() if model else None,
                    cpu_mhz_mean=statistics.fmean(mhz) if mhz else None)
    return {}


def parse_cpus(spec: str) -> set[int]:
    """'0-7,12' -> {0, ..., 7, 12}; every CPU must be in this process's affinity."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    missing = cpus - os.sched_getaffinity(0)
    if missing:
        raise SystemExit(f"--cpus {spec}: CPUs {sorted(missing)} are not available here ({sorted(os.sched_getaffinity(0))})")
    return cpus


def sweep(cpus: list[int], passes: int, repeats: int = 5) -> dict[int, list[float]]:
    """{cpu: [python probe ms of each pass]}: this process pinned to each CPU in turn (the order reversed
    every other pass); the process's affinity is restored afterwards."""
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


def sweep_report(cpus: list[int], passes: int) -> tuple[dict, list[str]]:
    """`sweep` of `cpus` as (JSON result: pid, seconds, probe_ms by CPU; table lines, one row per CPU)."""
    t0 = time.time()
    probes = sweep(cpus, passes)
    lines = ["| cpu | probe ms by pass | median |", "|---|---|---|"]
    lines += [f"| {c} | " + ", ".join(f"{v:.2f}" for v in values) + f" | {statistics.median(values):.2f} |"
              for c, values in probes.items()]
    return dict(pid=os.getpid(), seconds=time.time() - t0, probe_ms={str(c): v for c, v in probes.items()}), lines

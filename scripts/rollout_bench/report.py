"""The run's summary from the builds' merged results: the JSON summary keys and the printed tables.

- Builds against a baseline build of the same run (eager where it ran) and, where they ran, fused
  against eager and compiled, round by round.
- Host speed: the probes by process, the medians over the timed repeats that ran on a host at its
  nominal speed (`nominal_host`), and per build a fit of decode time against the probe (`host_fit`)
  and the CPU time stolen by the hypervisor.
- GPU time and kernels per step, decode by batch size, and the speed goals (`GOALS`) by wall clock,
  wall clock on a nominal host and GPU time (`goal_rows`).
"""

from __future__ import annotations

import statistics

from rollout_bench.harness import MAIN_BUILDS

GOALS = (("decode", "eager", 2.5), ("decode", "compiled", 1.3), ("prefill", "eager", 1.8), ("prefill", "compiled", 1.05))
"""(phase, baseline build, target): fused at least `target` x faster than the baseline in that phase."""


def host_fit(probe_ms: list[float], decode_ms: list[float]) -> dict | None:
    """Least-squares fit decode = intercept + slope x probe over a build's repeats (each repeat's decode
    with the python probe taken around it), and their correlation; None with fewer than 3 repeats or a
    constant probe. On a steady host the probe's spread is its own noise, and so is the fit."""
    if len(probe_ms) != len(decode_ms) or len(probe_ms) < 3 or len(set(probe_ms)) < 2 or len(set(decode_ms)) < 2:
        return None
    line = statistics.linear_regression(probe_ms, decode_ms)
    return dict(repeats=len(probe_ms), correlation=statistics.correlation(probe_ms, decode_ms),
                intercept_ms=line.intercept, slope=line.slope)


def nominal_host(results: dict[str, dict], factor: float) -> tuple[float, dict] | None:
    """The timed repeats that ran on a host at its nominal speed: those whose python probes, taken just
    before and just after the repeat, are both within `factor` x the fastest probe of the whole run (every
    build, decode and prefill). The probe is the same fixed work in every process and knows nothing of
    the build, so the selection is build-blind. Returns (threshold ms, {build: {phase: (median ms or None,
    selected repeats, all repeats)}}), None without probes. Where the host's vCPUs change speed within
    seconds, a repeat's wall clock measures the host's state as much as the build; these medians compare
    the builds on the host's fast state only."""
    probes = [p for r in results.values() for key in ("decode_probe_pairs_ms", "prefill_probe_pairs_ms")
              for pair in r.get(key, []) for p in pair]
    if not probes:
        return None
    threshold = factor * min(probes)
    selected = {}
    for name, r in results.items():
        selected[name] = {}
        for phase in ("decode", "prefill"):
            pairs, times = r.get(f"{phase}_probe_pairs_ms", []), r[f"{phase}_ms_all"]
            kept = [t for t, pair in zip(times, pairs) if max(pair) <= threshold]
            selected[name][phase] = (statistics.median(kept) if kept else None, len(kept), len(times))
    return threshold, selected


def goal_rows(results: dict[str, dict], nominal: dict | None) -> list[dict]:
    """The speed goals (`GOALS`: fused at least `target` x faster than the baseline build) by each measure
    the run has: wall clock (medians over rounds), wall clock on a nominal host (`nominal_host`'s
    selection) and GPU time. A measure is None where a build or its data is missing."""
    fused = results.get("fused")
    rows = []
    for phase, ref_name, target in GOALS:
        ref = results.get(ref_name)
        if fused is None or ref is None:
            continue
        wall = ref[f"{phase}_ms"] / fused[f"{phase}_ms"]
        ours, theirs = ((nominal or {}).get(name, {}).get(phase, (None,))[0] for name in ("fused", ref_name))
        gpu_key = f"{phase}_gpu_ms"
        gpu = ref[gpu_key] / fused[gpu_key] if gpu_key in ref and gpu_key in fused else None
        rows.append(dict(goal=f"{phase} >= {target}x {ref_name}", target=target, wall=wall,
                         wall_nominal_host=theirs / ours if ours and theirs else None, gpu=gpu))
    return rows


def summarize(results: dict[str, dict], *, rounds: int, prefill_len: int, nominal_factor: float,
              environment: dict) -> tuple[dict, list[str]]:
    """(summary keys, report lines) of the builds that ran: fused against eager and/or compiled, whichever
    are there (`decode_ms_<build>`, ...; ratios only for builds present). `environment` (device, vLLM
    version) joins the summary after the per-build medians."""
    summary = {**{f"{phase}_ms_{name}": r[f"{phase}_ms"] for phase in ("decode", "prefill") for name, r in results.items()},
               **environment, "rounds": rounds}
    lines: list[str] = []
    _builds(summary, lines, results, rounds, prefill_len)
    nominal = _host(summary, lines, results, nominal_factor)
    _gpu(summary, lines, results)
    _batches(summary, lines, results)
    goals = goal_rows(results, nominal[1] if nominal else None)
    if goals:
        summary["goals"] = goals
        lines += ["\n| goal | wall clock | on a nominal host | GPU time |", "|---|---|---|---|"]
        for g in goals:
            cells = ["-" if g[k] is None else f"{g[k]:.2f}x " + ("met" if g[k] >= g["target"] else "missed")
                     for k in ("wall", "wall_nominal_host", "gpu")]
            lines.append(f"| {g['goal']} | " + " | ".join(cells) + " |")
    return summary, lines


def _builds(summary: dict, lines: list[str], results: dict[str, dict], rounds: int, prefill_len: int) -> None:
    """Outputs compared, the table against the baseline build, fused's ratios by round, engine steps."""
    f, c, e = (results.get(name) for name in MAIN_BUILDS)
    if f and e:
        summary["fused_equals_eager_tokens"] = f["tokens"] == e["tokens"]
        summary["fused_equals_eager_logprobs"] = f["logprobs"] == e["logprobs"]
    if c and e:
        summary["compiled_equals_eager_logprobs"] = c["logprobs"] == e["logprobs"]
    if e:
        summary["eager_build_mode"] = e["mode"]
    base_name = next((name for name in ("eager", "fused", *results) if name in results), None)
    base = results.get(base_name)
    lines += [f"\n| build | decode ms/step (batch 1) | x vs {base_name} | 8x{prefill_len} prefill ms | x |",
              "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['decode_ms']:.3f} | {base['decode_ms'] / r['decode_ms']:.2f} | {r['prefill_ms']:.1f} | "
              f"{base['prefill_ms'] / r['prefill_ms']:.2f} |" for name, r in results.items()]
    if f and c:
        lines.append(f"fused vs compiled: decode {c['decode_ms'] / f['decode_ms']:.2f}x, "
                     f"prefill {c['prefill_ms'] / f['prefill_ms']:.2f}x")
    if rounds > 1 and f:  # the same ratios within each round: their spread is the run-to-run noise
        for phase in ("decode", "prefill"):
            for ref_name, b in (("eager", e), ("compiled", c)):
                if b is None:
                    continue
                ratios = [x / y for x, y in zip(b[f"{phase}_ms_by_round"], f[f"{phase}_ms_by_round"])]
                summary[f"{phase}_x_{ref_name}_by_round"] = ratios
                lines.append(f"fused {phase} x {ref_name} by round: " + ", ".join(f"{r:.2f}" for r in ratios))
    if rounds > 1:
        summary["same_outputs_every_round"] = all(r["same_outputs_every_round"] for r in results.values())
    if results and all("decode_step_ms_median" in r for r in results.values()):
        summary.update({f"decode_step_ms_median_{name}": r["decode_step_ms_median"] for name, r in results.items()})
        lines.append("engine step medians (ms): " + ", ".join(
            f"{name} {r['decode_step_ms_median']:.3f} (p10 {r['decode_step_ms_p10']:.3f})" for name, r in results.items()))


def _host(summary: dict, lines: list[str], results: dict[str, dict], factor: float) -> tuple[float, dict] | None:
    """Host probes by round, the nominal-host medians, decode against the probe and steal time; returns
    `nominal_host`'s selection."""
    if results and all("python_probe_ms" in r for r in results.values()):  # the host's speed, process by process
        for key in ("python_probe_ms", "torch_probe_us"):  # merge_rounds lists every statistic by round
            summary.update({f"{key}_{name}": r[f"{key}_by_round"] for name, r in results.items()})
        lines.append("host probes by round (python ms / torch us): " + "; ".join(
            f"{name} " + ", ".join(f"{p:.2f}/{t:.2f}" for p, t in zip(r["python_probe_ms_by_round"],
                                                                       r["torch_probe_us_by_round"]))
            for name, r in results.items()))
        summary["cpu_model"] = next(iter(results.values())).get("cpu_model")
    nominal = nominal_host(results, factor)
    if nominal:
        threshold, selected = nominal
        summary["nominal_host_threshold_ms"] = threshold
        lines += [f"\non a nominal host (repeats with both python probes <= {threshold:.2f} ms, {factor} x the run's fastest):",
                  "| build | decode ms/step | repeats | prefill ms | repeats |", "|---|---|---|---|---|"]
        for name, phases in selected.items():
            cells = []
            for phase in ("decode", "prefill"):
                ms, kept, total = phases[phase]
                summary[f"{phase}_ms_nominal_host_{name}"] = ms
                summary[f"{phase}_nominal_host_repeats_{name}"] = [kept, total]
                cells += ["-" if ms is None else f"{ms:.3f}" if phase == "decode" else f"{ms:.1f}", f"{kept}/{total}"]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")  # the ratios: in the goals table
    for name, r in results.items():  # within a build, how much of the decode's spread the host's speed explains
        fit = host_fit([statistics.fmean(pair) for pair in r.get("decode_probe_pairs_ms", [])], r["decode_ms_all"])
        if fit:
            summary[f"decode_vs_host_probe_{name}"] = fit
            lines.append(f"{name}: decode ms vs python probe ms over {fit['repeats']} repeats: correlation "
                         f"{fit['correlation']:.2f}, decode = {fit['intercept_ms']:.3f} + {fit['slope']:.4f} x probe")
        steal = r.get("decode_steal_fraction_all")
        if steal:
            summary[f"decode_steal_fraction_{name}"] = steal
            lines.append(f"{name}: CPU time stolen by the hypervisor during the decode repeats: "
                         + ", ".join(f"{x:.1%}" for x in steal))
    return nominal


def _gpu(summary: dict, lines: list[str], results: dict[str, dict]) -> None:
    """GPU ms and kernels per step against fused, where every build had the profiled pass."""
    f = results.get("fused")
    if not f or not all("decode_gpu_ms" in r for r in results.values()):
        return
    for key in ("decode_gpu_ms", "prefill_gpu_ms"):
        summary.update({f"{key}_{name}": r[key] for name, r in results.items()})
    lines += ["\nGPU time (profiled pass: kernels and copies only, no host overhead)",
              "| build | decode GPU ms/step | kernels/step | x fused | prefill GPU ms | x fused |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {r['decode_gpu_ms']:.3f} | {r['decode_kernels_per_step']:.0f} | "
              f"{r['decode_gpu_ms'] / f['decode_gpu_ms']:.2f} | {r['prefill_gpu_ms']:.1f} | "
              f"{r['prefill_gpu_ms'] / f['prefill_gpu_ms']:.2f} |" for name, r in results.items()]


def _batches(summary: dict, lines: list[str], results: dict[str, dict]) -> None:
    """Decode ms/step by batch size (GPU ms in brackets where measured), and fused's ratios."""
    batch_sizes = sorted({int(b) for r in results.values() for b in r.get("decode_batches", {})})
    if not batch_sizes:
        return
    f = results.get("fused")
    lines += ["\ndecode ms/step by batch size (wall clock; GPU time in brackets where measured)",
              "| batch | " + " | ".join(results) + " | "
              + " | ".join(f"fused x {n}" for n in results if n != "fused" and f) + " |",
              "|---" * (1 + len(results) + (len(results) - 1 if f else 0)) + "|"]
    for b in batch_sizes:
        rows = {n: r.get("decode_batches", {}).get(str(b)) for n, r in results.items()}
        cells = []
        for name, row in rows.items():
            if row is None:
                cells.append("-")
                continue
            summary[f"decode_ms_b{b}_{name}"] = row["decode_ms"]
            gpu = row.get("decode_gpu_ms")
            if gpu is not None:
                summary[f"decode_gpu_ms_b{b}_{name}"] = gpu
            cells.append(f"{row['decode_ms']:.3f}" + (f" ({gpu:.3f})" if gpu is not None else ""))
        if f:
            ours = rows.get("fused")
            cells += [f"{row['decode_ms'] / ours['decode_ms']:.2f}" if row and ours else "-"
                      for name, row in rows.items() if name != "fused"]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")

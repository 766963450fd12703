"""The learning result of a set of DAPO runs from one warm start, into docs/ (the learning page's data).

    python scripts/learning_report.py --suite math-mini-h200 --title "beam-mini, the math suite, one H200" --recipes recipes/math \\
        --device "one NVIDIA H200: ..." --date 2026-12-06 --commit abc1234 --via "h200_campaign.sh ..." \\
        --warm-start CKPT_DIR/warm_start.json --warm-start-command "beam-rl warm-start ..." RUNS/bf16 RUNS/lora RUNS/mxfp8 RUNS/no-r3

Each RUN_DIR is a `beam-rl dapo` run directory (run.json: its recipe; metrics.jsonl: its steps) named
after its recipe in --recipes (RUNS/bf16 ran recipes/math/bf16.yaml). Writes:
- docs/bench/learning_<suite>_<run>.jsonl: the provenance, then every step's metrics;
- docs/results.json: one row per run (`mode`, `r3`, `steps`, `avg8_before`, `avg8_after`,
  `max_mean_abs_logprob_diff` and more), replacing the suite's earlier rows, keeping other suites';
- docs/results/learning/<suite>/*.png: the runs' curves compared (`beam-rl plot --out`).
`python scripts/render_results.py` then renders docs/results/learning.md from them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the issue's bars on the per-step R3 gap, mean |d logprob| (runs with R3 on)
GAP_BARS = {"bf16": 0.005, "lora": 0.005, "mxfp8": 0.015}


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def run_row(run_dir: Path, suite: str, title: str, recipes: str, prov: dict, note: str | None = None) -> tuple[dict, list[dict]]:
    """(results.json row, metrics rows) of one run directory; `note`: what the numbers alone do not say
    (why a run falls short of the issue's bars, where it stopped)."""
    run = json.loads((run_dir / "run.json").read_text())
    recipe = run["recipe"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    k = recipe["rollout"]["eval_samples"]
    held = [(r["step"], r[f"heldout_avg{k}"]) for r in rows if f"heldout_avg{k}" in r]
    steps = [r for r in rows if "reward_mean" in r]
    if not held or held[0][0] != 0:
        raise SystemExit(f"{run_dir}: no step-0 held-out avg@{k} in metrics.jsonl (a run resumed past step 0 lost it?)")
    gaps = [r["mean_abs_logprob_diff"] for r in steps if "mean_abs_logprob_diff" in r]
    mode, r3 = recipe["train"]["mode"], recipe["train"]["routing_replay"]
    name = run_dir.name
    row = {
        "suite": suite, "title": title, "run": name, "mode": mode, "r3": r3, "steps": steps[-1]["step"] if steps else 0,
        "planned_steps": recipe["run"]["total_steps"],
        f"avg{k}_before": round(held[0][1], 4), f"avg{k}_after": round(held[-1][1], 4), "after_step": held[-1][0],
        "gain_points": round(100 * (held[-1][1] - held[0][1]), 1),
        "max_mean_abs_logprob_diff": max(gaps) if gaps else None,
        "gap_bar": GAP_BARS.get(mode) if r3 else None,
        "heldout": [{"step": s, f"avg{k}": round(a, 4)} for s, a in held],
        "rollout_tokens_per_s": _median(r.get("rollout_tokens_per_s") for r in steps),
        "train_tokens_per_s": _median(r.get("train_tokens_per_s") for r in steps),
        "rollout_s": _median(r.get("rollout_s") for r in steps), "train_s": _median(r.get("train_s") for r in steps),
        "sync_s": _median(r.get("sync_s") for r in steps), "step_s": _median(r.get("time_s") for r in steps),
        "gpu_peak_reserved_gib": max((r["gpu_peak_reserved_gib"] for r in steps if "gpu_peak_reserved_gib" in r), default=None),
        "command": f"beam-rl dapo --recipe {recipes}/{name}.yaml --out RUN_DIR", **prov,
    }
    if note:
        row["note"] = note
    return row, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories, each named after its recipe")
    ap.add_argument("--suite", required=True, help="name of this set of runs, e.g. math-mini-h200")
    ap.add_argument("--title", required=True, help="what the suite is: model, task, device (the page's heading for it)")
    ap.add_argument("--recipes", required=True, help="the recipes' folder, e.g. recipes/math")
    ap.add_argument("--device", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--via", default="", help="the script that ran the commands, if any")
    ap.add_argument("--warm-start", type=Path, default=None, help="the warm start's warm_start.json (its held-out curve)")
    ap.add_argument("--warm-start-command", default=None, help="the command that wrote it (`beam-rl warm-start ...`)")
    ap.add_argument("--warm-start-ran", default=None, metavar="DATE,COMMIT",
                    help="when and at which commit the warm start ran, where not with the runs (a warm start reused)")
    ap.add_argument("--note", action="append", default=[], metavar="RUN=TEXT",
                    help="a run's note on its page (why it falls short of a bar, where it stopped); once per run")
    ap.add_argument("--add", action="store_true",
                    help="add these runs to the suite's earlier ones instead of replacing them (a run of the same name is "
                         "replaced; each keeps its own provenance and warm start): a suite whose runs took several "
                         "machines, each with its own warm start")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs", help="the docs folder to write into (default: the repository's)")
    args = ap.parse_args(argv)
    bench, results, figures = args.docs / "bench", args.docs / "results.json", args.docs / "results" / "learning"

    sys.path.insert(0, str(ROOT))
    from beam_rl.dapo.plot import plot_runs

    prov = {"date": args.date, "device": args.device, "commit": args.commit, **({"via": args.via} if args.via else {})}
    notes = dict(n.split("=", 1) for n in args.note if "=" in n)
    if len(notes) != len(args.note) or not set(notes) <= {r.name for r in args.runs}:
        raise SystemExit(f"--note takes RUN=TEXT with RUN one of {sorted(r.name for r in args.runs)}; got {args.note}")
    warm = None
    if args.warm_start:
        warm = {"suite": args.suite, **json.loads(args.warm_start.read_text()), **prov}
        if args.warm_start_ran:
            date, _, commit = args.warm_start_ran.partition(",")
            if not (date and commit):
                raise SystemExit(f"--warm-start-ran takes DATE,COMMIT; got {args.warm_start_ran!r}")
            warm.update(date=date, commit=commit)
        if args.warm_start_command:
            warm["command"] = args.warm_start_command
    new = []
    for run_dir in args.runs:
        row, rows = run_row(run_dir, args.suite, args.title, args.recipes, prov, notes.get(run_dir.name))
        if warm:
            row["warm_start"] = f"{warm['date']}, {warm['commit']}"
        head = {"provenance": {k: row[k] for k in ("command", *prov)}, "summary": {"suite": args.suite, "run": row["run"]}}
        out = bench / f"learning_{args.suite}_{row['run']}.jsonl"
        out.write_text("".join(json.dumps(r) + "\n" for r in [head, *rows]))
        new.append(row)
        print(f"{row['run']}: {row['mode']}, R3 {'on' if row['r3'] else 'off'}, {row['steps']} steps, held-out "
              f"{row['avg8_before']:.3f} -> {row['avg8_after']:.3f} ({row['gain_points']:+.1f} points), "
              f"max per-step gap {row['max_mean_abs_logprob_diff']}")
    data = json.loads(results.read_text()) if results.exists() else {"runs": [], "warm_starts": []}
    names = {r["run"] for r in new}
    kept = [r for r in data["runs"] if r["suite"] == args.suite and r["run"] not in names] if args.add else []
    data["runs"] = [r for r in data["runs"] if r["suite"] != args.suite] + kept + new
    if warm:
        earlier = [w for w in data.get("warm_starts", []) if w["suite"] == args.suite and args.add
                   and (w["date"], w["commit"]) != (warm["date"], warm["commit"])]
        data["warm_starts"] = [w for w in data.get("warm_starts", []) if w["suite"] != args.suite] + earlier + [warm]
    results.write_text(json.dumps(data, indent=1) + "\n")
    with tempfile.TemporaryDirectory() as tmp:  # a kept run's metrics: its docs/bench file, as a run folder for the plots
        dirs = []
        for r in kept:
            d = Path(tmp) / r["run"]
            d.mkdir()
            lines = (bench / f"learning_{args.suite}_{r['run']}.jsonl").read_text().splitlines()
            (d / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if line.strip() and "provenance" not in json.loads(line)))
            dirs.append(d)
        runs = kept + new
        labels = [f"{r['run']} ({r['mode']}, R3 {'on' if r['r3'] else 'off'})" for r in runs]
        plot_runs(dirs + list(args.runs), figures / args.suite, labels=labels,
                  gap_bounds={lab: r["gap_bar"] for lab, r in zip(labels, runs) if r["gap_bar"]})
    print(f"-> {results}, {bench}/learning_{args.suite}_*.jsonl, {figures / args.suite}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

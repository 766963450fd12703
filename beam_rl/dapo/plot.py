"""`beam-rl plot RUN_DIR [RUN_DIR ...]`: PNG curves of runs' metrics.jsonl.

One run: a panel per metric group in RUN_DIR/plots. Several runs (`--out DIR`): the learning curves
side by side, a line per run on each panel (held-out avg@k, reward, response length, the per-step R3
gap on a log scale with its bound), labelled by run directory name or `--label`.
"""

from __future__ import annotations

from pathlib import Path

from beam_rl.dapo.metrics import read_metrics
from beam_rl.errors import InputError

PANELS = (
    ("reward_mean", "accuracy"), ("heldout_avg8",), ("mean_abs_logprob_diff", "max_abs_logprob_diff"),
    ("response_length",), ("clip_frac_low", "clip_frac_high"), ("kept_group_fraction",),
    ("rollout_tokens_per_s", "train_tokens_per_s"), ("sync_s",), ("train_s", "compile_s"),
    ("rollout_s", "rollout_generate_s", "rollout_grade_s"), ("gpu_peak_allocated_gib", "gpu_peak_reserved_gib"),
)
# the panels comparing runs: (metric, y-axis label, log scale)
COMPARED = (("heldout_avg8", "held-out avg@8", False), ("reward_mean", "reward mean (kept groups)", False),
            ("response_length", "response tokens (mean)", False), ("mean_abs_logprob_diff", "mean |d logprob|", True))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, xlabel: str, path: Path) -> Path:
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rows(run_dir: Path) -> list[dict]:
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl is missing or empty; run `beam-rl dapo --out {run_dir}` first")
    return rows


def plot_run(run_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    run_dir = Path(run_dir)
    rows = _rows(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for keys in PANELS:
        present = [k for k in keys if any(k in r for r in rows)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for k in present:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
        if "mean_abs_logprob_diff" in present:
            ax.axhline(0.01, color="red", linestyle="--", linewidth=0.8, label="0.01")
        written.append(_save(plt, fig, ax, "step", out_dir / f"{present[0]}.png"))
    return written


def plot_runs(run_dirs, out_dir: str | Path, labels=None, gap_bounds: dict[str, float] | None = None) -> list[Path]:
    """The `COMPARED` panels with a line per run, written to `out_dir` as `<metric>.png`;
    `gap_bounds` (label -> bound) draws each run's R3 bound on the gap panel."""
    plt = _pyplot()
    run_dirs = [Path(d) for d in run_dirs]
    labels = list(labels) if labels else [d.name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise InputError(f"--label given {len(labels)} times for {len(run_dirs)} run directories; give one per run or none")
    runs = [(label, _rows(d)) for label, d in zip(labels, run_dirs)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, ylabel, log in COMPARED:
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for i, (label, rows) in enumerate(runs):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label, color=f"C{i}")
            if key == "mean_abs_logprob_diff" and gap_bounds and label in gap_bounds:
                ax.axhline(gap_bounds[label], color=f"C{i}", linestyle="--", linewidth=0.8)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        written.append(_save(plt, fig, ax, "DAPO step", out_dir / f"{key}.png"))
    return written

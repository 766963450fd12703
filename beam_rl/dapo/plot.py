"""`beam-rl plot RUN_DIR`: PNG curves of a run's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from beam_rl.dapo.metrics import read_metrics

PANELS = (
    ("reward_mean", "accuracy"), ("heldout_avg8",), ("mean_abs_logprob_diff", "max_abs_logprob_diff"),
    ("response_length",), ("clip_frac_low", "clip_frac_high"), ("kept_group_fraction",),
    ("rollout_tokens_per_s", "train_tokens_per_s"), ("sync_s",), ("train_s", "compile_s"),
)


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl is missing or empty; run `beam-rl dapo --out {run_dir}` first")
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
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{present[0]}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written

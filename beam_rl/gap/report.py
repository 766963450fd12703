"""Reporting of `beam-rl gap`: the text table and the |delta| histogram."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from beam_rl.gap.measure import LN2


def write_histogram(raw: dict[str, np.ndarray], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    floor = 1e-7
    edges = np.logspace(-7, 1, 65)
    for key, color in (("r3_off", "tab:red"), ("r3_on", "tab:blue")):
        a = np.maximum(np.abs(raw[key]), floor)
        ax.hist(a, bins=edges, alpha=0.55, color=color, label=f"{key.replace('_', ' ')}: mean {np.abs(raw[key]).mean():.2e}")
    ax.axvline(LN2, color="k", ls="--", lw=1, label="ln 2 (extreme)")
    ax.set_xscale("log")
    ax.set_xlabel("|logprob(trainer) - logprob(rollout)| per generated token (values < 1e-7 at 1e-7)")
    ax.set_ylabel("tokens")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(report: dict) -> str:
    on, off = report["r3_on"], report["r3_off"]
    rows = [
        ("mean |delta logprob|", "mean_abs_logprob_diff", "{:.3e}"),
        ("max |delta logprob|", "max_abs_logprob_diff", "{:.3e}"),
        ("mean delta (signed)", "mean_logprob_diff", "{:+.3e}"),
        ("extreme tokens (|d| > ln 2)", "extreme_token_fraction", "{:.4%}"),
        ("router disagreement", "router_disagreement", "{:.4%}"),
        ("seq KL(rollout||trainer) k1", "seq_kl_k1", "{:+.3e}"),
        ("seq KL(rollout||trainer) k3", "seq_kl_k3", "{:.3e}"),
        ("generated tokens", "num_tokens", "{:d}"),
    ]
    lines = [f"beam-rl gap: {report['checkpoint']}, mode {report['mode']}, {report['num_sequences']} sequences x "
             f"{report['max_tokens']} generated tokens (+{report['prompt_tokens']} prompt tokens), temperature 1",
             f"{'':30s} {'R3 on':>12s} {'R3 off':>12s}"]
    lines += [f"{label:30s} {fmt.format(on[k]):>12s} {fmt.format(off[k]):>12s}" for label, k, fmt in rows]
    verdict = "within" if on["mean_abs_logprob_diff"] < report["bound"] else "OVER"
    lines.append(f"R3 on mean |delta| {on['mean_abs_logprob_diff']:.3e} is {verdict} the {report['mode']} bound {report['bound']}")
    if "lora_effect_mean_abs_logprob" in report:
        lines.append(f"LoRA adapter effect on the trainer (mean |delta| with vs without): {report['lora_effect_mean_abs_logprob']:.3e}")
    if "histogram" in report:
        lines.append(f"histogram: {report['histogram']}")
    return "\n".join(lines)

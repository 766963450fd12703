"""`beam-rl dapo` and `beam-rl plot` subcommands (hooked into beam_rl.cli.build_parser)."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path


def log_warnings_to(path: Path) -> None:
    """Library warnings (Megatron-Core's missing Transformer Engine / Apex, deprecations) go to
    `path` instead of the console; the console keeps the progress bar and the run's own lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logging.captureWarnings(True)
    logger = logging.getLogger("py.warnings")
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("WARNING %(asctime)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def cmd_dapo(args) -> int:
    from beam_rl.dapo.config import load_recipe
    from beam_rl.dapo.loop import R3GapError, run_dapo, summarize

    recipe = load_recipe(args.recipe)
    out = args.out or recipe.run.out
    if not args.verbose:
        log_warnings_to(Path(out) / "engine.log")
    t0 = time.perf_counter()
    try:
        run_dapo(recipe, out, resume=args.resume, stop_after=args.stop_after, max_seconds=args.max_seconds, engine_log=not args.verbose, overwrite=args.overwrite,
                 checkpoints=not args.no_checkpoints)
    except R3GapError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from beam_rl.dapo.metrics import read_metrics

    s = summarize(read_metrics(out), recipe.rollout.eval_samples)  # the whole run, also after --resume
    k = recipe.rollout.eval_samples
    print(f"done in {time.perf_counter() - t0:.1f} s: held-out avg@{k} {s['warm_start']:.3f} (warm start) -> {s['final']:.3f}; "
          f"per-step mean |delta logprob| ({'R3' if recipe.train.routing_replay else 'no R3'}) " + " ".join(f"{g:.4f}" for g in s["gaps"]) + f"; metrics in {out}/metrics.jsonl")
    return 0


def cmd_warm_start(args) -> int:
    from beam_rl.dapo.config import load_recipe
    from beam_rl.dapo.warmstart import write_warm_start

    write_warm_start(load_recipe(args.recipe), args.out, overwrite=args.overwrite, resume=args.resume, stop_after=args.stop_after,
                     max_seconds=args.max_seconds)
    return 0


def cmd_plot(args) -> int:
    from beam_rl.dapo.config import RecipeError
    from beam_rl.dapo.plot import plot_run, plot_runs

    if len(args.run_dir) > 1 or args.out:
        if not args.out:
            raise RecipeError("several run directories are compared into one folder: pass --out DIR")
        written = plot_runs(args.run_dir, args.out, labels=args.label)
    else:
        if args.label:
            raise RecipeError("--label names the runs compared with --out DIR; one run's plots go to RUN_DIR/plots")
        written = plot_run(args.run_dir[0])
    for p in written:
        print(p)
    return 0


def add_dapo_parser(sub) -> None:
    p = sub.add_parser("dapo", help="DAPO with R3 on one node (vLLM rollout + Megatron training + verified sync)")
    p.add_argument("--recipe", required=True, help="recipe YAML (see recipes/)")
    p.add_argument("--out", default=None, help="run directory (default: the recipe's run.out)")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's last intact checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's results in the run directory")
    p.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step, as if killed")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop with a checkpoint after the step past which the slowest step so far would end later than this "
                        "many seconds from the start (a device call's time limit minus the checkpoint's writing); --resume continues")
    p.add_argument("--no-checkpoints", action="store_true",
                   help="write no checkpoint in this call, also at the end (a machine's last call: ~16 GB for beam-mini that "
                        "could not outlive it); metrics.jsonl is still written every step")
    p.add_argument("--verbose", action="store_true", help="engine logs and library warnings on the console (default: RUN_DIR/engine.log)")
    p.set_defaults(func=cmd_dapo)


def add_warm_start_parser(sub) -> None:
    p = sub.add_parser("warm-start", help="the recipe's supervised warm start, saved as a checkpoint (evaluated on a rollout "
                                                 "engine when warm_start.target_heldout_avg is set); resumable")
    p.add_argument("--recipe", required=True, help="recipe YAML: its model, task, warm_start and train.mode sections")
    p.add_argument("--out", required=True, help="checkpoint directory to write (config.json + safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--resume", action="store_true", help="continue the warm start stopped early in --out (its checkpoints/)")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step, leaving a resumable checkpoint in --out/checkpoints")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop, leaving a resumable checkpoint, before a step (with its evaluation) would end past this many "
                        "seconds from the start; the checkpoint's writing comes after (a device call's time limit minus a margin)")
    p.set_defaults(func=cmd_warm_start)


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="PNG curves of a DAPO run's metrics.jsonl (RUN_DIR/plots), or of several runs "
                                    "compared, a line per run (--out DIR)")
    p.add_argument("run_dir", nargs="+")
    p.add_argument("--out", default=None, help="folder for the comparison of the runs (held-out avg@8, reward, response length, R3 gap)")
    p.add_argument("--label", action="append", default=None, help="a run's name in the legend, once per RUN_DIR in order (default: its folder name)")
    p.set_defaults(func=cmd_plot)

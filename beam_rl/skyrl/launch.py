"""`beam-rl launch RECIPE [key.path=value ...] [--dry-run]`: a Beam DAPO run through SkyRL 0.3.0.

Steps: read the recipe (`beam_rl.skyrl.config.load_recipe`: unknown keys and types named),
check what a Beam run needs, the layouts and the files (`beam_rl.skyrl.checks`), register
beam-rl's loss / advantage estimator / environment and run SkyRL's `validate_cfg`, point vLLM's
worker extension at `beam_rl.skyrl.vllm_worker`, print the resolved config as YAML; then (not
with --dry-run) start Ray with `beam_rl.skyrl.worker_setup` as every worker's setup hook (the
patches, the environment, Beam's Megatron-Bridge bridge), publish the registries to SkyRL's
registry actor and run SkyRL's experiment with `BeamDAPOTrainer` in a Ray task, as SkyRL's
`main_base` does. Every check runs before Ray starts; a bad input is one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from beam_rl.errors import InputError

SETUP_HOOK = "beam_rl.skyrl.worker_setup"


def resolve(recipe_path: str, overrides: list[str], dry_run: bool):
    """The validated typed config and the summary lines printed above it."""
    from beam_rl.skyrl import checks, register
    from beam_rl.skyrl._compat import skyrl_module
    from beam_rl.skyrl.config import load_recipe
    from beam_rl.skyrl.patches import apply_all
    from beam_rl.skyrl.vllm_worker import WORKER_EXTENSION

    apply_all()  # refuses a SkyRL other than 0.3.0 before anything else
    recipe = load_recipe(recipe_path, overrides)
    cfg = recipe.config
    absolute_paths(cfg)
    checks.check_beam_settings(cfg)
    model = checks.model_shape(cfg, recipe.beam.preset)
    sizes = checks.check_layout(cfg, model)
    notes = checks.check_files(cfg, model, dry_run)
    if not dry_run:
        checks.check_gpus(cfg)
    kwargs = cfg.generator.inference_engine.engine_init_kwargs
    if kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION) != WORKER_EXTENSION:
        raise InputError(f"generator.inference_engine.engine_init_kwargs.worker_extension_cls={kwargs['worker_extension_cls']!r}: "
                         f"a Beam run uses {WORKER_EXTENSION} (SkyRL's extension with beam-rl's patches); remove the key")
    register()
    try:
        skyrl_module("skyrl.train.utils").validate_cfg(cfg)
    except (AssertionError, ValueError, NotImplementedError) as exc:
        raise InputError(f"{recipe.path}: SkyRL's validate_cfg refused the config: {exc}") from exc
    s = sizes
    summary = [
        f"beam-rl launch {recipe.path}" + "".join(f" {o}" for o in overrides) + (" --dry-run" if dry_run else ""),
        f"model: {model.source}",
        f"trainer: {s['gpus']} GPU(s), TP {s['tp']} PP {s['pp']} EP {s['ep']}, DP {s['dp']} (expert DP {s['edp']})",
        f"vLLM: {s['engines']} engine(s) x TP {s['itp']} DP {s['idp']} EP {s['iep']}"
        f"{', colocated' if cfg.trainer.placement.colocate_all else ''}",
        *notes,
        f"run: ray.init(worker_process_setup_hook={SETUP_HOOK}) -> BeamDAPOExp(cfg).run() in a Ray task"
        + (" (not started: --dry-run)" if dry_run else ""),
    ]
    return cfg, summary


def absolute_paths(cfg) -> None:
    """Relative paths of the recipe, made absolute: Ray's workers need not share the driver's cwd."""
    import os

    t, d = cfg.trainer, cfg.data
    for obj, key in ((t.policy.model, "path"), (t, "ckpt_path"), (t, "export_path"), (t, "log_path")):
        if getattr(obj, key):
            setattr(obj, key, os.path.abspath(getattr(obj, key)))
    d.train_data, d.val_data = ([os.path.abspath(f) for f in files] for files in (d.train_data, d.val_data))


def config_yaml(cfg, summary: list[str]) -> str:
    """The summary as YAML comments, then SkyRL's YAML of the config (`get_config_as_yaml_str`)."""
    from beam_rl.skyrl._compat import skyrl_module

    head = "".join(f"# {line}\n" for line in summary)
    return head + skyrl_module("skyrl.train.config").get_config_as_yaml_str(cfg)


def run(cfg) -> None:
    """Start Ray and run the experiment (SkyRL's `main_base.main` with Beam's setup hook)."""
    import ray

    from beam_rl.skyrl import register_beam_bridge
    from beam_rl.skyrl._compat import skyrl_module
    from beam_rl.skyrl.trainer import experiment_class

    register_beam_bridge()  # here too: a missing bridge fails now, not in the first Megatron worker
    utils = skyrl_module("skyrl.train.utils.utils")
    ray.init(runtime_env={"env_vars": utils.prepare_runtime_environment(cfg), "worker_process_setup_hook": SETUP_HOOK},
             log_to_driver=True)
    skyrl_module("skyrl.backends.skyrl_train.utils.ppo_utils").sync_registries()

    @ray.remote(num_cpus=1)
    def experiment(cfg):
        experiment_class()(cfg).run()

    ray.get(experiment.remote(cfg))


def cmd_launch(args) -> int:
    cfg, summary = resolve(args.recipe, args.overrides, args.dry_run)
    print(config_yaml(cfg, summary), end="", flush=True)
    if not args.dry_run:
        run(cfg)
    return 0


class _OptionsFirst(argparse.ArgumentParser):
    """Overrides may come before or after --dry-run / --debug: argparse stops taking positionals at
    the first option ("unrecognized arguments"). Every option of `launch` is a flag and every
    override is key=value, so the flags are moved to the front."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([a for a in args if a.startswith("-")] + [a for a in args if not a.startswith("-")], namespace)


def add_launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="DAPO with R3 through SkyRL 0.3.0 (Ray, Megatron, vLLM) from a recipes/skyrl/ recipe")
    p.add_argument("recipe", help="recipe YAML (recipes/skyrl/dapo-bf16.yaml, dapo-lora.yaml, dapo-mxfp8.yaml, ...)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides of the recipe (SkyRL's config keys, or beam.*)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config; start nothing")
    p.set_defaults(func=cmd_launch)
    p.__class__ = _OptionsFirst


if __name__ == "__main__":
    from beam_rl.cli import main

    sys.exit(main(["launch", *sys.argv[1:]]))

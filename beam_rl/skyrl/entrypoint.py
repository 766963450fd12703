"""`python -m beam_rl.skyrl.entrypoint --config recipes/skyrl/beam-dapo.yaml [key.path=value ...]`

SkyRL's `main_base.main` with Beam's registrations: register the loss, advantage estimator and
environment, read the config, validate it with SkyRL's `validate_cfg`, start Ray (its env vars
from SkyRL's `prepare_runtime_environment`, plus `beam_rl.skyrl.worker_setup` as the worker
setup hook: every Ray worker gets the Python 3.11 import fix and the environment), publish the
registries to Ray (`sync_registries`), then run SkyRL's experiment with `BeamDAPOTrainer` in a
Ray task. Also reachable as SkyRL's `trainer.override_entrypoint=beam_rl.skyrl.entrypoint`
(that argument is dropped here).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    p = argparse.ArgumentParser(prog="python -m beam_rl.skyrl.entrypoint", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", required=True, help="SkyRL YAML (recipes/skyrl/beam-dapo.yaml)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides of the YAML")
    args = p.parse_args(argv)
    return args.config, [o for o in args.overrides if not o.startswith("trainer.override_entrypoint=")]


def main(argv: list[str] | None = None) -> None:
    from beam_rl.skyrl import register
    from beam_rl.skyrl._compat import skyrl_module
    from beam_rl.skyrl.config import load_config
    from beam_rl.skyrl.trainer import experiment_class

    config, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    register()
    cfg = load_config(config, overrides)
    skyrl_module("skyrl.train.utils").validate_cfg(cfg)

    import ray

    utils = skyrl_module("skyrl.train.utils.utils")
    ray.init(runtime_env={"env_vars": utils.prepare_runtime_environment(cfg),
                          "worker_process_setup_hook": "beam_rl.skyrl.worker_setup"}, log_to_driver=True)
    skyrl_module("skyrl.backends.skyrl_train.utils.ppo_utils").sync_registries()

    @ray.remote(num_cpus=1)
    def run(cfg):
        experiment_class()(cfg).run()

    ray.get(run.remote(cfg))


if __name__ == "__main__":
    main()

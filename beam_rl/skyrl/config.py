"""The SkyRL config of a Beam DAPO run: SkyRL's typed config plus three DAPO fields, read from
a YAML file (recipes/skyrl/beam-dapo.yaml) with `key.path=value` overrides on top.

SkyRL 0.3.0's config is dataclasses that mirror the YAML 1:1 (`SkyRLTrainConfig`,
`from_dict_config`, unknown keys rejected); `make_config` adds the fields below under
`trainer.algorithm` (SkyRL's own DAPO example extends the algorithm config the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from beam_rl.skyrl._compat import skyrl_module


@lru_cache(maxsize=1)
def config_class():
    """`SkyRLTrainConfig` subclass whose `trainer.algorithm` has the Beam DAPO fields."""
    cfg = skyrl_module("skyrl.train.config")

    @dataclass
    class BeamDAPOAlgorithmConfig(cfg.AlgorithmConfig):
        soft_overlong_punishment: bool = True
        """DAPO soft overlong punishment (beam_rl.dapo.overlong) added to each training reward."""
        overlong_cache_length: int = 2
        """L_cache: the penalty ramps from 0 at (max_generate_length - L_cache) to -overlong_penalty_factor at the cap."""
        overlong_penalty_factor: float = 1.0
        """Penalty at the cap."""

    return cfg.make_config(algorithm_cls=BeamDAPOAlgorithmConfig)


def load_config(path: str | Path, overrides: list[str] = ()):
    """YAML file + `a.b.c=value` overrides -> the typed config (unknown keys raise, naming them)."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"SkyRL config {path} does not exist (see recipes/skyrl/)")
    bad = [o for o in overrides if "=" not in o or o.startswith("+")]
    if bad:
        raise ValueError(f"overrides must look like key.path=value (no '+'); got {bad}")
    merged = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
    cfg = config_class().from_dict_config(merged)
    a = cfg.trainer.algorithm
    if a.soft_overlong_punishment and not 0 <= a.overlong_cache_length < cfg.generator.sampling_params.max_generate_length:
        raise ValueError(f"trainer.algorithm.overlong_cache_length={a.overlong_cache_length} must lie in "
                         f"[0, generator.sampling_params.max_generate_length={cfg.generator.sampling_params.max_generate_length})")
    return cfg

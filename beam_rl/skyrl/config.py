"""A Beam SkyRL recipe: YAML (optionally on top of a base recipe) + `key.path=value` overrides ->
SkyRL's typed config with three DAPO fields, and the recipe's own `beam:` section.

SkyRL 0.3.0's config is dataclasses that mirror the YAML 1:1 (`SkyRLTrainConfig`,
`from_dict_config`); `make_config` adds the overlong fields under `trainer.algorithm` (SkyRL's
own DAPO example extends the algorithm config the same way). SkyRL has no YAML composition (it
reads command-line overrides only), so `beam.base` is resolved here with OmegaConf's merge: the
base first, the recipe on top, the overrides last. Every error is an `InputError` naming the key
(or override) and the fix; an unknown key is named by its full path.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from beam_rl.errors import InputError
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


@dataclass
class BeamSection:
    """The recipe's `beam:` keys (not SkyRL's; removed before SkyRL sees the config)."""

    base: str | None = None
    """A recipe this one is written on top of (path relative to this file)."""
    preset: str | None = None
    """A `beam_rl.model.presets` name: the model shape for layout checks while
    `trainer.policy.model.path` holds no checkpoint yet (a layout on paper, `launch --dry-run`)."""


@dataclass
class SkyRLRecipe:
    config: object
    """The typed SkyRL config (`config_class()` instance)."""
    beam: BeamSection
    """The `beam:` section."""
    path: Path
    """The recipe file."""
    overrides: tuple[str, ...]
    """The `key.path=value` overrides applied on top."""


def _read(path: Path, seen: tuple[Path, ...] = ()):
    """The recipe at `path` merged onto its `beam.base` chain (OmegaConf DictConfig)."""
    from omegaconf import OmegaConf

    if not path.is_file():
        hint = "recipes/skyrl/ holds dapo-bf16.yaml, dapo-lora.yaml, dapo-mxfp8.yaml, dapo-bf16-501b.yaml"
        raise InputError(f"recipe {path} does not exist ({hint})" if not seen else
                         f"{seen[-1]}: beam.base={path} does not exist; give a path relative to {seen[-1].parent}")
    if path.resolve() in [p.resolve() for p in seen]:
        raise InputError(f"{path}: beam.base forms a cycle ({' -> '.join(map(str, seen + (path,)))}); remove one base")
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # YAML syntax: name the file, keep the parser's position
        raise InputError(f"{path} is not valid YAML: {exc}") from exc
    base = OmegaConf.select(node, "beam.base")
    if base is None:
        return node
    return OmegaConf.merge(_read(path.parent / str(base), seen + (path,)), node)


def _check_keys(cls, raw: dict, where: str) -> None:
    """Unknown keys (full path and the nearest valid names) and scalar types against SkyRL's dataclasses."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        path = f"{where}{key}"
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=3)
            fix = f"did you mean {' / '.join(where + n for n in near)}?" if near else f"{where.rstrip('.') or 'the top level'} has {sorted(fields)}"
            raise InputError(f"unknown key {path}: SkyRL 0.3.0 has no such field ({fix}); remove or rename it")
        kind = _dataclass_of(hints[key])
        if kind is not None and isinstance(value, dict):
            _check_keys(kind, value, path + ".")
        elif not (path in _LISTS_OK and isinstance(value, list)) and not _scalar_ok(hints[key], value):
            raise InputError(f"{path}={value!r}: expected {_type_name(hints[key])}; fix the value")


def _dataclass_of(hint):
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


_SCALARS = (bool, int, float, str)
# Annotated `str` in SkyRL 0.3.0, but its Megatron worker hands any value other than "all-linear"
# to Megatron-Bridge's `LoRA(target_modules: List[str], exclude_modules: List[str])`: a list.
_LISTS_OK = {"trainer.policy.model.lora.target_modules", "trainer.policy.model.lora.exclude_modules"}


def _scalar_ok(hint, value) -> bool:
    """Only plain scalar annotations (and Optional of them) are checked; anything else passes."""
    options = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    if value is None:
        return type(None) in options or not all(o in _SCALARS for o in options)
    scalars = [o for o in options if o in _SCALARS]
    if len(scalars) != len([o for o in options if o is not type(None)]):
        return True  # a list / dict / union with non-scalars: SkyRL's business
    if isinstance(value, bool):
        return bool in scalars
    return any(isinstance(value, o) or (o is float and isinstance(value, int)) for o in scalars)


def _type_name(hint) -> str:
    options = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    return " or ".join("null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> SkyRLRecipe:
    """Recipe + overrides -> `SkyRLRecipe`; raises InputError naming the bad key, override or file."""
    from omegaconf import OmegaConf

    path = Path(path)
    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~"))]
    if bad:
        raise InputError(f"override {bad[0]!r} must look like key.path=value (no '+' or '~'), e.g. trainer.seed=1")
    try:
        dotlist = OmegaConf.from_dotlist(list(overrides))
    except Exception as exc:
        raise InputError(f"overrides {list(overrides)} do not parse: {exc}") from exc
    merged = OmegaConf.to_container(OmegaConf.merge(_read(path), dotlist), resolve=True)
    beam_raw = merged.pop("beam", None) or {}
    if not isinstance(beam_raw, dict):
        raise InputError(f"{path}: beam must be a mapping with keys {[f.name for f in dataclasses.fields(BeamSection)]}")
    _check_keys(BeamSection, beam_raw, "beam.")
    beam = BeamSection(**beam_raw)
    cls = config_class()
    _check_keys(cls, merged, "")
    try:
        cfg = cls.from_dict_config(OmegaConf.create(merged))
    except (ValueError, AssertionError, TypeError) as exc:  # SkyRL's __post_init__ checks
        raise InputError(f"{path}: SkyRL's config refused it: {exc}") from exc
    a = cfg.trainer.algorithm
    cap = cfg.generator.sampling_params.max_generate_length
    if a.soft_overlong_punishment and not 0 <= a.overlong_cache_length < cap:
        raise InputError(f"trainer.algorithm.overlong_cache_length={a.overlong_cache_length} must lie in "
                         f"[0, generator.sampling_params.max_generate_length={cap})")
    return SkyRLRecipe(config=cfg, beam=beam, path=path, overrides=tuple(overrides))


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """The typed SkyRL config of a recipe (`load_recipe(...).config`)."""
    return load_recipe(path, overrides).config

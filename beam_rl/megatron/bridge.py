"""Megatron-Bridge 0.3.1 for Beam: importing it without Transformer Engine, registering Beam's bridge.

SkyRL 0.3.0 builds every Megatron model through Megatron-Bridge: `AutoBridge.from_hf_pretrained`
-> `to_megatron_provider()` -> trainer settings on the provider -> `provide_distributed_model()`,
and syncs weights to vLLM through `export_hf_weights`. `register_bridge()` makes that path build
beam-rl's `BeamGPTModel` (`beam_rl.megatron.bridge_model`); call it in every process that builds
or exports the model (SkyRL's Megatron workers) before importing SkyRL's `megatron_worker` module
(it imports `megatron.bridge` at module level) and before `AutoBridge.from_hf_pretrained`.

`megatron.bridge` imports `transformer_engine.pytorch` at module level (its LoRA layers subclass
TE classes) and TE has no CPU build. `import_megatron_bridge()` imports Megatron-Bridge with a
stub TE that only Megatron-Bridge's own modules can see: every other module imported meanwhile
(megatron-core's included) executes with `transformer_engine` unimportable, so megatron-core
keeps `HAVE_TE = False` and its local paths, and the stub is gone from `sys.modules` afterwards.
Stub classes raise when instantiated: Megatron-Bridge's TE-only paths (TE layer specs, TE LoRA
layers) fail loudly instead of running without TE. With TE installed, nothing is stubbed.

Without TE, megatron-core's `extensions.transformer_engine` still defines its `TE*` names (as
`MagicMock` objects: its classes subclass a mocked `te`), so Megatron-Bridge's PEFT modules,
which probe those names, believe TE is there; their `isinstance(module, TE*)` checks then raise
`TypeError` as LoRA wraps the first linear layer. `import_megatron_bridge()` sets those flags to
what is installed (`_PEFT_TE_FLAGS`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from beam_rl.importhooks import next_spec

_TE = "transformer_engine"
MEGATRON_BRIDGE_VERSION = "0.3.1"
# What SkyRL 0.3.0's Megatron worker imports from Megatron-Bridge at module level; all of it must
# be imported while the stub is visible.
_MODULES = ("megatron.bridge", "megatron.bridge.peft.lora", "megatron.bridge.peft.canonical_lora")
# Megatron-Bridge's "is TE there" flags that megatron-core's mocked TE classes set true.
_PEFT_TE_FLAGS = {
    "megatron.bridge.peft.utils": ("HAVE_TE",),
    "megatron.bridge.peft.module_matcher": ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"),
}


def _is_te(name: str) -> bool:
    return name == _TE or name.startswith(_TE + ".")


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{cls.__qualname__}.{name}", cls.__module__)
        setattr(cls, name, value)  # one class per name: Megatron-Bridge compares classes
        return value


class _MissingTE(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__module__}.{type(self).__qualname__} needs Transformer Engine, which is not "
                           f"installed; this Megatron-Bridge path is not available here")


def _stub_class(qualname: str, module: str) -> type:
    cls = _StubMeta(qualname.rsplit(".", 1)[-1], (_MissingTE,), {"__module__": module})
    cls.__qualname__ = qualname
    return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub_class(name, self.__name__)
        setattr(self, name, value)  # one class per name: Megatron-Bridge compares classes
        return value


class _Scoped(importlib.abc.Loader):
    """A module's real loader, executing it with the stub visible or not."""

    def __init__(self, finder: _TEStubFinder, real, visible: bool):
        self.finder, self.real, self.visible = finder, real, visible

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        with self.finder.scope(self.visible):
            self.real.exec_module(module)
        module.__loader__ = self.real
        if module.__spec__ is not None:
            module.__spec__.loader = self.real

    def __getattr__(self, name):  # get_source, is_package, ... for tracebacks and inspect
        return getattr(self.real, name)


class _TEStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stub `transformer_engine*` modules while a `megatron.bridge` module executes, and
    wraps every other module imported meanwhile so that it executes with them hidden."""

    def __init__(self):
        self.visible = [False]
        self.stubs: dict[str, types.ModuleType] = {}

    @contextlib.contextmanager
    def scope(self, visible: bool):
        self.visible.append(visible)
        self._sync()
        try:
            yield
        finally:
            self.visible.pop()
            self._sync()

    def _sync(self):
        for name in [n for n in sys.modules if _is_te(n)]:
            self.stubs[name] = sys.modules.pop(name)
        if self.visible[-1]:
            sys.modules.update(self.stubs)

    def find_spec(self, name, path=None, target=None):
        if _is_te(name):
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if self.visible[-1] else None
        spec = next_spec(self, name, path, target)
        if spec is None:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Scoped(self, spec.loader, visible=name == "megatron.bridge" or name.startswith("megatron.bridge."))
        return spec

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass

    def remove(self):
        sys.meta_path.remove(self)
        for name in [n for n in sys.modules if _is_te(n)]:
            del sys.modules[name]


def import_megatron_bridge() -> types.ModuleType:
    """`megatron.bridge` (and the Megatron-Bridge modules SkyRL's Megatron worker imports), with a
    stub Transformer Engine only where TE is not installed; idempotent. megatron-core is imported
    first and keeps `HAVE_TE = False`."""
    finder = None
    if "megatron.bridge" not in sys.modules:
        import megatron.core  # noqa: F401  (first, and without the stub)

        if importlib.util.find_spec("megatron.bridge") is None:
            raise ModuleNotFoundError(
                f"megatron-bridge is not installed; pip install --no-deps megatron-bridge=={MEGATRON_BRIDGE_VERSION}",
                name="megatron.bridge",
            )
        if importlib.util.find_spec(_TE) is None:
            finder = _TEStubFinder()
            sys.meta_path.insert(0, finder)
    try:
        for name in _MODULES:
            importlib.import_module(name)
    finally:
        if finder is not None:
            finder.remove()
    if importlib.util.find_spec(_TE) is None:
        for name, flags in _PEFT_TE_FLAGS.items():
            module = importlib.import_module(name)
            for flag in flags:
                setattr(module, flag, False)
    return sys.modules["megatron.bridge"]


def register_bridge():
    """Import Megatron-Bridge (`import_megatron_bridge`), register beam-rl's `beam` config with
    transformers' Auto classes and Beam's bridge with Megatron-Bridge, and fix the checkpoint index
    of megatron-core's distributed optimizer for Beam's mixed FP32 / BF16 parameters
    (`beam_rl.megatron.optimizer`); idempotent. Returns the bridge class (`bridge_model.BeamBridge`)."""
    import_megatron_bridge()
    from beam_rl.megatron import bridge_model
    from beam_rl.megatron.optimizer import order_groups_like_the_optimizer

    bridge_model.register()
    order_groups_like_the_optimizer()  # Beam's FP32 routers in megatron-core's distributed optimizer
    return bridge_model.BeamBridge

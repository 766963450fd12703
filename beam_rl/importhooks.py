"""Shared piece of beam-rl's two import hooks (`beam_rl.megatron.bridge`'s Transformer Engine stub,
`beam_rl.skyrl.imports`' patch-on-import): both answer for a few module names with the regular
finders' spec and wrap its loader."""

from __future__ import annotations

import sys


def next_spec(finder, name: str, path=None, target=None):
    """The spec that the finders on `sys.meta_path` other than `finder` give `name`, or None."""
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None

"""The Beam model spec: config and presets, numerics contract, routing, the reference model, the
checkpoint tensor table and file format, and the HF <-> Megatron / PEFT name tables.

Imports no engine (vLLM, Megatron-Core): every engine's definition is tested against this package.
"""

from beam_rl.model.config import BeamConfig, BeamConfigError
from beam_rl.model.presets import PRESETS, get_preset

__all__ = ["BeamConfig", "BeamConfigError", "PRESETS", "get_preset"]

"""beam-rl: DAPO post-training of Reflection's Beam MoE with Rollout Routing Replay (R3)."""

from beam_rl.config import BeamConfig, BeamConfigError
from beam_rl.presets import PRESETS, get_preset

__all__ = ["BeamConfig", "BeamConfigError", "PRESETS", "get_preset"]
__version__ = "0.1.0"

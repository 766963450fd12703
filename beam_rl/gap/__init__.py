"""`beam-rl gap`: the log-prob gap between the vLLM rollout and the Megatron trainer, R3 on and off.

`options` (every flag, declared once), `bounds` (the bound per mode, as data), `measure` (the
measurement), `report` (table and histogram), `cli`."""

from beam_rl.gap.bounds import BOUNDS
from beam_rl.gap.options import MODES, GapOptions

__all__ = ["BOUNDS", "MODES", "GapOptions"]

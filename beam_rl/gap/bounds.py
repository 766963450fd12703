"""The R3 gap bounds per training mode, as data: what `beam-rl gap` reports against and what
`scripts/gap_h200.sh` checks (it reads this table: `python -m beam_rl.gap.bounds`).

`launch`: the launch's bound on mean |logprob(trainer) - logprob(rollout)| with R3, on any
checkpoint. `trained`: the tighter bar for a trained (not random) checkpoint, where random
weights' amplification of last-bit differences with depth is absent.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GapBound:
    launch: float
    trained: float


BOUNDS: dict[str, GapBound] = {
    "bf16": GapBound(launch=0.01, trained=0.005),
    "lora": GapBound(launch=0.01, trained=0.005),
    "mxfp8": GapBound(launch=0.03, trained=0.015),
}

if __name__ == "__main__":
    print(json.dumps({mode: asdict(b) for mode, b in BOUNDS.items()}))

"""The commit a benchmark's JSON records (`provenance.commit`), one definition for every bench script."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str | None:
    """`BEAM_RL_COMMIT` where set, else `git rev-parse --short HEAD` of this checkout; None when neither
    answers. A device machine's copy of the tree can carry an older .git than the code it runs (an
    H100 run of 2026-12-07 recorded the commit before the one its wheel was built from), so
    h200_campaign.sh's caller sets BEAM_RL_COMMIT from the checkout the wheel came from."""
    if os.environ.get("BEAM_RL_COMMIT"):
        return os.environ["BEAM_RL_COMMIT"]
    got = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return got.stdout.strip() or None

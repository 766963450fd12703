"""`needs_skyrl`: the mark that skips a SkyRL test cleanly where SkyRL 0.3.0 is not installed."""

import pytest

from beam_rl.skyrl._compat import SkyRLMissing, skyrl_module

try:
    skyrl_module("skyrl.train.config")
    MISSING = None
except SkyRLMissing as exc:  # depends on the environment
    MISSING = str(exc)

needs_skyrl = pytest.mark.skipif(MISSING is not None, reason=f"SkyRL 0.3.0 not installed: {MISSING}")

"""vLLM worker extension of a SkyRL run on Beam: SkyRL 0.3.0's `NewInferenceWorkerWrap`, patched.

vLLM's worker processes are not Ray workers, so Ray's setup hook (`beam_rl.skyrl.worker_setup`)
never runs in them; vLLM imports `--worker-extension-cls` in each of them instead. `beam-rl
launch` sets `generator.inference_engine.engine_init_kwargs.worker_extension_cls` to
`WORKER_EXTENSION` (where SkyRL would set its own class), so looking the class up here applies
the patches (`beam_rl.skyrl.patches.apply_all`) in that process and hands vLLM SkyRL's class.
The Beam model itself reaches those processes through beam-rl's `vllm.general_plugins` entry
point.
"""

from __future__ import annotations

WORKER_EXTENSION = f"{__name__}.NewInferenceWorkerWrap"


def __getattr__(name: str):
    # Lazy: the launch driver reads WORKER_EXTENSION without importing SkyRL's worker code.
    if name != "NewInferenceWorkerWrap":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from beam_rl.skyrl._compat import skyrl_module
    from beam_rl.skyrl.patches import WORKER_WRAP, apply_all

    apply_all()
    return skyrl_module(WORKER_WRAP).NewInferenceWorkerWrap

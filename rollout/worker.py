"""`BeamWorkerExtension`: beam-rl's methods inside vLLM workers, reached with `collective_rpc`.

Start the engine with `worker_extension_cls="beam_rl.rollout.worker.BeamWorkerExtension"`.

- Routed-expert capture where the runner has no capturer of its own (vLLM's CPU runner has no
  Model Runner V2): `beam_start_routing_capture` wraps the model runner's `execute_model`; after
  each step the rows the model's `RoutingRecorder` wrote are filed under their requests by
  position; `beam_pop_routed_experts` returns, per finished request, the same array vLLM puts in
  `CompletionOutput.routed_experts`.
- Weights: `beam_weight_checksums` hashes the loaded tensors in checkpoint (HF) layout, so a
  weight sync can be verified on both sides; `beam_reload_weights` reloads in place.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from beam_rl.rollout.capture import RequestRouting


class BeamWorkerExtension:
    def _beam_model(self):
        return self.model_runner.get_model() if hasattr(self.model_runner, "get_model") else self.model_runner.model

    # -- routed experts -------------------------------------------------------------------------
    def beam_start_routing_capture(self) -> bool:
        model = self._beam_model()
        recorder = getattr(model, "routing_recorder", None)
        if recorder is None:
            raise RuntimeError("the loaded model has no routing recorder; is it beam_rl.rollout's BeamForCausalLM?")
        if getattr(self, "_beam_routing", None) is None:
            self._beam_routing = RequestRouting(recorder)
            runner = self.model_runner
            original = runner.execute_model

            def execute_model(scheduler_output, *args, **kwargs):
                out = original(scheduler_output, *args, **kwargs)
                req_ids = list(runner.input_batch.req_ids)
                counts = [scheduler_output.num_scheduled_tokens.get(r, 0) for r in req_ids]
                positions = getattr(runner.positions, "gpu", runner.positions)
                self._beam_routing.file_step(req_ids, counts, positions)
                return out

            runner.execute_model = execute_model
        recorder.enabled = True
        return True

    def beam_pop_routed_experts(self, request_ids: list[str]) -> dict[str, tuple[tuple[int, ...], str, bytes]]:
        """Routing of the given (external) request ids, as (shape, dtype, bytes) so it crosses
        process boundaries intact; `beam_rl.rollout.routing.fetch_routed_experts` decodes it."""
        routing = getattr(self, "_beam_routing", None)
        if routing is None:
            raise RuntimeError("call beam_start_routing_capture before generating")
        found: dict[str, np.ndarray] = {}
        for internal in list(routing.rows):
            for rid in request_ids:
                # vLLM may append a uniquifying suffix to the caller's request id.
                if internal == rid or internal.startswith(rid + "-"):
                    arr = routing.pop(internal)
                    found[rid] = (arr.shape, arr.dtype.str, arr.tobytes())
        return found

    # -- weights ----------------------------------------------------------------------------------
    def beam_weight_checksums(self) -> dict[str, str]:
        """sha256 of every parameter as held by this worker (after kernel-layout processing)."""
        out = {}
        for name, p in self._beam_model().named_parameters():
            t = p.detach().contiguous().cpu()
            out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        return out

    def beam_reload_weights(self, weights_path: str) -> bool:
        self.model_runner.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return True

"""Client side of routed-expert capture: `fetch_captured_routing` returns each request's routing as
`BeamWorkerExtension` captured it (CPU and GPU; the same arrays as vLLM's own
`CompletionOutput.routed_experts`, which beam-rl's engines do not turn on).

The array is [prompt + generated - 1, num_hidden_layers, top_k] (the last sampled token never
passes through the model). Rows of dense layers are not routed (zeros): select MoE layers by
layer type with `moe_layers`, never by value.
"""

from __future__ import annotations

import numpy as np

from beam_rl.model.config import BeamConfig


def fetch_captured_routing(llm, outputs) -> list[np.ndarray]:
    """Routing of each request as captured by `BeamWorkerExtension` (removed from the worker),
    [prompt + generated - 1, num_hidden_layers, top_k] like vLLM's own array."""
    replies = llm.collective_rpc("beam_pop_routed_experts", args=([o.request_id for o in outputs],))
    got = replies[0]  # every TP rank routes identically; rank 0 answers
    missing = [o.request_id for o in outputs if o.request_id not in got]
    if missing:
        raise RuntimeError(
            f"no captured routing for requests {missing[:5]}: start the engine with "
            "worker_extension_cls='beam_rl.rollout.worker.BeamWorkerExtension' and call "
            "llm.collective_rpc('beam_start_routing_capture') before generating (or use "
            "enable_return_routed_experts=True where vLLM supports it)"
        )
    out = []
    for o in outputs:
        shape, dtype, data = got[o.request_id]
        arr = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        need = len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1
        if arr.shape[0] < need:
            raise RuntimeError(
                f"request {o.request_id}: captured routing for {arr.shape[0]} positions; its prompt "
                f"({len(o.prompt_token_ids)}) + output ({len(o.outputs[0].token_ids)}) tokens need {need}"
            )
        # Rows are filed by position. Positions >= `need` are forward passes of the last sampled
        # token, which vLLM's async scheduler (GPU) runs before it learns the request stopped on a
        # stop token; their outputs were discarded, so their routing belongs to no kept token.
        out.append(arr[:need].copy())
    return out


def moe_layers(routed: np.ndarray, config: BeamConfig) -> np.ndarray:
    """[tokens, num_hidden_layers, top_k] -> [tokens, moe_layers, top_k] by layer type."""
    if routed.ndim != 3 or routed.shape[1] != config.num_hidden_layers or routed.shape[2] != config.num_experts_per_tok:
        raise ValueError(
            f"routed experts have shape {routed.shape}; expected [tokens, {config.num_hidden_layers}, {config.num_experts_per_tok}]"
        )
    return routed[:, config.moe_layer_ids]

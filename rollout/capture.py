"""Routed-expert capture for runners without vLLM's own capturer (vLLM's CPU runner).

`RoutingRecorder` lives in the model: each MoE layer writes this step's expert ids into a static
buffer [max_tokens, num_hidden_layers, top_k] (rows of dense layers stay 0, as in vLLM's array).
`RequestRouting` (driven by the worker extension after every model step) files the step's rows
under their requests by position, so each finished request has the same array vLLM returns in
`CompletionOutput.routed_experts`: [prompt + generated - 1, num_hidden_layers, top_k], uint8 for
<= 256 experts.
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingRecorder:
    def __init__(self, max_tokens: int, num_layers: int, top_k: int, num_experts: int, device=None):
        self.enabled = False
        self.buffer = torch.zeros(max_tokens, num_layers, top_k, dtype=torch.int32, device=device)
        self.num_tokens = 0
        self.np_dtype = np.uint8 if num_experts <= 256 else np.uint16

    def record(self, layer_idx: int, ids: torch.Tensor) -> None:
        if not self.enabled:
            return
        n = ids.shape[0]
        if n > self.buffer.shape[0]:
            raise RuntimeError(f"routing capture buffer holds {self.buffer.shape[0]} tokens, step has {n}")
        self.buffer[:n, layer_idx] = ids.to(torch.int32)
        self.num_tokens = n


class RequestRouting:
    """Per-request routing arrays assembled from model steps."""

    def __init__(self, recorder: RoutingRecorder):
        self.recorder = recorder
        self.rows: dict[str, np.ndarray] = {}  # capacity grows by doubling
        self.lengths: dict[str, int] = {}

    def file_step(self, req_ids: list[str], num_scheduled: list[int], positions: torch.Tensor) -> None:
        total = sum(num_scheduled)
        if total == 0:
            return
        step = self.recorder.buffer[:total].cpu().numpy().astype(self.recorder.np_dtype)
        pos = positions[:total].cpu().numpy()
        offset = 0
        for req_id, n in zip(req_ids, num_scheduled):
            if n == 0:
                continue
            p = pos[offset : offset + n]
            arr = self.rows.get(req_id)
            need = int(p.max()) + 1
            if arr is None or arr.shape[0] < need:
                grown = np.zeros((max(need, 2 * (0 if arr is None else arr.shape[0])),) + step.shape[1:], dtype=step.dtype)
                if arr is not None:
                    grown[: arr.shape[0]] = arr
                arr = grown
            arr[p] = step[offset : offset + n]
            self.rows[req_id] = arr
            self.lengths[req_id] = max(self.lengths.get(req_id, 0), need)
            offset += n

    def pop(self, req_id: str) -> np.ndarray | None:
        arr = self.rows.pop(req_id, None)
        if arr is None:
            return None
        return arr[: self.lengths.pop(req_id)]

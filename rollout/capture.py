"""Routed-expert capture (R3) in the model, on every runner: beam-rl's path on CPU and GPU alike.

`RoutingRecorder` lives in the model: each MoE layer writes this step's expert ids into a static
buffer [max_tokens, num_hidden_layers, top_k] on the model's device (rows of dense layers stay 0,
as in vLLM's array). It always records: a CUDA graph replays what was captured, so recording that
could be switched on later would silently miss every graphed step. The cost is one small copy
kernel per MoE layer, inside the graph.

`RequestRouting` (driven by the worker extension after every model step) never waits for the GPU:
`file_step` enqueues a copy of the step's rows and positions into pinned host memory on the
step's stream (ordered after the forward that wrote them, before the next step's writes) and
keeps it with the step's request rows. Nothing per request happens per step in Python while the
batch keeps its requests and their order (the usual decode step): the request-row array is reused
and repeated by the step's token counts. `pop_many` waits for the copies once, then assembles
each request's array by position, the last write of a position winning (a preempted request's
recompute overwrites its first pass, as in vLLM's slot buffer). So async scheduling keeps
overlapping the host with the GPU. A settled step keeps its ids in the returned dtype (uint8 for
<= 256 experts), a quarter of the device buffer's int32. Each finished request gets the array
vLLM returns in `CompletionOutput.routed_experts`: [prompt + generated - 1, num_hidden_layers,
top_k], uint8 for <= 256 experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class RoutingRecorder:
    def __init__(self, max_tokens: int, num_layers: int, top_k: int, num_experts: int, device=None):
        self.buffer = torch.zeros(max_tokens, num_layers, top_k, dtype=torch.int32, device=device)
        self.np_dtype = np.uint8 if num_experts <= 256 else np.uint16

    def record(self, layer_idx: int, ids: torch.Tensor) -> None:
        n = ids.shape[0]
        if n > self.buffer.shape[0]:
            raise RuntimeError(f"routing capture buffer holds {self.buffer.shape[0]} tokens, step has {n}")
        self.buffer[:n, layer_idx] = ids.to(torch.int32)


@dataclass
class _Step:
    """One model step's rows: ids [n, layers, top_k] and positions [n] (pinned host copies still in
    flight until `ready`, then numpy arrays of their own), and which request each row belongs to."""

    ids: torch.Tensor | np.ndarray
    positions: torch.Tensor | np.ndarray
    rows_of: np.ndarray
    ready: torch.cuda.Event | None


class RequestRouting:
    """Per-request routing arrays assembled from model steps."""

    HOST_SLOTS = 4
    """Pinned host buffers reused round-robin for the steps' copies (async scheduling has at most
    two steps in flight; a slot still in flight is waited for before reuse)."""

    def __init__(self, recorder: RoutingRecorder):
        self.recorder = recorder
        self.steps: list[_Step] = []
        self.request_index: dict[str, int] = {}
        self.request_ids: dict[int, str] = {}  # index -> id of the requests with rows held
        self._issued = 0  # indices handed out (never reused, so an id filed again gets a new one)
        self._slots: list[tuple[torch.Tensor, torch.Tensor, list[_Step | None]]] = []
        self._next = 0
        self._batch: tuple[list[str], np.ndarray] | None = None  # the last step's request ids and their indices
        self.steps_filed = 0  # model steps that scheduled tokens, since the capture started

    def file_step(self, req_ids: list[str], num_scheduled, positions: torch.Tensor) -> None:
        """File this step: the model's first sum(num_scheduled) recorded rows, the rows of req_ids[i]
        being the next num_scheduled[i] (vLLM's token order), with their positions."""
        counts = np.asarray(num_scheduled, dtype=np.int64)
        if counts.shape != (len(req_ids),):
            raise ValueError(f"num_scheduled has shape {counts.shape}; expected one count per request ({len(req_ids)})")
        total = int(counts.sum())
        if total == 0:
            return
        self.steps_filed += 1
        if self._batch is None or self._batch[0] != req_ids:
            self._batch = (list(req_ids), np.array([self._index(r) for r in req_ids], dtype=np.int32))
        rows_of = np.repeat(self._batch[1], counts)
        src_ids, src_pos = self.recorder.buffer[:total], positions[:total]
        if src_ids.device.type != "cuda":
            self.steps.append(_Step(src_ids.numpy().astype(self.recorder.np_dtype), src_pos.numpy().astype(np.int64),
                                    rows_of, None))
            return
        ids_host, pos_host, user = self._slot()
        ids_host, pos_host = ids_host[:total], pos_host[:total]
        ids_host.copy_(src_ids, non_blocking=True)
        pos_host.copy_(src_pos, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        step = _Step(ids_host, pos_host, rows_of, event)
        user[0] = step
        self.steps.append(step)

    def _index(self, req_id: str) -> int:
        i = self.request_index.get(req_id)
        if i is None:
            i = self.request_index[req_id] = self._issued
            self.request_ids[i] = req_id
            self._issued += 1
        return i

    def _slot(self):
        """The next pinned host slot; a step still using it gets its own copy first."""
        if not self._slots:
            shape = self.recorder.buffer.shape
            self._slots = [(torch.empty(shape, dtype=torch.int32, pin_memory=True),
                            torch.empty(shape[0], dtype=torch.int64, pin_memory=True), [None])
                           for _ in range(self.HOST_SLOTS)]
        ids_host, pos_host, user = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if user[0] is not None:
            self._settle(user[0])
            user[0] = None
        return ids_host, pos_host, user

    def _settle(self, step: _Step) -> None:
        """Wait for the step's copy, then give it storage of its own (its pinned slot is reused)."""
        if step.ready is not None:
            step.ready.synchronize()
            step.ids = step.ids.numpy().astype(self.recorder.np_dtype)
            step.positions = step.positions.numpy().copy()
            step.ready = None

    def pop_many(self, req_ids: list[str]) -> dict[str, np.ndarray]:
        """{req_id: routing [positions, layers, top_k]} of the given internal request ids that have any
        rows; their rows are dropped."""
        wanted = {self.request_index[r]: r for r in req_ids if r in self.request_index}
        if not wanted or not self.steps:
            return {}
        for step in self.steps:
            self._settle(step)
        ids = np.concatenate([s.ids for s in self.steps])
        positions = np.concatenate([s.positions for s in self.steps])
        rows_of = np.concatenate([s.rows_of for s in self.steps])
        take = np.isin(rows_of, np.fromiter(wanted, dtype=np.int32))
        keep = ~take
        # Rows in step order; a stable sort by (request, position) keeps that order within a
        # position, so the last row of each (request, position) is its latest write.
        sel = np.nonzero(take)[0]
        order = sel[np.lexsort((positions[sel], rows_of[sel]))]
        req_sorted, pos_sorted = rows_of[order], positions[order]
        last = np.ones(order.size, dtype=bool)
        last[:-1] = (req_sorted[1:] != req_sorted[:-1]) | (pos_sorted[1:] != pos_sorted[:-1])
        order, req_sorted, pos_sorted = order[last], req_sorted[last], pos_sorted[last]
        out: dict[str, np.ndarray] = {}
        bounds = np.flatnonzero(np.diff(req_sorted)) + 1
        for rows, pos in zip(np.split(order, bounds), np.split(pos_sorted, bounds)):
            arr = np.zeros((int(pos[-1]) + 1,) + ids.shape[1:], dtype=ids.dtype)  # positions never routed stay 0
            arr[pos] = ids[rows]
            out[wanted[int(rows_of[rows[0]])]] = arr
        self.steps = [_Step(ids[keep], positions[keep], rows_of[keep], None)] if keep.any() else []
        for i in wanted:
            del self.request_index[self.request_ids.pop(i)]
        self._batch = None  # a popped id filed again gets a new index
        return out

    def known(self) -> list[str]:
        """Internal ids of the requests with rows held."""
        return list(self.request_index)

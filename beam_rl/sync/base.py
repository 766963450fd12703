"""Weight sync into running `vllm serve` servers: typed payloads, the strategy interface and its
registry, and the HTTP client for one server.

A strategy moves one `WeightUpdate` into one server and verifies it there (`apply`), and can put
the previous weights back (`rollback`, which is `apply` of the previous update for full weights).
The orchestrator (`beam_rl.sync.run`) pauses every server, applies, verifies, and only then
resumes; strategies never pause or resume.

Servers must run with `VLLM_SERVER_DEV_MODE=1` (`/pause`, `/resume`, `/collective_rpc`) and
`--worker-extension-cls beam_rl.rollout.worker.BeamWorkerExtension`; LoRA hot-loading also needs
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and `--enable-lora`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


class SyncError(RuntimeError):
    """One server could not be updated / verified / rolled back; the message names it and why."""


@dataclass(frozen=True)
class WeightUpdate:
    """What a server should serve after the update."""

    kind: str
    """"full" (every base-model tensor, a checkpoint directory) or "lora" (a PEFT adapter)"""
    path: str
    """directory the servers read (they share the filesystem on CPU / disk sync)"""
    checksums: dict[str, str] = field(default_factory=dict)
    """HF name -> `tensor_checksum` of what the sender wrote / points to (full updates)"""
    nbytes: int = 0
    """bytes a server reads for this update"""
    lora_name: str | None = None
    """name the adapter is served under (LoRA updates)"""
    manifest: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    """HF name -> (shape, dtype name) of every tensor (full updates): checked against each server's
    model before anything is paused"""


@dataclass(frozen=True)
class ServerReport:
    url: str
    seconds: float
    nbytes: int

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class ServerClient:
    """HTTP client for one vLLM OpenAI-compatible server (dev-mode routes included)."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = self._client()

    def _client(self):
        import httpx

        return httpx.Client(base_url=self.url, timeout=self.timeout_s)

    def _request(self, method: str, path: str, **kw):
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            self._reconnect()
            raise SyncError(f"{self.url}: {method} {path} failed: {type(e).__name__}: {e or 'no response'}") from e
        if r.status_code != 200:
            self._reconnect()  # a server may close the kept-alive connection after an error answer
            hint = ""
            if r.status_code == 404 and path in ("/pause", "/resume", "/collective_rpc", "/is_paused", "/get_world_size",
                                                 "/init_weight_transfer_engine", "/reset_prefix_cache"):
                hint = " (start the server with VLLM_SERVER_DEV_MODE=1)"
            if r.status_code == 404 and "lora" in path:
                hint = " (start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)"
            raise SyncError(f"{self.url}: {method} {path} returned {r.status_code}{hint}: {r.text[:400]}")
        return r

    def check(self) -> None:
        """Reachable, healthy and in dev mode."""
        self._request("GET", "/health")
        self._request("GET", "/is_paused")

    def _reconnect(self) -> None:
        """Drop the kept-alive connection: the next request opens a new one."""
        self._http.close()
        self._http = self._client()

    def state(self, wait_s: float = 10.0) -> str:
        """"serving", "paused" or "unreachable", asked of the server itself on new connections
        (retried for `wait_s` seconds), never inferred from an earlier request's failure."""
        import time

        import httpx

        deadline = time.monotonic() + wait_s
        while True:
            try:
                with httpx.Client(base_url=self.url, timeout=min(self.timeout_s, 10.0)) as http:
                    if http.get("/health").status_code == 200:
                        r = http.get("/is_paused")
                        if r.status_code == 200:
                            return "paused" if r.json().get("is_paused") else "serving"
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() >= deadline:
                return "unreachable"
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.state() != "unreachable"

    def weight_manifest(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF name -> (shape, dtype name) the server's model loads (identical on every worker)."""
        results = self.collective_rpc("beam_weight_manifest")
        if not results or not all(isinstance(r, dict) for r in results):
            raise SyncError(f"{self.url}: beam_weight_manifest returned {str(results)[:200]!r} (is the worker extension "
                            "--worker-extension-cls beam_rl.rollout.worker.BeamWorkerExtension loaded?)")
        return {name: (tuple(shape), dtype) for name, (shape, dtype) in results[0].items()}

    def pause(self, mode: str = "wait") -> None:
        self._request("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        """Drop the prefix cache (its KV may predate the weights now loaded), then resume."""
        self._request("POST", "/reset_prefix_cache")
        self._request("POST", "/resume")

    def collective_rpc(self, method: str, *args: str) -> list:
        body = {"method": method, "args": list(args), "timeout": self.timeout_s}
        return self._request("POST", "/collective_rpc", json=body).json()["results"]

    # vLLM's weight-transfer API (dev-mode routes; the server runs --weight-transfer-config)
    def world_size(self) -> int:
        """The server's workers: TP x PP x DP."""
        return int(self._request("GET", "/get_world_size", params={"include_dp": "true"}).json()["world_size"])

    def init_weight_transfer(self, init_info: dict, backend: str) -> None:
        try:
            self._request("POST", "/init_weight_transfer_engine", json={"init_info": init_info})
        except SyncError as e:
            if "not configured" in str(e) or "Invalid weight transfer backend" in str(e):
                raise SyncError(f"{e} (start the server with --weight-transfer-config '{{\"backend\": \"{backend}\"}}')") from e
            raise

    def start_weight_update(self) -> None:
        self._request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._request("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self) -> None:
        self._request("POST", "/finish_weight_update")

    def models(self) -> dict[str, dict]:
        return {m["id"]: m for m in self._request("GET", "/v1/models").json()["data"]}

    def load_lora(self, name: str, path: str, inplace: bool) -> None:
        self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, "load_inplace": inplace})

    def unload_lora(self, name: str) -> None:
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    def close(self) -> None:
        self._http.close()


class WeightSyncStrategy(ABC):
    """Moves a `WeightUpdate` into one (paused) server and verifies it there."""

    name: str = ""

    @abstractmethod
    def apply(self, server: ServerClient, update: WeightUpdate) -> ServerReport:
        """Load `update` into `server` and verify it; raise `SyncError` naming the server on failure."""

    def rollback(self, server: ServerClient, previous: WeightUpdate) -> None:
        """Put `previous` back (verified); raise `SyncError` if that is impossible."""
        self.apply(server, previous)


STRATEGIES: dict[str, type[WeightSyncStrategy]] = {}


def register_strategy(name: str):
    def deco(cls):
        cls.name = name
        STRATEGIES[name] = cls
        return cls

    return deco


def get_strategy(name: str, **kwargs) -> WeightSyncStrategy:
    import beam_rl.sync.disk  # noqa: F401  (registers)
    import beam_rl.sync.lora  # noqa: F401
    import beam_rl.sync.transfer  # noqa: F401  (nccl, gloo)

    if name not in STRATEGIES:
        raise ValueError(f"--strategy {name!r}: choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](**kwargs)


def _differences(want: dict, got: dict, labels: tuple[str, str, str], show=lambda n: n) -> str | None:
    """"; "-joined counts and examples of the names missing from `got`, extra in it and of another
    value (labels in that order; `show(name)` describes a differing entry), or None if they agree."""
    missing = [n for n in want if n not in got]
    extra = [n for n in got if n not in want]
    wrong = [show(n) for n in want if n in got and got[n] != want[n]]
    parts = [f"{len(names)} {label}, e.g. {names[:3]}" for names, label in zip((missing, extra, wrong), labels) if names]
    return "; ".join(parts) or None


def check_manifest(url: str, payload: dict[str, tuple[tuple[int, ...], str]], server: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Raise SyncError naming the first tensors whose name, shape or dtype does not fit the server's model."""
    payload = {n: (tuple(shape), dtype) for n, (shape, dtype) in payload.items()}
    server = {n: (tuple(shape), dtype) for n, (shape, dtype) in server.items()}
    why = _differences(server, payload, ("tensor(s) the server's model needs are missing",
                                         "tensor(s) the server's model has no place for", "tensor(s) of another shape or dtype"),
                       show=lambda n: f"{n}: {payload[n][0]} {payload[n][1]} (the server's model loads {server[n][0]} {server[n][1]})")
    if why:
        raise SyncError(f"{url}: the update does not fit the served model (nothing was paused): {why}")


def compare_checksums(url: str, expected: dict[str, str], received: dict[str, str]) -> None:
    """Raise SyncError naming the first tensors a server received differently from what was sent."""
    why = _differences(expected, received, ("tensor(s) not received", "unexpected tensor(s)", "checksum mismatch(es)"))
    if why:
        raise SyncError(f"{url}: verification failed: {why}")

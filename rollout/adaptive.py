"""Adaptive verification for DFlash2 drafts: how many draft tokens of each request to verify.

Verifying a draft token costs target compute whether or not it is accepted; at high concurrency the
tail of long drafts is rarely accepted and slows every step. Per step:

1. Confidence: f = logit(max q) of each draft position's temperature-scaled proposal q (for DFlash2
   the softmax over the walked row's candidates), clamped to +-40. It depends on q only, not on the
   drawn token, so dropping positions keeps rejection sampling exact.
2. Acceptance estimate: p_k = sigmoid(w * f + b_k) per draft position k (w >= 0 shared, b_k per
   position; w = 0.5, b_k = -0.2 at the start), fitted online: a request's accepted positions are
   labelled 1, its first rejected position 0, positions after it are unlabelled. Every
   `refit_every` observed steps a ridge-regularised Newton (IRLS) fit moves the parameters towards
   the fit by the damping n / (n + 50) of n labelled positions.
3. Survival: S_k = prod_{j <= k} p_j, the estimated chance that draft token k is accepted.
4. Budget: B draft tokens for the whole batch, maximising expected tokens per millisecond
       (n_requests + sum of the B largest S) / (draft_ms(n_requests) + verify_ms(n_requests + B))
   with the two costs measured at start-up (`CostTable`: the padded size's median time). S falls
   along each request's draft, so the global top-B is a prefix of every request's draft
   (`admitted_prefix`).

This follows the design of vLLM 0.33's adaptive verification (`acceptance_estimator.py`,
`adaptive_verification.py`) for the vLLM 0.26 plugin; `fixed` verification is the switch's other
setting (every request verifies its whole draft). Where 0.33 profiles the costs at start-up and
applies the budget on the device, here the costs are fitted on the engine's own steps (`StepCosts`)
and each request's drafts are truncated on the host before the scheduler sees them
(`AdaptiveVerifier`, installed by `BeamWorkerExtension.beam_start_adaptive_verification`), which
needs synchronous scheduling.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

CONFIDENCE_CLAMP = 40.0


def confidence(proposal_max: torch.Tensor) -> torch.Tensor:
    """f = logit(max q), clamped to +-CONFIDENCE_CLAMP (q = 1 gives +40, not inf)."""
    q = proposal_max.double().clamp(1e-300, 1.0)
    return torch.clamp(torch.log(q) - torch.log1p(-q), -CONFIDENCE_CLAMP, CONFIDENCE_CLAMP)


def survival(p: torch.Tensor) -> torch.Tensor:
    """S [R, K] = cumulative product of the acceptance estimates along each draft."""
    return torch.cumprod(p.double(), dim=-1)


@dataclass
class AcceptanceEstimator:
    num_positions: int
    w: float = 0.5
    b: torch.Tensor | None = None
    refit_every: int = 100
    ridge: float = 1e-3
    damping_count: float = 50.0
    _f: list[float] = field(default_factory=list)
    _k: list[int] = field(default_factory=list)
    _y: list[float] = field(default_factory=list)
    _steps: int = 0

    def __post_init__(self):
        if self.b is None:
            self.b = torch.full((self.num_positions,), -0.2, dtype=torch.float64)

    def probabilities(self, f: torch.Tensor) -> torch.Tensor:
        """p [R, K] for confidences f [R, K]."""
        return torch.sigmoid(self.w * f.double() + self.b[: f.shape[-1]])

    def observe(self, f: torch.Tensor, accepted: torch.Tensor, drafted: torch.Tensor | None = None) -> None:
        """One verification step: confidences f [R, K] and each request's accepted count [R] out of
        its `drafted` (default K) verified positions."""
        R, K = f.shape
        drafted = torch.full((R,), K) if drafted is None else drafted
        for r in range(R):
            n_acc, n_ver = int(accepted[r]), int(drafted[r])
            if not 0 <= n_acc <= n_ver <= K:
                raise ValueError(f"request {r}: accepted {n_acc} of {n_ver} verified positions (K = {K})")
            for k in range(min(n_acc + 1, n_ver)):
                self._f.append(float(f[r, k]))
                self._k.append(k)
                self._y.append(1.0 if k < n_acc else 0.0)
        self._steps += 1
        if self._steps % self.refit_every == 0:
            self.refit()

    def refit(self, iterations: int = 25) -> None:
        """Ridge-regularised Newton (IRLS) fit of (w, b) on every labelled position, w kept >= 0,
        applied with the damping n / (n + damping_count)."""
        n = len(self._y)
        if n == 0:
            return
        f = torch.tensor(self._f, dtype=torch.float64)
        k = torch.tensor(self._k)
        y = torch.tensor(self._y, dtype=torch.float64)
        X = torch.zeros(n, 1 + self.num_positions, dtype=torch.float64)  # columns: f, one-hot position
        X[:, 0] = f
        X[torch.arange(n), 1 + k] = 1.0
        theta = torch.cat([torch.tensor([self.w], dtype=torch.float64), self.b.clone()])
        reg = self.ridge * torch.eye(theta.shape[0], dtype=torch.float64)
        for _ in range(iterations):
            mu = torch.sigmoid(X @ theta)
            grad = X.t() @ (mu - y) + reg @ theta
            hess = X.t() @ (X * (mu * (1 - mu))[:, None]) + reg
            step = torch.linalg.solve(hess, grad)
            theta = theta - step
            theta[0] = theta[0].clamp_min(0.0)
            if float(step.abs().max()) < 1e-10:
                break
        d = n / (n + self.damping_count)
        self.w = float((1 - d) * self.w + d * theta[0])
        self.b = (1 - d) * self.b + d * theta[1:]


@dataclass(frozen=True)
class CostTable:
    """Measured milliseconds at profiled sizes; a size costs what the next profiled size up costs
    (the step function of CUDA-graph padding). Sizes beyond the last are refused."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self):
        if not self.sizes or len(self.sizes) != len(self.ms) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError("CostTable: sizes must be strictly increasing, one time per size")

    def __call__(self, n: int) -> float:
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise ValueError(f"CostTable: size {n} is beyond the profiled {self.sizes[-1]}")
        return self.ms[i]


def choose_budget(S: torch.Tensor, draft_ms: CostTable, verify_ms: CostTable, max_tokens: int | None = None) -> int:
    """The B in 0..R*K maximising (R + sum of the B largest S) / (draft_ms(R) + verify_ms(R + B)),
    R the requests of S [R, K]; the smallest B on ties. `max_tokens` caps R + B (the largest
    verification batch the engine takes)."""
    R = S.shape[0]
    top = torch.sort(S.reshape(-1).double(), descending=True).values
    gain = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(top, 0)])
    limit = S.numel() if max_tokens is None else max(0, min(S.numel(), max_tokens - R))
    best, best_rate = 0, -1.0
    d = draft_ms(R)
    for B in range(limit + 1):
        rate = (R + float(gain[B])) / (d + verify_ms(R + B))
        if rate > best_rate + 1e-15:
            best, best_rate = B, rate
    return best


def admitted_prefix(S: torch.Tensor, budget: int) -> torch.Tensor:
    """Per request, how many leading draft tokens fall in the global top-`budget` of S [R, K]
    (S falls along each draft, so they form a prefix; ties broken by request then position)."""
    R, K = S.shape
    if budget <= 0:
        return torch.zeros(R, dtype=torch.long)
    flat = S.reshape(-1).double()
    order = sorted(range(R * K), key=lambda i: (-float(flat[i]), i))[:budget]
    counts = torch.zeros(R, dtype=torch.long)
    for i in order:
        counts[i // K] += 1
    return counts


@dataclass
class StepCosts:
    """ms of one engine step, fitted online as a + b * verified tokens + c * requests (least squares
    over the last `window` steps): the verified tokens' marginal cost b against what a step costs
    regardless, measured on the running engine (host work included: under synchronous scheduling it
    is part of every step). Until `min_steps` steps are in, nothing is known (None)."""

    window: int = 64
    min_steps: int = 8
    fixed: tuple[float, float, float] | None = None
    """(a, b, c) given instead of fitted (tests; costs measured elsewhere)."""
    _rows: list[tuple[float, float, float]] = field(default_factory=list)

    def add(self, tokens: int, requests: int, ms: float) -> None:
        self._rows.append((float(tokens), float(requests), float(ms)))
        del self._rows[: -self.window]

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c), b and c at least 0; None before `min_steps` steps or with no spread in tokens."""
        if self.fixed is not None:
            return self.fixed
        if len(self._rows) < self.min_steps:
            return None
        t, r, ms = (torch.tensor(col, dtype=torch.float64) for col in zip(*self._rows))
        if float(t.max() - t.min()) == 0:
            return None
        X = torch.stack([torch.ones_like(t), t, r], dim=1)
        theta = torch.linalg.lstsq(X, ms[:, None]).solution[:, 0]
        a, b, c = (float(v) for v in theta)
        return a, max(b, 0.0), max(c, 0.0)

    def tables(self, requests: int, max_drafts: int) -> tuple[CostTable, CostTable] | None:
        """`choose_budget`'s (draft_ms, verify_ms) for `requests` requests of up to `max_drafts` draft
        tokens in all: what the step costs at no drafts, and each verified token's share."""
        got = self.fit()
        if got is None:
            return None
        a, b, c = got
        sizes = tuple(range(requests, requests + max_drafts + 1))
        return CostTable((requests,), (max(a + c * requests, 1e-6),)), CostTable(sizes, tuple(b * n for n in sizes))


class AdaptiveVerifier:
    """Adaptive verification of a running engine's drafts, step by step:
    `plan` (after drafting): each request's confidences -> how many of its draft tokens to verify
    (`choose_budget` over the survival estimates, `admitted_prefix`; everything until the costs are
    known); `observe` (after verification): each request's accepted count for the estimator, and
    the step's time for the costs."""

    def __init__(self, num_positions: int, max_tokens: int | None = None, costs: StepCosts | None = None):
        self.estimator = AcceptanceEstimator(num_positions)
        self.costs = costs or StepCosts()
        self.max_tokens = max_tokens
        self._pending: dict[str, torch.Tensor] = {}  # request -> the confidences of the drafts it verifies next
        self.verified = self.drafted = 0

    def plan(self, req_ids: list[str], f: torch.Tensor) -> list[int]:
        """Confidences f [R, K] of the requests' drafts (rows in `req_ids` order) -> tokens to verify per request."""
        R, K = f.shape
        S = survival(self.estimator.probabilities(f))
        tables = self.costs.tables(R, R * K)
        counts = [K] * R
        if tables is not None:
            counts = admitted_prefix(S, choose_budget(S, *tables, max_tokens=self.max_tokens)).tolist()
        for r, req in enumerate(req_ids):
            self._pending[req] = f[r, : counts[r]]
        self.drafted += R * K
        self.verified += sum(counts)
        return counts

    def observe(self, accepted: dict[str, int], step_ms: float | None = None, tokens: int = 0) -> None:
        """The verification step's accepted draft tokens per request (requests that verified drafts),
        and, when timed, its ms for `tokens` scheduled tokens."""
        rows = [(self._pending.pop(req), n) for req, n in accepted.items() if req in self._pending]
        rows = [(f, n) for f, n in rows if f.numel()]
        if rows:
            K = max(f.numel() for f, _ in rows)
            F = torch.zeros(len(rows), K, dtype=torch.float64)
            for i, (f, _) in enumerate(rows):
                F[i, : f.numel()] = f.double()
            self.estimator.observe(F, torch.tensor([min(n, f.numel()) for f, n in rows]),
                                   torch.tensor([f.numel() for f, _ in rows]))
        if step_ms is not None:
            self.costs.add(tokens, len(accepted), step_ms)

    def forget(self, req_ids) -> None:
        for req in req_ids:
            self._pending.pop(req, None)

"""Where samples come from: an in-process vLLM `LLM`, or running OpenAI-compatible servers.

Both return, per prompt, n `Sample`s (text, token count, finish reason). The sampling options
mirror DAPO's validation setting (verl `recipe/dapo` scripts: `temperature=1.0`,
`val_top_p=0.7`, `top_k=-1`, `max_response_length=1024 * 20`); a request's seed is
`seed + problem index`, so results do not depend on which server answers.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    n: int = 8
    """samples per problem (avg@n / maj@n)"""
    temperature: float = 1.0
    """DAPO's validation temperature"""
    top_p: float = 0.7
    """DAPO's `val_top_p`"""
    max_tokens: int = 20480
    """DAPO's max response length (1024 * 20); lower it for small models / CPU"""
    seed: int = 0
    """request seed = seed + problem index (vLLM gives sample i of a request seed + i)"""

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n={self.n}: use --n >= 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: use 0 < --top-p <= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: use --temperature >= 0")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: use --max-tokens >= 1")


@dataclass(frozen=True)
class Sample:
    text: str
    num_tokens: int
    finish_reason: str | None


class InProcessSampler:
    """Samples from a running `RolloutEngine` (`beam_rl.engines`). With `tokenizer` (an HF
    tokenizer), prompts are encoded and outputs decoded here, so an engine without a tokenizer works."""

    def __init__(self, engine, tokenizer=None):
        self.engine, self.tokenizer = engine, tokenizer

    def sample(self, prompts: list[str], cfg: SamplingConfig, progress=None) -> list[list[Sample]]:
        from beam_rl.engines import Sampling

        sampling = [Sampling(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed + i)
                    for i in range(len(prompts))]
        inputs = [self.tokenizer.encode(p) for p in prompts] if self.tokenizer is not None else prompts
        outputs = self.engine.complete(inputs, sampling, n=cfg.n, progress=progress is not None)
        result = []
        for completions in outputs:
            samples = []
            for c in completions:
                text = self.tokenizer.decode(list(c.token_ids), skip_special_tokens=True) if self.tokenizer is not None else c.text
                samples.append(Sample(text, len(c.token_ids), c.finish_reason))
            result.append(samples)
        if progress is not None:
            progress.update(len(prompts))
        return result


class ServerSampler:
    """Samples from running OpenAI-compatible vLLM servers (`/v1/completions`), one request of
    n samples per problem, spread round-robin over `urls` with `concurrency` requests in flight
    per server."""

    def __init__(self, urls: list[str], model: str | None = None, concurrency: int = 4, timeout_s: float = 3600.0):
        import httpx

        if not urls:
            raise ValueError("ServerSampler needs at least one --server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self._client = httpx.Client(timeout=timeout_s)
        self.model = model or self._served_model(self.urls[0])
        self._lock = threading.Lock()

    def _served_model(self, url: str) -> str:
        r = self._client.get(f"{url}/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def _complete(self, url: str, prompt: str, cfg: SamplingConfig, seed: int) -> list[Sample]:
        body = {"model": self.model, "prompt": prompt, "n": cfg.n, "temperature": cfg.temperature, "top_p": cfg.top_p,
                "max_tokens": cfg.max_tokens, "seed": seed, "return_token_ids": True}
        r = self._client.post(f"{url}/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: /v1/completions returned {r.status_code}: {r.text[:300]}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        return [Sample(c["text"], len(c.get("token_ids") or []), c.get("finish_reason")) for c in choices]

    def sample(self, prompts: list[str], cfg: SamplingConfig, progress=None) -> list[list[Sample]]:
        result: list[list[Sample] | None] = [None] * len(prompts)
        with ThreadPoolExecutor(max_workers=self.concurrency * len(self.urls)) as pool:
            futures = {pool.submit(self._complete, self.urls[i % len(self.urls)], p, cfg, cfg.seed + i): i
                       for i, p in enumerate(prompts)}
            for fut in as_completed(futures):
                result[futures[fut]] = fut.result()
                if progress is not None:
                    with self._lock:
                        progress.update(1)
        return result  # type: ignore[return-value]

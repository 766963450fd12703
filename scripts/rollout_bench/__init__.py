"""The pieces of `scripts/bench_rollout.py`: `harness` (one build's process), `host_probe` (host speed),
`report` (summary keys and tables)."""

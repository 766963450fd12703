"""DAPO with Rollout Routing Replay: advantages, losses, dynamic sampling, overlong shaping, the
one-node loop (vLLM rollout -> reward -> Megatron training with R3 -> verified weight sync)."""

"""beam-rl: DAPO post-training of Reflection's Beam MoE with Rollout Routing Replay (R3).

Layers: `beam_rl.model` (the spec), `beam_rl.kernels` and `beam_rl.rollout` (vLLM side),
`beam_rl.megatron` (trainer side), `beam_rl.r3` (the routing contract between them),
`beam_rl.engines` (the one interface the loops use), then `dapo`, `gap`, `eval`, `sync`, `skyrl`.
"""

__version__ = "0.1.0"

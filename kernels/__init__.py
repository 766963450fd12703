"""Fused Triton kernels for Beam (installed as `beam_rl.kernels`).

Each op has a Triton kernel used on CUDA and falls back to its PyTorch reference in
`beam_rl.numerics` / `beam_rl.routing` elsewhere; both implement the same rounding contract.
"""

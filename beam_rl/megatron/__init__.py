"""Beam on Megatron-Core: provider, layer spec, R3 replay, HF conversion, LoRA, MXFP8, log-probs."""

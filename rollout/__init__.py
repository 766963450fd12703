"""Beam as a vLLM model plugin (installed as `beam_rl.rollout`)."""

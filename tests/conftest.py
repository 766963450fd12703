"""Shared fixtures: one seeded beam-tiny reference model per session (engines are expensive)."""

import pytest
import torch

from beam_rl.checkpoint import build_model, save_checkpoint
from beam_rl.presets import get_preset


@pytest.fixture(scope="session")
def tiny_config():
    return get_preset("beam-tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    """Seeded BF16 beam-tiny reference model (do not mutate: shared by the session)."""
    return build_model(tiny_config, seed=0, dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model, tmp_path_factory):
    return save_checkpoint(tiny_model, tmp_path_factory.mktemp("ckpt") / "beam-tiny")


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)

"""Shared fixtures: one tiny model per test session (built locally, no download)."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from asyncrl.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden_size=64, num_layers=2)

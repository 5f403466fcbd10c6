"""Shared fixtures: one tiny model per test session (built locally, no download); loguru capture."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from asyncrl.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), hidden_size=64, num_layers=2)


@pytest.fixture
def caplog_loguru():
    """The messages loguru logs during the test (pytest's caplog does not see loguru)."""
    from loguru import logger

    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="DEBUG")
    yield messages
    logger.remove(sink)

"""Fixtures shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.warm_model import build_warm_model, shared_warm_model


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory, worker_id) -> Path:
    """The demo's warm-up (`warm_model.build_warm_model`): a tiny model taken past SFT's drop in loss.

    Built once per session: under pytest-xdist the workers share it (the first builds it, under a file lock)."""
    if worker_id == "master":
        return build_warm_model(tmp_path_factory.mktemp("warm"))
    return shared_warm_model(tmp_path_factory.getbasetemp().parent / "warm")  # this session's, above the workers'

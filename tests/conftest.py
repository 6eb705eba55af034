"""Shared test setup.

* ``@pytest.mark.gpu`` tests are skipped when ``torch.cuda.is_available()`` is False
  (CUDA or ROCm builds of torch both report through ``torch.cuda``).
* ``device`` fixture: every test that takes it runs on "cpu", and also on "cuda" when a GPU
  is there.
* The CLI's output is read as plain text: typer forces colour codes into it where
  FORCE_COLOR, PY_COLORS or GITHUB_ACTIONS is set (read when typer is imported), which splits
  the messages the tests look for, so they are dropped here, before any test imports cpa.cli.
"""

from __future__ import annotations

import os

import pytest
import torch

for _var in ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS"):
    os.environ.pop(_var, None)

HAS_GPU = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_GPU else [])


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)

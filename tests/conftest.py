"""Shared fixtures. GPU tests (``@pytest.mark.gpu``) are skipped, not failed,
where no CUDA device exists, so CI on CPU machines stays green."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

import imp_mem

# "ci" runs the property tests with enough cases to mean something; "dev" is
# quicker for a local loop (IMP_MEM_HYPOTHESIS=dev).
settings.register_profile("ci", max_examples=1000, deadline=None, derandomize=False)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("IMP_MEM_HYPOTHESIS", "ci"))


def pytest_collection_modifyitems(config, items):
    if imp_mem.cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (cuda_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake() -> imp_mem.FakeBackend:
    """A 64 MiB backed fake with page granularity."""
    return imp_mem.FakeBackend(capacity=64 << 20, granularity=4096)

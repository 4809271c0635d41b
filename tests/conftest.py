"""Shared fixtures. GPU tests (``@pytest.mark.gpu``) are skipped, not failed,
where no CUDA device exists, so CI on CPU machines stays green."""

from __future__ import annotations

import os
import sys

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


@pytest.fixture(params=["buffer", "copy"])
def token_path(request) -> str:
    """Runs a test with token buffers read both ways: in place through the
    buffer protocol ("buffer", Python 3.11+ only) and copied through
    ``tobytes()`` ("copy", the path before 3.11); restores the default."""
    if request.param == "buffer" and sys.version_info < (3, 11):
        pytest.skip("the buffer protocol is in the stable ABI from Python 3.11")
    was = imp_mem._core._set_buffer_protocol(request.param == "buffer")
    yield request.param
    imp_mem._core._set_buffer_protocol(was)

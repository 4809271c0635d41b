"""Shared fixtures. GPU tests (``@pytest.mark.gpu``) are skipped, not failed,
where no CUDA device exists, so CI on CPU machines stays green."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
from _helpers import make_plan
from hypothesis import settings

import imp_mem

# "ci" runs the property tests with enough cases to mean something; "dev" is
# quicker for a local loop (IMP_MEM_HYPOTHESIS=dev).
settings.register_profile("ci", max_examples=1000, deadline=None, derandomize=False)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("IMP_MEM_HYPOTHESIS", "ci"))

# Without a CUDA device the paged kernel's tests run Triton's interpreter.
# Triton reads the flag when it is first imported, and the GPU test modules
# (collected before the CPU ones) import it, so it is set here, first.
if not imp_mem.cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture
def plan() -> imp_mem.MemoryPlan:
    """The small llama shape's plan (``_helpers.make_plan()``): 1 GiB, KV fit."""
    return make_plan()


@pytest.fixture(params=["direct", "buffer", "copy"])
def token_path(request) -> str:
    """Runs a test with token buffers read every way: int32/uint32 NumPy
    arrays straight from the array ("direct"; other buffers as in "buffer"
    where it exists, else "copy"), every buffer in place through the buffer
    protocol ("buffer", Python 3.11+ only), and copied through ``tobytes()``
    ("copy", the path before 3.11); restores the defaults."""
    with imp_mem_token_path(request.param):
        yield request.param


@pytest.fixture(scope="session")
def use_token_path():
    """The context manager behind `token_path`, for a test that runs every
    path itself: ``with use_token_path("copy"): ...``."""
    return imp_mem_token_path


@contextlib.contextmanager
def imp_mem_token_path(name: str):
    """Reads token buffers the way `name` says (see `token_path`)."""
    if name == "buffer" and sys.version_info < (3, 11):
        pytest.skip("the buffer protocol is in the stable ABI from Python 3.11")
    core = imp_mem._core
    direct = core._set_numpy_direct(name == "direct")
    buffer = core._set_buffer_protocol(
        name == "buffer" or (name == "direct" and sys.version_info >= (3, 11))
    )
    try:
        if name == "direct":
            assert core._numpy_direct_active(), "NumPy is imported: the direct reader must be on"
        yield
    finally:
        core._set_buffer_protocol(buffer)
        core._set_numpy_direct(direct)


# An engine's cold boot measures its warm-up in a probe child (issue 25):
# seconds per engine, across the GPU tests' dozens of engines. The probe's
# own test turns it on where it checks it.
os.environ.setdefault("IMP_MEM_WARMUP_PROBE", "0")

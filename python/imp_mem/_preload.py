"""imp-mem's LD_PRELOAD interposer, from Python: where it is, whether it is in
this process, and the per-thread scope that routes ``cudaMalloc`` to imp-mem.

The interposer (``libimp_mem_preload.so``, in this package beside
``_core.abi3.so``; built from ``crates/imp-mem-preload``) defines the two
runtime entry points torch_memory_saver's preload library defines,
``cudaMalloc`` and ``cudaFree``. Started with it in ``LD_PRELOAD``, a
process's every library that calls them through the dynamic linker (torch's
caching allocator, NCCL, cuBLAS, a training framework) calls the interposer
first:

* inside :func:`routing` (on that thread), ``cudaMalloc`` goes to imp-mem's
  hook malloc (``imp_mem_torch_malloc``), which allocates from the thread's
  hook region (``imp_mem.torch._hook_region``) on the current device, or
  returns ``cudaErrorMemoryAllocation``; outside, the real ``cudaMalloc``
  runs;
* ``cudaFree`` of a pointer imp-mem handed out goes home to imp-mem from any
  thread, routed or not (after a device synchronisation, as the real
  ``cudaFree`` does); any other pointer goes to the real ``cudaFree``.

Python loads ``_core`` with ``RTLD_LOCAL``, so the interposer cannot find
imp-mem's hooks itself: :func:`routing` hands their addresses over once
(``imp_mem_preload_register``). torch's caching allocator keeps what it got
inside a region in its cache and may serve a later allocation outside the
region from it: empty torch's cache (``torch.cuda.empty_cache()``) where
that matters, as with torch_memory_saver's preload mode.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from imp_mem.errors import BackendUnavailable

LIBRARY_NAME = "libimp_mem_preload.so"
"""The interposer's file name inside the ``imp_mem`` package."""

_REGISTER_SYMBOL = "imp_mem_preload_register"
_register_lock = threading.Lock()
_registered = False


def library_path() -> str:
    """The absolute path of the interposer shipped in the wheel
    (``imp_mem/libimp_mem_preload.so``). Raises BackendUnavailable where it is
    absent (a build for another system than Linux, or a source checkout whose
    Rust was never built)."""
    path = Path(__file__).resolve().parent / LIBRARY_NAME
    if not path.is_file():
        raise BackendUnavailable(
            f"imp-mem's LD_PRELOAD interposer is not installed ({path} is missing): it is "
            "built with the extension on Linux; reinstall imp-mem (pip install imp-mem, or "
            "`pip install .` / `maturin build` in a checkout, which runs crates/imp-mem-py/"
            "build.rs)"
        )
    return str(path)


def _global_scope() -> ctypes.CDLL:
    """The process's global symbol scope (``dlopen(NULL)``): an LD_PRELOADed
    library's symbols are found there first."""
    return ctypes.CDLL(None)


def loaded() -> bool:
    """Whether the interposer is in this process's global scope, ahead of the
    runtime: that is, the process was started with it in ``LD_PRELOAD``."""
    return hasattr(_global_scope(), _REGISTER_SYMBOL)


def _interposer() -> ctypes.CDLL:
    if not loaded():
        raise BackendUnavailable(
            "imp_mem._preload.routing() needs the interposer LD_PRELOADed into this process; "
            f"start it with LD_PRELOAD={_path_for_message()} (a child process: "
            "imp_mem._preload.configure_subprocess() or subprocess_env())"
        )
    return _global_scope()


def _path_for_message() -> str:
    try:
        return library_path()
    except BackendUnavailable:
        return f"<imp_mem package>/{LIBRARY_NAME} (not installed)"


def _register(lib: ctypes.CDLL) -> None:
    """Hands imp-mem's hook addresses to the interposer, once per process."""
    global _registered
    with _register_lock:
        if _registered:
            return
        from imp_mem import _core

        addresses = _core.hook_addresses()
        register = getattr(lib, _REGISTER_SYMBOL)
        register.restype = ctypes.c_int
        register.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        rc = register(addresses[_core.TORCH_MALLOC_SYMBOL], addresses[_core.FREE_OWNED_SYMBOL])
        if rc != 0:
            raise BackendUnavailable(
                f"imp-mem's interposer refused imp-mem's hook addresses (cudaError {rc})"
            )
        _registered = True


def _depth_call(lib: ctypes.CDLL, name: str) -> int:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_int, []
    return int(fn())


@contextlib.contextmanager
def routing() -> Iterator[None]:
    """On the calling thread while inside, ``cudaMalloc`` goes to imp-mem's
    hooks (the thread's hook region, as ``imp_mem.torch._hook_region`` sets
    it); scopes nest (a per-thread depth). Raises BackendUnavailable unless
    :func:`loaded`. A pointer imp-mem handed out is freed at home whichever
    thread frees it, inside a scope or not."""
    lib = _interposer()
    _register(lib)
    if _depth_call(lib, "imp_mem_preload_enter") < 1:
        raise BackendUnavailable("imp-mem's interposer could not route this thread")
    try:
        yield
    finally:
        _depth_call(lib, "imp_mem_preload_exit")


def _depth() -> int:
    """The calling thread's routing depth (0 where the interposer is absent)."""
    return _depth_call(_global_scope(), "imp_mem_preload_depth") if loaded() else 0


def _split(preload: str) -> list[str]:
    # ld.so separates LD_PRELOAD entries with colons or spaces.
    return [p for p in preload.replace(" ", ":").split(":") if p]


def subprocess_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) whose ``LD_PRELOAD`` starts
    with :func:`library_path` (listed once; the other entries kept, in
    order). Raises BackendUnavailable where the interposer is absent."""
    path = library_path()
    out = dict(os.environ if env is None else env)
    rest = [p for p in _split(out.get("LD_PRELOAD", "")) if p != path]
    out["LD_PRELOAD"] = ":".join([path, *rest])
    return out


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """While inside, ``os.environ["LD_PRELOAD"]`` starts with the interposer,
    so child processes started then load it (this process is unchanged: a
    preload is read at a process's start). Restored after, removed where it
    was unset."""
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = subprocess_env()["LD_PRELOAD"]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before

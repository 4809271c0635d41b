"""GPU benchmarks for the CUDA backends, each printed beside its peer, in one
run, as a ratio (ours / peer; < 1 is faster).

* VMM growth event (``Region.commit`` by one chunk, handle cache off) against
  the raw driver doing the same work for the same chunk: ``cuMemCreate`` +
  ``cuMemMap`` + ``cuMemSetAccess``, called from Python through ctypes on
  libcuda (and through cuda-python when it is installed). Goal <= 1.1x.
  CuPy's ``cupy.cuda.driver`` has no VMM calls, so it cannot be the peer.
* The same growth served from the handle cache (informative: no cuMemCreate).
* VMM decommit event (unmap + release of one chunk) against the raw driver.
* ``CudaBackend`` acquire + release against ``torch.empty`` + ``del`` on the
  caching allocator, and against raw ``cuMemAlloc`` + ``cuMemFree``: the
  backend is a load-time allocator (the tiers above it pool), so the torch
  ratio is expected to be far above 1; the raw ratio is its overhead.

Usage: ``python benches/bench_cuda.py [--json out.json] [--quick]``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench_json import write_json

import imp_mem

MIB = 1 << 20


# --------------------------------------------------------------------------
# The raw driver through ctypes: the peer.
# --------------------------------------------------------------------------


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class RawDriver:
    """The VMM and allocation calls, straight from libcuda."""

    name = "ctypes"

    def __init__(self, device: int = 0):
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size = ctypes.c_ulonglong, ctypes.c_size_t
        p64 = ctypes.POINTER(u64)
        sig = {
            "cuMemAddressReserve": [p64, size, size, u64, u64],
            "cuMemAddressFree": [u64, size],
            "cuMemCreate": [p64, size, ctypes.POINTER(_Prop), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size, size, u64, u64],
            "cuMemUnmap": [u64, size],
            "cuMemSetAccess": [u64, size, ctypes.POINTER(_Access), size],
            "cuMemAlloc_v2": [p64, size],
            "cuMemFree_v2": [u64],
        }
        self.f = {}
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
            self.f[name] = fn
        self.prop = _Prop(type=1, requestedHandleTypes=0, location=_Location(type=1, id=device))
        self.access = _Access(location=_Location(type=1, id=device), flags=3)
        self._out = u64(0)

    def _ok(self, rc: int, call: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{call} failed with CUresult {rc}")

    def reserve(self, nbytes: int) -> int:
        self._ok(self.f["cuMemAddressReserve"](ctypes.byref(self._out), nbytes, 0, 0, 0), "reserve")
        return self._out.value

    def address_free(self, ptr: int, nbytes: int) -> None:
        self._ok(self.f["cuMemAddressFree"](ptr, nbytes), "address free")

    def grow(self, addr: int, nbytes: int) -> int:
        """One growth event: create + map + set access. Returns the handle."""
        f = self.f
        self._ok(
            f["cuMemCreate"](ctypes.byref(self._out), nbytes, ctypes.byref(self.prop), 0), "create"
        )
        handle = self._out.value
        self._ok(f["cuMemMap"](addr, nbytes, 0, handle, 0), "map")
        self._ok(f["cuMemSetAccess"](addr, nbytes, ctypes.byref(self.access), 1), "access")
        return handle

    def shrink(self, addr: int, nbytes: int, handle: int) -> None:
        self._ok(self.f["cuMemUnmap"](addr, nbytes), "unmap")
        self._ok(self.f["cuMemRelease"](handle), "release")

    def alloc(self, nbytes: int) -> int:
        self._ok(self.f["cuMemAlloc_v2"](ctypes.byref(self._out), nbytes), "alloc")
        return self._out.value

    def free(self, ptr: int) -> None:
        self._ok(self.f["cuMemFree_v2"](ptr), "free")


class CudaPythonDriver:
    """The same growth event through cuda-python, when it is installed."""

    name = "cuda-python"

    def __init__(self, device: int = 0):
        try:
            from cuda.bindings import driver as cu  # cuda-python >= 12.8
        except ImportError:
            from cuda import cuda as cu  # older cuda-python
        self.cu = cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.prop, self.access = prop, access
        self.ok = cu.CUresult.CUDA_SUCCESS

    def grow(self, addr: int, nbytes: int):
        cu = self.cu
        err, handle = cu.cuMemCreate(nbytes, self.prop, 0)
        if err != self.ok:
            raise RuntimeError(f"cuMemCreate: {err}")
        (err,) = cu.cuMemMap(addr, nbytes, 0, handle, 0)
        if err != self.ok:
            raise RuntimeError(f"cuMemMap: {err}")
        (err,) = cu.cuMemSetAccess(addr, nbytes, [self.access], 1)
        if err != self.ok:
            raise RuntimeError(f"cuMemSetAccess: {err}")
        return handle

    def shrink(self, addr: int, nbytes: int, handle) -> None:
        self.cu.cuMemUnmap(addr, nbytes)
        self.cu.cuMemRelease(handle)


# --------------------------------------------------------------------------
# Measurement helpers
# --------------------------------------------------------------------------


def median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1000.0


def timed(fn: Callable[[], Any]) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


ROWS: list[dict[str, Any]] = []


def row(name: str, ours_us: float, peer: str, peer_us: float, goal: str = "") -> None:
    ratio = ours_us / peer_us if peer_us > 0 else float("inf")
    ROWS.append(
        {
            "benchmark": name,
            "ours_us": round(ours_us, 2),
            "peer": peer,
            "peer_us": round(peer_us, 2),
            "ratio": round(ratio, 3),
            "goal": goal,
        }
    )


def bench_growth(chunk: int, chunks: int, rounds: int, peers: list[Any]) -> None:
    """Growth and decommit events, ours and the peers' interleaved per round."""
    ours = imp_mem.VmmBackend(0, chunk_bytes=chunk, cache_chunks=0)
    warm = imp_mem.VmmBackend(0, chunk_bytes=chunk, cache_chunks=chunks)
    region = ours.acquire_growable(chunks * chunk, 0, tag="kv_cache")
    warm_region = warm.acquire_growable(chunks * chunk, 0, tag="kv_cache")
    raw = peers[0]
    raw_bases = {p.name: raw.reserve(chunks * chunk) for p in peers}
    grow = {"ours": [], "warm": [], **{p.name: [] for p in peers}}
    shrink = {"ours": [], **{p.name: [] for p in peers}}
    # Warm the handle cache once.
    warm_region.commit(chunks * chunk)
    warm.record_fence(0).wait()
    warm_region.decommit(0)
    for _ in range(rounds):
        for i in range(chunks):
            grow["ours"].append(timed(lambda i=i: region.commit((i + 1) * chunk)))
        ours.record_fence(0).wait()
        for i in reversed(range(chunks)):
            shrink["ours"].append(timed(lambda i=i: region.decommit(i * chunk)))
        for i in range(chunks):
            grow["warm"].append(timed(lambda i=i: warm_region.commit((i + 1) * chunk)))
        warm.record_fence(0).wait()
        warm_region.decommit(0)
        for p in peers:
            base = raw_bases[p.name]
            handles = []
            for i in range(chunks):
                t0 = time.perf_counter_ns()
                handles.append(p.grow(base + i * chunk, chunk))
                grow[p.name].append(time.perf_counter_ns() - t0)
            for i in reversed(range(chunks)):
                t0 = time.perf_counter_ns()
                p.shrink(base + i * chunk, chunk, handles[i])
                shrink[p.name].append(time.perf_counter_ns() - t0)
    mib = chunk // MIB
    for p in peers:
        row(
            f"VMM growth event, {mib} MiB chunk",
            median_us(grow["ours"]),
            f"raw create+map+access ({p.name})",
            median_us(grow[p.name]),
            "<= 1.1x",
        )
    row(
        f"VMM growth from the handle cache, {mib} MiB",
        median_us(grow["warm"]),
        f"raw create+map+access ({raw.name})",
        median_us(grow[raw.name]),
        "info",
    )
    row(
        f"VMM decommit event, {mib} MiB chunk",
        median_us(shrink["ours"]),
        f"raw unmap+release ({raw.name})",
        median_us(shrink[raw.name]),
        "info",
    )
    region.release()
    warm_region.release()
    for p in peers:
        raw.address_free(raw_bases[p.name], chunks * chunk)


def bench_acquire(sizes: list[int], iters: int, raw: RawDriver) -> None:
    import torch

    backend = imp_mem.CudaBackend(0)
    torch.cuda.synchronize()
    for nbytes in sizes:
        ours, peer, driver = [], [], []
        for _ in range(iters // 10):  # warm-up: torch's cache holds the block after this
            warm = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            del warm

        def acquire_release(n=nbytes):
            backend.acquire(n, tag="workspace").release()

        def torch_empty_del(n=nbytes):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            del t

        def raw_alloc_free(n=nbytes):
            raw.free(raw.alloc(n))

        for _ in range(iters):
            ours.append(timed(acquire_release))
            peer.append(timed(torch_empty_del))
            driver.append(timed(raw_alloc_free))
        label = f"{nbytes // 1024} KiB" if nbytes < MIB else f"{nbytes // MIB} MiB"
        row(
            f"CudaBackend acquire+release, {label}",
            median_us(ours),
            "torch.empty+del (caching allocator)",
            median_us(peer),
            "info: load-time path",
        )
        row(
            f"CudaBackend acquire+release, {label}",
            median_us(ours),
            "raw cuMemAlloc+cuMemFree (ctypes)",
            median_us(driver),
            "~1x (overhead)",
        )


def print_table(rows: list[dict[str, Any]]) -> None:
    headers = ["benchmark", "ours_us", "peer", "peer_us", "ratio", "goal"]
    widths = [
        max(len(str(r[h])) for r in [*rows, dict(zip(headers, headers, strict=True))])
        for h in headers
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(r[h]).ljust(w) for h, w in zip(headers, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    args = ap.parse_args(argv)
    if not imp_mem.cuda_available():
        print("bench_cuda: no CUDA device (cuda_available() is False); nothing to measure")
        return 0
    import torch

    torch.cuda.init()
    torch.cuda.synchronize()
    raw = RawDriver(0)
    peers: list[Any] = [raw]
    try:
        peers.append(CudaPythonDriver(0))
    except Exception as exc:  # not installed, or an API it lacks
        print(f"(cuda-python peer skipped: {exc.__class__.__name__}: {exc})")
    rounds = 5 if args.quick else 20
    for chunk, chunks in ((2 * MIB, 32), (64 * MIB, 8), (256 * MIB, 4)):
        bench_growth(chunk, chunks, rounds, peers)
    bench_acquire([4096, MIB, 64 * MIB], 50 if args.quick else 300, raw)
    print_table(ROWS)
    write_json(args.json, ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

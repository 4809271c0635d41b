"""Prefix-cache save / load bandwidth on a GPU (issue 16), per backend and build.

    python benches/bench_kv_persist.py [--blocks 2048] [--block-bytes 262144] \\
        [--turns 5] [--dir /dev/shm] [--json out.json] \\
        [--core base=/tmp/base/imp_mem/_core.abi3.so --core new=/tmp/new/imp_mem/_core.abi3.so]

On a ``VmmBackend`` and a ``CudaBackend`` (device 0), a ``KVCacheManager``
of ``--blocks`` blocks of ``--block-bytes`` gets its prefix cache filled by
one sequence of that many full blocks. Each turn then times
``save_prefix_cache`` (every block device -> host -> file, the checksums,
fsync and rename), evicts the cache, and times ``load_prefix_cache`` (the
verifying pass over the file, then file -> host -> device for every block);
one untimed turn comes first. GB/s is the block bytes over the median turn.
The peer is the file alone: the same bytes written from one host buffer in
blocks, fsynced, and read back, in the same directory — what a save or a
load would cost if the device copies and the checksums were free. Its ratio
(file time / ours) is 1.0 at that floor. The file lives in ``--dir``
(default ``/dev/shm`` where it exists: a tmpfs, so the disk does not drown
the copies).

Each ``--core NAME=PATH`` is a build of ``imp_mem._core`` (``maturin build
--release`` and ``pip install --target DIR`` the wheel; the module is
``DIR/imp_mem/_core.abi3.so``), loaded side by side as in ``ab_kv.py``; the
builds take turns in alternating order, so a before/after change is measured
with the machine's drift shared, and each later build's median per-turn
ratio to the first is printed. Without ``--core`` the installed
``imp_mem._core`` is measured alone. Where ``cuda_available()`` is false it
prints why and measures nothing (exit status 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_kv import load_builds, paired
from bench_json import write_json

BS = 16
ROWS: list[dict] = []


def installed() -> dict[str, ModuleType]:
    import imp_mem._core as core

    return {"installed": core}


def manager(core: ModuleType, kind: str, blocks: int, block_bytes: int):
    """A manager over a fresh backend of ``kind``, its cache full."""
    cls = core.VmmBackend if kind == "vmm" else core.CudaBackend
    kv = core.KVCacheManager(
        blocks,
        BS,
        backend=cls(device=0),
        block_bytes=block_bytes,
        model_fingerprint="bench_kv_persist",
        dtype="bf16",
    )
    kv.admit(1, list(range(blocks * BS)))
    kv.free(1)
    cached = kv.stats()["cached"]
    if cached != blocks:
        raise SystemExit(f"{kind}: {cached} blocks cached, expected {blocks}")
    return kv


def turn(kv, path: Path, blocks: int) -> tuple[float, float]:
    """One save and one load of the whole cache, in seconds each."""
    t0 = time.perf_counter()
    saved = kv.save_prefix_cache(path)
    t1 = time.perf_counter()
    kv.evict(blocks)
    t2 = time.perf_counter()
    loaded = kv.load_prefix_cache(path)
    t3 = time.perf_counter()
    if (saved, loaded) != (blocks, blocks):
        raise SystemExit(f"saved {saved}, loaded {loaded}, expected {blocks} each")
    return t1 - t0, t3 - t2


def file_only(path: Path, blocks: int, block_bytes: int) -> tuple[float, float]:
    """The peer: the same bytes written in blocks, fsynced, and read back."""
    buf = os.urandom(block_bytes)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(blocks):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(block_bytes):
            pass
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def row(kind: str, build: str, what: str, ours: list[float], peer: list[float], nbytes: int):
    ours_s, peer_s = statistics.median(ours), statistics.median(peer)
    ratio = peer_s / ours_s if ours_s > 0 else float("inf")
    gbps, peer_gbps = nbytes / ours_s / 1e9, nbytes / peer_s / 1e9
    ROWS.append(
        {
            "backend": kind,
            "build": build,
            "op": what,
            "bytes": nbytes,
            "ours_ms": round(ours_s * 1e3, 3),
            "ours_gb_s": round(gbps, 3),
            "peer": "file only",
            "peer_ms": round(peer_s * 1e3, 3),
            "peer_gb_s": round(peer_gbps, 3),
            "ratio": round(ratio, 3),
            "turns_ms": [round(t * 1e3, 3) for t in ours],
        }
    )
    print(
        f"{kind:5s} {build:12s} {what:5s} ours {ours_s * 1e3:9.2f} ms ({gbps:6.2f} GB/s)  "
        f"file only {peer_s * 1e3:9.2f} ms ({peer_gbps:6.2f} GB/s)  {ratio:6.3f}x of the file"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--core", action="append", default=[], metavar="NAME=PATH", help="a build (repeat)"
    )
    parser.add_argument("--blocks", type=int, default=2048, help="blocks in the cache")
    parser.add_argument("--block-bytes", type=int, default=256 << 10, help="bytes per block")
    parser.add_argument("--turns", type=int, default=5, help="timed turns per build")
    parser.add_argument(
        "--dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the files go (default /dev/shm where it exists, else the temp dir)",
    )
    parser.add_argument(
        "--backends", default="vmm,cuda", help="comma-separated, of vmm and cuda (default both)"
    )
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.blocks < 1 or args.block_bytes < 1 or args.turns < 1:
        raise SystemExit("--blocks, --block-bytes and --turns must be positive")
    kinds = [k for k in args.backends.split(",") if k]
    if not kinds or any(k not in ("vmm", "cuda") for k in kinds):
        raise SystemExit(f"--backends {args.backends!r}: give vmm, cuda or vmm,cuda")
    builds = load_builds(args.core) if args.core else installed()
    order = list(builds)

    if not all(core.cuda_available() for core in builds.values()):
        print(
            "bench_kv_persist: no CUDA device here (imp_mem.cuda_available() is False); "
            "nothing measured",
            file=sys.stderr,
        )
        if args.json:
            Path(args.json).write_text("[]\n")
        return 0

    nbytes = args.blocks * args.block_bytes
    print(
        f"{args.blocks} blocks of {args.block_bytes} B ({nbytes / 2**20:.0f} MiB), "
        f"{args.turns} turns, files in {args.dir or tempfile.gettempdir()}"
    )
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_kv_persist-") as tmp:
        tmp_dir = Path(tmp)
        for kind in kinds:
            try:
                managers = {
                    name: manager(core, kind, args.blocks, args.block_bytes)
                    for name, core in builds.items()
                }
            except Exception as e:  # a backend this device lacks (no VMM)
                print(f"{kind}: skipped ({type(e).__name__}: {e})")
                continue
            paths = {name: tmp_dir / f"{kind}-{name}.imp" for name in order}
            for name in order:
                turn(managers[name], paths[name], args.blocks)
            saves: dict[str, list[float]] = {n: [] for n in order}
            loads: dict[str, list[float]] = {n: [] for n in order}
            peer_w, peer_r = [], []
            for t in range(args.turns):
                for name in order if t % 2 == 0 else order[::-1]:
                    s, ld = turn(managers[name], paths[name], args.blocks)
                    saves[name].append(s)
                    loads[name].append(ld)
                w, r = file_only(tmp_dir / "peer.bin", args.blocks, args.block_bytes)
                peer_w.append(w)
                peer_r.append(r)
            for name in order:
                row(kind, name, "save", saves[name], peer_w, nbytes)
                row(kind, name, "load", loads[name], peer_r, nbytes)
            first = order[0]
            for name in order[1:]:
                print(f"{kind:5s} {name}/{first} save: {paired(saves[name], saves[first])}")
                print(f"{kind:5s} {name}/{first} load: {paired(loads[name], loads[first])}")
            for path in [*paths.values(), tmp_dir / "peer.bin"]:
                path.unlink(missing_ok=True)
            del managers
    write_json(args.json, ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefix-cache save / load and the disk tier's spill / reload against the
file alone (issues 16 and 31), per backend and block size.

    python benches/bench_kv_persist.py [--backends vmm,cuda] \\
        [--block-bytes 262144,2097152] [--mib 512] [--turns 5] [--disk-turns 3] \\
        [--dir /dev/shm] [--json out.json] [--no-disk] [--settle 0] \\
        [--core base=/tmp/base/imp_mem/_core.abi3.so --core new=/tmp/new/imp_mem/_core.abi3.so]
    python benches/bench_kv_persist.py --backends fake      # a CPU, no GPU

For each backend (``vmm``: ``VmmBackend``, ``cuda``: ``CudaBackend`` on
device 0; ``fake``: ``FakeBackend``, host memory, runs anywhere) and each
block size, ``--mib`` MiB of blocks are measured, side by side in one run
with the peer, the same bytes as a plain file in the same directory:

* **save / load**: a ``KVCacheManager`` of that many blocks gets its prefix
  cache filled by one sequence. Each turn times ``save_prefix_cache`` (every
  block device -> host -> file, the checksums, fsync and rename), evicts the
  cache, and times ``load_prefix_cache`` (the file read once, checked, every
  block host -> device); one untimed turn comes first. The peer writes the
  bytes from one host buffer in blocks and fsyncs, then reads them back in
  blocks (a fresh ``bytes`` a read, as Python's file reads give).
* **spill / reload** (the disk tier behind a host tier of as many slots):
  on a fresh manager, one prefix A is evicted to the host tier (timed:
  *offload*, for reference), a second prefix B of the same size is evicted
  after it, which spills A's blocks from the host tier to disk (timed:
  *spill*, B's device -> host copies included, as an engine's eviction
  pays them), B is onboarded back to free the host slots, and admitting A
  again reads each of its blocks from disk into a host slot and onboards it
  (timed with its wait: *reload*).

The ratio is the peer's time over ours: 1.0 is the file's own rate (the
target is >= 0.9). A save's replaced file and a reload's files are closed
on a thread of the process after the call (their storage freed there);
``--settle S`` sleeps S seconds before each timed operation, so that this
freeing does not overlap the next one (default 0: back to back, as an
engine would run them; on a machine of few cores the overlap lands in the
next operation's time). Times are the median turn's. The files live in ``--dir``
(default ``/dev/shm`` where it exists: a tmpfs, so a disk does not drown
the rest).

Each ``--core NAME=PATH`` is a build of ``imp_mem._core`` (``maturin build
--release`` and ``pip install --target DIR`` the wheel; the module is
``DIR/imp_mem/_core.abi3.so``), loaded side by side as in ``ab_kv.py``; the
builds take turns in alternating order, and each later build's median
per-turn ratio to the first is printed. Without ``--core`` the installed
``imp_mem._core`` is measured alone. A GPU backend where
``cuda_available()`` is false is skipped with a line saying so (exit
status 0).
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
# The A/B loader is a tool (tools/ab_kv.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from ab_kv import load_builds, paired
from bench_json import write_json

BS = 16
ROWS: list[dict] = []


def installed() -> dict[str, ModuleType]:
    import imp_mem._core as core

    return {"installed": core}


def backend(core: ModuleType, kind: str, nbytes: int):
    if kind == "fake":
        return core.FakeBackend(capacity=nbytes + (64 << 20))
    return (core.VmmBackend if kind == "vmm" else core.CudaBackend)(device=0)


def manager(core: ModuleType, kind: str, blocks: int, block_bytes: int):
    """A manager over a fresh backend of ``kind``, its cache full."""
    kv = core.KVCacheManager(
        blocks,
        BS,
        backend=backend(core, kind, blocks * block_bytes),
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


SETTLE = 0.0


def settle() -> None:
    if SETTLE > 0:
        time.sleep(SETTLE)


def turn(kv, path: Path, blocks: int) -> tuple[float, float]:
    """One save and one load of the whole cache, in seconds each."""
    settle()
    t0 = time.perf_counter()
    saved = kv.save_prefix_cache(path)
    t1 = time.perf_counter()
    settle()
    kv.evict(blocks)
    t2 = time.perf_counter()
    loaded = kv.load_prefix_cache(path)
    t3 = time.perf_counter()
    if (saved, loaded) != (blocks, blocks):
        raise SystemExit(f"saved {saved}, loaded {loaded}, expected {blocks} each")
    return t1 - t0, t3 - t2


def disk_turn(core: ModuleType, kind: str, blocks: int, block_bytes: int, tmp: Path):
    """One spill and reload of a prefix through the disk tier: (offload,
    spill round, reload) in seconds."""
    disk = tmp / "disk-tier"
    file_bytes = block_bytes + (4 << 10)  # a block file: the block, header, trailer
    kv = core.KVCacheManager(
        2 * blocks + 8,
        BS,
        backend=backend(core, kind, (2 * blocks + 8) * block_bytes),
        block_bytes=block_bytes,
        model_fingerprint="bench_kv_persist",
        dtype="bf16",
        host_blocks=blocks,
        disk_dir=disk,
        disk_bytes=2 * blocks * file_bytes,
    )
    a = list(range(blocks * BS))
    b = list(range(10_000_000, 10_000_000 + blocks * BS))

    kv.admit(1, a)
    kv.free(1)
    settle()
    t0 = time.perf_counter()
    kv.evict(blocks)
    kv.poll_copies(wait=True)
    t1 = time.perf_counter()
    kv.admit(2, b)
    kv.free(2)
    settle()
    t2 = time.perf_counter()
    kv.evict(blocks)
    kv.poll_copies(wait=True)
    t3 = time.perf_counter()
    s = kv.stats()
    if (s["disk_cached"], s["host_cached"]) != (blocks, blocks):
        raise SystemExit(f"{kind}: disk {s['disk_cached']}, host {s['host_cached']}")
    # B back onto the device frees the host slots A is read back into.
    kv.admit(3, [*b, 1])
    kv.wait_onboarding(3)
    kv.poll_copies(wait=True)
    settle()
    t4 = time.perf_counter()
    got = kv.admit(4, [*a, 1])
    kv.wait_onboarding(4)
    t5 = time.perf_counter()
    if got != blocks * BS or kv.stats()["disk_loads"] != blocks:
        raise SystemExit(f"{kind}: reload hit {got} tokens, {kv.stats()['disk_loads']} loads")
    del kv
    for f in disk.iterdir():
        f.unlink()
    return t1 - t0, t3 - t2, t5 - t4


def file_only(path: Path, blocks: int, block_bytes: int) -> tuple[float, float]:
    """The peer: the same bytes written in blocks, fsynced, and read back."""
    buf = os.urandom(block_bytes)
    settle()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(blocks):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    settle()
    t2 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(block_bytes):
            pass
    t3 = time.perf_counter()
    path.unlink()
    return t1 - t0, t3 - t2


def row(kind: str, bb: int, build: str, what: str, ours: list[float], peer: list[float], n: int):
    ours_s, peer_s = statistics.median(ours), statistics.median(peer)
    ratio = peer_s / ours_s if ours_s > 0 else float("inf")
    gbps, peer_gbps = n / ours_s / 1e9, n / peer_s / 1e9
    ROWS.append(
        {
            "backend": kind,
            "block_bytes": bb,
            "build": build,
            "op": what,
            "bytes": n,
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
        f"{kind:4s} {bb >> 10:5d} KiB {build:10s} {what:7s} ours {ours_s * 1e3:8.1f} ms "
        f"({gbps:6.2f} GB/s)  file only {peer_s * 1e3:8.1f} ms ({peer_gbps:6.2f} GB/s)  "
        f"{ratio:6.3f}x of the file",
        flush=True,
    )


def measure(kind, bb, builds, order, args, tmp_dir):
    blocks = max(1, (args.mib << 20) // bb)
    nbytes = blocks * bb
    try:
        managers = {name: manager(core, kind, blocks, bb) for name, core in builds.items()}
    except Exception as e:  # a backend this device lacks (no VMM)
        print(f"{kind}: skipped ({type(e).__name__}: {e})")
        return
    paths = {name: tmp_dir / f"{kind}-{name}.imp" for name in order}
    for name in order:
        turn(managers[name], paths[name], blocks)
    saves: dict[str, list[float]] = {n: [] for n in order}
    loads: dict[str, list[float]] = {n: [] for n in order}
    peer_w, peer_r = [], []
    for t in range(args.turns):
        for name in order if t % 2 == 0 else order[::-1]:
            s, ld = turn(managers[name], paths[name], blocks)
            saves[name].append(s)
            loads[name].append(ld)
        w, r = file_only(tmp_dir / "peer.bin", blocks, bb)
        peer_w.append(w)
        peer_r.append(r)
    for name in order:
        row(kind, bb, name, "save", saves[name], peer_w, nbytes)
        row(kind, bb, name, "load", loads[name], peer_r, nbytes)
    for path in paths.values():
        path.unlink(missing_ok=True)
    del managers
    first = order[0]
    for name in order[1:]:
        print(f"{kind:4s} {name}/{first} save: {paired(saves[name], saves[first])}")
        print(f"{kind:4s} {name}/{first} load: {paired(loads[name], loads[first])}")
    if args.no_disk or args.disk_turns < 1:
        return
    offs: dict[str, list[float]] = {n: [] for n in order}
    spills: dict[str, list[float]] = {n: [] for n in order}
    reloads: dict[str, list[float]] = {n: [] for n in order}
    peer_w, peer_r = [], []
    for t in range(args.disk_turns):
        for name in order if t % 2 == 0 else order[::-1]:
            off, spill_round, reload = disk_turn(builds[name], kind, blocks, bb, tmp_dir)
            offs[name].append(off)
            spills[name].append(spill_round)
            reloads[name].append(reload)
        w, r = file_only(tmp_dir / "peer.bin", blocks, bb)
        peer_w.append(w)
        peer_r.append(r)
    for name in order:
        row(kind, bb, name, "offload", offs[name], peer_w, nbytes)
        row(kind, bb, name, "spill", spills[name], peer_w, nbytes)
        row(kind, bb, name, "reload", reloads[name], peer_r, nbytes)
    for name in order[1:]:
        print(f"{kind:4s} {name}/{first} spill: {paired(spills[name], spills[first])}")
        print(f"{kind:4s} {name}/{first} reload: {paired(reloads[name], reloads[first])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--core", action="append", default=[], metavar="NAME=PATH", help="a build (repeat)"
    )
    parser.add_argument(
        "--backends", default="vmm,cuda", help="comma-separated, of vmm, cuda and fake"
    )
    parser.add_argument(
        "--block-bytes", default="262144,2097152", help="comma-separated block sizes in bytes"
    )
    parser.add_argument("--mib", type=int, default=512, help="MiB of blocks per measurement")
    parser.add_argument("--turns", type=int, default=5, help="timed save/load turns per build")
    parser.add_argument("--disk-turns", type=int, default=3, help="timed disk-tier turns")
    parser.add_argument("--no-disk", action="store_true", help="skip the disk tier")
    parser.add_argument(
        "--dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the files go (default /dev/shm where it exists, else the temp dir)",
    )
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds to sleep before each timed operation (default 0)",
    )
    args = parser.parse_args()
    global SETTLE
    SETTLE = max(0.0, args.settle)
    try:
        sizes = [int(x) for x in args.block_bytes.split(",") if x]
    except ValueError:
        raise SystemExit(f"--block-bytes {args.block_bytes!r}: give sizes in bytes") from None
    if not sizes or min(sizes) < 1 or args.mib < 1 or args.turns < 1:
        raise SystemExit("--block-bytes, --mib and --turns must be positive")
    kinds = [k for k in args.backends.split(",") if k]
    if not kinds or any(k not in ("vmm", "cuda", "fake") for k in kinds):
        raise SystemExit(f"--backends {args.backends!r}: give some of vmm, cuda, fake")
    builds = load_builds(args.core) if args.core else installed()
    order = list(builds)
    gpu = all(core.cuda_available() for core in builds.values())
    print(
        f"{args.mib} MiB a measurement, {args.turns} turns ({args.disk_turns} for the disk "
        f"tier), files in {args.dir or tempfile.gettempdir()}",
        flush=True,
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_kv_persist-") as tmp:
        for kind in kinds:
            if kind != "fake" and not gpu:
                print(
                    f"{kind}: no CUDA device here (imp_mem.cuda_available() is False); "
                    "not measured (--backends fake runs on a CPU)"
                )
                continue
            for bb in sizes:
                measure(kind, bb, builds, order, args, Path(tmp))
    print(f"total {time.perf_counter() - start:.1f} s")
    write_json(args.json, ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

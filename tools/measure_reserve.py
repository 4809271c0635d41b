"""Measure the CUDA context cost and the library reserve on this GPU, print
them with their fingerprint, remember them, and self-check against what was
remembered (seed "LibraryReserve calibration"; procedure in
``imp_mem/reserve.py``).

Usage: ``python tools/measure_reserve.py [--samples 5] [--cache PATH]``.
Prints one line per charge and a JSON line (``RESERVE {...}``) that
``scripts/gpu-check.sh`` picks up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import imp_mem
from imp_mem import reserve

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=None, help="default: ~/.cache/imp-mem")
    args = ap.parse_args(argv)
    if not imp_mem.cuda_available():
        print("measure_reserve: no CUDA device; nothing to measure")
        return 0
    path = args.cache or reserve.default_cache_path()
    fp = reserve.fingerprint()
    measured = reserve.measure(args.samples)
    previous = reserve.lookup(path, fp)
    if previous is None:
        reserve.store(measured, path, fp)
        check = {"diverged": False, "message": "first measurement on this fingerprint; stored"}
    else:
        check = reserve.compare(previous, measured, 0.10, fp)
    key = reserve.fingerprint_key(fp)
    print(f"fingerprint     {key}")
    print(f"context         {measured['context_bytes'] / MIB:.1f} MiB")
    print(f"library reserve {measured['library_reserve_bytes'] / MIB:.1f} MiB")
    print(f"samples         {measured['samples']}  (median)")
    print(f"self-check      {check['message']}")
    print("RESERVE " + json.dumps({"key": key, **measured, "diverged": check["diverged"]}))
    return 1 if check["diverged"] else 0


if __name__ == "__main__":
    sys.exit(main())

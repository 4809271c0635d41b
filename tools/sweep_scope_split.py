"""The scope mode's reserved bytes against torch's ``max_split_size_mb``
(GPU; why ``serve(mode="scope")`` leaves torch's setting alone, issue 28).

Runs ``bench_torch_hf.py``'s torch-allocator child once (HF's live peak)
and its scope-mode child once per value (each a fresh process with
``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:V``; a huge value is torch's
default, no block oversize), and prints the tier's
committed bytes ÷ HF's live peak, the fallbacks and whether the tokens
matched.

    python tools/sweep_scope_split.py [--values 21,64,256,1000000] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The benchmarks this tool borrows from live in benches/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import bench_torch_hf as hf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--values", default="21,64,256,1000000")
    ap.add_argument("--quick", action="store_true", help="batch 8 x 256 + 16")
    args = ap.parse_args()
    batch, prompt, new = (8, 256, 16) if args.quick else (32, 1024, 64)
    shape = argparse.Namespace(
        batch=batch, prompt=prompt, new=new, reps=1, cpus=None, record_trace=None
    )
    comp = ["--compile", "none"]
    try:
        peer = hf.run_child("default", shape, comp, "/tmp/imp-mem-scope-split-peer")
    except RuntimeError as exc:
        print("torch's allocator failed:", str(exc)[-300:])
        return 1
    print(f"HF live peak {peer['live_peak'] / 2**20:.1f} MiB; torch reserved "
          f"{peer['reserved'] / peer['live_peak']:.3f} of it")  # fmt: skip
    for value in args.values.split(","):
        # The child inherits it (run_child passes this process's environment).
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"max_split_size_mb:{value}"
        try:
            got = hf.run_child(
                "imp", shape, [*comp, "--mode", "scope"], f"/tmp/imp-mem-scope-split-{value}"
            )
        except RuntimeError as exc:
            print(f"max_split_size_mb {value:>8}: FAILED {str(exc)[-300:]}")
            continue
        print(
            f"max_split_size_mb {value:>8}: reserved/live-peak "
            f"{got['committed'] / peer['live_peak']:.3f}, fallbacks {got['fallbacks']}, "
            f"tokens identical {got['tokens'] == peer['tokens']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

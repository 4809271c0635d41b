"""The scope mode's reserved bytes against torch's ``max_split_size_mb``
(GPU; why ``serve(mode="scope")`` leaves torch's setting alone, issue 28).

Runs ``bench_torch_hf.py``'s torch-allocator child once (HF's live peak)
and its scope-mode child once per value (each a fresh process with
``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:V``; a huge value is torch's
default, no block oversize), and prints the tier's
committed bytes ÷ HF's live peak, the fallbacks and whether the tokens
matched.

    python benches/sweep_scope_split.py [--values 21,64,256,1000000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(kind: str, shape: list[str], env: dict) -> dict | str:
    cmd = [sys.executable, os.path.join(HERE, "bench_torch_hf.py"), "--child", kind, *shape]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return (proc.stderr or proc.stdout)[-300:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--values", default="21,64,256,1000000")
    ap.add_argument("--quick", action="store_true", help="batch 8 x 256 + 16")
    args = ap.parse_args()
    dims = ("8", "256", "16") if args.quick else ("32", "1024", "64")
    shape = ["--batch", dims[0], "--prompt", dims[1], "--new", dims[2], "--reps", "1"]
    shape += ["--compile", "none"]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    peer = child("default", shape, env)
    if isinstance(peer, str):
        print("torch's allocator failed:", peer)
        return 1
    print(f"HF live peak {peer['live_peak'] / 2**20:.1f} MiB; torch reserved "
          f"{peer['reserved'] / peer['live_peak']:.3f} of it")  # fmt: skip
    for value in args.values.split(","):
        run_env = dict(env, PYTORCH_CUDA_ALLOC_CONF=f"max_split_size_mb:{value}")
        run_env["IMP_MEM_CACHE_DIR"] = f"/tmp/imp-mem-scope-split-{value}"
        got = child("imp", [*shape, "--mode", "scope"], run_env)
        if isinstance(got, str):
            print(f"max_split_size_mb {value:>8}: FAILED {got}")
            continue
        print(
            f"max_split_size_mb {value:>8}: reserved/live-peak "
            f"{got['committed'] / peer['live_peak']:.3f}, fallbacks {got['fallbacks']}, "
            f"tokens identical {got['tokens'] == peer['tokens']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The paged decode kernels and the fused decode kernels compile for the
H200 (sm_90) without a GPU
(issue 13): Triton's own ptxas turns them into a cubin here, which catches
what the interpreter does not check (layouts, dot shapes, types). The launch
defaults must not spill registers. Runs in a subprocess, because the
interpreter (switched on by ``test_engine_attention.py``) replaces the
compiled kernels of the process that imports them under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    r"""
    import json, os, re, subprocess, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from imp_mem.engine.kernels import paged as K

    target = GPUTarget("cuda", 90, 32)
    try:
        # The ptxas Triton itself runs for sm_90 (newer releases ship two and
        # pick by architecture; the older one rejects their PTX version).
        from triton.backends.nvidia.compiler import get_ptxas
        PTXAS = get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):
        PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "ptxas")

    def compile(fn, args, consts, options):
        names = [n for n in fn.arg_names if n not in consts]
        assert len(names) == len(args), (fn.arg_names, args)
        sig = dict(zip(names, args))
        sig.update({k: "constexpr" for k in consts})
        # Strides and pointers divisible by 16, as Triton specialises them at
        # a launch over the engine's pages.
        div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n not in consts
               and n.startswith(("stride", "Q", "KV", "O", "LSE", "POS", "TABLES", "OUT"))}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=div)
        c = triton.compile(src, target=target, options=options)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(c.asm["ptx"])
            ptx.flush()
            report = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx.name, "-o",
                                     os.devnull], capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", report)
        spills = re.search(r"(\d+) bytes spill stores", report)
        return {"cubin": len(c.asm["cubin"]), "registers": int(regs.group(1)),
                "spill_bytes": int(spills.group(1))}

    # Pointers (the last the probes' stamps), 14 strides and the window, the
    # scale, the split count.
    split_args = (["*bf16", "*bf16", "*i32", "*i64", "*fp32", "*fp32", "*bf16", "*i64"]
                  + ["i32"] * 15
                  + ["fp32", "i32"])
    merge_args = ["*fp32", "*fp32", "*bf16"] + ["i32"] * 8
    out = {}
    # Both launch defaults (few programs, many), one split and several, with
    # and without a window, as paged_decode launches them for Qwen3-8B's
    # 32 / 8 heads.
    for name, (tile, warps, stages) in (("few", K.FEW_PROGRAMS), ("many", K.MANY_PROGRAMS)):
        for splits, window in ((1, False), (4, True)):
            consts = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=16, TILE=tile,
                          ONE_SPLIT=splits == 1, HAS_WINDOW=window, DOT_FP32=False,
                          EVICT=K.EVICTION, STAMP=False)
            out[f"split {name} splits={splits} window={window}"] = compile(
                K._split_kernel, split_args, consts, {"num_warps": warps, "num_stages": stages})
    # The probes' stamped kernel (inline PTX for the timer and the SM id).
    out["split few stamped"] = compile(
        K._split_kernel, split_args,
        dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=16, TILE=K.FEW_PROGRAMS[0],
             ONE_SPLIT=True, HAS_WINDOW=False, DOT_FP32=False, EVICT=K.EVICTION,
             STAMP=True),
        {"num_warps": K.FEW_PROGRAMS[1], "num_stages": K.FEW_PROGRAMS[2]})
    out["merge"] = compile(K._merge_kernel, merge_args,
                           dict(HEAD_DIM=128, BLOCK_S=K.MAX_SPLITS), {"num_warps": 4})
    # The fused decode kernels (issue 25), as the engine launches them.
    from imp_mem.engine.kernels import fused as F
    out["add_rms"] = compile(
        F._add_rms_kernel, ["*bf16"] * 5 + ["i32"] * 5 + ["fp32"],
        dict(HAS_DELTA=True, UNIT_OFFSET=False, BLOCK=4096, MANUAL=False), {"num_warps": 16})
    for norm in (True, False):
        out[f"qkv norm={norm}"] = compile(
            F._qkv_kernel,
            ["*bf16"] * 5 + ["*i64", "*bf16", "*i64", "*i64", "*bf16"] + ["i32"] * 8 + ["fp32"],
            dict(HEADS=32, KV_HEADS=8, HALF=64, HAS_NORM=norm, MANUAL=False), {"num_warps": 1})
    out["silu_mul"] = compile(
        F._silu_mul_kernel, ["*bf16", "*bf16", "i32", "i32", "i32"],
        dict(BLOCK=1024, MANUAL=False), {"num_warps": 4})
    print(json.dumps(out))
    """
)


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result) == 10
    for name, kernel in result.items():
        assert kernel["cubin"] > 0, name
        assert kernel["spill_bytes"] == 0, f"{name} spills registers: {kernel}"
        assert kernel["registers"] <= 200, f"{name} needs {kernel['registers']} registers"

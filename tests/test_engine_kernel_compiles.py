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
    from imp_mem.engine.model import _paged_kernel as K

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

    split_args = ["*bf16", "*bf16", "*i32", "*i64", "*fp32", "*fp32"] + ["i32"] * 14 + ["fp32"]
    merge_args = ["*fp32", "*fp32", "*i64", "*bf16"] + ["i32"] * 8
    out = {}
    for window in (False, True):
        consts = dict(GROUP=2, KV_HEADS=8, BLOCK_G=16, BLOCK_KVH=1, HEAD_DIM=128,
                      BLOCK_SIZE=16, SPLIT_TOKENS=128, TILE=K.DEFAULT_TILE, HAS_WINDOW=window,
                      DOT_FP32=False, EARLY_V=K.DEFAULT_EARLY_V, HEAD_FAST=K.DEFAULT_HEAD_FAST,
                      MULTI_HEAD=False)
        out[f"split window={window}"] = compile(
            K._split_kernel, split_args, consts,
            {"num_warps": K.DEFAULT_WARPS, "num_stages": K.DEFAULT_STAGES})
        if not window:
            # The other grid order (sweep_paged_kernel --head-fast).
            out["split head_fast"] = compile(
                K._split_kernel, split_args, dict(consts, HEAD_FAST=not K.DEFAULT_HEAD_FAST),
                {"num_warps": K.DEFAULT_WARPS, "num_stages": K.DEFAULT_STAGES})
            # Several KV heads a program (sweep_paged_kernel
            # --heads-per-program), as paged_decode launches it for Qwen3-8B's
            # 32 / 8 heads: every head, and four.
            for per in (8, 4):
                out[f"split heads_per_program={per}"] = compile(
                    K._split_kernel, split_args,
                    dict(consts, GROUP=4, BLOCK_G=max(16, 4 * per), BLOCK_KVH=per,
                         TILE=K.DEFAULT_TILE // per, EARLY_V=True, HEAD_FAST=False,
                         MULTI_HEAD=True),
                    {"num_warps": K.DEFAULT_WARPS, "num_stages": K.DEFAULT_STAGES})
        consts = dict(HEAD_DIM=128, SPLIT_TOKENS=128, BLOCK_S=8, HAS_WINDOW=window)
        out[f"merge window={window}"] = compile(K._merge_kernel, merge_args, consts,
                                                {"num_warps": 1})
    # The fused decode kernels (issue 25), as the engine launches them.
    from imp_mem.engine.model import _fused_kernels as F
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
    assert len(result) == 11
    for name, kernel in result.items():
        assert kernel["cubin"] > 0, name
        assert kernel["spill_bytes"] == 0, f"{name} spills registers: {kernel}"
        assert kernel["registers"] <= 200, f"{name} needs {kernel['registers']} registers"

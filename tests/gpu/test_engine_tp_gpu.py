"""The tensor-parallel engine's GPU path on one H200 (issue 18): a
``torch.distributed`` NCCL group of one process serves the same greedy tokens
as the engine without a group, its collectives (the agreements after
planning and loading, the collective open) run over NCCL, nothing is
acquired while serving, and the NCCL communicator's device memory, created
at the engine's first collective, is named in the memory report. (At TP = 1
the model's all-reduces are no-ops: the 2-GPU run would exercise them.)

Runs in a child process (the process group lives for the process); with more
GPUs lent, the same engine runs at TP = 2 (not run here: one GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import imp_mem

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("safetensors")

CHILD = textwrap.dedent(
    """
    import json, random, sys
    import torch, torch.distributed as dist
    import imp_mem
    from imp_mem.engine.checkpoint import write_random_checkpoint
    from imp_mem.engine.config import qwen3_0_6b_config
    from imp_mem.engine.llm_engine import Engine

    store, root = sys.argv[1], sys.argv[2]
    config = qwen3_0_6b_config()
    config["num_hidden_layers"] = 4
    ckpt = write_random_checkpoint(root, config)
    rng = random.Random(5)
    prompts = [[rng.randrange(config["vocab_size"]) for _ in range(rng.randint(8, 80))]
               for _ in range(6)]
    kw = {"max_batch": 8, "max_seq_len": 256}
    with Engine(ckpt, backend=imp_mem.VmmBackend(device=0, strict=True), **kw) as e:
        want = e.generate(prompts, 12)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    backend = imp_mem.VmmBackend(device=0, strict=True)
    with Engine(ckpt, backend=backend, group=dist.group.WORLD, **kw) as e:
        got = e.generate(prompts, 12)
        charges = {c["key"]: c["bytes"] for c in e.mem_report()["charges"]}
        text = e.mem_report_text()
        steady = sum(backend.stats()["steady_state_allocations_total"].values())
        tp = e.tp.tp
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"want": want, "got": got, "charges": charges,
                                  "steady": steady, "tp": tp, "report": text}))
    """
)


def test_a_group_of_one_on_nccl_serves_the_same_tokens_and_names_nccls_memory(tmp_path):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "store"), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-6000:]
    out = json.loads(lines[-1][7:])
    print(out["report"])
    gpu_out = os.environ.get("IMP_MEM_GPU_OUT")
    if gpu_out:
        with open(os.path.join(gpu_out, "engine_tp_nccl.txt"), "w") as fh:
            fh.write(out["report"])
    assert out["tp"] == 1
    assert out["got"] == out["want"]
    assert out["steady"] == 0
    # NCCL's communicator is created at the engine's first collective; its
    # device memory is outside every allocator and is named by its key.
    assert out["charges"].get("nccl", 0) > 0, out["charges"]
    assert imp_mem.cuda_available()

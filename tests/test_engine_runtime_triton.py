"""The Engine with the Triton paged decode kernel, through Triton's
interpreter on the CPU (``TRITON_INTERPRET=1``, set before Triton is
imported): the engine's block tables, padding rows and SWA tables feed the
kernel, and the greedy tokens still match Hugging Face's. Skipped without
torch, transformers or triton, and where a GPU is present (the GPU tests
run the compiled kernel)."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if torch.cuda.is_available():
    pytest.skip("a CUDA device is present: tests/gpu covers the kernel", allow_module_level=True)
if "imp_mem.engine.kernels.paged" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernel was already compiled without the interpreter", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated
pytest.importorskip("triton")

from test_engine_runtime import check_greedy, open_engine, prompts, tiny  # noqa: E402

from imp_mem.engine.checkpoint import write_random_checkpoint  # noqa: E402


@pytest.mark.parametrize("kind", ["full", "swa"])
def test_the_engine_on_the_triton_kernel_matches_hf(kind, tmp_path):
    directory = write_random_checkpoint(tmp_path, tiny(kind), seed=5, scale=0.1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    engine = open_engine(directory, attention_backend="triton")
    assert engine.model.attention_backend == "triton"
    ps = prompts(6, seed=1)
    outs = engine.generate(ps, 5)
    for p, o in zip(ps, outs, strict=True):
        check_greedy(hf, p, o)
    assert len(engine.stats.bucket_steps) > 1, "padded buckets ran"
    engine.close()

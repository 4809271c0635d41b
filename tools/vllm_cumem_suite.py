"""Runs vLLM's own allocator tests against ``imp_mem.vllm.CuMemAllocator``
(issue 51), on a GPU.

vLLM 0.33 needs torch 2.14 and cannot be installed beside the device's torch
2.11, so its allocator tests run through a small import shim instead of vLLM:
a throwaway ``vllm`` package whose ``vllm.device_allocator.cumem.CuMemAllocator``
is imp-mem's, with the few names the test module imports besides
(``current_platform.is_rocm``, ``GiB_bytes``, the per-test subprocess
decorator). The cases that start vLLM's engine (``LLM``) are deselected:
they need vLLM itself. vLLM's test file is not part of this repository: pass
the path of a copy (``tests/basic_correctness/test_cumem.py`` of vLLM's
repository).

    python tools/vllm_cumem_suite.py /path/to/test_cumem.py

Prints ``vllm-cumem-suite: imp_mem <P> passed <F> failed <S> skipped`` and
exits with pytest's status.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SHIM = {
    "vllm/__init__.py": '''
        """A shim standing in for vLLM: only what its allocator tests import."""


        class LLM:  # the engine is not here: its cases are deselected
            def __init__(self, *args, **kwargs):
                raise RuntimeError("the vllm shim has no engine")


        class SamplingParams:
            def __init__(self, *args, **kwargs):
                pass
    ''',
    "vllm/device_allocator/__init__.py": """
        from imp_mem.vllm import DEFERRABLE_TAGS  # noqa: F401


        def get_mem_allocator_instance():
            from vllm.device_allocator.cumem import CuMemAllocator

            return CuMemAllocator.get_instance()
    """,
    "vllm/device_allocator/cumem.py": """
        from imp_mem.vllm import CuMemAllocator  # noqa: F401

        cumem_available = True
    """,
    "vllm/platforms/__init__.py": """
        class _Platform:
            @staticmethod
            def is_rocm():
                return False

            @staticmethod
            def is_cuda():
                return True

            @staticmethod
            def is_cuda_alike():
                return True


        current_platform = _Platform()
    """,
    "vllm/utils/__init__.py": """
        GiB_bytes = 1 << 30
        MiB_bytes = 1 << 20
    """,
    "tests/__init__.py": "",
    "tests/basic_correctness/__init__.py": "",
    "tests/utils.py": '''
        """The per-test subprocess of vLLM's tests: a fork runs the test, the
        parent fails when the child did."""

        import functools
        import os
        import traceback


        def create_new_process_for_each_test(method=None):
            def decorate(fn):
                @functools.wraps(fn)
                def wrapper(*args, **kwargs):
                    pid = os.fork()
                    if pid == 0:
                        code = 0
                        try:
                            fn(*args, **kwargs)
                        except BaseException:
                            traceback.print_exc()
                            code = 1
                        os._exit(code)
                    _, status = os.waitpid(pid, 0)
                    code = os.waitstatus_to_exitcode(status)
                    assert code == 0, f"{fn.__name__} failed in its child"

                return wrapper

            if callable(method):
                return decorate(method)
            return decorate
    ''',
}


def build_shim(root: Path, test_file: Path) -> Path:
    for rel, body in SHIM.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body).lstrip())
    target = root / "tests" / "basic_correctness" / "test_cumem.py"
    shutil.copyfile(test_file, target)
    return target


def engine_cases(test_file: Path) -> list[str]:
    """The test functions that start vLLM's engine (they construct ``LLM``)."""
    text = test_file.read_text()
    cases = []
    for match in re.finditer(r"^def (test_\w+)\(.*?(?=^def |\Z)", text, re.S | re.M):
        if "LLM(" in match.group(0):
            cases.append(match.group(1))
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_file", type=Path, help="vLLM's tests/basic_correctness/test_cumem.py")
    args = ap.parse_args()
    if not args.test_file.is_file():
        ap.error(f"test_file: {args.test_file} is not a file")
    with tempfile.TemporaryDirectory(prefix="vllm-shim-") as tmp:
        root = Path(tmp)
        target = build_shim(root, args.test_file)
        skip = engine_cases(args.test_file)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", str(target)]
        if skip:
            cmd += ["-k", " and ".join(f"not {name}" for name in skip)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        print("deselected (need vLLM's engine):", ", ".join(skip) or "none", flush=True)
        run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        print(run.stdout[-20000:], run.stderr[-5000:], sep="\n")
        counts = {
            word: int(m.group(1)) if (m := re.search(rf"(\d+) {word}", run.stdout)) else 0
            for word in ("passed", "failed", "skipped")
        }
        print(
            f"vllm-cumem-suite: imp_mem {counts['passed']} passed {counts['failed']} failed "
            f"{counts['skipped']} skipped"
        )
        return run.returncode


if __name__ == "__main__":
    sys.exit(main())

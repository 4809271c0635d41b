"""torch and CuPy are optional extras: ``import imp_mem`` never needs them, and
``imp_mem.torch`` / ``imp_mem.cupy`` without them say what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("module", "dependency", "hint"),
    [("imp_mem.torch", "torch", "imp-mem[torch]"), ("imp_mem.cupy", "cupy", "imp-mem[cupy]")],
)
def test_integration_without_its_dependency_says_what_to_install(module, dependency, hint):
    # A None entry in sys.modules makes `import <dependency>` fail as if it were
    # not installed, also on a machine that has it.
    proc = _run(
        f"""
        import sys
        sys.modules[{dependency!r}] = None
        import imp_mem
        assert imp_mem.FakeBackend(capacity="1MiB").stats() is not None
        try:
            import {module}
        except ImportError as exc:
            print("HINT", exc)
        else:
            print("IMPORTED")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "HINT" in proc.stdout and hint in proc.stdout, proc.stdout


def test_import_imp_mem_loads_neither_torch_nor_cupy():
    proc = _run(
        """
        import sys
        import imp_mem, imp_mem.cli, imp_mem.system
        print(sorted(m for m in ("torch", "cupy") if m in sys.modules))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

"""imp-mem's LD_PRELOAD interposer (``imp_mem._preload``, issue 51) on the CPU.

A child process is started with the interposer in ``LD_PRELOAD`` and a
stand-in ``libcudart`` (a small C library built here with the system ``cc``:
``cudaMalloc`` / ``cudaFree`` are malloc / free that count, ``cudaGetDevice``
says 0, ``cudaDeviceSynchronize`` counts), loaded globally as torch loads
its CUDA libraries, and a stand-in "framework" library linked against it and
loaded ``RTLD_LOCAL`` as Python loads torch's extension, whose calls bind to
``cudaMalloc`` / ``cudaFree`` through the dynamic linker: without a routing
scope they reach the stand-in runtime; inside one, imp-mem's hooks and a
region of the fake backend, whose pause and resume keep the bytes; a
region's block freed from another thread outside any scope goes home.
Without the preload the same process reaches only the stand-in and
``routing()`` refuses. The GPU side, torch's caching allocator through the
interposer: ``docs/gpu-runs/2026-12-07-issue51-preload.log``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import imp_mem
from imp_mem import BackendUnavailable, _preload

STANDIN_C = r"""
#include <stdlib.h>
static int mallocs, frees, syncs;
int cudaMalloc(void **p, size_t n) { mallocs++; *p = malloc(n ? n : 1); return 0; }
int cudaFree(void *p) { frees++; free(p); return 0; }
int cudaGetDevice(int *d) { *d = 0; return 0; }
int cudaDeviceSynchronize(void) { syncs++; return 0; }
int standin_mallocs(void) { return mallocs; }
int standin_frees(void) { return frees; }
int standin_syncs(void) { return syncs; }
"""

FRAMEWORK_C = r"""
#include <stddef.h>
int cudaMalloc(void **p, size_t n);
int cudaFree(void *p);
int framework_malloc(void **p, size_t n) { return cudaMalloc(p, n); }
int framework_free(void *p) { return cudaFree(p); }
"""

CHILD = textwrap.dedent(
    """
    import ctypes, json, sys, threading
    from ctypes import POINTER, byref, c_int, c_size_t, c_void_p

    standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    framework = ctypes.CDLL(sys.argv[2])
    import imp_mem
    from imp_mem import BackendUnavailable, _core, _preload

    out = {"loaded": _preload.loaded()}
    cuda_malloc, cuda_free = framework.framework_malloc, framework.framework_free
    cuda_malloc.argtypes, cuda_malloc.restype = [POINTER(c_void_p), c_size_t], c_int
    cuda_free.argtypes, cuda_free.restype = [c_void_p], c_int

    def counts():
        return [standin.standin_mallocs(), standin.standin_frees(), standin.standin_syncs()]

    def owned(addr):
        return pool.size_of(addr) is not None

    def malloc(n):
        p = c_void_p()
        rc = cuda_malloc(byref(p), n)
        return rc, p.value or 0

    fake = imp_mem.FakeBackend(capacity=64 << 20, granularity=64 << 10)
    pool = imp_mem.ActivationPool(fake, 1 << 20, growable=True)
    _core.add_hook_region(pool, device=0)
    _core.set_hook_region(pool)

    rc, outside = malloc(4096)
    out["outside"] = [rc, owned(outside), counts()]
    try:
        with _preload.routing():
            rc, inside = malloc(5000)
            out["inside"] = [rc, owned(inside), pool.size_of(inside), counts()]
            with _preload.routing():
                out["nested_depth"] = _preload._depth()
            out["depth_after_inner"] = _preload._depth()
            ctypes.memmove(inside, b"preload!" * 625, 5000)
            out["paused_copy"] = pool.pause(cpu_backup=True)
            out["malloc_while_paused"] = malloc(64)
            pool.resume()
            out["bytes_kept"] = ctypes.string_at(inside, 5000) == b"preload!" * 625
            # A pointer imp-mem never handed out goes to the stand-in.
            out["free_foreign_routed"] = [cuda_free(outside), counts()]
    except BackendUnavailable as e:
        out["refused"] = str(e)
        print(json.dumps(out))
        sys.exit(0)
    out["depth_after"] = _preload._depth()
    live_before = pool.stats()["live"]
    freed = []
    t = threading.Thread(target=lambda: freed.append(cuda_free(inside)))
    t.start()
    t.join()
    out["free_home"] = [freed[0], live_before, pool.stats()["live"], counts()]
    out["free_null"] = [cuda_free(None), counts()]
    rc, after = malloc(64)
    out["after"] = [rc, owned(after), counts()]
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> tuple[str, str]:
    """The stand-in runtime and the framework library linked against it."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the stand-in libcudart")
    where = tmp_path_factory.mktemp("standin")
    (where / "standin.c").write_text(STANDIN_C)
    (where / "framework.c").write_text(FRAMEWORK_C)
    lib, fw = where / "libcudart_standin.so", where / "libframework.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(where / "standin.c")], check=True)
    link = [f"-L{where}", "-lcudart_standin", f"-Wl,-rpath,{where}"]
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(fw), str(where / "framework.c"), *link], check=True
    )
    return str(lib), str(fw)


@pytest.fixture(scope="module")
def interposer() -> str:
    try:
        return _preload.library_path()
    except BackendUnavailable as e:
        pytest.skip(f"the interposer is not built here: {e}")


def _child_env(env: dict[str, str]) -> dict[str, str]:
    out = dict(env)
    package_root = str(Path(imp_mem.__file__).resolve().parent.parent)
    out["PYTHONPATH"] = os.pathsep.join([package_root, out.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return out


def _run_child(tmp_path: Path, standin: tuple[str, str], env: dict[str, str]) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    done = subprocess.run(
        [sys.executable, str(script), *standin],
        env=_child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_calls_route_to_imp_mem_inside_routing_and_to_the_runtime_outside(
    tmp_path, standin, interposer
):
    env = _preload.subprocess_env()
    out = _run_child(tmp_path, standin, env)
    assert out["loaded"] is True
    # [malloc, free, sync] counts of the stand-in runtime.
    assert out["outside"] == [0, False, [1, 0, 0]], "outside routing: the runtime's"
    assert out["inside"] == [0, True, 5000, [1, 0, 0]], "inside: the region's, not the runtime's"
    assert (out["nested_depth"], out["depth_after_inner"], out["depth_after"]) == (2, 1, 0)
    assert out["paused_copy"] > 0
    assert out["malloc_while_paused"] == [2, 0], "cudaErrorMemoryAllocation while paused"
    assert out["bytes_kept"] is True
    # Freed inside routing, the runtime's pointer goes to the runtime (after a sync).
    assert out["free_foreign_routed"] == [0, [1, 1, 1]]
    # The region's block, freed on another thread outside any scope: home.
    assert out["free_home"] == [0, 1, 0, [1, 1, 2]]
    # cudaFree(NULL) is the runtime's, unsynchronised.
    assert out["free_null"] == [0, [1, 2, 2]]
    assert out["after"] == [0, False, [2, 2, 2]], "routing ended: the runtime's again"


def test_without_the_preload_only_the_runtime_answers_and_routing_refuses(tmp_path, standin):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = _run_child(tmp_path, standin, env)
    assert out["loaded"] is False
    assert out["outside"] == [0, False, [1, 0, 0]]
    assert "LD_PRELOAD" in out["refused"]
    assert "inside" not in out


def test_this_process_is_not_preloaded_so_routing_refuses():
    if _preload.LIBRARY_NAME in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("this test process was started with the interposer")
    assert _preload.loaded() is False
    with pytest.raises(BackendUnavailable, match="LD_PRELOAD"), _preload.routing():
        pass
    assert _preload._depth() == 0


def test_subprocess_env_prepends_the_interposer_once(interposer):
    env = {"LD_PRELOAD": f"/opt/a.so:{interposer} /opt/b.so", "KEEP": "1"}
    out = _preload.subprocess_env(env)
    assert out["LD_PRELOAD"] == f"{interposer}:/opt/a.so:/opt/b.so"
    assert out["KEEP"] == "1"
    assert env["LD_PRELOAD"] == f"/opt/a.so:{interposer} /opt/b.so", "a copy"
    assert _preload.subprocess_env({})["LD_PRELOAD"] == interposer
    assert _preload.subprocess_env(out)["LD_PRELOAD"] == out["LD_PRELOAD"]
    before = os.environ.get("LD_PRELOAD")
    assert _preload.subprocess_env()["LD_PRELOAD"].split(":")[0] == interposer
    assert os.environ.get("LD_PRELOAD") == before, "os.environ untouched"


def test_configure_subprocess_sets_ld_preload_for_children_and_restores_it(interposer, monkeypatch):
    probe = [sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD', ''))"]
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    with _preload.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == f"{interposer}:/opt/other.so"
        seen = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
        assert seen == f"{interposer}:/opt/other.so"
    assert os.environ["LD_PRELOAD"] == "/opt/other.so"
    monkeypatch.delenv("LD_PRELOAD")
    with pytest.raises(RuntimeError, match="inside"), _preload.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == interposer
        raise RuntimeError("inside")
    assert "LD_PRELOAD" not in os.environ, "unset again, even after an error"


def test_a_missing_interposer_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(_preload, "__file__", str(tmp_path / "_preload.py"))
    with pytest.raises(BackendUnavailable, match="reinstall imp-mem"):
        _preload.library_path()
    with pytest.raises(BackendUnavailable):
        _preload.subprocess_env({})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")
def test_an_installed_imp_mem_ships_the_interposer():
    if "site-packages" not in Path(imp_mem.__file__).resolve().parts:
        pytest.skip("imp_mem is imported from a source tree, not an installed wheel")
    path = Path(_preload.library_path())
    assert path.parent == Path(imp_mem.__file__).resolve().parent
    assert path.stat().st_size > 0

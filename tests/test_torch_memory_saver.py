"""imp-mem's torch_memory_saver drop-in on the CPU (issue 51): its state
machine over real imp-mem regions on the fake backend, torch's CUDA side
stood in for (``_torch_standins``). What a "tensor" of a region is here: a
block the region's tier hands out (what a torch segment would be), viewed
as a CPU tensor so that ``get_cpu_backup`` can take it. The GPU half
(torch_memory_saver's own suite, both hook modes, and the benchmark) is
``tools/gpu_tms_suite.sh``, one device call."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import types

import pytest
from _torch_standins import MemPoolStandIn, _Allocator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import imp_mem
from imp_mem import InvalidArgument, OutOfMemory

torch = pytest.importorskip("torch")
imt = pytest.importorskip("imp_mem.torch")
TorchMemorySaver = pytest.importorskip("imp_mem.torch_memory_saver").TorchMemorySaver
_impl = pytest.importorskip("imp_mem.torch_memory_saver._impl")

MIB = 1 << 20


@pytest.fixture
def fb(monkeypatch):
    """torch's CUDA side stood in for; every region on one fake backend."""
    backend = imp_mem.FakeBackend(capacity=256 * MIB, granularity=64 * 1024)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "MemPool", MemPoolStandIn)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 7 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 3 * MIB)
    monkeypatch.setattr(imt, "pluggable_allocator", lambda: _Allocator())
    monkeypatch.setattr(_impl._core, "VmmBackend", lambda device, **kw: backend)
    for var in ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "TMS_RETAIN_CPU_BACKUP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TMS_INIT_CPU_BACKUP_BACKEND", raising=False)
    yield backend
    for name in [n for n in imt.regions() if n.startswith(_impl.REGION_PREFIX)]:
        found = imt.regions()[name]
        if found.activations.asleep is not None:
            found.resume()
        for ptr in getattr(found, "_test_live", []):
            found.activations.free(ptr)
        imt.release_region(name)


def saver(mode: str = "torch") -> TorchMemorySaver:
    s = TorchMemorySaver()
    s.hook_mode = mode
    return s


def alloc(s: TorchMemorySaver, fb, tag: str, data: bytes, **region_kw) -> torch.Tensor:
    """A 'tensor' made in ``tag``'s region: a block of its tier filled with
    ``data``, viewed as a uint8 CPU tensor at the block's address."""
    with s.region(tag=tag, **region_kw):
        key = s._impl._key_now()
        found = s._impl._regions[key]
        ptr = found.activations.allocate(len(data))
    found.__dict__.setdefault("_test_live", []).append(ptr)
    fb.write(ptr, data)
    raw = (ctypes.c_uint8 * len(data)).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8)


def test_pause_keeps_the_backed_up_bytes_at_their_addresses_and_drops_the_rest(fb):
    s = saver()
    kept = bytes(range(256)) * 64
    x = alloc(s, fb, "default", kept, enable_cpu_backup=True)
    y = alloc(s, fb, "default", b"\x14" * 4096)  # same tag, no backup
    s.wait_pinned()
    s.pause()
    report = s.mem_report()["tags"]["default"]
    assert report["paused"] and report["device_bytes"] == 0
    assert report["host_bytes"] >= len(kept)
    backup = s.get_cpu_backup(x)
    assert bytes(backup.numpy()) == kept
    s.resume()
    assert fb.read(x.data_ptr(), len(kept)) == kept, "same address, same bytes"
    assert fb.read(y.data_ptr(), 4) != b"\x14" * 4, "no backup: the bytes were dropped"
    assert s.get_cpu_backup(x) is None, "the backup is given back (retain_cpu_backup False)"
    assert s.mem_report()["tags"]["default"]["host_bytes"] == 0


def test_the_host_buffer_is_pinned_ahead_so_the_first_pause_pins_nothing(fb):
    s = saver()
    alloc(s, fb, "w", b"\x01" * (3 * MIB), enable_cpu_backup=True)
    s.wait_pinned()
    found = s._impl._regions[_impl.Key("w", "pinned", 0)]
    assert found.activations.host_bytes >= 3 * MIB, "pinned when the region was left"
    before = imp_mem.pinned_stats()
    s.pause("w")
    after = imp_mem.pinned_stats()
    assert after["live_bytes"] == before["live_bytes"], "the pause reused the buffer"
    s.resume("w")
    # mmap backups take host memory only while paused: nothing ahead.
    alloc(s, fb, "m", b"\x02" * MIB, enable_cpu_backup=True, cpu_backup_backend="mmap")
    s.wait_pinned()
    assert s._impl._regions[_impl.Key("m", "mmap", 0)].activations.host_bytes == 0


def test_retain_keeps_the_backup_at_the_same_address_between_rounds(fb):
    s = saver()
    data = b"\x2a" * 8192
    x = alloc(s, fb, "kv", data, enable_cpu_backup=True)
    s.retain_cpu_backup = True
    s.pause("kv")
    first = s.get_cpu_backup(x, zero_copy=True)
    s.resume("kv")
    kept = s.get_cpu_backup(x, zero_copy=True)
    assert kept.data_ptr() == first.data_ptr()
    assert bytes(kept.numpy()) == data
    fb.write(x.data_ptr(), b"\x07" * 8192)
    s.pause("kv")
    again = s.get_cpu_backup(x, zero_copy=True)
    assert again.data_ptr() == first.data_ptr() and bytes(again.numpy()) == b"\x07" * 8192
    s.retain_cpu_backup = False
    s.resume("kv")
    assert s.get_cpu_backup(x) is None
    assert s.mem_report()["tags"]["kv"]["host_bytes"] == 0, "no pinned memory left behind"


def test_pause_twice_resume_unpaused_and_unknown_tags(fb):
    s = saver()
    alloc(s, fb, "a", b"\x01" * 1024, enable_cpu_backup=True)
    alloc(s, fb, "b", b"\x02" * 1024)
    s.pause("nope")  # a tag never used: nothing to do, as in the original
    s.resume("nope")
    with pytest.raises(InvalidArgument, match="not paused"):
        s.resume()
    s.pause("a")
    with pytest.raises(InvalidArgument, match="already paused"):
        s.pause("a")
    with pytest.raises(InvalidArgument, match="already paused"):
        s.pause()  # "b" is not paused by the refused call either
    assert s.mem_report()["tags"]["b"]["paused"] is False
    with pytest.raises(InvalidArgument, match="not paused"):
        s.resume()  # "a" stays paused: all or nothing
    assert s.mem_report()["tags"]["a"]["paused"] is True
    with pytest.raises(InvalidArgument, match="paused"), s.region(tag="a"):
        pass
    s.resume("a")
    with pytest.raises(InvalidArgument, match="tag"):
        s.pause(3)


def test_a_resume_that_does_not_fit_names_torchs_cache_and_leaves_all_paused(fb, monkeypatch):
    s = saver()
    alloc(s, fb, "a", b"\x01" * 4096, enable_cpu_backup=True)
    alloc(s, fb, "b", b"\x02" * 4096, enable_cpu_backup=True)
    s.pause()
    real = imt.Region.resume

    def resume(region):
        if ":b:" in region.tag:
            raise OutOfMemory("no room")
        real(region)

    monkeypatch.setattr(imt.Region, "resume", resume)
    with pytest.raises(OutOfMemory, match=r"torch's cache holds unused.*4194304 B") as err:
        s.resume()
    assert "stays paused" in str(err.value)
    tags = s.mem_report()["tags"]
    assert tags["a"]["paused"] and tags["b"]["paused"], "nothing left half-resumed"
    monkeypatch.setattr(imt.Region, "resume", real)
    s.resume()
    assert fb.read(s._impl._regions[_impl.Key("a", "pinned", 0)].activations.base, 1) is not None


def test_the_memory_margin_refuses_a_resume_that_would_leave_too_little(fb, monkeypatch):
    s = saver()
    alloc(s, fb, "a", b"\x01" * MIB, enable_cpu_backup=True)
    s.pause()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (2 * MIB, 80 * MIB))
    s.memory_margin_bytes = 2 * MIB
    with pytest.raises(OutOfMemory, match="memory_margin_bytes"):
        s.resume()
    assert s.mem_report()["tags"]["a"]["paused"]
    s.memory_margin_bytes = 0
    s.resume()
    with pytest.raises(InvalidArgument, match="memory_margin_bytes"):
        s.memory_margin_bytes = -1


def test_get_cpu_backup_refuses_what_the_original_crashes_on(fb):
    s = saver()
    x = alloc(s, fb, "nob", b"\x01" * 1024)
    s.pause("nob")
    with pytest.raises(InvalidArgument, match="without a CPU backup"):
        s.get_cpu_backup(x)
    s.resume("nob")
    with pytest.raises(InvalidArgument, match="not allocated in a torch_memory_saver region"):
        s.get_cpu_backup(torch.zeros(4))
    with pytest.raises(InvalidArgument, match="contiguous"):
        s.get_cpu_backup(torch.zeros(4, 4).t())


def test_disable_hook_mode_and_region_arguments(fb):
    s = saver()
    with pytest.raises(InvalidArgument, match="disable"), s.disable():
        pass
    with s.region(tag="t"), s.disable():
        assert s._impl._binary_wrapper.cdll.tms_get_interesting_region() is False
    with pytest.raises(InvalidArgument, match="hook_mode"):
        s.hook_mode = "preload"  # fixed once the saver runs
    with pytest.raises(InvalidArgument, match="hook_mode"):
        TorchMemorySaver().hook_mode = "cuda"
    with (
        pytest.raises(ValueError, match="requires enable_cpu_backup"),
        s.region(cpu_backup_backend="mmap"),
    ):
        pass
    with (
        pytest.raises(InvalidArgument, match="cpu_backup_backend"),
        s.region(enable_cpu_backup=True, cpu_backup_backend="disk"),
    ):
        pass
    with (
        pytest.raises(imp_mem.BackendUnavailable, match="enable_cpu_backup"),
        s.region(enable_disk_backup=True),
    ):
        pass
    with pytest.raises(InvalidArgument, match="tag"), s.region(tag=""):
        pass


def test_regions_nest_and_restore_the_outer_configuration(fb, monkeypatch):
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "mmap")
    s = saver()
    s._ensure_initialized()
    cdll = s._impl._binary_wrapper.cdll
    assert cdll.tms_get_current_tag() == b"default"
    assert cdll.tms_get_cpu_backup_backend() == b"mmap"
    with s.region(tag="outer", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        with s.region(tag="inner"):
            assert cdll.tms_get_current_tag() == b"inner"
            assert not cdll.tms_get_enable_cpu_backup()
        assert cdll.tms_get_current_tag() == b"outer"
        assert cdll.tms_get_enable_cpu_backup()
    assert cdll.tms_get_current_tag() == b"default"
    assert not cdll.tms_get_interesting_region()
    with s._impl._with_region_config(tag="x", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        assert cdll.tms_get_current_tag() == b"x" and cdll.tms_get_interesting_region()
        assert cdll.tms_get_cpu_backup_backend() == b"pinned"
    assert cdll.tms_get_cpu_backup_backend() == b"mmap"


def test_the_environment_sets_the_start(fb, monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")
    assert saver().retain_cpu_backup is True
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "maybe")
    with pytest.raises(InvalidArgument, match="TMS_RETAIN_CPU_BACKUP"):
        saver().retain_cpu_backup  # noqa: B018


def test_every_region_shows_in_the_memory_report_under_its_tag(fb):
    s = saver()
    alloc(s, fb, "weights", b"\x01" * (2 * MIB), enable_cpu_backup=True)
    alloc(s, fb, "kv_cache", b"\x02" * MIB)
    report = s.mem_report()
    assert report["hook_mode"] == "torch"
    assert report["tags"]["weights"]["live_bytes"] >= 2 * MIB
    assert report["tags"]["kv_cache"]["live_bytes"] >= MIB
    assert report["tags"]["weights"]["device_bytes"] >= 2 * MIB
    ledger = report["backends"][0]
    assert ledger["tags"]["activations"]["committed"] >= 3 * MIB, "the backend's ledger holds them"


class FakePreload(types.ModuleType):
    """Stands in for ``imp_mem._preload`` (the interposer's Python side)."""

    def __init__(self, loaded: bool = True) -> None:
        super().__init__("imp_mem._preload")
        self.is_loaded = loaded
        self.routed: list[object] = []

    def library_path(self) -> str:
        return "/fake/libimp_mem_preload.so"

    def loaded(self) -> bool:
        return self.is_loaded

    @contextlib.contextmanager
    def routing(self):
        self.routed.append(imt._region_stack()[-1])
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    # The interposer's per-thread routing depth, as _preload's private
    # depth calls reach it.
    depth = 0

    def _depth(self) -> int:
        return self.depth

    def _interposer(self):
        return self

    def _depth_call(self, lib, name: str) -> int:
        self.depth += 1 if name.endswith("enter") else -1
        return self.depth

    def subprocess_env(self, env=None):
        env = dict(os.environ if env is None else env)
        env["LD_PRELOAD"] = self.library_path()
        return env


def test_preload_mode_routes_the_region_through_the_interposer(fb, monkeypatch):
    fake = FakePreload()
    monkeypatch.setitem(sys.modules, "imp_mem._preload", fake)
    monkeypatch.setattr(imp_mem, "_preload", fake, raising=False)
    s = saver("preload")
    with s.region(tag="train", enable_cpu_backup=True):
        pass
    found = s._impl._regions[_impl.Key("train", "pinned", 0)]
    assert fake.routed == [found.activations], "routed to the region's tier on this thread"
    s.pause("train")
    s.resume("train")


def test_preload_mode_without_the_interposer_says_how_to_start_it(fb, monkeypatch):
    fake = FakePreload(loaded=False)
    monkeypatch.setitem(sys.modules, "imp_mem._preload", fake)
    monkeypatch.setattr(imp_mem, "_preload", fake, raising=False)
    with pytest.raises(imp_mem.BackendUnavailable, match="configure_subprocess"):
        saver("preload").pause()


def test_preload_mode_with_tms_init_enable_catches_allocations_from_the_start(fb, monkeypatch):
    fake = FakePreload()
    monkeypatch.setitem(sys.modules, "imp_mem._preload", fake)
    monkeypatch.setattr(imp_mem, "_preload", fake, raising=False)
    monkeypatch.setenv("TMS_INIT_ENABLE", "1")
    monkeypatch.setenv("TMS_INIT_ENABLE_CPU_BACKUP", "1")
    s = saver("preload")  # setting the mode starts the routing, as the original's first malloc
    assert _impl.Key("default", "pinned", 0) in s._impl._regions
    assert len(fake.routed) == 1 and fake.depth == 1
    with s.disable():
        assert fake.depth == 0, "cudaMalloc goes to the driver inside disable()"
    assert fake.depth == 1
    s._impl._init_route.close()
    assert fake.depth == 0


def test_configure_subprocess_prepends_the_interposer_and_restores(fb, monkeypatch):
    from imp_mem.torch_memory_saver import configure_subprocess

    fake = FakePreload()
    monkeypatch.setitem(sys.modules, "imp_mem._preload", fake)
    monkeypatch.setattr(imp_mem, "_preload", fake, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == "/fake/libimp_mem_preload.so:/other.so"
    assert os.environ["LD_PRELOAD"] == "/other.so"
    monkeypatch.delenv("LD_PRELOAD")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == "/fake/libimp_mem_preload.so"
    assert "LD_PRELOAD" not in os.environ


def test_a_pool_taken_out_and_dropped_releases_its_region_and_host_buffer(fb):
    s = saver()
    x = alloc(s, fb, "gone", b"\x05" * 4096, enable_cpu_backup=True)
    s.retain_cpu_backup = True
    s.pause("gone")
    assert s.get_cpu_backup(x) is not None
    key = ("gone", True, False, "pinned", 0)
    assert key in s._impl._mem_pools
    ref = s._impl._mem_pools.pop(key)
    found = s._impl._regions[_impl.Key("gone", "pinned", 0)]
    for ptr in found._test_live:  # the tensor freed while paused
        found.activations.free(ptr)
    found._test_live = []
    live_before = imp_mem.pinned_stats()["live_bytes"]
    del ref
    assert "gone" not in s.mem_report()["tags"]
    assert imp_mem.pinned_stats()["live_bytes"] < live_before, "the host buffer went with it"
    with pytest.raises(InvalidArgument, match="not allocated"):
        s.get_cpu_backup(x)


TAGS = ("a", "b", "c")
OPS = st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from(TAGS), st.booleans(), st.integers(1, 9000)),
    st.tuples(st.just("pause"), st.sampled_from((*TAGS, None, "never"))),
    st.tuples(st.just("resume"), st.sampled_from((*TAGS, None, "never"))),
    st.tuples(st.just("retain"), st.booleans()),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(OPS, max_size=14))
def test_any_sequence_is_all_or_nothing_and_keeps_the_backed_up_bytes(fb, ops):
    try:
        _run_sequence(fb, ops)
    finally:
        _drop_regions()


def _drop_regions() -> None:
    for name in [n for n in imt.regions() if n.startswith(_impl.REGION_PREFIX)]:
        found = imt.regions()[name]
        if found.activations.asleep is not None:
            found.resume()
        for ptr in getattr(found, "_test_live", []):
            found.activations.free(ptr)
        found._test_live = []
        imt.release_region(name)


def _run_sequence(fb, ops) -> None:
    s = saver()
    s._ensure_initialized()
    paused: set[str] = set()  # the model: tags paused now
    kept: list[tuple[torch.Tensor, bytes]] = []  # backed-up tensors and their bytes
    tags_made: set[str] = set()
    for op in ops:
        if op[0] == "alloc":
            _, tag, backup, n = op
            if tag in paused:
                with pytest.raises(InvalidArgument, match="paused"):
                    alloc(s, fb, tag, b"\x01" * n, enable_cpu_backup=backup)
                continue
            data = bytes((i * 7 + n) % 251 for i in range(n))
            x = alloc(s, fb, tag, data, enable_cpu_backup=backup)
            tags_made.add(tag)
            if backup:
                kept.append((x, data))
        elif op[0] in ("pause", "resume"):
            name, tag = op
            chosen = {t for t in tags_made if tag is None or t == tag}
            wrong = chosen & paused if name == "pause" else chosen - paused
            if wrong:
                with pytest.raises(InvalidArgument):
                    getattr(s, name)(tag)
            else:
                getattr(s, name)(tag)
                paused = paused | chosen if name == "pause" else paused - chosen
        else:
            s.retain_cpu_backup = op[1]
        report = s.mem_report()["tags"]
        assert {t for t, r in report.items() if r["paused"]} == paused, "state is the model's"
        for x, data in kept:
            if not any(k.tag in paused for k, r in s._impl._regions.items() if _owns(r, x)):
                assert fb.read(x.data_ptr(), len(data)) == data, "an awake backed-up tensor"
            else:
                assert bytes(s.get_cpu_backup(x).numpy()) == data, "a paused one's backup"


def _owns(found, x) -> bool:
    act = found.activations
    return act.base <= x.data_ptr() < act.base + act.capacity

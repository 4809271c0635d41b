"""The measured-reserve cache and its arithmetic (`imp_mem.reserve`): the
fingerprint's key, the file's format, the charges from readings and the
10 % self-check. None of it needs a GPU."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import imp_mem
from imp_mem import reserve

MIB = 1 << 20

H200 = {
    "gpu_name": "NVIDIA H200",
    "driver_version": "580.95.05",
    "cuda_version": "13.0",
    "libraries": {"torch": "2.9.0", "cublas": "13.0.0"},
}


def test_fingerprint_key_is_stable():
    key = reserve.fingerprint_key(H200)
    assert key == "gpu=NVIDIA H200;driver=580.95.05;cuda=13.0;cublas=13.0.0;torch=2.9.0"
    with pytest.raises(imp_mem.InvalidArgument, match="gpu_name"):
        reserve.fingerprint_key({"driver_version": "1", "cuda_version": "2"})


def test_reserve_cache_round_trip(tmp_path):
    path = tmp_path / "cache" / "reserve.json"
    assert reserve.lookup(path, H200) is None
    measured = {"context_bytes": 527 * MIB, "library_reserve_bytes": 66 * MIB, "samples": 5}
    reserve.store(measured, path, fp=H200)
    hit = reserve.lookup(path, H200)
    assert hit["context_bytes"] == 527 * MIB and hit["library_reserve_bytes"] == 66 * MIB
    assert hit["samples"] == 5 and hit["key"] == reserve.fingerprint_key(H200)
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == "imp-mem-reserve-cache" and on_disk["version"] == 1
    (entry,) = on_disk["entries"].values()
    assert entry["fingerprint"] == H200
    assert entry["measurement"] == {"context_bytes": 527 * MIB, "library_reserve_bytes": 66 * MIB}
    other = dict(H200, driver_version="590.1")
    assert reserve.lookup(path, other) is None
    reserve.store({"context_bytes": 1, "library_reserve_bytes": 2}, path, fp=other)
    assert len(json.loads(path.read_text())["entries"]) == 2
    assert reserve.lookup(path, H200)["context_bytes"] == 527 * MIB
    assert not list(path.parent.glob(".reserve-*")), "a temporary file left behind"


def test_a_file_written_before_the_cache_moved_to_python_still_reads(tmp_path):
    """The format the Rust cache wrote (pretty JSON, a trailing newline)."""
    path = tmp_path / "reserve.json"
    entry = {
        "fingerprint": H200,
        "measurement": {"context_bytes": 527 * MIB, "library_reserve_bytes": 66 * MIB},
        "measured_unix_s": 1_764_000_000,
        "samples": 3,
    }
    data = {
        "format": "imp-mem-reserve-cache",
        "version": 1,
        "entries": {reserve.fingerprint_key(H200): entry},
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    hit = reserve.lookup(path, H200)
    assert (hit["library_reserve_bytes"], hit["samples"]) == (66 * MIB, 3)
    assert hit["measured_unix_s"] == 1_764_000_000


@pytest.mark.parametrize(
    "text",
    [
        "{broken",
        json.dumps({"format": "something-else", "version": 1, "entries": {}}),
        json.dumps({"format": "imp-mem-reserve-cache", "version": 1}),
    ],
    ids=["not-json", "foreign", "no-entries"],
)
def test_a_file_that_is_not_a_cache_is_an_error_naming_it_and_the_next_store_replaces_it(
    tmp_path, text
):
    path = tmp_path / "reserve.json"
    path.write_text(text)
    with pytest.raises(imp_mem.InvalidArgument, match="delete it") as info:
        reserve.lookup(path, H200)
    assert str(path) in str(info.value)
    reserve.store({"context_bytes": 1, "library_reserve_bytes": 2}, path, fp=H200)
    assert reserve.lookup(path, H200)["library_reserve_bytes"] == 2


def test_a_newer_cache_is_refused_and_never_overwritten(tmp_path):
    path = tmp_path / "reserve.json"
    newer = json.dumps({"format": "imp-mem-reserve-cache", "version": 2, "entries": {}})
    path.write_text(newer)
    with pytest.raises(imp_mem.InvalidArgument, match="newer"):
        reserve.lookup(path, H200)
    with pytest.raises(imp_mem.InvalidArgument, match="newer"):
        reserve.store({"context_bytes": 1, "library_reserve_bytes": 2}, path, fp=H200)
    assert path.read_text() == newer


def test_self_check_flags_over_ten_percent():
    expected = {"context_bytes": 527 * MIB, "library_reserve_bytes": 66 * MIB}
    fine = reserve.compare(expected, dict(expected, library_reserve_bytes=72 * MIB))
    assert not fine["diverged"] and "hold" in fine["message"]
    far = reserve.compare(expected, dict(expected, library_reserve_bytes=74 * MIB), fp=H200)
    assert far["diverged"] and "NVIDIA H200" in far["message"]
    assert far["library_divergence"] == pytest.approx(8 / 66)
    line = "library reserve measured 74.0 MiB against 66.0 MiB remembered (+12.1 %)"
    assert line in far["message"]
    with pytest.raises(imp_mem.InvalidArgument, match="tolerance"):
        reserve.compare(expected, expected, tolerance=-1.0)


def test_a_zero_charge_is_measured_against_a_floor():
    # A remembered 0 does not make every later reading infinitely divergent.
    zero = {"context_bytes": 0, "library_reserve_bytes": 0}
    check = reserve.compare(zero, {"context_bytes": MIB // 16, "library_reserve_bytes": 0})
    assert check["context_divergence"] == 1 / 16 and not check["diverged"]


def test_readings_give_the_charges():
    r = {
        "free_before_context": 140_000 * MIB,
        "free_after_context": 140_000 * MIB - 527 * MIB,
        "used_before_library": 1000 * MIB,
        "allocator_before_library": 200 * MIB,
        "used_after_library": 1086 * MIB,
        "allocator_after_library": 220 * MIB,
    }
    assert reserve.charges_from(r) == {
        "context_bytes": 527 * MIB,
        "library_reserve_bytes": 66 * MIB,
    }
    with pytest.raises(imp_mem.InvalidArgument, match="used_after_library"):
        reserve.charges_from({k: v for k, v in r.items() if k != "used_after_library"})


@given(
    st.lists(st.integers(0, 1 << 40), min_size=6, max_size=6),
)
def test_the_charges_are_never_negative_and_never_exceed_the_growth(values):
    r = dict(zip(reserve._READINGS, values, strict=True))
    charges = reserve.charges_from(r)
    assert 0 <= charges["context_bytes"] <= r["free_before_context"]
    growth = max(0, r["used_after_library"] - r["used_before_library"])
    assert 0 <= charges["library_reserve_bytes"] <= growth


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 40))
def test_the_divergence_is_the_distance_over_the_floored_expectation(expected, observed):
    e = {"context_bytes": expected, "library_reserve_bytes": expected}
    o = {"context_bytes": observed, "library_reserve_bytes": observed}
    check = reserve.compare(e, o)
    want = abs(observed - expected) / max(expected, MIB)
    assert check["context_divergence"] == pytest.approx(want)
    assert check["diverged"] == (want > 0.10)

//! Token ids read straight out of a NumPy array's object, without the buffer
//! protocol.
//!
//! Exporting a buffer costs NumPy about 50 ns (it builds a format string and
//! a shape), a quarter of a small `admit`. An exact `numpy.ndarray` that is
//! one-dimensional, C-contiguous, aligned and of native-endian `int32` or
//! `uint32` is read here instead: its data pointer and length come from the
//! array's C struct, whose leading fields NumPy's own C API macros
//! (`PyArray_DATA`, `PyArray_NDIM`, `PyArray_DIMS`, `PyArray_DESCR`,
//! `PyArray_FLAGS`) read at fixed offsets, so the layout is part of NumPy's
//! ABI, identical in NumPy 1.x and 2.x (`numpy/ndarraytypes.h`,
//! `PyArrayObject_fields`; 2.0 kept the descriptor's leading fields in place
//! too, `_former_flags` included).
//!
//! The reader never trusts that: it is turned on only for NumPy 1 and 2, and
//! only after a self-check on arrays it builds itself agrees with what NumPy
//! reports through Python (the data address from `__array_interface__`,
//! checked before any pointer in the struct is followed; the length; which
//! arrays qualify). Anything else — another dtype, a strided view, a
//! subclass, a failed self-check — goes through the buffer protocol as
//! before. `_core._set_numpy_direct(False)` turns the reader off, so the
//! tests run every path.
//!
//! The ids are lent out as a slice borrowed from the array argument: valid
//! while the caller holds it, exactly as a buffer export's memory is (NumPy
//! keeps no count of exports either; only `resize(refcheck=False)` or
//! assigning `.data`, both documented as unsafe, could move the memory).
//!
//! A NumPy array of integers that exports no C-contiguous buffer (a strided
//! view) is read by the copying path, [`copied_ids`]: one `tobytes()` and
//! two attribute reads, the dtype's layout cached.

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use imp_mem_core::kv::tokens::{self as rule, IntLayout};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PySlice};

use crate::errors::IntoPyResult;

/// The leading fields of NumPy's `PyArrayObject_fields` (some are here only
/// to place the next at its offset).
#[repr(C)]
#[allow(dead_code)]
struct ArrayHead {
    ob_base: ffi::PyObject,
    data: *mut c_char,
    nd: c_int,
    dimensions: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    base: *mut ffi::PyObject,
    descr: *mut DescrHead,
    flags: c_int,
}

/// The leading fields of NumPy's `PyArray_Descr` (1.x and 2.x alike).
#[repr(C)]
#[allow(dead_code)]
struct DescrHead {
    ob_base: ffi::PyObject,
    typeobj: *mut ffi::PyObject,
    kind: c_char,
    type_char: c_char,
    byteorder: c_char,
}

/// `NPY_ARRAY_C_CONTIGUOUS`.
const C_CONTIGUOUS: c_int = 0x0001;
/// `NPY_ARRAY_ALIGNED`.
const ALIGNED: c_int = 0x0100;

/// The type objects compared against, held so their addresses stay theirs.
struct Types {
    ndarray: Py<PyAny>,
    int32: Py<PyAny>,
    uint32: Py<PyAny>,
}

/// Set once NumPy has been imported (by anyone) and the self-check ran:
/// `None` when it failed or NumPy's major version is not 1 or 2.
static TYPES: PyOnceLock<Option<Types>> = PyOnceLock::new();
/// `sys.modules`, to find NumPy without importing it.
static SYS_MODULES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
/// The test hook's switch.
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the reader on or off (a test hook); returns whether it was on.
pub fn set_enabled(on: bool) -> bool {
    ENABLED.swap(on, Ordering::Relaxed)
}

/// Whether the reader would be used: on, and NumPy found and self-checked.
pub fn active(py: Python<'_>) -> bool {
    ENABLED.load(Ordering::Relaxed) && types(py).is_some()
}

/// The ids of `obj` in place, and whether they are signed (`int32`, which
/// the caller must check non-negative), when `obj` is an exact
/// `numpy.ndarray` the reader handles; `None` for anything else.
pub fn int32_ids<'a>(obj: &'a Bound<'_, PyAny>) -> Option<(&'a [u32], bool)> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    let types = types(obj.py())?;
    read(types, obj)
}

fn types(py: Python<'_>) -> Option<&'static Types> {
    if let Some(t) = TYPES.get(py) {
        return t.as_ref();
    }
    // Not decided yet: only once NumPy is imported is there anything to
    // read, and importing it here would cost every user who has none.
    let numpy = loaded_numpy(py).ok().flatten()?;
    let checked = build(&numpy).ok().flatten();
    TYPES.get_or_init(py, || checked).as_ref()
}

/// The `numpy` module if someone imported it (looked up in `sys.modules`,
/// never imported here).
pub fn loaded_numpy(py: Python<'_>) -> PyResult<Option<Bound<'_, PyAny>>> {
    let modules = SYS_MODULES.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("sys")?.getattr("modules")?.unbind())
    })?;
    match modules.bind(py).cast::<PyDict>() {
        Ok(modules) => modules.get_item("numpy"),
        Err(_) => Ok(None),
    }
}

/// The type objects, if NumPy's major version is one whose layout is known
/// and the self-check passes.
fn build(numpy: &Bound<'_, PyAny>) -> PyResult<Option<Types>> {
    let version: String = numpy.getattr("__version__")?.extract()?;
    if !matches!(version.split('.').next(), Some("1" | "2")) {
        return Ok(None);
    }
    let dtype = numpy.getattr("dtype")?;
    let types = Types {
        ndarray: numpy.getattr("ndarray")?.unbind(),
        int32: dtype.call1(("int32",))?.getattr("type")?.unbind(),
        uint32: dtype.call1(("uint32",))?.getattr("type")?.unbind(),
    };
    Ok(self_check(numpy, &types)?.then_some(types))
}

/// Reads arrays built here both ways and compares.
fn self_check(numpy: &Bound<'_, PyAny>, types: &Types) -> PyResult<bool> {
    let py = numpy.py();
    let arange = numpy.getattr("arange")?;
    let array = |n: usize, dtype: &str| {
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", dtype)?;
        arange.call((n,), Some(&kwargs))
    };
    for (dtype, signed) in [("int32", true), ("uint32", false)] {
        let a = array(5, dtype)?;
        // The data address first, through Python: if the struct's layout
        // were not the expected one, no pointer in it may be followed.
        let (address, _): (usize, bool) = a
            .getattr("__array_interface__")?
            .get_item("data")?
            .extract()?;
        // SAFETY: `a` is a live exact ndarray (built by `arange` just
        // above), so its object is at least `PyArrayObject_fields` long and
        // its first field after the header is the data pointer; only that
        // field is read here.
        let data = unsafe { (*(a.as_ptr() as *const ArrayHead)).data } as usize;
        if data != address || !a.get_type().is(types.ndarray.bind(a.py())) {
            return Ok(false);
        }
        match read(types, &a) {
            Some((ids, s)) if ids == [0, 1, 2, 3, 4] && s == signed => {}
            _ => return Ok(false),
        }
    }
    // And what must not qualify: a strided view, a 2-D array, a foreign
    // byte order, another width.
    let strided = array(10, "int32")?.get_item(PySlice::new(py, 0, 10, 2))?;
    let refused = [
        strided,
        array(4, "int32")?.call_method1("reshape", ((2, 2),))?,
        array(
            5,
            if cfg!(target_endian = "big") {
                "<i4"
            } else {
                ">i4"
            },
        )?,
        array(5, "int64")?,
    ];
    Ok(refused.iter().all(|r| read(types, r).is_none()))
}

fn read<'a>(types: &Types, obj: &'a Bound<'_, PyAny>) -> Option<(&'a [u32], bool)> {
    // SAFETY: `obj` is a live object (borrowed), whose header holds its type.
    let ty = unsafe { ffi::Py_TYPE(obj.as_ptr()) };
    if ty.cast::<ffi::PyObject>() != types.ndarray.as_ptr() {
        return None;
    }
    // SAFETY: `obj` is an exact `numpy.ndarray` (the type compared above is
    // the one NumPy's module holds), so it begins with the fields of
    // `ArrayHead`: NumPy's ABI for 1.x and 2.x, verified for this process
    // by `self_check` before `types` existed. `obj` is borrowed for `'a`,
    // so the array is alive while this reads it.
    let head = unsafe { &*(obj.as_ptr() as *const ArrayHead) };
    let wanted = C_CONTIGUOUS | ALIGNED;
    if head.nd != 1 || head.flags & wanted != wanted || head.descr.is_null() {
        return None;
    }
    // SAFETY: a live array's `descr` is its (non-null, checked) dtype object,
    // which begins with `DescrHead` in NumPy 1.x and 2.x; the array holds a
    // reference to it.
    let descr = unsafe { &*head.descr };
    let native = if cfg!(target_endian = "big") {
        b'>'
    } else {
        b'<'
    };
    if !(descr.byteorder as u8 == b'=' || descr.byteorder as u8 == native) {
        return None;
    }
    let signed = if descr.typeobj == types.int32.as_ptr() {
        true
    } else if descr.typeobj == types.uint32.as_ptr() {
        false
    } else {
        return None;
    };
    // SAFETY: `nd == 1`, so `dimensions` points to one length.
    let len = usize::try_from(unsafe { *head.dimensions }).ok()?;
    if len == 0 {
        return Some((&[], signed));
    }
    // One-dimensional and C-contiguous means a stride of one item (NumPy
    // lets a length-1 dimension carry any stride; its one item is at
    // `data` regardless).
    // SAFETY: as for `dimensions`, one stride.
    if (len > 1 && unsafe { *head.strides } != 4)
        || head.data.is_null()
        || head.data.align_offset(4) != 0
    {
        return None;
    }
    // SAFETY: the array owns (or its base keeps alive) `len` contiguous
    // 4-byte items at `data`, aligned (checked), for as long as the array
    // lives and is not resized; `obj` is borrowed for `'a`. The callers run
    // no Python code while they use the slice; a thread that runs while a
    // large call has released the GIL could move the memory only through
    // NumPy's documented-unsafe `resize(refcheck=False)` or `.data`
    // assignment, which would pull a buffer export's memory away just the
    // same. Every bit pattern is a valid `u32`; int32 ids are checked
    // non-negative by the caller (`signed`).
    let ids = unsafe { std::slice::from_raw_parts(head.data as *const u32, len) };
    Some((ids, signed))
}

/// `numpy.ndarray`, once NumPy has been imported by someone.
static NDARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
/// NumPy dtypes seen so far and how to read them, `None` for a non-integer
/// dtype. Holding each dtype keeps its identity (the pointer compared) from
/// being reused.
type DtypeLayout = Option<IntLayout>;
static DTYPES: Mutex<Vec<(Py<PyAny>, DtypeLayout)>> = Mutex::new(Vec::new());

fn ndarray_type<'py>(py: Python<'py>) -> PyResult<Option<&'py Bound<'py, PyAny>>> {
    if let Some(t) = NDARRAY.get(py) {
        return Ok(Some(t.bind(py)));
    }
    let Some(numpy) = loaded_numpy(py)? else {
        return Ok(None);
    };
    let t = numpy.getattr("ndarray")?.unbind();
    Ok(Some(NDARRAY.get_or_init(py, || t).bind(py)))
}

/// Token ids from an exact `numpy.ndarray` of integers: one `tobytes()` and
/// two attribute reads, the dtype's layout cached. `None` for anything
/// else (and for what the buffer path refuses, so its errors stay the same).
pub fn copied_ids(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    let py = obj.py();
    let Some(ndarray) = ndarray_type(py)? else {
        return Ok(None);
    };
    if !obj.get_type().is(ndarray) {
        return Ok(None);
    }
    let dtype = obj.getattr(intern!(py, "dtype"))?;
    let known = {
        let cache = DTYPES.lock().unwrap_or_else(|p| p.into_inner());
        cache.iter().find(|(d, _)| d.is(&dtype)).map(|(_, l)| *l)
    };
    let layout = match known {
        Some(layout) => layout,
        None => {
            let kind: String = dtype.getattr(intern!(py, "kind"))?.extract()?;
            let size: usize = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
            let order: String = dtype.getattr(intern!(py, "byteorder"))?.extract()?;
            let big = match order.as_str() {
                ">" => true,
                "<" => false,
                _ => cfg!(target_endian = "big"),
            };
            let layout = match kind.as_str() {
                "i" | "u" if matches!(size, 1 | 2 | 4 | 8) => Some(IntLayout {
                    size,
                    signed: kind == "i",
                    big_endian: big,
                }),
                _ => None,
            };
            let mut cache = DTYPES.lock().unwrap_or_else(|p| p.into_inner());
            if cache.len() < 32 {
                cache.push((dtype.unbind(), layout));
            }
            layout
        }
    };
    let Some(layout) = layout else {
        return Ok(None);
    };
    let ndim: usize = obj.getattr(intern!(py, "ndim"))?.extract()?;
    if ndim > 1 {
        return Ok(None);
    }
    let raw = obj.call_method0(intern!(py, "tobytes"))?;
    rule::ids_from_bytes(raw.cast::<PyBytes>()?.as_bytes(), layout)
        .py()
        .map(Some)
}

//! A Python buffer read in place, through the CPython buffer protocol.
//!
//! `PyObject_GetBuffer`, `PyBuffer_Release` and `Py_buffer` are in the
//! stable ABI from Python 3.11, the wheel's floor, and pyo3-ffi declares them
//! for it. (pyo3's own `PyBuffer` is not used: it always asks for
//! `PyBUF_FULL_RO`, so it cannot ask for a writable or a C-contiguous export,
//! and its drop re-attaches to the interpreter to release.)
//!
//! A [`BufferView`] holds one export, asked for C-contiguous and with its
//! format (`PyBUF_FORMAT | PyBUF_ND`), and releases it on drop. It borrows
//! the GIL lifetime `'py` and is neither `Send` nor `Sync`, so it cannot be
//! moved into (or dropped inside) `detach`: `PyBuffer_Release` always
//! runs with the GIL held. What it lends out — bytes or `u32` words — is
//! plain memory that the exporter keeps valid until the release, so those
//! slices may be read with the GIL released.
//!
//! What has no C-contiguous export (a strided view) is read by the copying
//! path instead, [`copied_ids`]: a `memoryview`, copied once to bytes.

use std::borrow::Cow;
use std::ffi::{c_int, CStr};
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};

use imp_mem_core::kv::tokens::{self as rule, IntLayout};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyString};

use crate::convert::type_name;
use crate::errors::{invalid, IntoPyResult};

/// Whether [`BufferView::get`] is used (a test hook turns it off so the
/// tests run the copying path too).
static ENABLED: AtomicBool = AtomicBool::new(true);

/// True unless the test hook turned the buffer path off.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Turns the buffer path on or off (tests use it to run both paths); returns
/// whether it was on.
pub fn set_enabled(on: bool) -> bool {
    ENABLED.swap(on, Ordering::Relaxed)
}

/// `memoryview`, looked up once.
pub fn memoryview(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static MEMORYVIEW: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let memoryview = MEMORYVIEW.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("builtins")?.getattr("memoryview")?.unbind())
    })?;
    Ok(memoryview.bind(py))
}

/// Token ids of `obj` through a `memoryview` of it, copied to bytes with
/// `tobytes()` and converted in Rust: any buffer, strided ones too. Refuses
/// what has no buffer, or one that is not 1-D integers.
pub fn copied_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    let view = memoryview(py)?.call1((obj,)).map_err(|_| {
        invalid(format!(
            "tokens must be a list of ints or a buffer of integers, got {}",
            type_name(obj)
        ))
    })?;
    let ndim: usize = view.getattr(intern!(py, "ndim"))?.extract()?;
    rule::one_dimensional(ndim).py()?;
    let format = view.getattr(intern!(py, "format"))?;
    let format = format.cast::<PyString>()?.to_cow()?;
    let itemsize: usize = view.getattr(intern!(py, "itemsize"))?.extract()?;
    let layout = IntLayout::from_format(&format, itemsize).py()?;
    let raw = view.call_method0(intern!(py, "tobytes"))?;
    rule::ids_from_bytes(raw.cast::<PyBytes>()?.as_bytes(), layout).py()
}

/// One held, C-contiguous buffer export; released on drop, with the GIL.
pub struct BufferView<'py> {
    // Boxed so the struct never moves while exported: an exporter may point
    // into it (`PyBuffer_FillInfo` sets `shape = &view->len`), and
    // `PyBuffer_Release` is handed its address.
    raw: Box<ffi::Py_buffer>,
    _gil: Python<'py>,
}

impl<'py> BufferView<'py> {
    /// Exports `obj` C-contiguous with its format, or `None`: when the path
    /// is off ([`enabled`]), and (the error cleared) when `obj` has no
    /// buffer or cannot export one that way — a strided NumPy view, say.
    pub fn get(obj: &Bound<'py, PyAny>) -> Option<Self> {
        Self::export(obj, ffi::PyBUF_FORMAT | ffi::PyBUF_ND)
    }

    /// Exports `obj` writable and C-contiguous with its format, or `None`
    /// (the error cleared) when the path is off or `obj` cannot lend its
    /// memory that way: no buffer, read-only, or strided.
    pub fn get_writable(obj: &Bound<'py, PyAny>) -> Option<Self> {
        Self::export(obj, ffi::PyBUF_WRITABLE | ffi::PyBUF_FORMAT | ffi::PyBUF_ND)
    }

    fn export(obj: &Bound<'py, PyAny>, flags: c_int) -> Option<Self> {
        if !enabled() {
            return None;
        }
        let py = obj.py();
        let mut raw = Box::new(ffi::Py_buffer::new());
        // SAFETY: the GIL is held (`obj` is bound to `'py`) and `raw` is a
        // writable `Py_buffer` that stays at its address (boxed).
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *raw, flags) } != 0 {
            // SAFETY: the GIL is held and the failed call set an exception;
            // clearing it is all the fallback needs (`PyErr::take` would
            // resume a panic an exporter raised, which this path must not).
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        Some(Self { raw, _gil: py })
    }

    /// The extent of each dimension.
    pub fn shape(&self) -> Vec<usize> {
        let ndim = self.ndim();
        if self.raw.shape.is_null() || ndim == 0 {
            return Vec::new();
        }
        // SAFETY: `PyBUF_ND` was asked for, so a non-null `shape` points to
        // `ndim` extents, valid until the release, which `&self` precedes.
        let dims = unsafe { std::slice::from_raw_parts(self.raw.shape, ndim) };
        dims.iter()
            .map(|&d| usize::try_from(d).unwrap_or(0))
            .collect()
    }

    /// The buffer as `i32` values to write in place, when it was exported
    /// writable ([`Self::get_writable`]) with 4-byte items at a 4-byte
    /// aligned address; `None` otherwise (or when it is empty).
    pub fn as_i32_mut(&mut self) -> Option<&mut [i32]> {
        let len = usize::try_from(self.raw.len).unwrap_or(0);
        if self.raw.readonly != 0
            || self.itemsize() != 4
            || len < 4
            || self.raw.buf.is_null()
            || self.raw.buf.align_offset(4) != 0
        {
            return None;
        }
        // SAFETY: the export is writable (`readonly == 0`, and only
        // `get_writable` asks for that), `buf` is non-null, 4-byte aligned
        // and holds `len` contiguous bytes (`PyBUF_ND`) until the release,
        // which only `drop` calls, after this `&mut self` borrow ends; every
        // bit pattern is a valid `i32`. Another thread writing the same
        // buffer meanwhile is the caller's race, as for any buffer consumer.
        Some(unsafe { std::slice::from_raw_parts_mut(self.raw.buf as *mut i32, len / 4) })
    }

    /// Dimensions (0 for a scalar, whose one item is the whole buffer).
    pub fn ndim(&self) -> usize {
        usize::try_from(self.raw.ndim).unwrap_or(0)
    }

    /// Bytes per item.
    pub fn itemsize(&self) -> usize {
        usize::try_from(self.raw.itemsize).unwrap_or(0)
    }

    /// The struct-module format of an item (`"B"` when the exporter gave
    /// none, as the protocol specifies).
    pub fn format(&self) -> Cow<'_, str> {
        if self.raw.format.is_null() {
            return Cow::Borrowed("B");
        }
        // SAFETY: a non-null `format` is a NUL-terminated string owned by
        // the exporter and valid until the release, which `&self` precedes.
        unsafe { CStr::from_ptr(self.raw.format) }.to_string_lossy()
    }

    /// The buffer's bytes, in C order.
    pub fn bytes(&self) -> &[u8] {
        let len = usize::try_from(self.raw.len).unwrap_or(0);
        if len == 0 || self.raw.buf.is_null() {
            return &[];
        }
        // SAFETY: the exporter guarantees `buf` points to `len` readable
        // bytes, contiguous because `PyBUF_ND` asked for no strides, until
        // `PyBuffer_Release`, which only `drop` calls, after this borrow of
        // `self` ends. A `u8` slice needs no alignment.
        unsafe { std::slice::from_raw_parts(self.raw.buf as *const u8, len) }
    }

    /// The buffer as `u32` words in place, when its items are 4 bytes and
    /// its address is 4-byte aligned and non-empty; the view back otherwise.
    /// (What the bytes mean — order, sign — is the caller's to check.)
    pub fn into_words(self) -> Result<WordView<'py>, Self> {
        let words = self.bytes().len() / 4;
        if self.itemsize() != 4 || words == 0 || self.raw.buf.align_offset(4) != 0 {
            return Err(self);
        }
        Ok(WordView { view: self, words })
    }
}

impl Drop for BufferView<'_> {
    fn drop(&mut self) {
        // SAFETY: `raw` was filled by a successful `PyObject_GetBuffer` and
        // is released exactly once, here; the GIL is held, since the view
        // is bound to `'py` and is not `Send`, so it is dropped on the
        // thread that holds the GIL and never inside `detach`.
        unsafe { ffi::PyBuffer_Release(&mut *self.raw) };
    }
}

/// A held buffer read as `u32` words in place (see
/// [`BufferView::into_words`]).
pub struct WordView<'py> {
    view: BufferView<'py>,
    words: usize,
}

impl Deref for WordView<'_> {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        // SAFETY: `into_words` checked that `buf` is non-null and 4-byte
        // aligned and that `words * 4` bytes lie within `len`; every bit
        // pattern is a valid `u32`; the exporter keeps the memory valid
        // until `PyBuffer_Release`, which runs only when the view drops,
        // after this borrow ends. The slice is plain memory, so it may be
        // read with the GIL released (the view itself cannot leave the GIL
        // holder's thread). A writer in another thread changing the buffer
        // meanwhile is the caller's race, as for any buffer consumer.
        unsafe { std::slice::from_raw_parts(self.view.raw.buf as *const u32, self.words) }
    }
}

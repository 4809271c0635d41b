//! A Python buffer read in place, through the CPython buffer protocol.
//!
//! `PyObject_GetBuffer`, `PyBuffer_Release` and the `Py_buffer` struct are in
//! the stable ABI from Python 3.11; the wheel is built for abi3-py39, where
//! pyo3-ffi does not declare them, so they are declared here and used only
//! when the running interpreter is 3.11 or later (checked once). On older
//! interpreters [`enabled`] is false and callers keep their `memoryview` path.
//! The symbols themselves have been exported by every CPython 3 on Linux and
//! macOS, so declaring them does not stop the module loading on 3.9 or 3.10.
//! (A Windows abi3 build links `python3.dll`, which exports them only from
//! 3.11; it would need them looked up at run time. No Windows wheel is
//! built.)
//!
//! A [`BufferView`] holds one export, asked for C-contiguous and with its
//! format (`PyBUF_FORMAT | PyBUF_ND`), and releases it on drop. It borrows
//! the GIL lifetime `'py` and is neither `Send` nor `Sync`, so it cannot be
//! moved into (or dropped inside) `detach`: `PyBuffer_Release` always
//! runs with the GIL held. What it lends out — bytes or `u32` words — is
//! plain memory that the exporter keeps valid until the release, so those
//! slices may be read with the GIL released.

use std::borrow::Cow;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ops::Deref;
use std::sync::atomic::{AtomicU8, Ordering};

use pyo3::ffi;
use pyo3::prelude::*;

/// CPython's `Py_buffer`, field for field, as the stable ABI of 3.11 fixes it
/// (Include/pybuffer.h).
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

impl RawBuffer {
    const EMPTY: Self = Self {
        buf: std::ptr::null_mut(),
        obj: std::ptr::null_mut(),
        len: 0,
        itemsize: 0,
        readonly: 0,
        ndim: 0,
        format: std::ptr::null_mut(),
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        suboffsets: std::ptr::null_mut(),
        internal: std::ptr::null_mut(),
    };
}

/// `PyBUF_WRITABLE`: the exporter must lend the memory for writing.
const PYBUF_WRITABLE: c_int = 0x0001;
/// `PyBUF_FORMAT`: fill in `format`.
const PYBUF_FORMAT: c_int = 0x0004;
/// `PyBUF_ND`: shape, no strides, so the exporter must be C-contiguous.
const PYBUF_ND: c_int = 0x0008;

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

const UNKNOWN: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
/// Whether [`BufferView::get`] is used: decided from the interpreter's
/// version on first use, or set by [`set_enabled`] (a test hook).
static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);

fn supported(py: Python<'_>) -> bool {
    py.version_info() >= (3, 11)
}

/// True when the running interpreter has the buffer protocol in its stable
/// ABI (3.11+) and the test hook has not turned it off.
pub fn enabled(py: Python<'_>) -> bool {
    match STATE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let on = supported(py);
            STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
            on
        }
    }
}

/// Turns the buffer path on or off (tests use it to run both paths); returns
/// whether it was on. Turning it on before 3.11 is refused.
pub fn set_enabled(py: Python<'_>, on: bool) -> PyResult<bool> {
    if on && !supported(py) {
        return Err(crate::errors::invalid(
            "the buffer protocol path needs Python 3.11 or later",
        ));
    }
    let was = enabled(py);
    STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
    Ok(was)
}

/// One held, C-contiguous buffer export; released on drop, with the GIL.
pub struct BufferView<'py> {
    // Boxed so the struct never moves while exported: an exporter may point
    // into it (`PyBuffer_FillInfo` sets `shape = &view->len`), and
    // `PyBuffer_Release` is handed its address.
    raw: Box<RawBuffer>,
    _gil: Python<'py>,
}

impl<'py> BufferView<'py> {
    /// Exports `obj` C-contiguous with its format, or `None`: when the path
    /// is off ([`enabled`]), and (the error cleared) when `obj` has no
    /// buffer or cannot export one that way — a strided NumPy view, say.
    pub fn get(obj: &Bound<'py, PyAny>) -> Option<Self> {
        if !enabled(obj.py()) {
            return None;
        }
        let mut raw = Box::new(RawBuffer::EMPTY);
        // SAFETY: the GIL is held (`obj` is bound to `'py`); the interpreter
        // is 3.11+ (`enabled`), so the function is in its stable ABI and
        // `raw` is a writable `Py_buffer` with the layout it documents.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, PYBUF_FORMAT | PYBUF_ND) };
        if rc != 0 {
            // SAFETY: the GIL is held and an exception is set (the call
            // failed); clearing it is all the fallback needs.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        Some(Self {
            raw,
            _gil: obj.py(),
        })
    }

    /// Exports `obj` writable and C-contiguous with its format, or `None`
    /// (the error cleared) when the path is off or `obj` cannot lend its
    /// memory that way: no buffer, read-only, or strided.
    pub fn get_writable(obj: &Bound<'py, PyAny>) -> Option<Self> {
        if !enabled(obj.py()) {
            return None;
        }
        let mut raw = Box::new(RawBuffer::EMPTY);
        let flags = PYBUF_WRITABLE | PYBUF_FORMAT | PYBUF_ND;
        // SAFETY: as in `get`: the GIL is held, the interpreter is 3.11+,
        // and `raw` is a writable `Py_buffer` of the documented layout.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *raw, flags) };
        if rc != 0 {
            // SAFETY: the GIL is held and the failed call set an exception.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        Some(Self {
            raw,
            _gil: obj.py(),
        })
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
        unsafe { PyBuffer_Release(&mut *self.raw) };
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

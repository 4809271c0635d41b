//! The token input layer: every way token ids arrive, read by one entry
//! point, [`read_tokens`]. Its callers (`kv.rs`) never know how the ids
//! came.
//!
//! Readers, tried in this order:
//!
//! 1. `ndarray.rs`: an exact 1-D, C-contiguous NumPy `int32` / `uint32`
//!    array, read from the array's struct in place (no buffer export);
//! 2. `sequence.rs`: a list or tuple of ints, read item by item in Rust
//!    with no per-item Python work;
//! 3. `buffer.rs`: any other buffer of integers (a NumPy array of another
//!    dtype, `array('i')`, a `memoryview`) exported C-contiguous: native
//!    4-byte ids borrowed in place, anything else converted straight from
//!    the exporter's memory;
//! 4. the copying path, for what has no C-contiguous export (a strided
//!    view): a NumPy array through `tobytes()` (`ndarray.rs`), anything
//!    else through a `memoryview` (`buffer.rs`), copied once to bytes and
//!    converted in Rust.
//!
//! `str` and `bytes` are refused before the buffer readers see them. What
//! counts as an id, and every refusal's message, is the core's rule
//! (`imp_mem_core::kv::tokens`), the same for every reader.
//!
//! Int32 ids read in place are checked non-negative by the reader, or left
//! to the manager ([`Int32Check`]): `admit` hashes first and checks after,
//! when the prompt is in the cache.

pub mod buffer;
pub mod ndarray;
pub mod sequence;

use std::ops::Deref;

use imp_mem_core::kv::tokens as rule;
use imp_mem_core::kv::IdSource;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyString};

use crate::convert::type_name;
use crate::errors::{invalid, IntoPyResult};
use buffer::{BufferView, WordView};

/// Who checks that int32 ids read in place are not negative.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Int32Check {
    /// The reader, before it hands the ids over.
    Now,
    /// The manager, once it has hashed them (`IdSource::I32`): the prompt
    /// may be cold, and the hash requests its memory ahead of its work,
    /// where a check before it would wait for every line.
    Manager,
}

/// Reads the token ids of `obj` and calls `f` with them and their
/// [`IdSource`] (`I32` only when `check` is [`Int32Check::Manager`] and
/// they are int32s read in place; `U32` otherwise, checked). The ids are
/// borrowed from `obj` where they can be, so `f` runs while they are held;
/// it may release the GIL (the slice is plain memory) but must not run
/// Python code that could change `obj`.
///
/// The one entry point of the layer: the order of the readers is decided
/// here.
#[inline(always)]
pub fn read_tokens<R>(
    obj: &Bound<'_, PyAny>,
    check: Int32Check,
    f: impl FnOnce(&[u32], IdSource) -> PyResult<R>,
) -> PyResult<R> {
    // A NumPy array's ids go to `f` straight from the array, without the
    // `Tokens` wrapper: moving that through a `Result` cost the hot path a
    // store-forwarding stall.
    if let Some((ids, signed)) = ndarray::int32_ids(obj) {
        let source = int32_source(ids, signed, check)?;
        return f(ids, source);
    }
    let (toks, source) = other_tokens(obj, check)?;
    f(&toks, source)
}

/// Token ids: borrowed in place from a held buffer export, or owned.
/// Derefs to `&[u32]`. It holds the GIL lifetime and is not `Send`, so it
/// stays on this side of `detach`; the slice crosses.
enum Tokens<'a> {
    /// Native 4-byte ids read where the exporter keeps them.
    Borrowed(WordView<'a>),
    /// Ids converted from any other integer buffer.
    Owned(Vec<u32>),
    /// Ids read from a list or a tuple.
    Read(sequence::Ids),
}

impl Deref for Tokens<'_> {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        match self {
            Tokens::Borrowed(words) => words,
            Tokens::Owned(ids) => ids,
            Tokens::Read(ids) => ids,
        }
    }
}

/// Readers 2 to 4: anything the direct NumPy reader did not take.
fn other_tokens<'a>(
    obj: &'a Bound<'_, PyAny>,
    check: Int32Check,
) -> PyResult<(Tokens<'a>, IdSource)> {
    if let Some(ids) = sequence::token_ids(obj)? {
        return Ok((Tokens::Read(ids), IdSource::U32));
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(invalid(
            "tokens must be integers (a list, a NumPy array, array('i')), not str or bytes",
        ));
    }
    if let Some(view) = BufferView::get(obj) {
        return view_tokens(view, check);
    }
    // No C-contiguous export (a strided view, or no buffer at all): the
    // copying path reads or refuses it.
    let ids = match ndarray::copied_ids(obj)? {
        Some(ids) => ids,
        None => buffer::copied_ids(obj)?,
    };
    Ok((Tokens::Owned(ids), IdSource::U32))
}

/// Token ids from a held C-contiguous export: borrowed when they are
/// native-endian 4-byte integers at an aligned address (signed ones checked
/// non-negative, or left to the manager), converted from the exporter's
/// memory otherwise.
fn view_tokens(view: BufferView<'_>, check: Int32Check) -> PyResult<(Tokens<'_>, IdSource)> {
    rule::one_dimensional(view.ndim()).py()?;
    let layout = rule::IntLayout::from_format(&view.format(), view.itemsize()).py()?;
    let view = if layout == rule::IntLayout::native(4, layout.signed) {
        match view.into_words() {
            Ok(words) => {
                let source = int32_source(&words, layout.signed, check)?;
                return Ok((Tokens::Borrowed(words), source));
            }
            Err(view) => view,
        }
    } else {
        view
    };
    let ids = rule::ids_from_bytes(view.bytes(), layout).py()?;
    Ok((Tokens::Owned(ids), IdSource::U32))
}

/// Checks 4-byte ids read in place now, or says what the manager must.
fn int32_source(ids: &[u32], signed: bool, check: Int32Check) -> PyResult<IdSource> {
    match (signed, check) {
        (false, _) => Ok(IdSource::U32),
        (true, Int32Check::Manager) => Ok(IdSource::I32),
        (true, Int32Check::Now) => rule::check_int32(ids).py().map(|()| IdSource::U32),
    }
}

/// A test hook's `enabled` argument: `True` or `False`, nothing else.
fn switch(enabled: &Bound<'_, PyAny>) -> PyResult<bool> {
    match enabled.cast::<PyBool>() {
        Ok(b) => Ok(b.is_true()),
        Err(_) => Err(invalid(format!(
            "enabled must be True or False, got {}",
            type_name(enabled)
        ))),
    }
}

/// Test hook: reads int32/uint32 NumPy arrays straight from the array
/// (`True`, the default) or through the buffer protocol like any other
/// buffer (`False`); returns the previous setting.
#[pyfunction(name = "_set_numpy_direct")]
fn set_numpy_direct(enabled: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(ndarray::set_enabled(switch(enabled)?))
}

/// Test hook: whether int32/uint32 NumPy arrays are being read straight
/// from the array now (the hook on, NumPy imported, its self-check passed).
#[pyfunction(name = "_numpy_direct_active")]
fn numpy_direct_active(py: Python<'_>) -> bool {
    ndarray::active(py)
}

/// Test hook: reads buffers through the buffer protocol (`True`, the
/// default) or through the copying path that strided views take (`False`);
/// returns the previous setting.
#[pyfunction(name = "_set_buffer_protocol")]
fn set_buffer_protocol(enabled: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(buffer::set_enabled(switch(enabled)?))
}

/// Registers the readers' test hooks.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_buffer_protocol, m)?)?;
    m.add_function(wrap_pyfunction!(set_numpy_direct, m)?)?;
    m.add_function(wrap_pyfunction!(numpy_direct_active, m)?)?;
    sequence::register(m)
}

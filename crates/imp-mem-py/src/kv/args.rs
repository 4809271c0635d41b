//! Reading the KV cache manager's call arguments: a request's token ids
//! and extra keys (LoRA id, cache salt, multimodal spans), sequence ids and
//! counts, and the `out` buffer `block_tables` writes into.

use imp_mem_core::kv::{ExtraKeys, MmSpan};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};

use crate::convert::{self, type_name};
use crate::errors::{invalid, IntoPyResult};
use crate::input::buffer::{self};
use crate::input::{read_tokens, Int32Check};

/// A request's extra keys, from the methods' keyword arguments.
#[inline(always)]
pub(super) fn extras(
    lora_id: Option<u64>,
    cache_salt: Option<&Bound<'_, PyAny>>,
    mm: Option<&Bound<'_, PyAny>>,
) -> PyResult<ExtraKeys> {
    // Most requests have none: built in place, without the call (the keys
    // are 64 bytes, and each move of them through a `Result` cost the hot
    // path a store-forwarding stall).
    if cache_salt.is_none() && mm.is_none() {
        return Ok(ExtraKeys {
            lora_id,
            ..ExtraKeys::default()
        });
    }
    read_extras(lora_id, cache_salt, mm)
}

/// [`extras`] with a salt or multimodal items to read.
#[inline(never)]
fn read_extras(
    lora_id: Option<u64>,
    cache_salt: Option<&Bound<'_, PyAny>>,
    mm: Option<&Bound<'_, PyAny>>,
) -> PyResult<ExtraKeys> {
    let cache_salt = match cache_salt.filter(|s| !s.is_none()) {
        None => None,
        Some(s) => {
            if s.is_instance_of::<PyString>() {
                Some(convert::text(s, "cache_salt")?.into_bytes())
            } else if let Ok(b) = s.cast::<PyBytes>() {
                Some(b.as_bytes().to_vec())
            } else {
                return Err(invalid("cache_salt must be str or bytes"));
            }
        }
    };
    let mut spans = Vec::new();
    if let Some(items) = mm.filter(|m| !m.is_none()) {
        let items = items.try_iter().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "mm must be an iterable of (start, end, content_hash) triples, got {}",
                type_name(items)
            ))
        })?;
        for item in items {
            let (start, end, hash): (usize, usize, u128) = item?.extract().map_err(|_| {
                invalid("mm must be a sequence of (start, end, content_hash) integer triples")
            })?;
            spans.push(MmSpan::new(start, end, hash).py()?);
        }
    }
    Ok(ExtraKeys::new(lora_id, cache_salt, spans))
}

/// Calls `f` with a request's token ids (checked) and extra keys. The
/// extras are read first: that may run Python code (an `mm` iterable),
/// which must not run while the ids are borrowed from the caller's array.
pub(super) fn request<R>(
    tokens: &Bound<'_, PyAny>,
    lora_id: Option<u64>,
    cache_salt: Option<&Bound<'_, PyAny>>,
    mm: Option<&Bound<'_, PyAny>>,
    f: impl FnOnce(&[u32], ExtraKeys) -> PyResult<R>,
) -> PyResult<R> {
    let extras = extras(lora_id, cache_salt, mm)?;
    read_tokens(tokens, Int32Check::Now, |ids, _| f(ids, extras))
}

/// `block_tables`' `pool` argument: `"full"` (false) or `"swa"` (true).
pub(super) fn table_pool(pool: &Bound<'_, PyAny>) -> PyResult<bool> {
    match convert::text(pool, "pool")?.as_str() {
        "full" => Ok(false),
        "swa" => Ok(true),
        other => Err(invalid(format!(
            "pool must be \"full\" or \"swa\", got {other:?}"
        ))),
    }
}

/// `block_tables`' sequence ids: a list, tuple or 1-D array of ints.
pub(super) fn seq_id_list(seq_ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if seq_ids.is_instance_of::<PyString>() || seq_ids.is_instance_of::<PyBytes>() {
        return Err(invalid(
            "seq_ids must be a sequence of ints, not str or bytes",
        ));
    }
    let items = seq_ids.try_iter().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "seq_ids must be a sequence of sequence ids (ints), got {}",
            type_name(seq_ids)
        ))
    })?;
    let mut ids = Vec::new();
    for (i, item) in items.enumerate() {
        ids.push(convert::u64_arg(&item?, &format!("seq_ids[{i}]"))?);
    }
    Ok(ids)
}

/// Whether a struct-module format names a native-endian signed 4-byte int.
pub(super) fn native_int32(format: &str, itemsize: usize) -> bool {
    itemsize == 4
        && match format.as_bytes() {
            [b'<', c] => cfg!(target_endian = "little") && matches!(c, b'i' | b'l'),
            [b'>' | b'!', c] => cfg!(target_endian = "big") && matches!(c, b'i' | b'l'),
            [b'=' | b'@', c] | [c] => matches!(c, b'i' | b'l'),
            _ => false,
        }
}

/// Why `out` cannot take `rows` block-table rows: the typed refusal, read
/// through a `memoryview` (the error path).
/// `Ok((memoryview, width))` when it can.
pub(super) fn check_out<'py>(
    out: &Bound<'py, PyAny>,
    rows: usize,
) -> PyResult<(Bound<'py, PyAny>, usize)> {
    let py = out.py();
    let view = buffer::memoryview(py)?.call1((out,)).map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "out must be a writable int32 buffer of shape [n, width] (a NumPy array, a CPU \
             tensor's .numpy()), got {}",
            type_name(out)
        ))
    })?;
    let format: String = view.getattr(intern!(py, "format"))?.extract()?;
    let itemsize: usize = view.getattr(intern!(py, "itemsize"))?.extract()?;
    if !native_int32(&format, itemsize) {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "out must hold int32 values; its format is {format:?} ({itemsize}-byte items) — \
             allocate it with dtype int32"
        )));
    }
    if view.getattr(intern!(py, "readonly"))?.is_truthy()? {
        return Err(invalid("out is read-only; pass a writable buffer"));
    }
    if !view.getattr(intern!(py, "c_contiguous"))?.is_truthy()? {
        return Err(invalid(
            "out must be C-contiguous; pass a contiguous array (numpy.ascontiguousarray)",
        ));
    }
    let shape: Vec<usize> = view.getattr(intern!(py, "shape"))?.extract()?;
    match shape.as_slice() {
        [n, width] if *n == rows => Ok((view, *width)),
        _ => Err(invalid(format!(
            "out must have shape [{rows}, width] (one row per seq id), got {shape:?}"
        ))),
    }
}

/// A sequence id.
pub(super) fn seq(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    convert::u64_arg(value, "seq_id")
}

/// An optional LoRA id.
pub(super) fn lora(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    convert::opt(value, "lora_id", convert::u64_arg)
}

/// A token or block count.
pub(super) fn count(value: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    convert::usize_arg(value, what)
}

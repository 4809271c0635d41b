//! Reading sizes, alignments and tags from Python values, so that bad input
//! becomes an `InvalidArgument` that names the parameter instead of an
//! `OverflowError` or `TypeError` from deep inside.

use imp_mem_core::units::parse_bytes;
use imp_mem_core::Tag;
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use crate::errors::{invalid, IntoPyResult};

/// A non-negative integer (anything with `__index__`), or a string such as
/// `"80GiB"` when `allow_text`.
fn count(value: &Bound<'_, PyAny>, what: &str, allow_text: bool) -> PyResult<u64> {
    if value.is_instance_of::<PyBool>() {
        return Err(invalid(format!("{what} must be an integer, got a bool")));
    }
    if let Ok(text) = value.downcast::<PyString>() {
        if allow_text {
            return parse_bytes(&text.to_cow()?).py();
        }
        return Err(invalid(format!(
            "{what} must be an integer, got the string {text}"
        )));
    }
    match value.extract::<i64>() {
        Ok(n) if n < 0 => Err(invalid(format!("{what} must be non-negative, got {n}"))),
        Ok(n) => Ok(n as u64),
        Err(e) if e.is_instance_of::<PyOverflowError>(value.py()) => {
            let negative = value.lt(0).unwrap_or(false);
            if negative {
                Err(invalid(format!("{what} must be non-negative, got {value}")))
            } else {
                Err(invalid(format!(
                    "{what} of {value} is absurdly large; check the units"
                )))
            }
        }
        Err(_) => Err(invalid(format!(
            "{what} must be an integer, got {} {value}",
            value
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))),
    }
}

/// A byte count: an int, or text like `"80GiB"`.
pub fn bytes(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    count(value, what, true)
}

/// A plain non-negative integer.
pub fn index(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    count(value, what, false)
}

/// An optional byte count.
pub fn opt_bytes(value: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<u64>> {
    value
        .filter(|v| !v.is_none())
        .map(|v| bytes(v, what))
        .transpose()
}

/// A tag name.
pub fn tag(name: &str) -> PyResult<Tag> {
    name.parse::<Tag>().py()
}

/// The bytes of a bytes-like object (bytes, bytearray, memoryview, a NumPy
/// array). Ints and strings are refused: `bytes(12)` would silently mean
/// twelve zero bytes.
pub fn bytes_like(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let refuse = || invalid("data must be bytes-like (bytes, bytearray, memoryview)");
    if data.is_instance_of::<pyo3::types::PyInt>() || data.is_instance_of::<PyString>() {
        return Err(refuse());
    }
    let as_bytes = py
        .import("builtins")?
        .getattr("bytes")?
        .call1((data,))
        .map_err(|_| refuse())?;
    Ok(as_bytes
        .downcast::<pyo3::types::PyBytes>()?
        .as_bytes()
        .to_vec())
}

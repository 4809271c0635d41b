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
    if let Ok(text) = value.cast::<PyString>() {
        if allow_text {
            let text = text.to_cow().map_err(|_| {
                invalid(format!(
                    "{what} holds a character UTF-8 cannot encode (a lone surrogate); pass a \
                     byte count such as 4096 or \"64MiB\""
                ))
            })?;
            return parse_bytes(&text)
                .map_err(|e| invalid(format!("{what}: {e}{}", int_hint(&text))));
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
            type_name(value)
        ))),
    }
}

/// For a bare whole number given as text: Python's other way to say bytes.
pub fn int_hint(text: &str) -> String {
    let t = text.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        format!("; or pass the int {t} for {t} bytes")
    } else {
        String::new()
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
    Ok(as_bytes.cast::<pyo3::types::PyBytes>()?.as_bytes().to_vec())
}

/// The name of `value`'s type, for messages.
pub fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default()
}

/// The one conversion of an integer parameter: anything with `__index__`
/// (not a bool) whose value lies in `lo..=hi`. A value outside the range
/// raises `InvalidArgument` naming the parameter, the range and the value;
/// another type raises `TypeError` naming the parameter and `int`. A bool
/// is an `InvalidArgument` here as in [`bytes`], [`index`] and token ids:
/// it is an int to Python, so the value, not its type, is what is wrong.
pub fn int_in(value: &Bound<'_, PyAny>, what: &str, lo: i128, hi: i128) -> PyResult<i128> {
    if let Ok(i) = value.cast_exact::<pyo3::types::PyInt>() {
        if let Ok(n) = i.extract::<i64>() {
            let n = i128::from(n);
            if (lo..=hi).contains(&n) {
                return Ok(n);
            }
        }
    }
    let wrong_type = || {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be an int, got {} {}",
            type_name(value),
            value
                .repr()
                .map(|r| r.to_string())
                .unwrap_or_default()
                .chars()
                .take(60)
                .collect::<String>()
        ))
    };
    if value.is_instance_of::<PyBool>() {
        return Err(invalid(format!("{what} must be an integer, got a bool")));
    }
    let out_of_range = || {
        let shown = value.str().map(|s| s.to_string()).unwrap_or_default();
        invalid(format!(
            "{what} must be an integer from {lo} to {hi}, got {}",
            if shown.len() > 60 {
                format!("an integer of {} digits", shown.len())
            } else {
                shown
            }
        ))
    };
    match value.extract::<i128>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        Ok(_) => Err(out_of_range()),
        Err(e) if e.is_instance_of::<PyOverflowError>(value.py()) => Err(out_of_range()),
        Err(_) => Err(wrong_type()),
    }
}

/// A `u64` parameter (`0..=2**64 - 1`).
pub fn u64_arg(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    int_in(value, what, 0, u64::MAX.into()).map(|n| n as u64)
}

/// A `u32` parameter (`0..=2**32 - 1`).
pub fn u32_arg(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    int_in(value, what, 0, u32::MAX.into()).map(|n| n as u32)
}

/// A count parameter that must fit this host's `usize`.
pub fn usize_arg(value: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    int_in(value, what, 0, usize::MAX as i128).map(|n| n as usize)
}

/// An optional parameter: `None` (or absent) stays `None`.
pub fn opt<T>(
    value: Option<&Bound<'_, PyAny>>,
    what: &str,
    read: impl FnOnce(&Bound<'_, PyAny>, &str) -> PyResult<T>,
) -> PyResult<Option<T>> {
    match value.filter(|v| !v.is_none()) {
        Some(v) => read(v, what).map(Some),
        None => Ok(None),
    }
}

/// A text parameter: a `str` whose characters UTF-8 can encode (a lone
/// surrogate is refused with `InvalidArgument`); `TypeError` otherwise.
pub fn text(value: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    let Ok(s) = value.cast::<PyString>() else {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be a str, got {}",
            type_name(value)
        )));
    };
    s.to_cow().map(|c| c.into_owned()).map_err(|_| {
        invalid(format!(
            "{what} holds a character UTF-8 cannot encode (a lone surrogate); pass valid text"
        ))
    })
}

/// A filesystem path parameter: `str`, `bytes` or any `os.PathLike`, as
/// `open()` takes it. `TypeError` for another type; `InvalidArgument` for an
/// empty path or one with a NUL byte.
pub fn path(value: &Bound<'_, PyAny>, what: &str) -> PyResult<std::path::PathBuf> {
    let py = value.py();
    let os = py.import("os")?;
    let raw = os
        .getattr("fspath")?
        .call1((value,))
        .and_then(|p| os.getattr("fsencode")?.call1((p,)))
        .map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "{what} must be a path (str, bytes or os.PathLike), got {}",
                type_name(value)
            ))
        })?;
    let bytes = raw
        .cast::<pyo3::types::PyBytes>()
        .map_err(|_| invalid(format!("{what} could not be encoded as a file name")))?
        .as_bytes()
        .to_vec();
    if bytes.is_empty() {
        return Err(invalid(format!("{what} is empty; pass the path of a file")));
    }
    if bytes.contains(&0) {
        return Err(invalid(format!(
            "{what} holds a NUL byte, which no file name can"
        )));
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStringExt;
        Ok(std::path::PathBuf::from(std::ffi::OsString::from_vec(
            bytes,
        )))
    }
    #[cfg(not(unix))]
    {
        String::from_utf8(bytes)
            .map(std::path::PathBuf::from)
            .map_err(|_| invalid(format!("{what} is not valid UTF-8")))
    }
}

/// A `True`/`False` parameter (`TypeError` for anything else: `1` or `"no"`
/// is more likely a mistake than a choice).
pub fn flag(value: &Bound<'_, PyAny>, what: &str) -> PyResult<bool> {
    value.cast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be True or False, got {}",
            type_name(value)
        ))
    })
}

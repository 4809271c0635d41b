//! `PinnedBuffer` (T5b) and `pinned_stats`; which pinned host goes with a
//! backend, and the process's count, are the core's (`pinned_hosts`).

use std::sync::{Arc, Mutex};

pub(crate) use imp_mem_core::pinned_host_for;
use imp_mem_core::{fake_pinned_host, PinnedBuffer};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::span::{stable, Owner, PyStableSpan};
use super::{lock, size};
use crate::backend::PyBackend;
use crate::errors::{invalid, IntoPyResult, StaleSpan};

/// Pinned host memory (T5b): move-only, freed exactly once. With
/// `or_empty=True` a failure gives an empty buffer (`empty` is True) instead
/// of raising, so a caller can fall back to pageable memory.
#[pyclass(frozen, name = "PinnedBuffer", module = "imp_mem._core")]
pub struct PyPinnedBuffer {
    pub(super) inner: Mutex<Option<Arc<PinnedBuffer>>>,
    nbytes: usize,
    address: usize,
    empty: bool,
}

#[pymethods]
impl PyPinnedBuffer {
    #[new]
    #[pyo3(signature = (nbytes, *, backend = None, or_empty = false))]
    fn new(
        nbytes: &Bound<'_, PyAny>,
        backend: Option<PyRef<'_, PyBackend>>,
        or_empty: bool,
    ) -> PyResult<Self> {
        let len = size(nbytes, "nbytes")?;
        let host = match &backend {
            None => fake_pinned_host(),
            Some(b) => pinned_host_for(&b.inner),
        };
        let buf = if or_empty {
            host.allocate_or_empty(len)
        } else {
            host.allocate(len).py()?
        };
        let (nbytes, address, empty) = (buf.len(), buf.addr(), buf.is_empty());
        Ok(Self {
            inner: Mutex::new(Some(Arc::new(buf))),
            nbytes,
            address,
            empty,
        })
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    #[getter]
    fn address(&self) -> usize {
        self.address
    }

    /// True when the allocation failed with `or_empty=True`.
    #[getter]
    fn empty(&self) -> bool {
        self.empty
    }

    #[getter]
    fn released(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// Frees now (once an export, if any, is done with it); a second call
    /// raises `InvalidArgument`.
    fn release(&self) -> PyResult<()> {
        lock(&self.inner)
            .take()
            .map(drop)
            .ok_or_else(|| invalid("this PinnedBuffer was already released; release it once"))
    }

    /// The memory, valid while the buffer is held.
    fn span(slf: &Bound<'_, Self>) -> PyResult<PyStableSpan> {
        let this = slf.get();
        if this.empty {
            return Err(invalid("an empty PinnedBuffer has no memory to view"));
        }
        if this.released() {
            return Err(StaleSpan::new_err("this PinnedBuffer was released"));
        }
        Ok(stable(
            Owner::Pinned(slf.clone().unbind()),
            this.nbytes,
            true,
        ))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        drop(lock(&self.inner).take());
        false
    }

    fn __repr__(&self) -> String {
        if self.empty {
            return "<PinnedBuffer empty>".to_string();
        }
        format!(
            "<PinnedBuffer {:#x} {} B{}>",
            self.address,
            self.nbytes,
            if self.released() { " released" } else { "" }
        )
    }
}

/// Live pinned bytes and counts, over the fake pinned host and every
/// device's (a sleep's host buffer, pinned ahead or not, included); the
/// peak is the sum of each one's peak.
#[pyfunction]
pub(super) fn pinned_stats<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let s = imp_mem_core::process_pinned_stats();
    let d = PyDict::new(py);
    d.set_item("live_bytes", s.live_bytes)?;
    d.set_item("buffers", s.buffers)?;
    d.set_item("registered_bytes", s.registered_bytes)?;
    d.set_item("registrations", s.registrations)?;
    d.set_item("failures", s.failures)?;
    d.set_item("peak_bytes", s.peak_bytes)?;
    Ok(d)
}

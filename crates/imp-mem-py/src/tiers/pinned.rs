//! `PinnedBuffer` (T5b), the pinned host memory that goes with a backend,
//! and `pinned_stats`.

use std::sync::{Arc, Mutex, OnceLock};

use imp_mem_core::{FakePinnedHost, PinnedBuffer, PinnedHost};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::span::{stable, Owner, PyStableSpan};
use super::{lock, size};
use crate::backend::PyBackend;
use crate::errors::{invalid, IntoPyResult, StaleSpan};

/// The pinned host memory the fake backend (and a machine without CUDA)
/// uses: ordinary host memory, exported as kDLCPU.
fn fake_pinned_host() -> &'static PinnedHost {
    static HOST: OnceLock<PinnedHost> = OnceLock::new();
    HOST.get_or_init(|| PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 40))))
}

/// The devices' pinned hosts, one per device, made on first use.
fn device_hosts() -> &'static Mutex<Vec<(i32, PinnedHost)>> {
    static HOSTS: OnceLock<Mutex<Vec<(i32, PinnedHost)>>> = OnceLock::new();
    HOSTS.get_or_init(|| Mutex::new(Vec::new()))
}

/// The pinned host memory that goes with `backend`: its source's
/// (`MemorySource::pinned_host`, the driver's on a device), one
/// `PinnedHost` per device so that `pinned_stats` counts them together;
/// ordinary host memory for a source with none (the fake).
pub(crate) fn pinned_host_for(backend: &imp_mem_core::Backend) -> PinnedHost {
    let Some(ops) = backend.pinned_host() else {
        return fake_pinned_host().clone();
    };
    let device = backend.info().device;
    let mut hosts = lock(device_hosts());
    if let Some((_, host)) = hosts.iter().find(|(d, _)| *d == device) {
        return host.clone();
    }
    let host = PinnedHost::new(ops);
    hosts.push((device, host.clone()));
    host
}

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
            None => fake_pinned_host().clone(),
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
    let mut s = fake_pinned_host().stats();
    // Copied out first: nothing else is done under the lock.
    let hosts: Vec<PinnedHost> = lock(device_hosts())
        .iter()
        .map(|(_, h)| h.clone())
        .collect();
    for h in hosts {
        let t = h.stats();
        s.live_bytes += t.live_bytes;
        s.buffers += t.buffers;
        s.registered_bytes += t.registered_bytes;
        s.registrations += t.registrations;
        s.failures += t.failures;
        s.peak_bytes += t.peak_bytes;
    }
    let d = PyDict::new(py);
    d.set_item("live_bytes", s.live_bytes)?;
    d.set_item("buffers", s.buffers)?;
    d.set_item("registered_bytes", s.registered_bytes)?;
    d.set_item("registrations", s.registrations)?;
    d.set_item("failures", s.failures)?;
    d.set_item("peak_bytes", s.peak_bytes)?;
    Ok(d)
}

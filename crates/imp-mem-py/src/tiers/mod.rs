//! Python face of L2/L3: `Tier`, `Arena`, `BlockPool`, `BlockRef`,
//! `BlockRefs`, `ScratchStack`, `Mark`, `PinnedBuffer`, `StableSpan`,
//! `DeviceSpan` and `TensorView`.
//!
//! Python cannot borrow, so every object here wraps the core's `Shared*`
//! form of a tier and every span is a ticket checked by the core on each use
//! (generation, open mark, live ref). No rule lives here: these files
//! convert arguments, map errors and build the exports.
//!
//! One file per wrapper: `span.rs` (the spans, their owners and exports),
//! `arena.rs`, `block_pool.rs` (with `BlockRef` / `BlockRefs`), `scratch.rs`
//! (with `Mark`), `pinned.rs`; this one holds `Tier`, the argument helpers
//! they share, and `register`.

use std::sync::{Mutex, MutexGuard};

use imp_mem_core::backend::DEFAULT_ALIGNMENT;
use imp_mem_core::Tier;
use pyo3::prelude::*;
use pyo3::types::PyInt;

use crate::convert;
use crate::errors::invalid;

mod arena;
mod block_pool;
mod pinned;
mod scratch;
mod span;

pub use arena::PyArena;
pub(crate) use block_pool::FenceWatch;
pub use block_pool::{PyBlockPool, PyBlockRef, PyBlockRefs};
pub(crate) use pinned::pinned_host_for;
pub use pinned::PyPinnedBuffer;
pub use scratch::{PyMark, PyScratchStack};
pub use span::{PyDeviceSpan, PyStableSpan, PyTensorView};

/// The lifetime tiers (seed A2).
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    name = "Tier",
    module = "imp_mem._core"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum PyTier {
    /// T1: model load to unload.
    #[pyo3(name = "MODEL_RESIDENT")]
    ModelResident,
    /// T2: the life of the process.
    #[pyo3(name = "ENGINE_PERSISTENT")]
    EnginePersistent,
    /// T3: refcounted fixed-size blocks.
    #[pyo3(name = "POOLED")]
    Pooled,
    /// T4: one forward pass, LIFO.
    #[pyo3(name = "SCRATCH")]
    Scratch,
    /// T4a: a framework's own allocations (the activation pool).
    #[pyo3(name = "ACTIVATIONS")]
    Activations,
    /// T5b: pinned host memory.
    #[pyo3(name = "PINNED_HOST")]
    PinnedHost,
}

impl From<PyTier> for Tier {
    fn from(t: PyTier) -> Self {
        match t {
            PyTier::ModelResident => Tier::ModelResident,
            PyTier::EnginePersistent => Tier::EnginePersistent,
            PyTier::Pooled => Tier::Pooled,
            PyTier::Scratch => Tier::Scratch,
            PyTier::Activations => Tier::Activations,
            PyTier::PinnedHost => Tier::PinnedHost,
        }
    }
}

impl From<Tier> for PyTier {
    fn from(t: Tier) -> Self {
        match t {
            Tier::ModelResident => PyTier::ModelResident,
            Tier::EnginePersistent => PyTier::EnginePersistent,
            Tier::Pooled => PyTier::Pooled,
            Tier::Scratch => PyTier::Scratch,
            Tier::Activations => PyTier::Activations,
            Tier::PinnedHost => PyTier::PinnedHost,
        }
    }
}

#[pymethods]
impl PyTier {
    fn __str__(&self) -> &'static str {
        Tier::from(*self).name()
    }

    /// The seed's short label: T1, T2, T3, T4, T4a, T5b.
    #[getter]
    fn label(&self) -> &'static str {
        Tier::from(*self).label()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A plain `int` (not a bool, not text) that fits, read without the general
/// conversion: the hot paths take one per call.
fn fast_int<T: for<'a, 'py> FromPyObject<'a, 'py>>(value: &Bound<'_, PyAny>) -> Option<T> {
    value
        .cast_exact::<PyInt>()
        .ok()
        .and_then(|i| i.extract::<T>().ok())
}

fn size(value: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    if let Some(n) = fast_int::<usize>(value).filter(|&n| n > 0) {
        return Ok(n);
    }
    let n = convert::bytes(value, what)?;
    usize::try_from(n).map_err(|_| invalid(format!("{what} of {n} B does not fit this host")))
}

fn align(value: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    match value.filter(|v| !v.is_none()) {
        Some(v) => {
            let n = convert::index(v, "align")?;
            usize::try_from(n).map_err(|_| invalid(format!("align {n} does not fit this host")))
        }
        None => Ok(DEFAULT_ALIGNMENT),
    }
}

fn opt_tag(tag: Option<&Bound<'_, PyAny>>) -> PyResult<Option<imp_mem_core::Tag>> {
    convert::opt(tag, "tag", convert::text)?
        .as_deref()
        .map(convert::tag)
        .transpose()
}

/// Registers the classes of this file.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTier>()?;
    m.add_class::<PyArena>()?;
    m.add_class::<PyBlockPool>()?;
    m.add_class::<PyBlockRef>()?;
    m.add_class::<PyBlockRefs>()?;
    m.add_class::<PyScratchStack>()?;
    m.add_class::<PyMark>()?;
    m.add_class::<PyPinnedBuffer>()?;
    m.add_class::<PyStableSpan>()?;
    m.add_class::<PyDeviceSpan>()?;
    m.add_class::<PyTensorView>()?;
    m.add_function(wrap_pyfunction!(pinned::pinned_stats, m)?)?;
    Ok(())
}

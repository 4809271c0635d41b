//! The one place where core errors become Python exceptions.
//!
//! The exception classes are defined in Python (`imp_mem/errors.py`) so that
//! they can also derive from `MemoryError` / `ValueError`; Rust imports them.

use imp_mem_core::MemError;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

pyo3::import_exception!(imp_mem.errors, ImpMemError);
pyo3::import_exception!(imp_mem.errors, OutOfMemory);
pyo3::import_exception!(imp_mem.errors, CapacityError);
pyo3::import_exception!(imp_mem.errors, PhaseViolation);
pyo3::import_exception!(imp_mem.errors, Asleep);
pyo3::import_exception!(imp_mem.errors, StaleSpan);
pyo3::import_exception!(imp_mem.errors, PlanFailure);
pyo3::import_exception!(imp_mem.errors, BackendUnavailable);
pyo3::import_exception!(imp_mem.errors, InvalidArgument);
pyo3::import_exception!(imp_mem.errors, DriverError);
pyo3::import_exception!(imp_mem.errors, ImpMemWarning);

/// A value attached to a raised exception as an attribute.
pub enum Attr {
    /// An `int`.
    Int(u64),
    /// A `str`.
    Text(String),
    /// A `bool`.
    Flag(bool),
    /// A `list` of `str`.
    Texts(Vec<String>),
}

/// An exception's message and attributes, turned into Python objects only
/// when the exception is raised: after the method returned, so never while
/// the binding or the core holds a lock. (Building them here could run a
/// garbage collection, whose callbacks may call back into the object whose
/// lock is held.) `ImpMemError.__init__` sets the attributes.
struct Facts {
    message: String,
    attrs: Vec<(&'static str, Attr)>,
}

impl pyo3::PyErrArguments for Facts {
    fn arguments(self, py: Python<'_>) -> Py<PyAny> {
        let message = self.message.clone();
        let build = || -> PyResult<Py<PyAny>> {
            let facts = py.import("imp_mem.errors")?.getattr("_Facts")?.call0()?;
            for (name, value) in self.attrs {
                match value {
                    Attr::Int(n) => facts.set_item(name, n)?,
                    Attr::Text(t) => facts.set_item(name, t)?,
                    Attr::Flag(b) => facts.set_item(name, b)?,
                    Attr::Texts(t) => facts.set_item(name, t)?,
                }
            }
            (self.message, facts).into_py_any(py)
        };
        // Without its attributes the exception still has its class and
        // message.
        build()
            .or_else(|_| (message,).into_py_any(py))
            .unwrap_or_else(|_| py.None())
    }
}

/// The class, message and attributes `err` raises as.
fn facts(err: MemError) -> (fn(Facts) -> PyErr, Facts) {
    let message = err.to_string();
    let mut attrs = Vec::new();
    let class: fn(Facts) -> PyErr = match err {
        MemError::OutOfMemory(report) => {
            attrs.push(("asked", Attr::Int(report.asked)));
            attrs.push(("live", Attr::Int(report.live)));
            attrs.push(("budget", Attr::Int(report.budget)));
            attrs.push(("capacity", Attr::Int(report.capacity)));
            attrs.push(("tag", Attr::Text(report.tag.name().to_string())));
            attrs.push(("device_refused", Attr::Flag(report.device_refused)));
            OutOfMemory::new_err
        }
        MemError::HostOutOfMemory { bytes, .. } => {
            attrs.push(("asked", Attr::Int(bytes)));
            attrs.push(("device_refused", Attr::Flag(false)));
            OutOfMemory::new_err
        }
        MemError::PhaseViolation { phase, .. } => {
            attrs.push(("phase", Attr::Text(phase.name().to_string())));
            PhaseViolation::new_err
        }
        MemError::InvalidArgument(_) => InvalidArgument::new_err,
        MemError::StaleSpan(_) => StaleSpan::new_err,
        MemError::Asleep(_) => Asleep::new_err,
        MemError::Capacity(_) => CapacityError::new_err,
        MemError::KvCapacity(report) => {
            attrs.push(("needed", Attr::Int(report.needed.into())));
            attrs.push(("free", Attr::Int(report.free.into())));
            attrs.push(("growable", Attr::Int(report.growable.into())));
            attrs.push(("evictable", Attr::Int(report.evictable.into())));
            attrs.push(("pinned", Attr::Int(report.pinned.into())));
            attrs.push(("pool", Attr::Text(report.pool.to_string())));
            CapacityError::new_err
        }
        MemError::BackendUnavailable(_) => BackendUnavailable::new_err,
        MemError::Driver(_) => DriverError::new_err,
        MemError::Invariant(_) => ImpMemError::new_err,
    };
    (class, Facts { message, attrs })
}

/// Converts a core error into the matching Python exception, with the
/// arithmetic attached as attributes where there is some. Builds no Python
/// object (see [`Facts`]), so it is safe under any lock.
pub fn to_py(err: MemError) -> PyErr {
    let (class, facts) = facts(err);
    class(facts)
}

/// [`to_py`] with another message and more attributes.
pub fn to_py_with(err: MemError, message: String, more: Vec<(&'static str, Attr)>) -> PyErr {
    let (class, mut facts) = facts(err);
    facts.message = message;
    facts.attrs.extend(more);
    class(facts)
}

/// `Result<T, MemError>` → `PyResult<T>`.
pub trait IntoPyResult<T> {
    /// Maps the error with [`to_py`].
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, MemError> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// An `InvalidArgument` with `message`.
pub fn invalid(message: impl Into<String>) -> PyErr {
    InvalidArgument::new_err(message.into())
}

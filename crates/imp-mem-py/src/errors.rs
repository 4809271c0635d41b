//! The one place where core errors become Python exceptions.
//!
//! The exception classes are defined in Python (`imp_mem/errors.py`) so that
//! they can also derive from `MemoryError` / `ValueError`; Rust imports them.

use imp_mem_core::MemError;
use pyo3::prelude::*;

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

/// Converts a core error into the matching Python exception, with the
/// arithmetic attached as attributes where there is some.
pub fn to_py(err: MemError) -> PyErr {
    let message = err.to_string();
    match err {
        MemError::OutOfMemory(report) => Python::with_gil(|py| {
            let exc = OutOfMemory::new_err(message);
            let value = exc.value(py);
            // Attribute setting on a fresh exception instance cannot fail in
            // practice; if it did, the message still carries the numbers.
            let _ = value.setattr("asked", report.asked);
            let _ = value.setattr("live", report.live);
            let _ = value.setattr("budget", report.budget);
            let _ = value.setattr("capacity", report.capacity);
            let _ = value.setattr("tag", report.tag.name());
            let _ = value.setattr("device_refused", report.device_refused);
            exc
        }),
        MemError::PhaseViolation { phase, .. } => Python::with_gil(|py| {
            let exc = PhaseViolation::new_err(message);
            let _ = exc.value(py).setattr("phase", phase.name());
            exc
        }),
        MemError::InvalidArgument(_) => InvalidArgument::new_err(message),
        MemError::StaleSpan(_) => StaleSpan::new_err(message),
        MemError::Asleep(_) => Asleep::new_err(message),
        MemError::Capacity(_) => CapacityError::new_err(message),
        MemError::KvCapacity(report) => Python::with_gil(|py| {
            let exc = CapacityError::new_err(message);
            let value = exc.value(py);
            let _ = value.setattr("needed", report.needed);
            let _ = value.setattr("free", report.free);
            let _ = value.setattr("growable", report.growable);
            let _ = value.setattr("evictable", report.evictable);
            let _ = value.setattr("pinned", report.pinned);
            let _ = value.setattr("pool", report.pool);
            exc
        }),
        MemError::BackendUnavailable(_) => BackendUnavailable::new_err(message),
        MemError::Driver(_) => DriverError::new_err(message),
        MemError::Invariant(_) => ImpMemError::new_err(message),
    }
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

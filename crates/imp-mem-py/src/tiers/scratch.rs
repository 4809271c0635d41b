//! `ScratchStack` (T4) and its `Mark`.

use std::sync::Mutex;

use imp_mem_core::{SharedMark, SharedScratchStack};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::span::{stable, Owner, PyStableSpan};
use super::{align, lock, opt_tag, size};
use crate::backend::PyBackend;
use crate::convert;
use crate::errors::{IntoPyResult, StaleSpan};

/// A LIFO scratch stack (T4). `with stack.mark() as m: m.take(...)`.
#[pyclass(frozen, name = "ScratchStack", module = "imp_mem._core")]
pub struct PyScratchStack {
    stack: SharedScratchStack,
    exportable: bool,
}

impl PyScratchStack {
    /// Wraps a stack opened elsewhere (by a `MemorySystem`).
    pub(crate) fn wrap(stack: SharedScratchStack, exportable: bool) -> Self {
        Self { stack, exportable }
    }
}

#[pymethods]
impl PyScratchStack {
    #[new]
    #[pyo3(signature = (backend, nbytes, *, tag = None))]
    fn new(
        backend: PyRef<'_, PyBackend>,
        nbytes: &Bound<'_, PyAny>,
        tag: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let bytes = convert::bytes(nbytes, "nbytes")?;
        let stack = SharedScratchStack::new(&backend.inner, bytes, opt_tag(tag)?).py()?;
        backend.notices.emit(backend.py())?;
        Ok(Self {
            stack,
            exportable: backend.inner.addressable(),
        })
    }

    /// Opens a mark; use it as a context manager, or call `rewind()`.
    fn mark(&self) -> PyResult<PyMark> {
        let mark = self.stack.mark().py()?;
        Ok(PyMark {
            inner: Mutex::new(Some(mark)),
            stack: self.stack.clone(),
            exportable: self.exportable,
        })
    }

    /// Closes every mark, clears a V6 violation.
    fn reset(&self) {
        self.stack.reset();
    }

    /// Starts a new high-water measurement from the current use.
    fn reset_high_water(&self) {
        self.stack.reset_high_water();
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.stack.stats();
        let d = PyDict::new(py);
        d.set_item("used", s.used)?;
        d.set_item("capacity", s.capacity)?;
        d.set_item("high_water", s.high_water)?;
        d.set_item("open_marks", s.open_marks)?;
        d.set_item("generation", s.generation)?;
        d.set_item("violations", s.violations)?;
        Ok(d)
    }

    #[getter]
    fn used(&self) -> usize {
        self.stack.stats().used
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.stack.stats().capacity
    }

    #[getter]
    fn high_water(&self) -> usize {
        self.stack.stats().high_water
    }

    fn __repr__(&self) -> String {
        let s = self.stack.stats();
        format!(
            "<ScratchStack used={} of {} high_water={} open_marks={}>",
            s.used, s.capacity, s.high_water, s.open_marks
        )
    }
}

/// An open scratch mark. Takes come from the innermost open mark; leaving
/// the `with` block (or `rewind()`) rewinds; rewinding out of LIFO order
/// raises and stops the stack until `reset()`.
#[pyclass(frozen, name = "Mark", module = "imp_mem._core")]
pub struct PyMark {
    inner: Mutex<Option<SharedMark>>,
    stack: SharedScratchStack,
    exportable: bool,
}

fn mark_closed() -> PyErr {
    StaleSpan::new_err("this scratch mark is already closed; open a new one with stack.mark()")
}

#[pymethods]
impl PyMark {
    /// Takes `nbytes` aligned to `align` (default 256); valid until this mark
    /// closes.
    #[pyo3(signature = (nbytes, align = None))]
    fn take(
        &self,
        nbytes: &Bound<'_, PyAny>,
        align: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStableSpan> {
        let len = size(nbytes, "nbytes")?;
        let align = self::align(align)?;
        let ticket = {
            let guard = lock(&self.inner);
            guard
                .as_ref()
                .ok_or_else(mark_closed)?
                .take(len, align)
                .py()?
        };
        Ok(stable(
            Owner::Scratch(self.stack.clone(), ticket),
            len,
            self.exportable,
        ))
    }

    /// Closes the mark now.
    fn rewind(&self) -> PyResult<()> {
        let mark = lock(&self.inner).take().ok_or_else(mark_closed)?;
        mark.rewind().py()
    }

    /// Whether the mark is open.
    #[getter]
    fn open(&self) -> bool {
        lock(&self.inner).as_ref().is_some_and(SharedMark::is_open)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        match lock(&self.inner).take() {
            Some(mark) => mark.rewind().py().map(|()| false),
            None => Ok(false),
        }
    }

    fn __repr__(&self) -> String {
        format!("<Mark {}>", if self.open() { "open" } else { "closed" })
    }
}

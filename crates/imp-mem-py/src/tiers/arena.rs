//! `Arena`: the T1 / T2 bump arena.

use imp_mem_core::SharedArena;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::span::{stable, Owner, PyStableSpan};
use super::{align, opt_tag, size, PyTier};
use crate::backend::PyBackend;
use crate::convert;
use crate::errors::IntoPyResult;

/// A bump arena for T1 (model-resident) or T2 (engine-persistent).
#[pyclass(frozen, name = "Arena", module = "imp_mem._core")]
pub struct PyArena {
    pub(crate) arena: SharedArena,
    exportable: bool,
}

impl PyArena {
    /// Wraps an arena opened elsewhere (by a `MemorySystem`).
    pub(crate) fn wrap(arena: SharedArena, exportable: bool) -> Self {
        Self { arena, exportable }
    }
}

#[pymethods]
impl PyArena {
    #[new]
    #[pyo3(
        signature = (backend, nbytes, *, tier = PyTier::ModelResident, tag = None),
        text_signature = "(backend, nbytes, *, tier=Tier.MODEL_RESIDENT, tag=None)"
    )]
    fn new(
        backend: PyRef<'_, PyBackend>,
        nbytes: &Bound<'_, PyAny>,
        tier: PyTier,
        tag: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let bytes = convert::bytes(nbytes, "nbytes")?;
        let arena = SharedArena::new(&backend.inner, tier.into(), bytes, opt_tag(tag)?).py()?;
        backend.notices.emit(backend.py())?;
        Ok(Self {
            arena,
            exportable: backend.inner.addressable(),
        })
    }

    /// Takes `nbytes` aligned to `align` (default 256).
    #[pyo3(signature = (nbytes, align = None))]
    fn take(
        &self,
        nbytes: &Bound<'_, PyAny>,
        align: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStableSpan> {
        let len = size(nbytes, "nbytes")?;
        let ticket = self.arena.take(len, self::align(align)?).py()?;
        Ok(stable(
            Owner::Arena(self.arena.clone(), ticket),
            len,
            self.exportable,
        ))
    }

    /// Frees everything at once; every span taken before raises `StaleSpan`.
    /// Refused (`InvalidArgument`, naming how many) while DLPack exports of
    /// the arena's spans are alive, unless `unsafe_allow_live_exports=True`:
    /// unsafe, because those tensors then read what the arena hands out
    /// next.
    #[pyo3(signature = (*, unsafe_allow_live_exports = false))]
    fn reset(&self, unsafe_allow_live_exports: bool) -> PyResult<()> {
        self.arena.reset_checked(unsafe_allow_live_exports).py()
    }

    /// Live DLPack exports of the current generation's spans.
    #[getter]
    fn live_exports(&self) -> usize {
        self.arena.live_exports()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.arena.stats();
        let d = PyDict::new(py);
        d.set_item("tier", self.arena.tier().name())?;
        d.set_item("tag", self.arena.tag().name())?;
        d.set_item("used", s.used)?;
        d.set_item("capacity", s.capacity)?;
        d.set_item("committed", s.committed)?;
        d.set_item("high_water", s.high_water)?;
        d.set_item("generation", s.generation)?;
        d.set_item("takes", s.takes)?;
        Ok(d)
    }

    #[getter]
    fn used(&self) -> usize {
        self.arena.stats().used
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.arena.stats().capacity
    }

    #[getter]
    fn high_water(&self) -> usize {
        self.arena.stats().high_water
    }

    #[getter]
    fn generation(&self) -> u64 {
        self.arena.stats().generation
    }

    #[getter]
    fn tier(&self) -> PyTier {
        self.arena.tier().into()
    }

    #[getter]
    fn tag(&self) -> &'static str {
        self.arena.tag().name()
    }

    fn __repr__(&self) -> String {
        let s = self.arena.stats();
        format!(
            "<Arena {} used={} of {} high_water={} generation={}>",
            self.arena.tier().label(),
            s.used,
            s.capacity,
            s.high_water,
            s.generation
        )
    }
}

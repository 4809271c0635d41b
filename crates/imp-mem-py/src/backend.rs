//! Python face of L1: `Backend` (the shared base class), `FakeBackend`,
//! `Region`, `Phase` and the re-entry bracket.
//!
//! No rule lives here: every check is the core's. This file converts
//! arguments, maps errors, and turns the core's notices into Python warnings
//! and log records.

use std::sync::{Arc, Mutex};

use imp_mem_core::backend::{NoticeLevel, ReplanGuard, DEFAULT_ALIGNMENT};
use imp_mem_core::{
    Backend, BackendStats, FakeBackend, FakeConfig, Phase, PhaseMode, Region, TagStats,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::convert;
use crate::errors::{invalid, ImpMemWarning, IntoPyResult};
use crate::ledger::PyLedgerTenant;

/// The engine's phase, as Python sees it.
#[pyclass(
    eq,
    eq_int,
    frozen,
    hash,
    from_py_object,
    name = "Phase",
    module = "imp_mem._core"
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub enum PyPhase {
    /// Weights are loading.
    #[pyo3(name = "LOADING")]
    Loading,
    /// The plan is applied.
    #[pyo3(name = "PLANNING")]
    Planning,
    /// Serving requests.
    #[pyo3(name = "SERVING")]
    Serving,
}

impl From<Phase> for PyPhase {
    fn from(p: Phase) -> Self {
        match p {
            Phase::Loading => PyPhase::Loading,
            Phase::Planning => PyPhase::Planning,
            Phase::Serving => PyPhase::Serving,
        }
    }
}

impl From<PyPhase> for Phase {
    fn from(p: PyPhase) -> Self {
        match p {
            PyPhase::Loading => Phase::Loading,
            PyPhase::Planning => Phase::Planning,
            PyPhase::Serving => Phase::Serving,
        }
    }
}

#[pymethods]
impl PyPhase {
    fn __str__(&self) -> &'static str {
        Phase::from(*self).name()
    }
}

/// Notices the core emitted during a call, delivered to Python after it.
#[derive(Clone, Default)]
pub struct Notices(Arc<Mutex<Vec<(NoticeLevel, String)>>>);

impl Notices {
    fn install(&self, backend: &Backend) {
        let queue = self.0.clone();
        backend.set_notifier(Some(Arc::new(move |level, message: &str| {
            queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((level, message.to_string()));
        })));
    }

    /// Emits queued warnings with `warnings.warn` and infos to the `imp_mem`
    /// logger. A warning filter that turns warnings into errors makes this
    /// raise, as it should.
    pub fn emit(&self, py: Python<'_>) -> PyResult<()> {
        let drained: Vec<_> =
            std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        for (level, message) in drained {
            match level {
                NoticeLevel::Warning => {
                    let category = py.get_type::<ImpMemWarning>();
                    PyErr::warn(py, &category, &std::ffi::CString::new(message)?, 2)?;
                }
                NoticeLevel::Info => {
                    let logger = py
                        .import("logging")?
                        .call_method1("getLogger", ("imp_mem",))?;
                    logger.call_method1("info", (message,))?;
                }
            }
        }
        Ok(())
    }
}

/// Methods every backend has. Concrete backends (`FakeBackend`,
/// `CudaBackend`, `VmmBackend`) subclass it.
#[pyclass(subclass, frozen, name = "Backend", module = "imp_mem._core")]
pub struct PyBackend {
    /// The core backend.
    pub inner: Backend,
    /// Its notice queue.
    pub notices: Notices,
}

impl PyBackend {
    /// Wraps a core backend, routing its notices to Python.
    pub fn wrap(inner: Backend) -> Self {
        let notices = Notices::default();
        notices.install(&inner);
        Self { inner, notices }
    }
}

fn tag_stats<'py>(py: Python<'py>, t: &TagStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("reserved", t.reserved)?;
    d.set_item("committed", t.committed)?;
    d.set_item("live", t.live)?;
    d.set_item("peak", t.peak)?;
    d.set_item("acquisitions", t.acquisitions)?;
    d.set_item("releases", t.releases)?;
    Ok(d)
}

/// Renders a stats snapshot as plain Python data.
pub fn stats_dict<'py>(py: Python<'py>, s: &BackendStats) -> PyResult<Bound<'py, PyDict>> {
    let d = tag_stats(py, &s.total)?;
    d.set_item("phase", s.phase.name())?;
    d.set_item(
        "mode",
        if s.mode == PhaseMode::Strict {
            "strict"
        } else {
            "production"
        },
    )?;
    d.set_item("budget", s.budget)?;
    d.set_item("capacity", s.capacity)?;
    d.set_item("acquired_bytes_total", s.acquired_bytes_total)?;
    d.set_item("released_bytes_total", s.released_bytes_total)?;
    let tags = PyDict::new(py);
    for (tag, t) in &s.tags {
        tags.set_item(tag.name(), tag_stats(py, t)?)?;
    }
    d.set_item("tags", tags)?;
    let steady = PyDict::new(py);
    for (tag, n) in &s.steady_state_allocations_total {
        steady.set_item(tag.name(), n)?;
    }
    d.set_item("steady_state_allocations_total", steady)?;
    Ok(d)
}

#[pymethods]
impl PyBackend {
    /// Acquires `nbytes` aligned to `align` for `tag`; returns a `Region`.
    #[pyo3(
        signature = (nbytes, *, align = None, tag = None),
        text_signature = "($self, nbytes, *, align=None, tag='other')"
    )]
    fn acquire(
        &self,
        py: Python<'_>,
        nbytes: &Bound<'_, PyAny>,
        align: Option<&Bound<'_, PyAny>>,
        tag: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRegion> {
        let tag = convert::opt(tag, "tag", convert::text)?;
        let tag = tag.as_deref().unwrap_or("other");
        let bytes = convert::bytes(nbytes, "nbytes")?;
        let align = match align.filter(|a| !a.is_none()) {
            Some(a) => convert::index(a, "align")?,
            None => DEFAULT_ALIGNMENT as u64,
        };
        let tag = convert::tag(tag)?;
        let result = self.inner.acquire(bytes, align, tag);
        let region = result.py()?;
        self.notices.emit(py)?;
        Ok(PyRegion::new(region))
    }

    /// Acquires a growable region: `reserve` bytes of address space, `initial`
    /// of them committed now (rounded up to the granularity).
    #[pyo3(
        signature = (reserve, initial = None, *, tag = None),
        text_signature = "($self, reserve, initial=None, *, tag='other')"
    )]
    fn acquire_growable(
        &self,
        py: Python<'_>,
        reserve: &Bound<'_, PyAny>,
        initial: Option<&Bound<'_, PyAny>>,
        tag: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyRegion> {
        let tag = convert::opt(tag, "tag", convert::text)?;
        let tag = tag.as_deref().unwrap_or("other");
        let reserve = convert::bytes(reserve, "reserve")?;
        let initial = convert::opt_bytes(initial, "initial")?.unwrap_or(0);
        let tag = convert::tag(tag)?;
        let region = self.inner.acquire_growable(reserve, initial, tag).py()?;
        self.notices.emit(py)?;
        Ok(PyRegion::new(region))
    }

    /// Releases `region` now. Releasing twice raises `InvalidArgument`.
    fn release(&self, region: &PyRegion) -> PyResult<()> {
        let taken = region.take()?;
        self.inner.release(taken).py()
    }

    /// Accounting as plain data: totals, per tag, and steady-state counts.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.inner.stats())
    }

    /// The phase now.
    #[getter]
    fn phase(&self) -> PyPhase {
        self.inner.phase().into()
    }

    /// `LOADING -> PLANNING`.
    fn begin_planning(&self) -> PyResult<()> {
        self.inner.begin_planning().py()
    }

    /// `PLANNING -> SERVING`.
    fn begin_serving(&self) -> PyResult<()> {
        self.inner.begin_serving().py()
    }

    /// Moves to `phase`, one step forward only.
    fn advance(&self, phase: &Bound<'_, PyAny>) -> PyResult<()> {
        let phase: PyPhase = phase.extract().map_err(|_| {
            invalid(format!(
                "advance() takes a Phase (Phase.PLANNING, Phase.SERVING), got {phase}"
            ))
        })?;
        self.inner.advance(phase.into()).py()
    }

    /// A context manager re-entering `PLANNING` while serving (model swap);
    /// the phase returns to `SERVING` when it exits.
    #[pyo3(signature = (reason = None), text_signature = "($self, reason='model swap')")]
    fn replanning(&self, reason: Option<&Bound<'_, PyAny>>) -> PyResult<PyReplanning> {
        let reason = convert::opt(reason, "reason", convert::text)?;
        let reason = reason.as_deref().unwrap_or("model swap");
        Ok(PyReplanning {
            backend: self.inner.clone(),
            notices: self.notices.clone(),
            reason: reason.to_string(),
            guard: Mutex::new(None),
        })
    }

    /// Commits through `tenant` (a `LedgerTenant` of a `DeviceLedger`) from
    /// now on: every acquisition and growth asks the ledger first, every
    /// release and decommit returns to it. What is committed already is
    /// charged to the tenant now; the budget becomes at most its cap.
    fn attach_ledger(&self, py: Python<'_>, tenant: &PyLedgerTenant) -> PyResult<()> {
        let t = std::sync::Arc::clone(&tenant.inner);
        py.detach(|| self.inner.attach_ledger(t)).py()
    }

    /// Stops committing through the device ledger; refused
    /// (`InvalidArgument`) while anything is committed. The tenant leaves the
    /// ledger once no one holds it.
    fn detach_ledger(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.detach_ledger()).py().map(drop)
    }

    /// Bytes this backend could commit now: its budget less what it holds,
    /// and on a ledger no more than the ledger would grant.
    fn headroom(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| self.inner.headroom()).py()
    }

    /// The budget cap in bytes.
    #[getter]
    fn budget(&self) -> u64 {
        self.inner.budget()
    }

    /// Changes the budget cap (an int or text like `"40GiB"`).
    fn set_budget(&self, budget: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner
            .set_budget(convert::bytes(budget, "budget")?)
            .py()
    }

    /// The device's capacity in bytes.
    #[getter]
    fn capacity(&self) -> u64 {
        self.inner.info().capacity
    }

    /// Growable regions commit in multiples of this many bytes.
    #[getter]
    fn granularity(&self) -> usize {
        self.inner.info().granularity
    }

    /// Whether `acquire_growable` is supported.
    #[getter]
    fn growable(&self) -> bool {
        self.inner.info().growable
    }

    /// Device ordinal.
    #[getter]
    fn device(&self) -> i32 {
        self.inner.info().device
    }

    /// `"fake"`, `"cuda"`, `"vmm"`.
    #[getter]
    fn kind(&self) -> String {
        self.inner.info().name.clone()
    }

    /// Bytes live now.
    #[getter]
    fn live(&self) -> u64 {
        self.inner.live()
    }

    /// Starts keeping the journal (a fake keeps it from the start; a device
    /// backend only from this call on): every acquisition, release, commit
    /// and decommit from now, for `journal()` and the V8 replay.
    fn enable_journal(&self) {
        self.inner.enable_journal();
    }

    /// The journal as a list of `(seq, phase, tag, bytes, op)` tuples, or
    /// None when the backend does not keep one.
    fn journal<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(entries) = self.inner.journal() else {
            return Ok(None);
        };
        let rows = entries
            .iter()
            .map(|e| {
                PyTuple::new(
                    py,
                    [
                        e.seq.into_pyobject(py)?.into_any(),
                        e.phase.name().into_pyobject(py)?.into_any(),
                        e.tag.name().into_pyobject(py)?.into_any(),
                        e.bytes.into_pyobject(py)?.into_any(),
                        e.op.name().into_pyobject(py)?.into_any(),
                    ],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Some(PyList::new(py, rows)?))
    }

    /// Checks the accounting invariants (V1 against the journal); raises
    /// `ImpMemError` if one is broken.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().py()
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!(
            "<{} backend device={} phase={} live={} budget={}>",
            self.inner.info().name,
            self.inner.info().device,
            s.phase,
            s.total.live,
            s.budget
        )
    }
}

/// The context manager returned by `Backend.replanning()`.
#[pyclass(frozen, name = "Replanning", module = "imp_mem._core")]
pub struct PyReplanning {
    backend: Backend,
    notices: Notices,
    reason: String,
    guard: Mutex<Option<ReplanGuard>>,
}

#[pymethods]
impl PyReplanning {
    fn __enter__(slf: PyRef<'_, Self>, py: Python<'_>) -> PyResult<Py<Self>> {
        let guard = slf.backend.replanning(&slf.reason).py()?;
        *slf.guard.lock().unwrap_or_else(|p| p.into_inner()) = Some(guard);
        slf.notices.emit(py)?;
        Ok(slf.into())
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        let guard = self.guard.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(guard);
        self.notices.emit(py)?;
        Ok(false)
    }
}

/// Memory acquired from a backend. Released when `release()` is called, when a
/// `with` block exits, or when the object is garbage-collected — exactly once.
#[pyclass(frozen, name = "Region", module = "imp_mem._core")]
pub struct PyRegion {
    inner: Mutex<Option<Region>>,
    address: usize,
    reserved: usize,
    tag: &'static str,
    growable: bool,
}

impl PyRegion {
    /// Wraps a core region.
    pub fn new(region: Region) -> Self {
        Self {
            address: region.base(),
            reserved: region.reserved(),
            tag: region.tag().name(),
            growable: region.is_growable(),
            inner: Mutex::new(Some(region)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Region>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the region out; a second take is an error.
    pub fn take(&self) -> PyResult<Region> {
        self.lock()
            .take()
            .ok_or_else(|| invalid("region already released; keep one owner and release it once"))
    }

    /// Runs `f` on the live region, holding it; `StaleSpan` once released.
    pub(crate) fn with_live<T>(&self, f: impl FnOnce(&mut Region) -> PyResult<T>) -> PyResult<T> {
        let mut guard = self.lock();
        match guard.as_mut() {
            Some(region) => f(region),
            None => Err(crate::errors::StaleSpan::new_err(
                "region was released; acquire a new one",
            )),
        }
    }
}

#[pymethods]
impl PyRegion {
    /// The base address. It never changes, even when a growable region grows.
    #[getter]
    fn address(&self) -> usize {
        self.address
    }

    /// Bytes usable now (committed); 0 once released.
    #[getter]
    fn nbytes(&self) -> usize {
        self.lock().as_ref().map_or(0, Region::len)
    }

    /// Address space reserved (the most a growable region can commit).
    #[getter]
    fn reserved(&self) -> usize {
        self.reserved
    }

    /// What the region is for.
    #[getter]
    fn tag(&self) -> &'static str {
        self.tag
    }

    /// Whether it can commit and decommit.
    #[getter]
    fn growable(&self) -> bool {
        self.growable
    }

    /// True once released.
    #[getter]
    fn released(&self) -> bool {
        self.lock().is_none()
    }

    /// Releases it now. A second call raises `InvalidArgument`.
    fn release(&self) -> PyResult<()> {
        drop(self.take()?);
        Ok(())
    }

    /// Commits up to at least `nbytes` (growable regions).
    fn commit(&self, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::bytes(nbytes, "nbytes")?;
        self.with_live(|r| r.commit(n).py())
    }

    /// Decommits down to `nbytes` (growable regions). On a GPU, the caller
    /// guarantees no queued work still uses the tail.
    fn decommit(&self, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::bytes(nbytes, "nbytes")?;
        self.with_live(|r| r.decommit(n).py())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        drop(self.lock().take());
        false
    }

    fn __repr__(&self) -> String {
        match self.lock().as_ref() {
            Some(r) => format!(
                "<Region {:#x} {} B of {} B tag={}{}>",
                self.address,
                r.len(),
                self.reserved,
                self.tag,
                if self.growable { " growable" } else { "" }
            ),
            None => format!("<Region {:#x} released>", self.address),
        }
    }
}

/// A backend over host memory, for tests: journal, poison on release,
/// fault injection and growth simulation.
#[pyclass(extends = PyBackend, frozen, name = "FakeBackend", module = "imp_mem._core")]
pub struct PyFakeBackend {
    /// The core fake (the KV manager copies block bytes through it).
    pub(crate) fake: FakeBackend,
}

#[pymethods]
impl PyFakeBackend {
    #[new]
    #[pyo3(signature = (capacity = None, *, budget = None, granularity = None, backed = true, strict = true))]
    fn new(
        capacity: Option<&Bound<'_, PyAny>>,
        budget: Option<&Bound<'_, PyAny>>,
        granularity: Option<&Bound<'_, PyAny>>,
        backed: bool,
        strict: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let capacity = convert::opt_bytes(capacity, "capacity")?.unwrap_or(1 << 30);
        let granularity = convert::opt_bytes(granularity, "granularity")?.unwrap_or(4096);
        let config = FakeConfig {
            capacity,
            budget: convert::opt_bytes(budget, "budget")?,
            granularity: usize::try_from(granularity)
                .map_err(|_| invalid("granularity does not fit this host"))?,
            backed,
            mode: if strict {
                PhaseMode::Strict
            } else {
                PhaseMode::Production
            },
        };
        let fake = FakeBackend::new(config).py()?;
        let base = PyBackend::wrap(fake.backend().clone());
        Ok(PyClassInitializer::from(base).add_subclass(Self { fake }))
    }

    /// Makes the `n`-th acquisition from now fail (1 = the next); None clears.
    #[pyo3(signature = (n))]
    fn fail_nth(&self, n: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let n = n
            .filter(|v| !v.is_none())
            .map(|v| convert::index(v, "n"))
            .transpose()?;
        self.fake.fail_nth(n).py()
    }

    /// Makes the next `n` commits of growable regions fail; 0 clears;
    /// None is the default, 1 (as for every defaulted argument of this API).
    #[pyo3(signature = (n = None), text_signature = "($self, n=1)")]
    fn fail_commits(&self, n: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let n = convert::opt(n, "n", convert::u32_arg)?.unwrap_or(1);
        self.fake.fail_commits(n);
        Ok(())
    }

    /// Makes the next `n` decommits fail; 0 clears; None is the default, 1.
    #[pyo3(signature = (n = None), text_signature = "($self, n=1)")]
    fn fail_decommits(&self, n: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let n = convert::opt(n, "n", convert::u32_arg)?.unwrap_or(1);
        self.fake.fail_decommits(n);
        Ok(())
    }

    /// Simulates device memory used outside this backend.
    fn set_external_usage(&self, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        self.fake
            .set_external_usage(convert::bytes(nbytes, "nbytes")?);
        Ok(())
    }

    /// Reads `nbytes` at `address` from a live or quarantined region.
    fn read<'py>(
        &self,
        py: Python<'py>,
        address: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let addr = convert::index(address, "address")? as usize;
        let n = convert::index(nbytes, "nbytes")? as usize;
        let data = self.fake.read(addr, n).py()?;
        Ok(PyBytes::new(py, &data))
    }

    /// Writes a bytes-like object at `address` inside a live region.
    fn write(
        &self,
        py: Python<'_>,
        address: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let addr = convert::index(address, "address")? as usize;
        let bytes = convert::bytes_like(py, data)?;
        self.fake.write(addr, &bytes).py()
    }

    /// True when every byte at `[address, address + nbytes)` is the poison 0xDE.
    fn is_poisoned(&self, address: &Bound<'_, PyAny>, nbytes: &Bound<'_, PyAny>) -> PyResult<bool> {
        let addr = convert::index(address, "address")? as usize;
        let n = convert::index(nbytes, "nbytes")? as usize;
        self.fake.is_poisoned(addr, n).py()
    }

    /// Addresses of released regions still held in quarantine, oldest first.
    fn quarantine(&self) -> Vec<usize> {
        self.fake.quarantine()
    }

    /// Physical bytes the fake device has in use.
    #[getter]
    fn device_used(&self) -> u64 {
        self.fake.device_used()
    }
}

/// Registers this file's classes.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPhase>()?;
    m.add_class::<PyBackend>()?;
    m.add_class::<PyFakeBackend>()?;
    m.add_class::<PyRegion>()?;
    m.add_class::<PyReplanning>()?;
    Ok(())
}

//! The device ledger (issue 27): `DeviceLedger`, `LedgerTenant` and
//! `ledger_devices()`. The protocol lives in `imp_mem_core::ledger`.

use std::sync::Arc;
use std::time::Duration;

use imp_mem_core::ledger::{self, DeviceLedger, LedgerSnapshot, SlotState, Tenant};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use imp_mem_core::decommit::{FenceLike, NothingInFlight};

use crate::convert;
use crate::cuda::PyFence;
use crate::errors::{invalid, IntoPyResult};

fn dir_of(dir: Option<&Bound<'_, PyAny>>) -> PyResult<std::path::PathBuf> {
    match dir.filter(|d| !d.is_none()) {
        Some(d) => convert::path(d, "dir"),
        None => Ok(ledger::default_dir()),
    }
}

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    if !value.is_finite() || !(0.0..=86_400.0).contains(&value) {
        return Err(invalid(format!(
            "{what}={value} must be between 0 and 86400 seconds"
        )));
    }
    Ok(Duration::from_secs_f64(value))
}

fn snapshot_list<'py>(py: Python<'py>, snap: &LedgerSnapshot) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for t in &snap.tenants {
        let r = &t.record;
        let d = PyDict::new(py);
        d.set_item("slot", t.slot)?;
        d.set_item("name", &r.name)?;
        d.set_item("pid", r.pid)?;
        d.set_item(
            "state",
            match r.state {
                SlotState::Live => "live",
                SlotState::Pending => "pending",
                SlotState::Free => "free",
            },
        )?;
        d.set_item("floor", r.floor)?;
        d.set_item("cap", r.cap)?;
        d.set_item("committed", r.committed)?;
        d.set_item("kv_live", r.kv_live)?;
        d.set_item("want", r.want)?;
        d.set_item("asleep", r.asleep)?;
        d.set_item("updated_ms", r.updated_ms)?;
        out.append(d)?;
    }
    Ok(out)
}

/// One device's ledger: a table in shared memory of the imp-mem processes
/// (tenants) that commit the device's memory, with their floors, caps and
/// commitments. Every process that opens the same `key` in the same `dir`
/// shares it; the first sets the `budget`.
#[pyclass(frozen, name = "DeviceLedger", module = "imp_mem._core")]
pub struct PyDeviceLedger {
    inner: DeviceLedger,
}

#[pymethods]
impl PyDeviceLedger {
    /// Opens (creating) the ledger of device `key` (its UUID, or a name
    /// for a fake) in `dir` (default: `$IMP_MEM_LEDGER_DIR` or
    /// `/dev/shm/imp-mem-ledger`). The first opener's `budget` is the
    /// table's; a later opener passes the same, or `None` to take it
    /// (another budget is refused, naming the table's).
    #[new]
    #[pyo3(signature = (key, budget = None, dir = None))]
    fn new(
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        budget: Option<&Bound<'_, PyAny>>,
        dir: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let key = convert::text(key, "key")?;
        let budget = match budget.filter(|b| !b.is_none()) {
            Some(b) => Some(convert::bytes(b, "budget")?),
            None => None,
        };
        let dir = dir_of(dir)?;
        let inner = py
            .detach(|| match budget {
                Some(budget) => DeviceLedger::open(&dir, &key, budget),
                None => DeviceLedger::open_existing(&dir, &key),
            })
            .py()?;
        Ok(Self { inner })
    }

    /// The device key.
    #[getter]
    fn key(&self) -> String {
        self.inner.key().to_string()
    }

    /// The bytes all tenants together may commit.
    #[getter]
    fn budget(&self) -> u64 {
        self.inner.budget()
    }

    /// Admits a tenant: `floor` bytes always available to it, at most
    /// `cap`. Raises `PlanFailure` (naming every tenant and its floor) when
    /// its floor does not fit beside theirs; waits up to `wait_s` seconds
    /// for the others to give elastic memory back (`CapacityError` after).
    #[pyo3(signature = (name, floor, cap, wait_s = 5.0))]
    fn join(
        &self,
        py: Python<'_>,
        name: &Bound<'_, PyAny>,
        floor: &Bound<'_, PyAny>,
        cap: &Bound<'_, PyAny>,
        wait_s: f64,
    ) -> PyResult<PyLedgerTenant> {
        let name = convert::text(name, "name")?;
        let floor = convert::bytes(floor, "floor")?;
        let cap = convert::bytes(cap, "cap")?;
        let wait = seconds(wait_s, "wait_s")?;
        let t = py
            .detach(|| self.inner.join(&name, floor, cap, wait))
            .py()?;
        Ok(PyLedgerTenant { inner: Arc::new(t) })
    }

    /// The tenants now (dead ones reaped first), as dicts: `slot`, `name`,
    /// `pid`, `state`, `floor`, `cap`, `committed`, `kv_live`, `want`,
    /// `asleep`, `updated_ms`.
    fn tenants<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let snap = py.detach(|| self.inner.snapshot()).py()?;
        snapshot_list(py, &snap)
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceLedger(key={:?}, budget={})",
            self.inner.key(),
            self.inner.budget()
        )
    }
}

/// An admitted tenant of a `DeviceLedger`. Pass it to
/// `Backend.attach_ledger` so that the backend commits only what the
/// ledger grants. It leaves the ledger when the last reference goes (or
/// when its process dies, however).
#[pyclass(frozen, name = "LedgerTenant", module = "imp_mem._core")]
pub struct PyLedgerTenant {
    pub(crate) inner: Arc<Tenant>,
}

impl PyLedgerTenant {
    /// A refused grant as Python's `OutOfMemory`, with the ledger's headroom.
    fn refusal(&self, asked: u64, refused: imp_mem_core::ledger::Refused) -> PyErr {
        let budget = self.inner.ledger().budget();
        crate::errors::to_py(imp_mem_core::MemError::OutOfMemory(
            imp_mem_core::error::OomReport {
                asked,
                live: refused.committed,
                budget,
                capacity: budget,
                tag: imp_mem_core::Tag::Workspace,
                device_refused: false,
                ledger_headroom: Some(refused.headroom),
                ledger_tenant: Some(refused.share(false)),
            },
        ))
    }
}

#[pymethods]
impl PyLedgerTenant {
    /// Its slot in the table.
    #[getter]
    fn slot(&self) -> usize {
        self.inner.slot()
    }

    /// Its record: the dict `DeviceLedger.tenants()` gives for it.
    fn record<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = py.detach(|| self.inner.record()).py()?;
        let snap = LedgerSnapshot {
            key: self.inner.ledger().key().to_string(),
            budget: self.inner.ledger().budget(),
            tenants: vec![ledger::TenantView {
                slot: self.inner.slot(),
                record: r,
            }],
            reaped: 0,
        };
        let list = snapshot_list(py, &snap)?;
        Ok(list.get_item(0)?.cast_into::<PyDict>()?)
    }

    /// Bytes it may still be granted now (its cap and the others'
    /// reservations).
    fn headroom(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| self.inner.headroom()).py()
    }

    /// Bytes the ledger asks it to give back now (0: none).
    fn pressure(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| self.inner.pressure()).py()
    }

    /// Charges `nbytes` the ledger grants outside any backend (a CUDA
    /// context, NCCL's buffers); `OutOfMemory` when it cannot grant them.
    fn grow(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::bytes(nbytes, "nbytes")?;
        let answer = py.detach(|| self.inner.grow(n)).py()?;
        answer.map_err(|refused| self.refusal(n, refused))
    }

    /// Raises its floor by `nbytes` (memory it must always hold, learned
    /// after its join: a warm-up measured past its plan's line); its cap
    /// rises with it. `OutOfMemory` when the others' reservations leave no
    /// room for it (nothing changed).
    fn raise_floor(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::bytes(nbytes, "nbytes")?;
        let answer = py.detach(|| self.inner.raise_floor(n)).py()?;
        answer.map_err(|refused| self.refusal(n, refused))
    }

    /// Lowers its floor by `nbytes` (to zero at most): what a join planned
    /// for rounding, given back once the tenant knows what it holds at
    /// rest. Always granted; its cap stays.
    fn lower_floor(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::bytes(nbytes, "nbytes")?;
        py.detach(|| self.inner.lower_floor(n)).py()
    }

    /// Returns `nbytes` charged with `grow`.
    fn shrink(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::bytes(nbytes, "nbytes")?;
        py.detach(|| self.inner.shrink(n)).py()
    }

    /// Asks the others to give `nbytes` back (a want, fresh for a second).
    fn want(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::bytes(nbytes, "nbytes")?;
        py.detach(|| self.inner.want(n)).py()
    }

    /// Records the bytes of its live KV blocks, for operators.
    fn set_kv_live(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::bytes(nbytes, "nbytes")?;
        py.detach(|| self.inner.set_kv_live(n)).py()
    }

    /// Records its sleep level (0: awake), for operators.
    fn set_asleep(&self, py: Python<'_>, level: u8) -> PyResult<()> {
        if level > 2 {
            return Err(invalid(format!("level={level} must be 0, 1 or 2")));
        }
        py.detach(|| self.inner.set_asleep(level)).py()
    }

    fn __repr__(&self) -> String {
        format!(
            "LedgerTenant(ledger={:?}, slot={})",
            self.inner.ledger().key(),
            self.inner.slot()
        )
    }
}

/// A fence for a KV give-back: None (nothing in flight) or an
/// `imp_mem.Fence`.
pub(crate) fn kv_fence(
    fence: Option<&Bound<'_, PyAny>>,
) -> PyResult<Box<dyn FenceLike + Send + Sync>> {
    let Some(fence) = fence.filter(|f| !f.is_none()) else {
        return Ok(Box::new(NothingInFlight));
    };
    if let Ok(f) = fence.cast::<PyFence>() {
        return Ok(Box::new(f.get().shared()));
    }
    Err(invalid(format!(
        "fence must be None or an imp_mem.Fence (synchronize a torch event first and pass \
         None), got {}",
        convert::type_name(fence)
    )))
}

/// The device keys with a ledger in `dir` (default: the ledger's
/// directory), sorted.
#[pyfunction]
#[pyo3(signature = (dir = None))]
fn ledger_devices(dir: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let dir = dir_of(dir)?;
    ledger::list_devices(&dir).py()
}

/// The ledger's directory now: `$IMP_MEM_LEDGER_DIR`, or
/// `/dev/shm/imp-mem-ledger`.
#[pyfunction]
fn ledger_dir() -> String {
    ledger::default_dir().to_string_lossy().into_owned()
}

/// Registers this file's classes.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDeviceLedger>()?;
    m.add_class::<PyLedgerTenant>()?;
    m.add_function(wrap_pyfunction!(ledger_devices, m)?)?;
    m.add_function(wrap_pyfunction!(ledger_dir, m)?)?;
    Ok(())
}

//! Python face of the memory system: `MemorySystem`.
//!
//! Every rule is the core's (`imp_mem_core::system`): the open order, the
//! clean failure, the budget, the report and the metrics. This file converts
//! arguments, hands out the opened tiers as the same Python classes
//! (`Arena`, `BlockPool`, `ScratchStack`) a caller would build by hand, and
//! converts a report's device argument (the core reads the backend's device
//! and its VMM charges itself: `MemorySystem::report_input`).

use std::sync::{Arc, Mutex, MutexGuard};

use imp_mem_core::kv::DEFAULT_HASH_SEED;
use imp_mem_core::system::{DeviceQuery, DeviceReading, MemReport, MemorySystem, SystemOptions};
use imp_mem_core::{MemError, SharedBlockPool};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyTuple};

use crate::activations::PyActivationPool;
use crate::backend::{PyBackend, PyPhase};
use crate::convert;
use crate::errors::{invalid, ImpMemWarning, IntoPyResult};
use crate::kv::PyKVCacheManager;
use crate::planner::PyMemoryPlan;
use crate::tiers::{FenceWatch, PyArena, PyBlockPool, PyScratchStack};

fn u32_opt(value: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<u32>> {
    value
        .filter(|v| !v.is_none())
        .map(|v| {
            let n = convert::index(v, what)?;
            u32::try_from(n).map_err(|_| invalid(format!("{what}={n} is too large")))
        })
        .transpose()
}

/// The `tiers` argument of `sleep` and `wake`: a tier key or tag, an
/// iterable of them, or None (the default selection).
fn tier_names(tiers: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<String>>> {
    Ok(match tiers.filter(|t| !t.is_none()) {
        None => None,
        Some(t) if t.is_instance_of::<pyo3::types::PyString>() => {
            Some(vec![convert::text(t, "tiers")?])
        }
        Some(t) => Some(
            t.try_iter()
                .map_err(|_| {
                    pyo3::exceptions::PyTypeError::new_err(
                        "tiers: expected a tier name or an iterable of tier names (str)",
                    )
                })?
                .map(|n| convert::text(&n?, "tiers: every tier name"))
                .collect::<PyResult<Vec<String>>>()?,
        ),
    })
}

/// The `level` argument of `sleep`: 1 when None; checked by the core,
/// which names the value as given (a bool or a float is no level).
fn sleep_level(level: Option<&Bound<'_, PyAny>>) -> PyResult<u8> {
    let Some(value) = level.filter(|l| !l.is_none()) else {
        return Ok(1);
    };
    let number = if value.is_instance_of::<PyBool>() {
        None
    } else {
        value.extract::<i64>().ok()
    };
    let shown = value.repr().map(|r| r.to_string())?;
    imp_mem_core::system::sleep_level(number, &shown).py()
}

/// The tiers of one `MemoryPlan`, opened on one backend in the plan's
/// order, with the phases, the memory report and the metrics.
#[pyclass(frozen, name = "MemorySystem", module = "imp_mem._core")]
pub struct PyMemorySystem {
    inner: Mutex<MemorySystem>,
    backend: Py<PyBackend>,
    /// The plan now (replaced by a model swap).
    plan: Mutex<Py<PyMemoryPlan>>,
    exportable: bool,
    /// One `BlockPool` object per pool, by pool id, made on first use.
    /// Emptied on close, so the system itself keeps nothing alive.
    pools: Mutex<Vec<(u64, Py<PyBlockPool>)>>,
    /// The Python fences `step()` hands the pools, shared with the pools'
    /// objects, so `system.kv_pool.flush_decommit()` waits for them too.
    watch: Arc<FenceWatch>,
}

impl PyMemorySystem {
    fn lock(&self) -> MutexGuard<'_, MemorySystem> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn open(&self) -> PyResult<MutexGuard<'_, MemorySystem>> {
        let guard = self.lock();
        if guard.is_closed() {
            return Err(invalid(
                "this MemorySystem is closed; its tiers were released — open a new one",
            ));
        }
        Ok(guard)
    }

    /// The one `BlockPool` object of `pool`.
    fn pool_object(&self, py: Python<'_>, pool: SharedBlockPool) -> PyResult<Py<PyBlockPool>> {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, obj)) = pools.iter().find(|(id, _)| *id == pool.id()) {
            return Ok(obj.clone_ref(py));
        }
        let id = pool.id();
        let obj = Py::new(
            py,
            PyBlockPool::wrap_watched(pool, self.exportable, self.watch.clone()),
        )?;
        pools.push((id, obj.clone_ref(py)));
        Ok(obj)
    }

    fn emit(&self, py: Python<'_>) -> PyResult<()> {
        self.backend.get().notices.emit(py)
    }

    /// What one report reads: the device `device` names (by default the
    /// backend's own reading) and, in the core, the backend's charges.
    fn query(
        device: Option<&Bound<'_, PyAny>>,
        other_processes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(DeviceQuery, u64)> {
        let query = match device.filter(|d| !d.is_none()) {
            Some(d) if d.is_instance_of::<PyBool>() => {
                if d.extract::<bool>()? {
                    DeviceQuery::Backend
                } else {
                    DeviceQuery::Skip
                }
            }
            Some(d) => {
                let (free, total): (u64, u64) = d.extract().map_err(|_| {
                    invalid("device: expected a (free, total) pair of byte counts, or False")
                })?;
                if free > total {
                    return Err(invalid(format!(
                        "device: free {free} B is larger than total {total} B; pass (free, total)"
                    )));
                }
                DeviceQuery::Given(DeviceReading { free, total })
            }
            None => DeviceQuery::Backend,
        };
        let other_processes = convert::opt_bytes(other_processes, "other_processes")?.unwrap_or(0);
        Ok((query, other_processes))
    }

    fn report(
        &self,
        device: Option<&Bound<'_, PyAny>>,
        other_processes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<MemReport> {
        let (query, other_processes) = Self::query(device, other_processes)?;
        let system = self.lock();
        let input = system.report_input(query, other_processes).py()?;
        Ok(system.report(&input))
    }
}

fn to_py_object<T: serde::Serialize>(py: Python<'_>, value: &T) -> PyResult<Py<PyAny>> {
    let text = serde_json::to_string(value)
        .map_err(|err| MemError::Invariant(format!("memory report does not serialise: {err}")))
        .py()?;
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
}

#[pymethods]
impl PyMemorySystem {
    /// Opens every tier `plan` sizes on `backend`: T2, T1, the fixed T3
    /// pools, T4, then the KV pool (growable where the backend is). Raises
    /// the failing step's exception (with `step` and `step_name`) and leaves
    /// nothing acquired. `context` / `library_reserve` are the measured
    /// charges (default: the plan's figures).
    #[new]
    #[pyo3(signature = (
        backend, plan, *, context = None, library_reserve = None, kv_growable = None,
        kv_initial_blocks = None, kv_grow_blocks = None, apply_budget = true,
        activation_strict = None, sleepable = None, activation_measure = None,
        activation_margin = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: &Bound<'_, PyBackend>,
        plan: &Bound<'_, PyMemoryPlan>,
        context: Option<&Bound<'_, PyAny>>,
        library_reserve: Option<&Bound<'_, PyAny>>,
        kv_growable: Option<bool>,
        kv_initial_blocks: Option<&Bound<'_, PyAny>>,
        kv_grow_blocks: Option<&Bound<'_, PyAny>>,
        apply_budget: bool,
        activation_strict: Option<bool>,
        sleepable: Option<bool>,
        activation_measure: Option<&Bound<'_, PyAny>>,
        activation_margin: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let core_backend = backend.get().inner.clone();
        let options = SystemOptions {
            context_bytes: convert::opt_bytes(context, "context")?,
            library_reserve_bytes: convert::opt_bytes(library_reserve, "library_reserve")?,
            kv_growable,
            kv_initial_blocks: u32_opt(kv_initial_blocks, "kv_initial_blocks")?,
            kv_grow_blocks: u32_opt(kv_grow_blocks, "kv_grow_blocks")?,
            apply_budget,
            sleepable,
            activation_strict,
            activation_order: None,
            activation_measure: convert::opt_bytes(activation_measure, "activation_measure")?,
            activation_margin: convert::opt_bytes(activation_margin, "activation_margin")?
                .unwrap_or(0),
        };
        let result = MemorySystem::open(&core_backend, plan.get().core(), options);
        backend.get().notices.emit(py)?;
        let system = result.py()?;
        Ok(Self {
            inner: Mutex::new(system),
            backend: backend.clone().unbind(),
            plan: Mutex::new(plan.clone().unbind()),
            exportable: core_backend.addressable(),
            pools: Mutex::new(Vec::new()),
            watch: Arc::default(),
        })
    }

    /// The backend the tiers were acquired from.
    #[getter]
    fn backend(&self, py: Python<'_>) -> Py<PyBackend> {
        self.backend.clone_ref(py)
    }

    /// The plan the tiers were sized from.
    #[getter]
    fn plan(&self, py: Python<'_>) -> Py<PyMemoryPlan> {
        self.plan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone_ref(py)
    }

    /// The backend's phase.
    #[getter]
    fn phase(&self) -> PyPhase {
        self.backend.get().inner.phase().into()
    }

    /// Whether `close()` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.lock().is_closed()
    }

    /// T1: the model-resident arena the weights are loaded into.
    #[getter]
    fn weights_arena(&self) -> PyResult<Option<PyArena>> {
        let system = self.open()?;
        Ok(system
            .weights_arena()
            .map(|a| PyArena::wrap(a, self.exportable)))
    }

    /// T2: the engine-persistent arena (workspaces, logits, block tables).
    #[getter]
    fn engine_arena(&self) -> PyResult<Option<PyArena>> {
        let system = self.open()?;
        Ok(system
            .engine_arena()
            .map(|a| PyArena::wrap(a, self.exportable)))
    }

    /// T3: the paged KV pool (the same object on every call).
    #[getter]
    fn kv_pool(&self, py: Python<'_>) -> PyResult<Option<Py<PyBlockPool>>> {
        let pool = self.open()?.kv_pool();
        pool.map(|p| self.pool_object(py, p)).transpose()
    }

    /// T3: the sliding-window KV pool, or None.
    #[getter]
    fn swa_pool(&self, py: Python<'_>) -> PyResult<Option<Py<PyBlockPool>>> {
        let pool = self.open()?.swa_pool();
        pool.map(|p| self.pool_object(py, p)).transpose()
    }

    /// T3: the per-sequence state pools (linear attention / SSM).
    #[getter]
    fn state_pools(&self, py: Python<'_>) -> PyResult<Vec<Py<PyBlockPool>>> {
        let pools = self.open()?.state_pools();
        pools.into_iter().map(|p| self.pool_object(py, p)).collect()
    }

    /// A `KVCacheManager` over this system's KV pool (and SWA pool, if the
    /// plan has one), so the KV it serves is the memory the report
    /// attributes to `kv_cache`. `block_size` and `swa_window` default to
    /// the plan's, `dtype` to the plan's KV dtype, `pin_budget` to a quarter
    /// of the pool's maximum; admission counts the blocks a growable pool
    /// can still commit. Block contents persist through the pool's own
    /// block copies (a memcpy on the fake, a device copy on a GPU). Drop
    /// the manager before `close()`: it holds the pools.
    #[pyo3(
        signature = (
            block_size = None, *, swa_window = None, enable_prefix_caching = None,
            hash_seed = None, pin_budget = None, model_fingerprint = None, dtype = None,
            layout = None, kv_events = None, host_blocks = None
        ),
        text_signature = "($self, block_size=None, *, swa_window=None, \
            enable_prefix_caching=True, hash_seed=None, pin_budget=None, model_fingerprint='', \
            dtype=None, layout='', kv_events=False, host_blocks=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn kv_manager(
        &self,
        block_size: Option<&Bound<'_, PyAny>>,
        swa_window: Option<&Bound<'_, PyAny>>,
        enable_prefix_caching: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        pin_budget: Option<&Bound<'_, PyAny>>,
        model_fingerprint: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        layout: Option<&Bound<'_, PyAny>>,
        kv_events: Option<&Bound<'_, PyAny>>,
        host_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyKVCacheManager> {
        let block_size = convert::opt(block_size, "block_size", |v, what| {
            convert::int_in(v, what, 1, u32::MAX.into()).map(|n| n as usize)
        })?;
        let swa_window = convert::opt(swa_window, "swa_window", convert::usize_arg)?;
        let enable_prefix_caching = convert::opt(
            enable_prefix_caching,
            "enable_prefix_caching",
            convert::flag,
        )?
        .unwrap_or(true);
        let hash_seed = convert::opt(hash_seed, "hash_seed", convert::u64_arg)?;
        let pin_budget = convert::opt(pin_budget, "pin_budget", convert::u32_arg)?;
        let model_fingerprint =
            convert::opt(model_fingerprint, "model_fingerprint", convert::text)?
                .unwrap_or_default();
        let dtype = convert::opt(dtype, "dtype", convert::text)?;
        let layout = convert::opt(layout, "layout", convert::text)?.unwrap_or_default();
        let kv_events = convert::opt(kv_events, "kv_events", convert::flag)?.unwrap_or(false);
        let host_blocks = convert::opt(host_blocks, "host_blocks", |v, what| {
            convert::int_in(v, what, 0, (u32::MAX - 1).into()).map(|n| n as u32)
        })?;
        let m = {
            let system = self.open()?;
            let mut config = system.kv_config().py()?;
            if let Some(bs) = block_size {
                config.block_size = bs;
            }
            if let Some(w) = swa_window {
                config.swa_window = w;
            }
            config.enable_prefix_caching = enable_prefix_caching;
            config.hash_seed = hash_seed.unwrap_or(DEFAULT_HASH_SEED);
            if let Some(b) = pin_budget {
                config.pin_budget = b;
            }
            config.model_fingerprint = model_fingerprint;
            if let Some(d) = dtype {
                config.dtype = d;
            }
            config.layout = layout;
            config.kv_events = kv_events;
            // The plan's host tier unless told otherwise (the core's rule).
            system.kv_manager_with_host_tier(config, host_blocks).py()?
        };
        Ok(PyKVCacheManager::from_core(m))
    }

    /// One engine step for every growable pool (the KV pool's hysteretic,
    /// fenced shrink; `BlockPool.step`): call it once per step with a fence
    /// recorded after the step's work was enqueued — an `imp_mem.Fence`, a
    /// `torch.cuda.Event`-like object, or None when nothing in flight can
    /// touch the pools. Returns the bytes decommitted during this call.
    #[pyo3(signature = (fence = None))]
    fn step(&self, py: Python<'_>, fence: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        if self.open()?.growable_pools().is_empty() {
            return Ok(0);
        }
        // The fence is converted once and watched by the system's watch,
        // which its pools' objects share; the core steps every pool with it.
        self.watch.poll(py, false, true)?;
        let fence = self.watch.core_fence(fence)?;
        let done = py.detach(|| self.lock().step(fence));
        self.watch.poll(py, false, false)?;
        done.py()
    }

    /// Waits for every growable pool's pending decommit (its fence) and
    /// decommits; the bytes returned.
    fn flush_decommit(&self, py: Python<'_>) -> PyResult<u64> {
        if self.open()?.growable_pools().is_empty() {
            return Ok(0);
        }
        self.watch.poll(py, true, true)?;
        let done = py.detach(|| self.lock().flush_decommit());
        self.watch.poll(py, false, false)?;
        done.py()
    }

    /// T4a: the activation pool (torch's / CuPy's own allocations), if the
    /// plan measured one (`Features(activation_bytes=...)`).
    #[getter]
    fn activations(&self, py: Python<'_>) -> PyResult<Option<PyActivationPool>> {
        let system = self.open()?;
        Ok(system
            .activations()
            .map(|p| PyActivationPool::wrap(p, self.backend.clone_ref(py))))
    }

    /// T4: the forward-pass scratch stack.
    #[getter]
    fn scratch(&self) -> PyResult<Option<PyScratchStack>> {
        let system = self.open()?;
        Ok(system
            .scratch()
            .map(|s| PyScratchStack::wrap(s, self.exportable)))
    }

    /// The opened tiers' keys, in open order.
    #[getter]
    fn tiers(&self) -> Vec<String> {
        self.lock()
            .tier_keys()
            .into_iter()
            .map(str::to_string)
            .collect()
    }

    /// `LOADING -> PLANNING` (a no-op if already planning).
    fn begin_planning(&self, py: Python<'_>) -> PyResult<()> {
        let result = self.open()?.begin_planning();
        self.emit(py)?;
        result.py()
    }

    /// Through `PLANNING` to `SERVING`: from here on nothing is acquired.
    fn begin_serving(&self, py: Python<'_>) -> PyResult<()> {
        let result = self.open()?.begin_serving();
        self.emit(py)?;
        result.py()
    }

    /// The measured tiers (an activation tier opened with
    /// `activation_measure`): per tier a dict of `tier`, `state`
    /// (`measuring` / `frozen`), `high_water`, `margin`, `size`,
    /// `committed`, `decommitted`.
    fn measured(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        // No Python object is built under the system's lock (a GC callback
        // may touch this system meanwhile).
        let lines = self.open()?.measured();
        to_py_object(py, &lines)
    }

    /// Names memory in use outside the backend (another allocator's pool,
    /// a library workspace) so it is attributed; `nbytes=0` removes it.
    /// `context` / `library_reserve` replace those measured charges.
    #[pyo3(signature = (key, nbytes, label = None))]
    fn set_charge(
        &self,
        key: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        label: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let key = convert::text(key, "key")?;
        let label = convert::opt(label, "label", convert::text)?.unwrap_or_default();
        let bytes = convert::bytes(nbytes, "nbytes")?;
        let done = self.lock().set_charge(&key, &label, bytes);
        done.py()
    }

    /// Every named charge, plan against actual, per tier and per tag, as
    /// plain data. `device` is a `(free, total)` reading; by default the
    /// backend's device is read (a `DeviceBackend`'s; the fake has none;
    /// False: no reading).
    /// `other_processes` is left out of the attribution's denominator.
    #[pyo3(signature = (device = None, other_processes = None))]
    fn mem_report(
        &self,
        py: Python<'_>,
        device: Option<&Bound<'_, PyAny>>,
        other_processes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let report = self.report(device, other_processes)?;
        to_py_object(py, &report)
    }

    /// The memory report as a text table (MiB).
    #[pyo3(signature = (device = None, other_processes = None))]
    fn mem_report_text(
        &self,
        device: Option<&Bound<'_, PyAny>>,
        other_processes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        Ok(self.report(device, other_processes)?.text())
    }

    /// Prometheus text exposition of one snapshot.
    #[pyo3(signature = (device = None, other_processes = None))]
    fn metrics(
        &self,
        device: Option<&Bound<'_, PyAny>>,
        other_processes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        Ok(self.report(device, other_processes)?.metrics())
    }

    /// Checks the invariants of the whole system (backend, every pool, no
    /// tier past its plan); raises on the first broken one.
    fn check(&self) -> PyResult<()> {
        self.lock().check().py()
    }

    /// Swaps the model: checks `plan` against what survives (budget, T2,
    /// context, library reserve: an itemised InvalidArgument otherwise),
    /// refuses while T1 is exported, a pool holds blocks or a re-laid pool
    /// has another handle (a KV manager), then re-lays what the new plan
    /// changes inside the replanning bracket and resets T1 (same base on a
    /// VMM backend). Returns what it did. A failure raises the error's
    /// exception with `old_model_kept` (True: the old model serves on with
    /// its weights) and `missing`.
    fn swap_model<'py>(
        &self,
        py: Python<'py>,
        plan: &Bound<'py, PyMemoryPlan>,
    ) -> PyResult<Bound<'py, PyDict>> {
        // The system's own pool objects would count as handles to a pool
        // the swap re-lays; the caller's still do.
        let pools = std::mem::take(&mut *self.pools.lock().unwrap_or_else(|p| p.into_inner()));
        drop(pools);
        let core_plan = plan.get().core().clone();
        let result = {
            let mut system = self.open()?;
            system.swap_model(&core_plan)
        };
        self.emit(py)?;
        let report = result.py()?;
        *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = plan.clone().unbind();
        let out = PyDict::new(py);
        out.set_item("kept", report.kept)?;
        out.set_item("relaid", report.relaid)?;
        out.set_item("opened", report.opened)?;
        out.set_item("released", report.released)?;
        out.set_item("t1_in_place", report.t1_in_place)?;
        out.set_item("t1_base", report.t1_base)?;
        out.set_item("prefix_cache_dropped", report.prefix_cache_dropped)?;
        Ok(out)
    }

    /// Puts tiers to sleep on a growable (VMM) backend: at `level=1` T1's
    /// bytes are copied to pinned host memory and its memory given back,
    /// and the KV pool's memory is dropped; `level=2` drops both. `tiers`
    /// names tier keys or tags (default: `model_resident` and `kv_pool`).
    /// Every address stays: `wake()` recommits at the same ones. Raises
    /// BackendUnavailable on a backend without growable regions and
    /// InvalidArgument for a busy pool; nothing changes then. Returns
    /// `{"level", "released", "host_bytes", "tiers": [...]}`.
    #[pyo3(
        signature = (level = None, tiers = None),
        text_signature = "($self, level=1, tiers=None)"
    )]
    fn sleep<'py>(
        &self,
        py: Python<'py>,
        level: Option<&Bound<'py, PyAny>>,
        tiers: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let level = sleep_level(level)?;
        let names = tier_names(tiers)?;
        let backend = self.backend.get().inner.clone();
        let host = crate::tiers::pinned_host_for(&backend);
        let report = {
            let system = self.open()?;
            let refs: Option<Vec<&str>> = names
                .as_ref()
                .map(|v| v.iter().map(String::as_str).collect());
            system.sleep(level, refs.as_deref(), Some(&host))
        }
        .py()?;
        let out = PyDict::new(py);
        out.set_item("level", report.level)?;
        out.set_item("released", report.released())?;
        out.set_item("host_bytes", report.host_bytes())?;
        let tiers = pyo3::types::PyList::empty(py);
        for t in &report.tiers {
            let d = PyDict::new(py);
            d.set_item("key", &t.key)?;
            d.set_item("tag", t.tag.name())?;
            d.set_item("released", t.released)?;
            d.set_item("host_bytes", t.host_bytes)?;
            tiers.append(d)?;
        }
        out.set_item("tiers", tiers)?;
        Ok(out)
    }

    /// Checks what `sleep(level, tiers)` checks before any tier sleeps (the
    /// level, the backend, the names, a tier already asleep) and sleeps
    /// nothing: raises as `sleep` would, or returns None. A caller with
    /// work to drain first asks before it drains.
    #[pyo3(
        signature = (level = None, tiers = None),
        text_signature = "($self, level=1, tiers=None)"
    )]
    fn check_sleep(
        &self,
        level: Option<&Bound<'_, PyAny>>,
        tiers: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let level = sleep_level(level)?;
        let names = tier_names(tiers)?;
        let refs: Option<Vec<&str>> = names
            .as_ref()
            .map(|v| v.iter().map(String::as_str).collect());
        // `sleep` is always given its pinned host.
        self.open()?.check_sleep(level, refs.as_deref(), true).py()
    }

    /// The groups an engine sleeps and wakes by name, `{group: [tier key,
    /// ...]}` in order, those this system has: ``weights`` (T1),
    /// ``kv_cache`` (the KV pool and the sliding-window pool) and
    /// ``activations`` (T4a). Pass a group's keys to `sleep` and `wake`.
    fn sleep_groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Read under the lock, built after it: a Python allocation can run
        // the GC, whose callbacks may call back into this system.
        let groups = self.open()?.sleep_groups();
        let out = PyDict::new(py);
        for (group, keys) in groups {
            out.set_item(group, keys)?;
        }
        Ok(out)
    }

    /// Adopts `plan`, this system's plan made again with a measured warm-up
    /// line (the same inputs, the same budget): the KV pool is capped at
    /// its blocks and the backend's budget lowered to what it gives the
    /// tiers, as opening on it would set it; no tier moves. Returns the
    /// plan's KV blocks. Raises InvalidArgument, changing nothing, when its
    /// KV pool has other block bytes or more blocks than the open one.
    fn adopt_replan(&self, plan: &Bound<'_, PyMemoryPlan>) -> PyResult<u64> {
        let core_plan = plan.get().core().clone();
        self.open()?.adopt_replan(&core_plan).py()
    }

    /// Wakes sleeping tiers at their old addresses and restores T1's bytes
    /// after a level-1 sleep; returns the keys woken (none when nothing
    /// named slept). `tiers` names tier keys or tags as `sleep` takes them
    /// (`"weights"`, `"kv_cache"`, ...; default: every sleeping tier), so a
    /// wake can be staged: the weights, then their update, then the KV
    /// cache. A named tier that is awake is skipped; a name that is no tier,
    /// or T2 / scratch (which never sleep), raises InvalidArgument and
    /// nothing changes. When the device has no room, it raises OutOfMemory
    /// with `needed` (bytes the tiers not woken need), `device_free`,
    /// `budget_free`, `woken` and `still_asleep`: those tiers still sleep,
    /// their host copies kept, and a later wake retries them.
    #[pyo3(signature = (tiers = None))]
    fn wake(&self, py: Python<'_>, tiers: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
        let names = tier_names(tiers)?;
        let result = {
            let system = self.open()?;
            let refs: Option<Vec<&str>> = names
                .as_ref()
                .map(|v| v.iter().map(String::as_str).collect());
            // The copy back of T1 runs without the GIL (seconds for gigabytes).
            py.detach(|| system.wake(refs.as_deref()))
        };
        self.emit(py)?;
        result.map_err(|e| crate::errors::wake_error(*e))
    }

    /// Device bytes `wake(tiers)` would commit now (the named tiers that
    /// sleep; default: every sleeping tier), to make room before waking.
    #[pyo3(signature = (tiers = None))]
    fn wake_needs(&self, tiers: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let names = tier_names(tiers)?;
        let refs: Option<Vec<&str>> = names
            .as_ref()
            .map(|v| v.iter().map(String::as_str).collect());
        self.open()?.wake_needs(refs.as_deref()).py()
    }

    /// Pins T1's level-1 host buffer now, ahead of the first sleep, so that
    /// sleep copies at the line rate instead of pinning first (pinning
    /// 16 GiB takes seconds). `nbytes` defaults to the plan's T1 weights
    /// bytes (`plan.sleep_host`), or what T1 holds if that is more; the host
    /// memory held is exactly that (no power-of-two rounding). It releases
    /// the GIL and holds no lock while pinning, so it can run on a
    /// background thread while the weights load; a later level-1 sleep copies
    /// into it when it holds T1's used bytes. A buffer already held of at
    /// least `nbytes` is kept. Returns the bytes held. `release_sleep_host()`
    /// frees it.
    #[pyo3(signature = (nbytes = None))]
    fn pin_sleep_host(&self, py: Python<'_>, nbytes: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let nbytes = convert::opt_bytes(nbytes, "nbytes")?;
        let pin = self.open()?.sleep_host_pin(nbytes).py()?;
        let backend = self.backend.get().inner.clone();
        let host = crate::tiers::pinned_host_for(&backend);
        py.detach(|| pin.pin(&host)).py()
    }

    /// Frees the pinned host buffer kept for the next level-1 sleep (T5b:
    /// pinned ahead by `pin_sleep_host`, or kept after a wake); returns the
    /// bytes freed. A sleeping T1's copy is not freed.
    fn release_sleep_host(&self) -> PyResult<u64> {
        Ok(self.open()?.release_sleep_host())
    }

    /// The tiers asleep now, as `{key: level}`.
    #[getter]
    fn asleep<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        // Copied out first: no Python object is built under the lock.
        let asleep = self.lock().asleep();
        for (key, level) in asleep {
            out.set_item(key, level)?;
        }
        Ok(out)
    }

    /// Releases every tier and restores the backend's budget. Memory a
    /// block ref, an export or a tier object still holds is released when
    /// that is dropped; an `ImpMemWarning` names it. Returns
    /// `{"released": bytes, "still_held": {tag: bytes}}`.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // The system's own pool objects go first, so only what the caller
        // still holds is reported as held.
        let pools = std::mem::take(&mut *self.pools.lock().unwrap_or_else(|p| p.into_inner()));
        drop(pools);
        let closed = self.lock().close();
        let out = PyDict::new(py);
        out.set_item("released", closed.released)?;
        let held = PyDict::new(py);
        for (tag, bytes) in &closed.still_held {
            held.set_item(tag.name(), bytes)?;
        }
        out.set_item("still_held", held)?;
        if !closed.still_held.is_empty() {
            let names: Vec<String> = closed
                .still_held
                .iter()
                .map(|(tag, bytes)| format!("{tag} {bytes} B"))
                .collect();
            let message = format!(
                "MemorySystem closed while its memory is still referenced ({}); it is released \
                 when the last BlockRef, span export or tier object is dropped",
                names.join(", ")
            );
            let category = py.get_type::<ImpMemWarning>();
            PyErr::warn(py, &category, &std::ffi::CString::new(message)?, 1)?;
        }
        Ok(out)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __str__(&self) -> PyResult<String> {
        self.mem_report_text(None, None)
    }

    fn __repr__(&self) -> String {
        let system = self.lock();
        format!(
            "<MemorySystem {} tiers=[{}] phase={}{}>",
            self.backend.get().inner.info().name,
            system.tier_keys().join(", "),
            self.backend.get().inner.phase(),
            if system.is_closed() { " closed" } else { "" }
        )
    }
}

/// Adds `MemorySystem` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMemorySystem>()
}

//! Python face of T4a: `ActivationPool`.
//!
//! Every rule is the core's (`imp_mem_core::activations`); the backend's
//! source gives the stream order (`Backend::stream_order`). This file
//! converts arguments, renders the counters — once in the core's own names
//! (`stats()`) and once in `torch.cuda.memory_stats` names
//! (`memory_stats()`) — and installs a pool behind the C hooks (`hooks.rs`).

use imp_mem_core::activations::{ActivationConfig, ActivationPool};
use imp_mem_core::MemoryKind;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt};

use crate::backend::PyBackend;
use crate::convert;
use crate::errors::{invalid, IntoPyResult};
use crate::hooks;
use crate::tiers::PyArena;

/// A plain int read without the general conversion (the hot calls).
fn fast_u64(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if let Ok(i) = value.cast_exact::<PyInt>() {
        if let Ok(n) = i.extract::<u64>() {
            return Ok(n);
        }
    }
    convert::index(value, what)
}

/// A general-purpose, stream-ordered sub-allocator over one region of tag
/// `activations` (T4a): what torch's and CuPy's own allocations go through.
#[pyclass(frozen, name = "ActivationPool", module = "imp_mem._core")]
pub struct PyActivationPool {
    pub(crate) pool: ActivationPool,
    /// Where a fallback's notices (production mode) are delivered.
    backend: Py<PyBackend>,
}

impl PyActivationPool {
    /// Wraps a pool opened elsewhere (by a `MemorySystem`).
    pub(crate) fn wrap(pool: ActivationPool, backend: Py<PyBackend>) -> Self {
        Self { pool, backend }
    }
}

#[pymethods]
impl PyActivationPool {
    #[new]
    #[pyo3(signature = (
        backend, capacity, *, strict = None, align = None, growable = None, measure_chunk = None
    ))]
    fn new(
        backend: &Bound<'_, PyBackend>,
        capacity: &Bound<'_, PyAny>,
        strict: Option<&Bound<'_, PyAny>>,
        align: Option<&Bound<'_, PyAny>>,
        growable: Option<&Bound<'_, PyAny>>,
        measure_chunk: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let strict = convert::opt(strict, "strict", convert::flag)?;
        let growable = convert::opt(growable, "growable", convert::flag)?;
        let capacity = convert::bytes(capacity, "capacity")?;
        let mut config = ActivationConfig::new(capacity);
        if let Some(a) = align.filter(|a| !a.is_none()) {
            config.align = convert::index(a, "align")?;
        }
        config.strict = strict;
        config.growable = growable.unwrap_or(false);
        config.measure_chunk = convert::opt_bytes(measure_chunk, "measure_chunk")?;
        if config.measure_chunk.is_some() && config.growable {
            return Err(invalid(
                "growable and measure_chunk: a measured pool commits as it grows, so it is not \
                 also committed whole; pass one of them",
            ));
        }
        let core = &backend.get().inner;
        let order = core.stream_order().py()?;
        let pool = ActivationPool::new(core, &config, order).py();
        backend.get().notices.emit(backend.py())?;
        Ok(Self {
            pool: pool?,
            backend: backend.clone().unbind(),
        })
    }

    /// Allocates `nbytes` (rounded up to `align`) for work on `stream` (a
    /// raw `cudaStream_t` as an int; 0 is the legacy default stream) and
    /// returns the address.
    #[pyo3(signature = (nbytes, stream = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        nbytes: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let bytes = match nbytes.cast_exact::<PyInt>() {
            Ok(i) => match i.extract::<u64>() {
                Ok(n) => n,
                Err(_) => convert::bytes(nbytes, "nbytes")?,
            },
            Err(_) => convert::bytes(nbytes, "nbytes")?,
        };
        if bytes == 0 {
            return Err(invalid(
                "nbytes must be positive, got 0; ask for at least 1 byte",
            ));
        }
        let stream = stream.map_or(Ok(0), |s| fast_u64(s, "stream"))?;
        let result = self.pool.allocate(bytes, stream);
        let fell_back = match &result {
            Ok(addr) => !self.pool.contains(*addr),
            Err(_) => !self.pool.is_strict(),
        };
        if fell_back {
            // A fallback is a backend acquisition: deliver its notices (the
            // steady-state warning) now.
            self.backend.get().notices.emit(py)?;
        }
        result.py()
    }

    /// Frees what `allocate` returned, on the stream its last use was
    /// queued on. An address this pool did not hand out, or a second free,
    /// raises `InvalidArgument` and changes nothing.
    #[pyo3(signature = (ptr, stream = None))]
    fn free(&self, ptr: &Bound<'_, PyAny>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let addr = fast_u64(ptr, "ptr")?;
        let addr = usize::try_from(addr)
            .map_err(|_| invalid(format!("ptr {addr:#x} is not an address")))?;
        let stream = stream.map_or(Ok(0), |s| fast_u64(s, "stream"))?;
        self.pool.free(addr, stream).py()?;
        Ok(())
    }

    /// The requested size of the live allocation at `ptr`, or None.
    fn size_of(&self, ptr: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        let addr = fast_u64(ptr, "ptr")?;
        Ok(usize::try_from(addr)
            .ok()
            .and_then(|a| self.pool.requested_size(a)))
    }

    /// The pool's counters, in its own names.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.pool.stats();
        let d = PyDict::new(py);
        d.set_item("capacity", s.capacity)?;
        d.set_item("align", s.align)?;
        d.set_item("allocated", s.allocated)?;
        d.set_item("allocated_peak", s.allocated_peak)?;
        d.set_item("in_use", s.in_use)?;
        d.set_item("in_use_peak", s.in_use_peak)?;
        d.set_item("requested", s.requested)?;
        d.set_item("live", s.live)?;
        d.set_item("live_peak", s.live_peak)?;
        d.set_item("allocs_total", s.allocs_total)?;
        d.set_item("frees_total", s.frees_total)?;
        d.set_item("allocated_bytes_total", s.allocated_bytes_total)?;
        d.set_item("freed_bytes_total", s.freed_bytes_total)?;
        d.set_item("fallbacks_total", s.fallbacks_total)?;
        d.set_item("fallback_bytes_total", s.fallback_bytes_total)?;
        d.set_item("fallback_live", s.fallback_live)?;
        d.set_item("fallback_bytes", s.fallback_bytes)?;
        let reserved = if s.measuring {
            self.pool.committed()
        } else {
            s.capacity
        };
        d.set_item("reserved", reserved + s.fallback_bytes)?;
        d.set_item("reserved_peak", s.reserved_peak)?;
        d.set_item("ooms", s.ooms)?;
        d.set_item("refused_frees", s.refused_frees)?;
        d.set_item("free_bytes", s.free_bytes)?;
        d.set_item("free_blocks", s.free_blocks)?;
        d.set_item("largest_free", s.largest_free)?;
        d.set_item("cross_stream_reuses", s.cross_stream_reuses)?;
        d.set_item("reclaims", s.reclaims)?;
        d.set_item("streams", s.streams)?;
        d.set_item("parked_blocks", s.parked_blocks)?;
        d.set_item("measuring", s.measuring)?;
        d.set_item("high_water", s.high_water)?;
        d.set_item("committed", self.pool.committed())?;
        Ok(d)
    }

    /// Whether this is a measured pool not yet frozen: it commits chunks
    /// as blocks reach past its committed end.
    #[getter]
    fn measuring(&self) -> bool {
        self.pool.measuring()
    }

    /// The highest end offset any block has reached (bytes): what a
    /// measured pool needed.
    #[getter]
    fn high_water(&self) -> u64 {
        self.pool.high_water()
    }

    /// Starts the high-water again from the blocks live now: what ran
    /// before (a compile, a first warm-up) no longer counts, and a freeze
    /// after it decommits the chunks only that needed. Nothing moves; a
    /// no-op on a pool that does not measure.
    fn reset_high_water(&self) {
        self.pool.reset_high_water();
    }

    /// Starts recording a pass of repeated work (a compiled generate(), a
    /// step): every allocation and free until `plan_pass()`. Hints
    /// installed before are dropped; a recording running starts again.
    fn record_pass(&self) {
        self.pool.record_pass();
    }

    /// Whether a pass is being recorded.
    #[getter]
    fn recording(&self) -> bool {
        self.pool.recording()
    }

    /// Ends the recording and lays the pass out offline, every lifetime
    /// known; installs the layout as placement hints when it needs less
    /// than the recorded high-water (a measuring pool, whose high-water
    /// then becomes the layout's top, so a freeze after fixes the pool
    /// there) or fits the capacity (a fixed pool). The same pass run again
    /// takes its blocks where the layout put them; other work takes the
    /// ordinary search. Returns a dict: `allocations`, `hinted`, `ops`,
    /// `live_peak`, `top`, `recorded_high_water` (bytes), `installed`.
    /// `InvalidArgument` when no pass is being recorded.
    fn plan_pass<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let pool = self.pool.clone();
        let p = py.detach(move || pool.plan_pass()).py()?;
        let d = PyDict::new(py);
        d.set_item("allocations", p.allocations)?;
        d.set_item("hinted", p.hinted)?;
        d.set_item("ops", p.ops)?;
        d.set_item("live_peak", p.live_peak)?;
        d.set_item("top", p.top)?;
        d.set_item("recorded_high_water", p.recorded_high_water)?;
        d.set_item("installed", p.installed)?;
        Ok(d)
    }

    /// The installed hints' counters (a dict: `hints`, `hits`, `misses`,
    /// `refused`), or None when no hints are installed.
    #[getter]
    fn pass_hints<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.pool
            .pass_hints()
            .map(|h| {
                let d = PyDict::new(py);
                d.set_item("hints", h.hints)?;
                d.set_item("hits", h.hits)?;
                d.set_item("misses", h.misses)?;
                d.set_item("refused", h.refused)?;
                Ok(d)
            })
            .transpose()
    }

    /// Drops the installed hints and any recording: placement is the
    /// ordinary search's again.
    fn drop_pass_plan(&self) {
        self.pool.drop_pass_plan();
    }

    /// Bytes committed now.
    #[getter]
    fn committed(&self) -> u64 {
        self.pool.committed()
    }

    /// What the freeze fixed (a dict: `high_water`, `margin`, `size`,
    /// `committed_before`, `decommitted`), or None before it.
    #[getter]
    fn frozen<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.pool.frozen().map(|f| frozen_dict(py, &f)).transpose()
    }

    /// Fixes a measured pool at its high-water plus `margin` bytes, rounded
    /// up to whole chunks (at most its capacity): the commit becomes exactly
    /// that size, the rest is decommitted, no live block moves, and the
    /// pool commits nothing after. Returns what it fixed (see `frozen`).
    /// `InvalidArgument` on a pool that does not measure, was frozen, or
    /// sleeps.
    #[pyo3(signature = (margin = None), text_signature = "($self, margin=0)")]
    fn freeze<'py>(
        &self,
        py: Python<'py>,
        margin: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let margin = convert::opt_bytes(margin, "margin")?.unwrap_or(0);
        let pool = self.pool.clone();
        let frozen = py.detach(move || pool.freeze(margin)).py()?;
        frozen_dict(py, &frozen)
    }

    /// The counters under `torch.cuda.memory_stats` key names, for what the
    /// pool tracks (every key is an `all` pool: the pool has no small/large
    /// split). A fallback region counts as a segment and as reserved bytes.
    fn memory_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (key, value) in self.pool.torch_memory_stats() {
            d.set_item(key, value)?;
        }
        Ok(d)
    }

    /// Starts new peaks from the current values.
    fn reset_peak(&self) {
        self.pool.reset_peak();
    }

    /// Raises `ImpMemError` if an invariant is broken (a bug in imp-mem).
    fn check_invariants(&self) -> PyResult<()> {
        self.pool.check_invariants().py()
    }

    /// Routes the C hooks (`imp_mem_torch_malloc`, `imp_mem_cupy_malloc`, …)
    /// to this pool for device `device`, replacing any pool installed
    /// before. `weights_arena` (a T1 `Arena`) serves the hooks while the
    /// route is "weights" (`set_hook_route`).
    #[pyo3(signature = (device = None, weights_arena = None))]
    fn install(
        &self,
        py: Python<'_>,
        device: Option<&Bound<'_, PyAny>>,
        weights_arena: Option<PyRef<'_, PyArena>>,
    ) -> PyResult<()> {
        let device = device.map_or(Ok(0), |d| convert::index(d, "device"))?;
        let device = i32::try_from(device)
            .map_err(|_| invalid(format!("device {device} is not a device ordinal")))?;
        let expected = self.pool.placement().device;
        let kind = self.pool.placement().kind;
        if kind == MemoryKind::Device && device != expected {
            return Err(invalid(format!(
                "device={device} but this pool's memory is on device {expected}; install it for \
                 device {expected}"
            )));
        }
        let pool = self.pool.clone();
        let weights = weights_arena.map(|a| a.arena.clone());
        // The write lock waits for hook calls reading the slot, which never
        // need the GIL; release it so none of them can wait on this thread.
        py.detach(move || hooks::install(pool, device, weights));
        Ok(())
    }

    /// Gives the region's physical memory back, its addresses kept: with
    /// `cpu_backup` the live blocks' bytes are first copied to pinned host
    /// memory (the buffer of the last pause when it is large enough) and
    /// `resume()` copies them back; without it they are dropped.
    /// Allocations are refused (`Asleep`; the hooks return null) until
    /// `resume()`. The caller synchronises first: nothing may still use the
    /// memory. Needs a growable pool (`growable=True`, a VMM backend);
    /// nothing changes on a refusal. Returns the bytes copied.
    #[pyo3(signature = (cpu_backup = None), text_signature = "($self, cpu_backup=True)")]
    fn pause(&self, py: Python<'_>, cpu_backup: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let cpu_backup = convert::opt(cpu_backup, "cpu_backup", convert::flag)?.unwrap_or(true);
        let pool = self.pool.clone();
        if !cpu_backup {
            return py.detach(move || pool.sleep(2)).py().map(|_| 0);
        }
        let host = crate::tiers::pinned_host_for(&self.backend.get().inner);
        py.detach(move || pool.sleep_keeping(&host)).py()
    }

    /// Recommits the region at the same addresses and, after
    /// `pause(cpu_backup=True)`, copies the live blocks' bytes back. A no-op
    /// when awake; on failure (the device has no room) it stays paused and
    /// a later call retries.
    fn resume(&self, py: Python<'_>) -> PyResult<()> {
        let pool = self.pool.clone();
        py.detach(move || pool.wake()).py()
    }

    /// The sleep level while paused (1: bytes kept in host memory, 2:
    /// dropped), None when awake.
    #[getter]
    fn asleep(&self) -> Option<u8> {
        self.pool.asleep()
    }

    /// Pinned host bytes held for pausing (a paused pool's copy and the
    /// buffer kept for the next pause).
    #[getter]
    fn host_bytes(&self) -> u64 {
        self.pool.host_bytes()
    }

    /// Frees the pinned buffer kept after a resume; returns the bytes freed.
    fn release_host_copy(&self) -> u64 {
        self.pool.release_host_copy()
    }

    /// Pins the buffer the next `pause(cpu_backup=True)` copies into, ahead
    /// of it: at least `nbytes` (default: the bytes of the live blocks
    /// now), so that the first pause runs at the line rate too. The GIL is
    /// released while the driver pins (a thread of its own may call it).
    /// Returns the size of the buffer now kept (0 while paused).
    #[pyo3(signature = (nbytes = None))]
    fn pin_host_copy(&self, py: Python<'_>, nbytes: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let bytes = match nbytes {
            Some(n) => convert::index(n, "nbytes")?,
            None => self.pool.stats().allocated,
        };
        let bytes = usize::try_from(bytes).map_err(|_| {
            invalid(format!(
                "nbytes: {bytes} does not fit this host's address space"
            ))
        })?;
        let pool = self.pool.clone();
        let host = crate::tiers::pinned_host_for(&self.backend.get().inner);
        py.detach(move || pool.pin_host_copy(bytes, &host)).py()
    }

    /// The host address of the copy of the `nbytes` device bytes at `ptr`
    /// (inside one live block): while paused with a CPU backup, or after
    /// the resume while the buffer is kept (until the next pause or
    /// `release_host_copy()`); None otherwise.
    fn host_copy_address(&self, ptr: u64, nbytes: u64) -> Option<u64> {
        let base = self.pool.base() as u64;
        let offset = usize::try_from(ptr.checked_sub(base)?).ok()?;
        let len = usize::try_from(nbytes).ok()?;
        self.pool.host_copy_of(offset, len).map(|a| a as u64)
    }

    /// The pool's process-unique id.
    #[getter]
    fn id(&self) -> u64 {
        self.pool.id()
    }

    /// Whether the C hooks route to this pool now.
    #[getter]
    fn installed(&self) -> bool {
        hooks::installed_pool_id() == Some(self.pool.id())
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.pool.capacity()
    }

    #[getter]
    fn base(&self) -> usize {
        self.pool.base()
    }

    #[getter]
    fn strict(&self) -> bool {
        self.pool.is_strict()
    }

    #[getter]
    fn align(&self) -> u64 {
        self.pool.align()
    }

    #[getter]
    fn tag(&self) -> &'static str {
        imp_mem_core::Tag::Activations.name()
    }

    fn __repr__(&self) -> String {
        let s = self.pool.stats();
        format!(
            "<ActivationPool {} B, {} live ({} B), largest free {} B, {}>",
            s.capacity,
            s.live,
            s.in_use,
            s.largest_free,
            if self.pool.is_strict() {
                "strict"
            } else {
                "production"
            }
        )
    }
}

/// Registers the class.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyActivationPool>()?;
    Ok(())
}

fn frozen_dict<'py>(
    py: Python<'py>,
    f: &imp_mem_core::activations::Frozen,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("high_water", f.high_water)?;
    d.set_item("margin", f.margin)?;
    d.set_item("size", f.size)?;
    d.set_item("committed_before", f.committed_before)?;
    d.set_item("decommitted", f.decommitted)?;
    Ok(d)
}

//! Python face of L2/L3: `Tier`, `Arena`, `BlockPool`, `BlockRef`,
//! `BlockRefs`, `ScratchStack`, `Mark`, `PinnedBuffer`, `StableSpan`,
//! `DeviceSpan` and `TensorView`.
//!
//! Python cannot borrow, so every object here wraps the core's `Shared*`
//! form of a tier and every span is a ticket checked by the core on each use
//! (generation, open mark, live ref). No rule lives here: this file converts
//! arguments, maps errors and builds the exports.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use imp_mem_core::backend::DEFAULT_ALIGNMENT;
use imp_mem_core::decommit::{DecommitPolicy, FenceLike, NothingInFlight};
use imp_mem_core::MemError;
use imp_mem_core::{
    ArenaExport, ArenaSpan, FakePinnedHost, PinnedBuffer, PinnedHost, Placement, PoolConfig,
    ScratchSpan, SharedArena, SharedBlockPool, SharedBlockRef, SharedBlockRefs, SharedMark,
    SharedScratchStack, Tier,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyTuple};

use crate::backend::PyBackend;
use crate::convert;
use crate::cuda::PyFence;
use crate::dlpack::{self, DType, Export, UINT8};
use crate::errors::{invalid, IntoPyResult, StaleSpan};

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

// ------------------------------------------------------------------ spans

/// What a span came from, and how the core checks it is still valid.
enum Owner {
    Arena(SharedArena, ArenaSpan),
    Scratch(SharedScratchStack, ScratchSpan),
    Block(Py<PyBlockRef>),
    Batch(Py<PyBlockRefs>, usize),
    Pinned(Py<PyPinnedBuffer>),
    /// A pool's whole reservation (`BlockPool.span()` / `view()`).
    Pool(SharedBlockPool),
}

/// Holds the memory behind an export alive (no Python objects inside); it
/// is only ever dropped, by the DLPack deleter.
#[allow(dead_code)]
enum KeepAlive {
    Arena(ArenaExport),
    Scratch(SharedScratchStack),
    Block(SharedBlockRef),
    Pinned(Arc<PinnedBuffer>),
    Pool(SharedBlockPool),
}

struct Resolved {
    addr: usize,
    len: usize,
    placement: Placement,
}

impl Owner {
    fn clone_ref(&self, py: Python<'_>) -> Self {
        match self {
            Owner::Arena(a, t) => Owner::Arena(a.clone(), *t),
            Owner::Scratch(s, t) => Owner::Scratch(s.clone(), *t),
            Owner::Block(b) => Owner::Block(b.clone_ref(py)),
            Owner::Batch(b, i) => Owner::Batch(b.clone_ref(py), *i),
            Owner::Pinned(p) => Owner::Pinned(p.clone_ref(py)),
            Owner::Pool(p) => Owner::Pool(p.clone()),
        }
    }

    /// Checks validity with the core and returns where the memory is, plus a
    /// keep-alive when exporting.
    fn resolve(&self, keep: bool) -> PyResult<(Resolved, Option<KeepAlive>)> {
        fn from(s: imp_mem_core::StableSpan<'_>) -> Resolved {
            Resolved {
                addr: s.addr(),
                len: s.len(),
                placement: s.placement(),
            }
        }
        match self {
            Owner::Arena(arena, ticket) => {
                let r = from(arena.span(ticket).py()?);
                let k = if keep {
                    Some(KeepAlive::Arena(arena.export(ticket).py()?))
                } else {
                    None
                };
                Ok((r, k))
            }
            Owner::Scratch(stack, ticket) => {
                let r = from(stack.span(ticket).py()?);
                Ok((r, keep.then(|| KeepAlive::Scratch(stack.clone()))))
            }
            Owner::Block(block) => {
                let guard = lock(&block.get().inner);
                let live = guard.as_ref().ok_or_else(released_span)?;
                let r = from(live.span().py()?);
                let k = if keep {
                    Some(KeepAlive::Block(live.share().py()?))
                } else {
                    None
                };
                Ok((r, k))
            }
            Owner::Batch(batch, i) => {
                let guard = lock(&batch.get().inner);
                let live = guard.as_ref().ok_or_else(released_span)?;
                let r = from(live.span(*i).py()?);
                let k = if keep {
                    Some(KeepAlive::Block(live.share_at(*i).py()?))
                } else {
                    None
                };
                Ok((r, k))
            }
            Owner::Pinned(buf) => {
                let guard = lock(&buf.get().inner);
                let live = guard.as_ref().ok_or_else(|| {
                    StaleSpan::new_err("span of a PinnedBuffer used after release(); keep the buffer while you use it")
                })?;
                let s = live
                    .span()
                    .ok_or_else(|| invalid("an empty PinnedBuffer has no memory to view"))?;
                let r = from(s);
                Ok((r, keep.then(|| KeepAlive::Pinned(live.clone()))))
            }
            Owner::Pool(pool) => {
                let r = from(pool.reservation().py()?);
                Ok((r, keep.then(|| KeepAlive::Pool(pool.clone()))))
            }
        }
    }
}

fn released_span() -> PyErr {
    StaleSpan::new_err(
        "span of a block used after its ref was released; the block may belong to another \
         request now — keep the ref (or share() it) while you use the span",
    )
}

/// A span as the binding keeps it: an owner plus a sub-range.
struct SpanInner {
    owner: Owner,
    offset: usize,
    len: usize,
    exportable: bool,
}

impl SpanInner {
    fn clone_ref(&self, py: Python<'_>) -> Self {
        Self {
            owner: self.owner.clone_ref(py),
            offset: self.offset,
            len: self.len,
            exportable: self.exportable,
        }
    }

    /// The address and placement now, checked.
    fn locate(&self) -> PyResult<(usize, Placement)> {
        let (r, _) = self.owner.resolve(false)?;
        Ok((r.addr + self.offset, r.placement))
    }

    fn sub(
        &self,
        py: Python<'_>,
        offset: &Bound<'_, PyAny>,
        nbytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        // A stale span has no subspans.
        self.locate()?;
        let offset = convert::index(offset, "offset")? as usize;
        let nbytes = match nbytes.filter(|n| !n.is_none()) {
            Some(n) => convert::index(n, "nbytes")? as usize,
            None => self.len.saturating_sub(offset),
        };
        match offset.checked_add(nbytes) {
            Some(end) if end <= self.len && nbytes > 0 => {}
            _ => {
                return Err(invalid(format!(
                    "subspan [{offset}, {offset} + {nbytes}) is outside a span of {} B; keep 0 < \
                     nbytes and offset + nbytes <= {}",
                    self.len, self.len
                )))
            }
        }
        Ok(Self {
            owner: self.owner.clone_ref(py),
            offset: self.offset + offset,
            len: nbytes,
            exportable: self.exportable,
        })
    }

    fn export(
        &self,
        py: Python<'_>,
        dtype: DType,
        shape: Vec<i64>,
        args: DlpackArgs<'_, '_>,
    ) -> PyResult<Py<PyAny>> {
        if !self.exportable {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "this span's backend is unbacked (FakeBackend(backed=False)): its addresses have \
                 no memory behind them, so it cannot be exported; use backed=True",
            ));
        }
        let (r, keep) = self.owner.resolve(true)?;
        if self.offset + self.len > r.len {
            return Err(invalid(format!(
                "sub-range [{}, {}) is outside its {} B allocation",
                self.offset,
                self.offset + self.len,
                r.len
            )));
        }
        let (versioned, device) = dlpack::negotiate(
            r.placement,
            args.stream,
            args.max_version,
            args.dl_device,
            args.copy,
        )?;
        let keep = keep.ok_or_else(|| invalid("nothing keeps this span's memory alive"))?;
        let export = Export {
            addr: r.addr + self.offset,
            placement: r.placement,
            device,
            dtype,
            shape,
            keep: Box::new(keep),
        };
        dlpack::capsule(py, export, versioned)
    }

    fn cai<'py>(
        &self,
        py: Python<'py>,
        dtype: DType,
        shape: &[i64],
    ) -> PyResult<Bound<'py, PyDict>> {
        let (addr, placement) = self.locate()?;
        dlpack::cuda_array_interface(py, addr, placement, dtype, shape)
    }

    fn view(
        &self,
        py: Python<'_>,
        dtype: &Bound<'_, PyAny>,
        shape: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTensorView> {
        // A stale span has no views.
        self.locate()?;
        let dtype = dlpack::parse_dtype(dtype)?;
        let item = dtype.itemsize();
        let shape: Vec<i64> = match shape.filter(|s| !s.is_none()) {
            None => vec![(self.len / item) as i64],
            Some(s) => {
                if let Ok(n) = s.extract::<i64>() {
                    vec![n]
                } else {
                    s.extract::<Vec<i64>>()
                        .map_err(|_| invalid("shape must be an int or a sequence of ints"))?
                }
            }
        };
        if shape.iter().any(|&d| d < 0) {
            return Err(invalid(format!("shape {shape:?} has a negative dimension")));
        }
        let elements = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        let need = elements.and_then(|e| e.checked_mul(item as u64));
        match need {
            Some(need) if need <= self.len as u64 => {}
            _ => {
                return Err(invalid(format!(
                    "a {} view of shape {shape:?} needs {} B; the span has {} B — choose a smaller \
                     shape",
                    dtype.name,
                    need.map_or("too many".to_string(), |n| n.to_string()),
                    self.len
                )))
            }
        }
        Ok(PyTensorView {
            span: self.clone_ref(py),
            dtype,
            shape,
        })
    }

    fn repr(&self, class: &str) -> String {
        match self.locate() {
            Ok((addr, p)) => format!("<{class} {addr:#x} {} B {:?}>", self.len, p.kind),
            Err(_) => format!("<{class} {} B stale>", self.len),
        }
    }
}

/// The keyword arguments of `__dlpack__`.
#[derive(Clone, Copy)]
struct DlpackArgs<'a, 'py> {
    stream: Option<&'a Bound<'py, PyAny>>,
    max_version: Option<&'a Bound<'py, PyAny>>,
    dl_device: Option<&'a Bound<'py, PyAny>>,
    copy: Option<bool>,
}

fn raw_shape(len: usize) -> Vec<i64> {
    vec![len as i64]
}

/// Memory whose address a tier allocator promises is stable while the span
/// is valid. Minted only by the tiers; used after its arena was reset (or its
/// mark closed, or its block ref released) it raises `StaleSpan`.
#[pyclass(frozen, name = "StableSpan", module = "imp_mem._core")]
pub struct PyStableSpan {
    inner: SpanInner,
}

/// Memory with no stability promise (what a `StableSpan` widens to).
#[pyclass(frozen, name = "DeviceSpan", module = "imp_mem._core")]
pub struct PyDeviceSpan {
    inner: SpanInner,
}

/// A typed, shaped view of a span, for export.
#[pyclass(frozen, name = "TensorView", module = "imp_mem._core")]
pub struct PyTensorView {
    span: SpanInner,
    dtype: DType,
    shape: Vec<i64>,
}

/// The methods `StableSpan` and `DeviceSpan` share; the literals are the
/// class name (for the repr) and the docstring of `subspan`.
macro_rules! span_methods {
    ($ty:ty, $class:literal, $subspan_doc:literal, { $($extra:tt)* }) => {
        #[pymethods]
        impl $ty {
            $($extra)*

            #[doc = $subspan_doc]
            #[pyo3(signature = (offset, nbytes = None))]
            fn subspan(
                &self,
                py: Python<'_>,
                offset: &Bound<'_, PyAny>,
                nbytes: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<Self> {
                Ok(Self {
                    inner: self.inner.sub(py, offset, nbytes)?,
                })
            }

            /// Bytes in the span.
            #[getter]
            fn nbytes(&self) -> usize {
                self.inner.len
            }

            fn __len__(&self) -> usize {
                self.inner.len
            }

            /// The first address (raises `StaleSpan` if the span is no longer
            /// valid).
            #[getter]
            fn address(&self) -> PyResult<usize> {
                Ok(self.inner.locate()?.0)
            }

            /// Whether the span is still valid.
            #[getter]
            fn valid(&self) -> bool {
                self.inner.locate().is_ok()
            }

            /// `(device_type, device_id)` as DLPack numbers them.
            #[getter]
            fn device<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
                let (_, p) = self.inner.locate()?;
                dlpack::device_tuple(py, p)
            }

            #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
            fn __dlpack__(
                &self,
                py: Python<'_>,
                stream: Option<&Bound<'_, PyAny>>,
                max_version: Option<&Bound<'_, PyAny>>,
                dl_device: Option<&Bound<'_, PyAny>>,
                copy: Option<bool>,
            ) -> PyResult<Py<PyAny>> {
                let args = DlpackArgs { stream, max_version, dl_device, copy };
                self.inner.export(py, UINT8, raw_shape(self.inner.len), args)
            }

            fn __dlpack_device__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
                self.device(py)
            }

            #[getter]
            fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                self.inner.cai(py, UINT8, &raw_shape(self.inner.len))
            }

            /// A typed view: `view("float16", (4, 128))`. The shape defaults
            /// to as many elements as fit.
            #[pyo3(signature = (dtype, shape = None))]
            fn view(
                &self,
                py: Python<'_>,
                dtype: &Bound<'_, PyAny>,
                shape: Option<&Bound<'_, PyAny>>,
            ) -> PyResult<PyTensorView> {
                self.inner.view(py, dtype, shape)
            }

            fn __repr__(&self) -> String {
                self.inner.repr($class)
            }
        }
    };
}

span_methods!(
    PyStableSpan,
    "StableSpan",
    "A sub-range, as stable as this span.",
    {
        /// Widens to a `DeviceSpan` (there is no way back).
        fn as_device(&self, py: Python<'_>) -> PyDeviceSpan {
            PyDeviceSpan {
                inner: self.inner.clone_ref(py),
            }
        }
    }
);

span_methods!(PyDeviceSpan, "DeviceSpan", "A sub-range.", {});

#[pymethods]
impl PyTensorView {
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.shape.iter().product::<i64>() as usize * self.dtype.itemsize()
    }

    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<&Bound<'_, PyAny>>,
        dl_device: Option<&Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let args = DlpackArgs {
            stream,
            max_version,
            dl_device,
            copy,
        };
        self.span.export(py, self.dtype, self.shape.clone(), args)
    }

    fn __dlpack_device__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let (_, p) = self.span.locate()?;
        dlpack::device_tuple(py, p)
    }

    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.span.cai(py, self.dtype, &self.shape)
    }

    fn __repr__(&self) -> String {
        format!("<TensorView {} {:?}>", self.dtype.name, self.shape)
    }
}

fn stable(owner: Owner, len: usize, exportable: bool) -> PyStableSpan {
    PyStableSpan {
        inner: SpanInner {
            owner,
            offset: 0,
            len,
            exportable,
        },
    }
}

// ------------------------------------------------------------------ arena

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

// ------------------------------------------------------------------ pool

/// A refcounted pool of fixed-size blocks (T3), or an id space only
/// (`BlockPool.slots(n)`).
#[pyclass(frozen, name = "BlockPool", module = "imp_mem._core")]
pub struct PyBlockPool {
    pool: SharedBlockPool,
    exportable: bool,
    /// Python fences (`torch.cuda.Event`-like) a pending decommit may wait
    /// on. The core never calls Python: it holds a flag, and the binding
    /// queries these objects (outside the pool's lock) and sets the flags.
    watched: Mutex<Vec<Watched>>,
}

/// A Python fence object and the flag the core holds for it.
struct Watched {
    obj: Py<PyAny>,
    flag: Arc<AtomicBool>,
    query: &'static str,
    wait: &'static str,
}

/// The core's view of a Python fence: complete once the binding saw it
/// complete.
struct FlagFence(Arc<AtomicBool>);

impl FenceLike for FlagFence {
    fn is_complete(&self) -> Result<bool, MemError> {
        Ok(self.0.load(Ordering::Acquire))
    }

    fn wait(&self) -> Result<(), MemError> {
        if self.0.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(MemError::invalid(
                "a Python fence can only be waited on through BlockPool.flush_decommit()",
            ))
        }
    }
}

type CoreFence = Box<dyn FenceLike + Send>;

impl PyBlockPool {
    /// Wraps a pool (opened here, or elsewhere by a `MemorySystem`).
    pub(crate) fn wrap(pool: SharedBlockPool, exportable: bool) -> Self {
        Self {
            pool,
            exportable,
            watched: Mutex::new(Vec::new()),
        }
    }

    /// `None`, an `imp_mem.Fence`, or an object with `query()` /
    /// `synchronize()` (torch / CuPy events) or `is_complete()` / `wait()`.
    fn core_fence(&self, fence: Option<&Bound<'_, PyAny>>) -> PyResult<CoreFence> {
        let Some(fence) = fence.filter(|f| !f.is_none()) else {
            return Ok(Box::new(NothingInFlight));
        };
        if let Ok(f) = fence.cast::<PyFence>() {
            return Ok(Box::new(f.get().shared()));
        }
        let (query, wait) = if fence.hasattr("query")? && fence.hasattr("synchronize")? {
            ("query", "synchronize")
        } else if fence.hasattr("is_complete")? && fence.hasattr("wait")? {
            ("is_complete", "wait")
        } else {
            return Err(invalid(format!(
                "fence must be None, an imp_mem.Fence, or an event with query() and \
                 synchronize() (torch.cuda.Event, cupy.cuda.Event); got {}",
                fence.get_type().name()?
            )));
        };
        let done = fence.call_method0(query)?.is_truthy()?;
        let flag = Arc::new(AtomicBool::new(done));
        if !done {
            lock(&self.watched).push(Watched {
                obj: fence.clone().unbind(),
                flag: flag.clone(),
                query,
                wait,
            });
        }
        Ok(Box::new(FlagFence(flag)))
    }

    /// Queries (or, with `block`, waits on) the Python fences the core still
    /// holds, sets their flags, and drops those it no longer holds. Runs with
    /// the GIL and without the pool's lock.
    fn poll_watched(&self, py: Python<'_>, block: bool, query: bool) -> PyResult<()> {
        let list = std::mem::take(&mut *lock(&self.watched));
        let mut kept = Vec::with_capacity(list.len());
        let mut failed = None;
        for w in list {
            if Arc::strong_count(&w.flag) == 1 {
                continue;
            }
            if query && failed.is_none() && !w.flag.load(Ordering::Acquire) {
                let done = if block {
                    w.obj.call_method0(py, w.wait).map(|_| true)
                } else {
                    w.obj
                        .call_method0(py, w.query)
                        .and_then(|r| r.is_truthy(py))
                };
                match done {
                    Ok(true) => w.flag.store(true, Ordering::Release),
                    Ok(false) => {}
                    Err(e) => failed = Some(e),
                }
            }
            kept.push(w);
        }
        lock(&self.watched).extend(kept);
        failed.map_or(Ok(()), Err)
    }

    /// Runs a shrink step `op` of the pool without the GIL, under `fence`:
    /// first queries the Python fences still held, then converts `fence`
    /// (which may watch a new one), and afterwards drops the fences the pool
    /// no longer holds.
    fn fenced(
        &self,
        py: Python<'_>,
        fence: Option<&Bound<'_, PyAny>>,
        op: impl FnOnce(&SharedBlockPool, CoreFence) -> Result<u64, MemError> + Send,
    ) -> PyResult<u64> {
        self.poll_watched(py, false, true)?;
        let fence = self.core_fence(fence)?;
        let pool = &self.pool;
        let done = py.detach(move || op(pool, fence));
        self.poll_watched(py, false, false)?;
        done.py()
    }
}

fn count32(value: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    if let Some(n) = fast_int::<u32>(value) {
        return Ok(n);
    }
    let n = convert::index(value, what)?;
    u32::try_from(n).map_err(|_| {
        invalid(format!(
            "{what}={n} is above the most a pool can hold ({})",
            u32::MAX - 1
        ))
    })
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (backend, block_bytes, blocks, *, max_blocks = None, grow_blocks = None, tag = None, min_idle_steps = None, keep_chunks = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        backend: PyRef<'_, PyBackend>,
        block_bytes: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        max_blocks: Option<&Bound<'_, PyAny>>,
        grow_blocks: Option<&Bound<'_, PyAny>>,
        tag: Option<&Bound<'_, PyAny>>,
        min_idle_steps: Option<&Bound<'_, PyAny>>,
        keep_chunks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let min_idle_steps = convert::opt(min_idle_steps, "min_idle_steps", convert::u32_arg)?;
        let keep_chunks = convert::opt(keep_chunks, "keep_chunks", convert::usize_arg)?;
        let block_bytes = size(block_bytes, "block_bytes")?;
        let blocks = count32(blocks, "blocks")?;
        let max_blocks = max_blocks
            .filter(|v| !v.is_none())
            .map(|v| count32(v, "max_blocks"))
            .transpose()?;
        let grow_blocks = grow_blocks
            .filter(|v| !v.is_none())
            .map(|v| count32(v, "grow_blocks"))
            .transpose()?;
        let max = max_blocks.unwrap_or(blocks);
        let mut config = PoolConfig::growable(block_bytes, blocks, max, grow_blocks.unwrap_or(0));
        if max > blocks && grow_blocks.is_none() {
            config.grow_blocks = blocks.max(1);
        }
        config.tag = opt_tag(tag)?;
        let pool = SharedBlockPool::new(&backend.inner, &config).py()?;
        backend.notices.emit(backend.py())?;
        if min_idle_steps.is_some() || keep_chunks.is_some() {
            let default = DecommitPolicy::default();
            pool.set_decommit_policy(DecommitPolicy {
                min_idle_steps: min_idle_steps.unwrap_or(default.min_idle_steps),
                keep_chunks: keep_chunks.unwrap_or(default.keep_chunks),
            });
        }
        Ok(Self::wrap(pool, backend.inner.addressable()))
    }

    /// An id space of `blocks` ids with no memory (a KV cache that lays out
    /// its own memory keeps only the free list and refcounts here).
    #[staticmethod]
    fn slots(blocks: &Bound<'_, PyAny>) -> PyResult<Self> {
        let pool = SharedBlockPool::slots(count32(blocks, "blocks")?).py()?;
        Ok(Self::wrap(pool, false))
    }

    /// One engine step of the shrink policy. Call it once per step with a
    /// fence recorded after the step's work was enqueued (`None`: nothing in
    /// flight can touch the pool). After `min_idle_steps` steps with more
    /// than `keep_chunks` spare chunks above the highest live block, the
    /// free tail is withdrawn and decommitted once its fence completes.
    /// Returns the bytes decommitted during this call.
    #[pyo3(signature = (fence = None))]
    fn step(&self, py: Python<'_>, fence: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        self.fenced(py, fence, |pool, fence| pool.step(fence))
    }

    /// Shrinks to the highest live block now (never below the initial
    /// blocks), bypassing the hysteresis; the decommit still waits for
    /// `fence`. Returns the bytes decommitted during this call.
    #[pyo3(signature = (fence = None))]
    fn shrink(&self, py: Python<'_>, fence: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        self.fenced(py, fence, |pool, fence| pool.shrink_now(fence))
    }

    /// Waits for a pending decommit's fence and decommits; the bytes
    /// returned (0 when nothing was pending).
    fn flush_decommit(&self, py: Python<'_>) -> PyResult<u64> {
        self.poll_watched(py, true, true)?;
        let pool = &self.pool;
        let done = py.detach(move || pool.flush_decommit());
        self.poll_watched(py, false, false)?;
        done.py()
    }

    /// Replaces the shrink policy (and restarts the idle count); a value
    /// left out keeps its current setting.
    #[pyo3(signature = (min_idle_steps = None, keep_chunks = None))]
    fn set_decommit_policy(
        &self,
        min_idle_steps: Option<&Bound<'_, PyAny>>,
        keep_chunks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let min_idle_steps = convert::opt(min_idle_steps, "min_idle_steps", convert::u32_arg)?;
        let keep_chunks = convert::opt(keep_chunks, "keep_chunks", convert::usize_arg)?;
        let now = self.pool.decommit_policy();
        self.pool.set_decommit_policy(DecommitPolicy {
            min_idle_steps: min_idle_steps.unwrap_or(now.min_idle_steps),
            keep_chunks: keep_chunks.unwrap_or(now.keep_chunks),
        });
        Ok(())
    }

    /// `{"min_idle_steps": ..., "keep_chunks": ...}`.
    #[getter]
    fn decommit_policy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let p = self.pool.decommit_policy();
        let d = PyDict::new(py);
        d.set_item("min_idle_steps", p.min_idle_steps)?;
        d.set_item("keep_chunks", p.keep_chunks)?;
        Ok(d)
    }

    /// The pool's whole reservation as one `StableSpan`: `max_blocks *
    /// block_bytes` bytes from the base, block `id` at `id * block_bytes`.
    /// The base never moves, so the span (and anything viewing it) stays
    /// valid across growth and shrinking, as long as the pool lives (an
    /// export keeps it alive). Only committed blocks have memory behind
    /// them: touch only blocks you hold a ref to, or the ids a
    /// `KVCacheManager` over this pool handed out for a live sequence.
    fn span(&self) -> PyResult<PyStableSpan> {
        let len = self.pool.reservation().py()?.len();
        Ok(stable(Owner::Pool(self.pool.clone()), len, self.exportable))
    }

    /// A typed view of the whole pool: shape `[max_blocks, *block_shape]`,
    /// one row per block id, for DLPack / `__cuda_array_interface__`
    /// (`torch.from_dlpack(pool.view("bfloat16", (layers, 2, block_size,
    /// kv_heads, head_dim)))`). One block of `block_shape` must fill
    /// exactly `block_bytes`. Valid across growth, as `span()` is, and with
    /// the same rule: only committed blocks — those whose ids you hold —
    /// may be touched.
    fn view(
        &self,
        py: Python<'_>,
        dtype: &Bound<'_, PyAny>,
        block_shape: &Bound<'_, PyAny>,
    ) -> PyResult<PyTensorView> {
        let parsed = dlpack::parse_dtype(dtype)?;
        let dims: Vec<i64> = if let Ok(n) = block_shape.extract::<i64>() {
            vec![n]
        } else {
            block_shape
                .extract()
                .map_err(|_| invalid("block_shape must be an int or a sequence of ints"))?
        };
        if dims.iter().any(|&d| d <= 0) {
            return Err(invalid(format!(
                "block_shape {dims:?} has a dimension below 1"
            )));
        }
        let per_block = dims.iter().try_fold(parsed.itemsize() as u64, |acc, &d| {
            acc.checked_mul(d as u64)
        });
        let block_bytes = self.pool.block_bytes() as u64;
        if per_block != Some(block_bytes) {
            return Err(invalid(format!(
                "a {} block of shape {dims:?} is {} B; this pool's blocks are {block_bytes} B — \
                 the shape must fill a block exactly",
                parsed.name,
                per_block.map_or("too many".to_string(), |n| n.to_string())
            )));
        }
        let span = self.span()?;
        let blocks = (span.inner.len as u64 / block_bytes.max(1)) as i64;
        let mut shape = vec![blocks];
        shape.extend(dims);
        span.inner
            .view(py, dtype, Some(&PyTuple::new(py, &shape)?.into_any()))
    }

    /// One block, with one ref.
    fn allocate(&self) -> PyResult<PyBlockRef> {
        let r = self.pool.allocate().py()?;
        Ok(PyBlockRef::new(r, self.exportable))
    }

    /// `n` blocks as one `BlockRefs`, or none (`CapacityError`, pool
    /// unchanged).
    fn allocate_many(&self, n: &Bound<'_, PyAny>) -> PyResult<PyBlockRefs> {
        let refs = self.pool.allocate_many(count32(n, "n")?).py()?;
        Ok(PyBlockRefs::new(refs, self.exportable))
    }

    /// Releases `block` (a `BlockRef` or `BlockRefs`) into this pool; a ref
    /// from another pool is refused with `InvalidArgument` and left as it is.
    fn release(&self, block: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Ok(r) = block.cast::<PyBlockRef>() {
            let r = r.get();
            let mut guard = lock(&r.inner);
            let live = guard.as_ref().ok_or_else(already_released)?;
            self.pool.check_owner(live).py()?;
            drop(guard.take());
            return Ok(());
        }
        if let Ok(b) = block.cast::<PyBlockRefs>() {
            let b = b.get();
            let mut guard = lock(&b.inner);
            let live = guard.as_ref().ok_or_else(already_released)?;
            if live.pool().id() != self.pool.id() {
                return Err(invalid(format!(
                    "these block refs belong to pool #{}, not #{}; a ref is only ever released \
                     into the pool it came from",
                    live.pool().id(),
                    self.pool.id()
                )));
            }
            drop(guard.take());
            return Ok(());
        }
        Err(invalid("release() takes a BlockRef or BlockRefs"))
    }

    /// The live refs on block `id` (0 when free).
    fn refcount(&self, id: &Bound<'_, PyAny>) -> PyResult<u32> {
        Ok(self.pool.refcount(count32(id, "id")?))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.pool.stats();
        let d = PyDict::new(py);
        d.set_item("capacity", s.capacity)?;
        d.set_item("max_blocks", s.max_blocks)?;
        d.set_item("free", s.free)?;
        d.set_item("live", s.live)?;
        d.set_item("refs", s.refs)?;
        d.set_item("high_water", s.high_water)?;
        d.set_item("block_bytes", s.block_bytes)?;
        d.set_item("growths", s.growths)?;
        d.set_item("shrinks", s.shrinks)?;
        d.set_item("decommitted_bytes", s.decommitted_bytes)?;
        d.set_item("cancelled_shrinks", s.cancelled_shrinks)?;
        d.set_item("pending_blocks", s.pending_blocks)?;
        d.set_item("committed_bytes", s.committed_bytes)?;
        d.set_item("min_blocks", s.min_blocks)?;
        d.set_item("chunk_blocks", s.chunk_blocks)?;
        d.set_item("idle_steps", s.idle_steps)?;
        Ok(d)
    }

    /// Walks the pool: V4 and the refcount sum.
    fn check_invariants(&self) -> PyResult<()> {
        self.pool.check_invariants().py()
    }

    #[getter]
    fn free(&self) -> u32 {
        self.pool.stats().free
    }

    #[getter]
    fn live(&self) -> u32 {
        self.pool.stats().live
    }

    #[getter]
    fn capacity(&self) -> u32 {
        self.pool.stats().capacity
    }

    #[getter]
    fn block_bytes(&self) -> usize {
        self.pool.block_bytes()
    }

    fn __repr__(&self) -> String {
        let s = self.pool.stats();
        format!(
            "<BlockPool free={} live={} capacity={} block_bytes={}>",
            s.free, s.live, s.capacity, s.block_bytes
        )
    }
}

fn already_released() -> PyErr {
    invalid(
        "this block ref was already released; each ref is released once — share() it first if \
         two owners need the block",
    )
}

/// The methods `BlockRef` and `BlockRefs` share: each is released once
/// (`release()`, or quietly on leaving a `with` block), and `share()` is the
/// only alias. The two literals are the docstrings of `share` and `release`.
macro_rules! ref_methods {
    ($ty:ty, $share_doc:literal, $release_doc:literal, { $($extra:tt)* }) => {
        #[pymethods]
        impl $ty {
            $($extra)*

            #[getter]
            fn released(&self) -> bool {
                lock(&self.inner).is_none()
            }

            #[doc = $share_doc]
            fn share(&self) -> PyResult<Self> {
                let guard = lock(&self.inner);
                let live = guard.as_ref().ok_or_else(already_released)?;
                Ok(Self::new(live.share().py()?, self.exportable))
            }

            #[doc = $release_doc]
            fn release(&self) -> PyResult<()> {
                let taken = lock(&self.inner).take().ok_or_else(already_released)?;
                drop(taken);
                Ok(())
            }

            fn __enter__(slf: Py<Self>) -> Py<Self> {
                slf
            }

            #[pyo3(signature = (*_args))]
            fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
                drop(lock(&self.inner).take());
                false
            }
        }
    };
}

/// One reference to a live block. Not copyable: `share()` is the only alias.
/// `release()` (or leaving a `with` block) drops it; a second release raises
/// `InvalidArgument`.
#[pyclass(frozen, name = "BlockRef", module = "imp_mem._core")]
pub struct PyBlockRef {
    inner: Mutex<Option<SharedBlockRef>>,
    id: u32,
    exportable: bool,
}

impl PyBlockRef {
    fn new(r: SharedBlockRef, exportable: bool) -> Self {
        Self {
            id: r.id(),
            inner: Mutex::new(Some(r)),
            exportable,
        }
    }
}

ref_methods!(
    PyBlockRef,
    "Another ref to the same block.",
    "Drops this ref now.",
    {
        #[getter]
        fn id(&self) -> u32 {
            self.id
        }

        /// The live refs on this block (0 once this ref is released and no other
        /// holds it).
        #[getter]
        fn refcount(&self) -> u32 {
            lock(&self.inner)
                .as_ref()
                .map_or(0, SharedBlockRef::refcount)
        }

        /// The block's bytes, valid while this ref is held.
        fn span(slf: &Bound<'_, Self>) -> PyResult<PyStableSpan> {
            let this = slf.get();
            let len = {
                let guard = lock(&this.inner);
                guard
                    .as_ref()
                    .ok_or_else(already_released)?
                    .span()
                    .py()?
                    .len()
            };
            Ok(stable(
                Owner::Block(slf.clone().unbind()),
                len,
                this.exportable,
            ))
        }

        fn __repr__(&self) -> String {
            match lock(&self.inner).as_ref() {
                Some(r) => format!("<BlockRef id={} refcount={}>", self.id, r.refcount()),
                None => format!("<BlockRef id={} released>", self.id),
            }
        }
    }
);

/// A batch of refs from `allocate_many`: one object for the batch, released
/// together.
#[pyclass(frozen, name = "BlockRefs", module = "imp_mem._core")]
pub struct PyBlockRefs {
    inner: Mutex<Option<SharedBlockRefs>>,
    exportable: bool,
}

impl PyBlockRefs {
    fn new(refs: SharedBlockRefs, exportable: bool) -> Self {
        Self {
            inner: Mutex::new(Some(refs)),
            exportable,
        }
    }
}

ref_methods!(
    PyBlockRefs,
    "Another ref to every block.",
    "Drops every ref now.",
    {
        /// The block ids, in allocation order.
        #[getter]
        fn ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
            // Copied out first: building the list may run a garbage
            // collection whose callbacks touch this object.
            let ids = lock(&self.inner)
                .as_ref()
                .map(|live| live.ids().to_vec())
                .ok_or_else(already_released)?;
            PyList::new(py, ids)
        }

        fn __len__(&self) -> usize {
            lock(&self.inner).as_ref().map_or(0, SharedBlockRefs::len)
        }

        /// Moves the refs into one `BlockRef` each (this batch is then released).
        fn split(&self) -> PyResult<Vec<PyBlockRef>> {
            let taken = lock(&self.inner).take().ok_or_else(already_released)?;
            Ok(taken
                .into_refs()
                .into_iter()
                .map(|r| PyBlockRef::new(r, self.exportable))
                .collect())
        }

        /// The bytes of the `i`-th block, valid while the batch is held.
        fn span(slf: &Bound<'_, Self>, i: &Bound<'_, PyAny>) -> PyResult<PyStableSpan> {
            let this = slf.get();
            let i = convert::index(i, "i")? as usize;
            let len = {
                let guard = lock(&this.inner);
                guard
                    .as_ref()
                    .ok_or_else(already_released)?
                    .span(i)
                    .py()?
                    .len()
            };
            Ok(stable(
                Owner::Batch(slf.clone().unbind(), i),
                len,
                this.exportable,
            ))
        }

        fn __repr__(&self) -> String {
            match lock(&self.inner).as_ref() {
                Some(r) => format!("<BlockRefs {} blocks {:?}>", r.len(), r.ids()),
                None => "<BlockRefs released>".to_string(),
            }
        }
    }
);

// ------------------------------------------------------------------ scratch

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

// ------------------------------------------------------------------ pinned

/// The pinned host memory the fake backend (and a machine without CUDA)
/// uses: ordinary host memory, exported as kDLCPU.
fn fake_pinned_host() -> &'static PinnedHost {
    static HOST: OnceLock<PinnedHost> = OnceLock::new();
    HOST.get_or_init(|| PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 40))))
}

/// The pinned host memory that goes with `backend`: the fake's for the
/// fake, the driver's for a device backend.
pub(crate) fn pinned_host_for(backend: &imp_mem_core::Backend) -> PyResult<PinnedHost> {
    if backend.info().name == "fake" {
        Ok(fake_pinned_host().clone())
    } else {
        cuda_pinned_host(backend.info().device)
    }
}

/// The driver's pinned host memory for `device`, opened once per device.
fn cuda_pinned_host(device: i32) -> PyResult<PinnedHost> {
    static HOSTS: OnceLock<Mutex<Vec<(i32, PinnedHost)>>> = OnceLock::new();
    let mut hosts = lock(HOSTS.get_or_init(|| Mutex::new(Vec::new())));
    if let Some((_, host)) = hosts.iter().find(|(d, _)| *d == device) {
        return Ok(host.clone());
    }
    let ops = imp_mem_cuda::CudaPinnedHost::new(device).py()?;
    let host = PinnedHost::new(Arc::new(ops));
    hosts.push((device, host.clone()));
    Ok(host)
}

/// Pinned host memory (T5b): move-only, freed exactly once. With
/// `or_empty=True` a failure gives an empty buffer (`empty` is True) instead
/// of raising, so a caller can fall back to pageable memory.
#[pyclass(frozen, name = "PinnedBuffer", module = "imp_mem._core")]
pub struct PyPinnedBuffer {
    inner: Mutex<Option<Arc<PinnedBuffer>>>,
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
            Some(b) => pinned_host_for(&b.inner)?,
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

/// Live pinned bytes and counts of the fake pinned host.
#[pyfunction]
fn pinned_stats<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let s = fake_pinned_host().stats();
    let d = PyDict::new(py);
    d.set_item("live_bytes", s.live_bytes)?;
    d.set_item("buffers", s.buffers)?;
    d.set_item("registered_bytes", s.registered_bytes)?;
    d.set_item("registrations", s.registrations)?;
    d.set_item("failures", s.failures)?;
    d.set_item("peak_bytes", s.peak_bytes)?;
    Ok(d)
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
    m.add_function(wrap_pyfunction!(pinned_stats, m)?)?;
    Ok(())
}

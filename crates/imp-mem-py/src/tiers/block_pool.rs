//! `BlockPool` (T3) and its refs, `BlockRef` and `BlockRefs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use imp_mem_core::decommit::{DecommitPolicy, FenceLike, NothingInFlight};
use imp_mem_core::MemError;
use imp_mem_core::{PoolConfig, SharedBlockPool, SharedBlockRef, SharedBlockRefs};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::span::{stable, Owner, PyStableSpan, PyTensorView};
use super::{fast_int, lock, opt_tag, size};
use crate::backend::PyBackend;
use crate::convert;
use crate::cuda::PyFence;
use crate::dlpack;
use crate::errors::{invalid, IntoPyResult};

/// A refcounted pool of fixed-size blocks (T3), or an id space only
/// (`BlockPool.slots(n)`).
#[pyclass(frozen, name = "BlockPool", module = "imp_mem._core")]
pub struct PyBlockPool {
    pool: SharedBlockPool,
    exportable: bool,
    /// The Python fences a pending decommit of this pool may wait on; a
    /// `MemorySystem` shares one between its pools' objects and its own
    /// `step()`.
    watch: Arc<FenceWatch>,
}

/// Python fences (`torch.cuda.Event`-like) that pending decommits may wait
/// on. The core never calls Python: it holds a flag, and the binding
/// queries these objects (outside every pool's lock) and sets the flags.
#[derive(Default)]
pub(crate) struct FenceWatch {
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

/// A fence as the core takes it (one conversion can serve every pool).
pub(crate) type CoreFence = Box<dyn FenceLike + Send + Sync>;

impl FenceWatch {
    /// `None`, an `imp_mem.Fence`, or an object with `query()` /
    /// `synchronize()` (torch / CuPy events) or `is_complete()` / `wait()`;
    /// a Python fence not yet complete is watched.
    pub(crate) fn core_fence(&self, fence: Option<&Bound<'_, PyAny>>) -> PyResult<CoreFence> {
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
    /// the GIL and without any pool's lock.
    pub(crate) fn poll(&self, py: Python<'_>, block: bool, query: bool) -> PyResult<()> {
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
}

impl PyBlockPool {
    /// Wraps a pool opened here, with its own fence watch.
    pub(crate) fn wrap(pool: SharedBlockPool, exportable: bool) -> Self {
        Self::wrap_watched(pool, exportable, Arc::default())
    }

    /// Wraps a pool whose fences `watch` holds (a `MemorySystem`'s).
    pub(crate) fn wrap_watched(
        pool: SharedBlockPool,
        exportable: bool,
        watch: Arc<FenceWatch>,
    ) -> Self {
        Self {
            pool,
            exportable,
            watch,
        }
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
        self.watch.poll(py, false, true)?;
        let fence = self.watch.core_fence(fence)?;
        let pool = &self.pool;
        let done = py.detach(move || op(pool, fence));
        self.watch.poll(py, false, false)?;
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
        self.watch.poll(py, true, true)?;
        let pool = &self.pool;
        let done = py.detach(move || pool.flush_decommit());
        self.watch.poll(py, false, false)?;
        done.py()
    }

    /// Lowers the most blocks this pool may grow to (`max_blocks`), at least
    /// the blocks committed now: the reservation and every address stay,
    /// and admission counts no room past it. A growable KV pool opened
    /// before its plan was final is capped at the final plan's blocks so.
    fn limit_blocks(&self, max_blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = convert::u32_arg(max_blocks, "max_blocks")?;
        self.pool.limit_blocks(n).py()
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
    pub(super) inner: Mutex<Option<SharedBlockRef>>,
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
    pub(super) inner: Mutex<Option<SharedBlockRefs>>,
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

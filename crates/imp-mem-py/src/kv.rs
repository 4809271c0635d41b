//! Python face of the KV cache manager: `KVCacheManager`.
//!
//! Conversions only. Token ids arrive through the input layer's one entry
//! point (`input::read_tokens`: a list, a tuple or any buffer of integers),
//! which hands this file a `&[u32]` however they came.
//! Hashing, matching and allocation run with the GIL released,
//! except a small call (up to `SMALL_TOKENS` tokens) that finds the
//! manager's lock free: it keeps the GIL, which costs less than releasing
//! it (see `PyKVCacheManager::run`). The call arguments' readers live in
//! `kv/args.rs`.

use std::sync::{Mutex, MutexGuard, TryLockError};

use imp_mem_core::kv::{
    host_tier_io, Admission, BlockHash, ExtraKeys, IdSource, KVCacheManager, KvConfig, KvEvent,
    KvStats, TierIo,
};
use imp_mem_core::{Backend, MemError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::backend::PyBackend;
use crate::convert::{self, type_name};
use crate::errors::IntoPyResult;
use crate::input::buffer::BufferView;
use crate::input::{read_tokens, Int32Check};

mod args;

use args::{check_out, count, extras, lora, native_int32, request, seq, seq_id_list, table_pool};

fn stats_dict<'py>(py: Python<'py>, s: &KvStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("capacity", s.capacity)?;
    d.set_item("max_blocks", s.max_blocks)?;
    d.set_item("free", s.free)?;
    d.set_item("live", s.live)?;
    d.set_item("active", s.active)?;
    d.set_item("cached", s.cached)?;
    d.set_item("evictable", s.evictable)?;
    d.set_item("pinned", s.pinned)?;
    d.set_item("pins", s.pins)?;
    d.set_item("sequences", s.sequences)?;
    d.set_item("swa_capacity", s.swa_capacity)?;
    d.set_item("swa_free", s.swa_free)?;
    d.set_item("swa_live", s.swa_live)?;
    d.set_item("prefix_queries", s.prefix_queries)?;
    d.set_item("prefix_query_blocks", s.prefix_query_blocks)?;
    d.set_item("prefix_hit_blocks", s.prefix_hit_blocks)?;
    d.set_item("prefix_query_tokens", s.prefix_query_tokens)?;
    d.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("host_capacity", s.host_capacity)?;
    d.set_item("host_cached", s.host_cached)?;
    d.set_item("host_free", s.host_free)?;
    d.set_item("host_offloading", s.host_offloading)?;
    d.set_item("host_onboarding", s.host_onboarding)?;
    d.set_item("host_hit_blocks", s.host_hit_blocks)?;
    d.set_item("offloads", s.offloads)?;
    d.set_item("offload_bytes", s.offload_bytes)?;
    d.set_item("onboards", s.onboards)?;
    d.set_item("onboard_bytes", s.onboard_bytes)?;
    d.set_item("host_evictions", s.host_evictions)?;
    d.set_item("disk_cached", s.disk_cached)?;
    d.set_item("disk_bytes", s.disk_bytes)?;
    d.set_item("disk_spills", s.disk_spills)?;
    d.set_item("disk_loads", s.disk_loads)?;
    Ok(d)
}

/// Calls with at most this many tokens (admit, append; free and abort of a
/// sequence this long) keep the GIL when the manager is uncontended: about
/// a microsecond of work at most.
const SMALL_TOKENS: usize = 2048;

fn small_sequence(m: &KVCacheManager, id: u64) -> bool {
    m.num_tokens(id).map_or(true, |n| n <= SMALL_TOKENS)
}

/// The paged KV cache manager: sequence block tables (with holes), a prefix
/// cache that owns its blocks, pins, an SWA pool, admission control and
/// persistence. Thread-safe: one lock around the core.
#[pyclass(frozen, name = "KVCacheManager", module = "imp_mem._core")]
pub struct PyKVCacheManager {
    inner: Mutex<KVCacheManager>,
    block_size: usize,
}

impl PyKVCacheManager {
    fn lock(&self) -> MutexGuard<'_, KVCacheManager> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the manager. Small work (`small` says, given the
    /// manager) runs with the GIL held when the manager's lock is free at
    /// once and it has no disk tier (whose file I/O any call that moves
    /// blocks may do): releasing and re-taking the GIL costs more than such
    /// a call's work. Anything else — large work, or a lock another thread holds —
    /// releases the GIL first, so no thread ever waits for the lock while
    /// holding the GIL, and no long operation holds it.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        small: impl FnOnce(&KVCacheManager) -> bool,
        f: impl FnOnce(&mut KVCacheManager) -> R + Send,
    ) -> R {
        let guard = match self.inner.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if let Some(mut g) = guard {
            // A manager with a disk tier may read or write block files in
            // any call that moves blocks: never with the GIL held.
            if small(&g) && !g.has_disk_tier() {
                return f(&mut g);
            }
        }
        py.detach(|| f(&mut self.lock()))
    }

    /// Runs `f` under the manager's lock: at once, keeping the GIL, when the
    /// lock is free; otherwise it waits with the GIL released (a save, a
    /// load or a large admission in another thread may hold the lock), so
    /// no thread ever waits for the lock holding the GIL. Errors are
    /// converted by the caller, after the lock is released.
    fn with<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut KVCacheManager) -> R + Send) -> R {
        self.run(py, |_| true, f)
    }

    /// `admit` (and `try_admit`) with the extras read: `done` turns the
    /// core's answer into the method's. The extras come first because
    /// reading them may run Python code (an `mm` iterable), which must not
    /// run while the ids are borrowed. Int32 ids read in place are left for
    /// the manager to check once it has hashed them (K21).
    #[inline(always)]
    fn admit_with<R>(
        &self,
        py: Python<'_>,
        seq_id: u64,
        tokens: &Bound<'_, PyAny>,
        extras: ExtraKeys,
        done: impl FnOnce(Result<Admission, MemError>) -> PyResult<R>,
    ) -> PyResult<R> {
        read_tokens(tokens, Int32Check::Manager, |ids, source| {
            done(self.admit_ids(py, seq_id, ids, source, extras))
        })
    }

    /// Admits `ids` under the manager's lock, keeping the GIL for a small
    /// prompt (K14).
    #[inline(always)]
    fn admit_ids(
        &self,
        py: Python<'_>,
        seq_id: u64,
        ids: &[u32],
        source: IdSource,
        extras: ExtraKeys,
    ) -> Result<Admission, MemError> {
        let n = ids.len();
        self.run(
            py,
            |_| n <= SMALL_TOKENS,
            |m| m.admit_from(seq_id, ids, source, extras),
        )
    }

    /// `append` with its arguments converted.
    pub(crate) fn append_impl(
        &self,
        py: Python<'_>,
        seq_id: u64,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        read_tokens(tokens, Int32Check::Now, |ids, _| {
            let n = ids.len();
            self.run(py, |_| n <= SMALL_TOKENS, |m| m.append(seq_id, ids))
                .py()
        })
    }

    /// `free` (and `abort`: nothing computed) with the arguments converted.
    pub(crate) fn free_impl(
        &self,
        py: Python<'_>,
        seq_id: u64,
        computed_tokens: Option<usize>,
    ) -> PyResult<()> {
        self.run(
            py,
            |m| small_sequence(m, seq_id),
            |m| m.free(seq_id, computed_tokens),
        )
        .py()
    }

    /// Wraps a manager built in Rust (by `MemorySystem.kv_manager`).
    pub(crate) fn from_core(m: KVCacheManager) -> Self {
        let block_size = m.config().block_size;
        Self {
            inner: Mutex::new(m),
            block_size,
        }
    }
}

/// The host tier's copies for a pool on `backend`: the engine its source
/// gives (`imp_mem_core::kv::host_tier_io` holds the rule and its refusal).
pub(crate) fn tier_io(
    backend: Option<&Bound<'_, PyAny>>,
    block_bytes: usize,
    host_blocks: u32,
) -> PyResult<Box<dyn TierIo>> {
    let core = backend
        .and_then(|b| b.cast::<PyBackend>().ok())
        .map(|b| b.get().inner.clone());
    host_tier_io(core.as_ref(), block_bytes, host_blocks).py()
}

#[pymethods]
impl PyKVCacheManager {
    #[new]
    #[pyo3(
        signature = (
            num_blocks, block_size, *, backend = None, block_bytes = None, swa_blocks = None,
            swa_window = None, swa_block_bytes = None, enable_prefix_caching = None,
            hash_seed = None, pin_budget = None, model_fingerprint = None, dtype = None,
            layout = None, kv_events = None, host_blocks = None, disk_dir = None,
            disk_bytes = None
        ),
        text_signature = "(num_blocks, block_size, *, backend=None, block_bytes=0, \
            swa_blocks=0, swa_window=0, swa_block_bytes=0, enable_prefix_caching=True, \
            hash_seed=None, pin_budget=None, model_fingerprint='', dtype='', layout='', \
            kv_events=False, host_blocks=0, disk_dir=None, disk_bytes=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        backend: Option<&Bound<'_, PyAny>>,
        block_bytes: Option<&Bound<'_, PyAny>>,
        swa_blocks: Option<&Bound<'_, PyAny>>,
        swa_window: Option<&Bound<'_, PyAny>>,
        swa_block_bytes: Option<&Bound<'_, PyAny>>,
        enable_prefix_caching: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        pin_budget: Option<&Bound<'_, PyAny>>,
        model_fingerprint: Option<&Bound<'_, PyAny>>,
        dtype: Option<&Bound<'_, PyAny>>,
        layout: Option<&Bound<'_, PyAny>>,
        kv_events: Option<&Bound<'_, PyAny>>,
        host_blocks: Option<&Bound<'_, PyAny>>,
        disk_dir: Option<&Bound<'_, PyAny>>,
        disk_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let blocks = |v: &Bound<'_, PyAny>, what: &str| {
            convert::int_in(v, what, 1, (u32::MAX - 1).into()).map(|n| n as u32)
        };
        let mut cfg = KvConfig::new(
            convert::int_in(block_size, "block_size", 1, u32::MAX.into())? as usize,
            blocks(num_blocks, "num_blocks")?,
        );
        let size =
            |v, what| convert::opt(v, what, convert::usize_arg).map(Option::unwrap_or_default);
        cfg.block_bytes = size(block_bytes, "block_bytes")?;
        cfg.swa_blocks = convert::opt(swa_blocks, "swa_blocks", |v, what| {
            convert::int_in(v, what, 0, (u32::MAX - 1).into()).map(|n| n as u32)
        })?
        .unwrap_or_default();
        cfg.swa_window = size(swa_window, "swa_window")?;
        cfg.swa_block_bytes = size(swa_block_bytes, "swa_block_bytes")?;
        // What is not given keeps KvConfig::new's default.
        let prefix = convert::opt(
            enable_prefix_caching,
            "enable_prefix_caching",
            convert::flag,
        )?;
        cfg.enable_prefix_caching = prefix.unwrap_or(cfg.enable_prefix_caching);
        let seed = convert::opt(hash_seed, "hash_seed", convert::u64_arg)?;
        cfg.hash_seed = seed.unwrap_or(cfg.hash_seed);
        if let Some(b) = convert::opt(pin_budget, "pin_budget", convert::u32_arg)? {
            cfg.pin_budget = b;
        }
        let text = |v, what| convert::opt(v, what, convert::text).map(Option::unwrap_or_default);
        cfg.model_fingerprint = text(model_fingerprint, "model_fingerprint")?;
        cfg.dtype = text(dtype, "dtype")?;
        cfg.layout = text(layout, "layout")?;
        let events = convert::opt(kv_events, "kv_events", convert::flag)?;
        cfg.kv_events = events.unwrap_or(cfg.kv_events);
        let host_blocks = convert::opt(host_blocks, "host_blocks", |v, what| {
            convert::int_in(v, what, 0, (u32::MAX - 1).into()).map(|n| n as u32)
        })?
        .unwrap_or_default();
        let disk_dir = convert::opt(disk_dir, "disk_dir", convert::path)?;
        let disk_bytes =
            convert::opt(disk_bytes, "disk_bytes", convert::u64_arg)?.unwrap_or_default();
        let block_bytes = cfg.block_bytes;
        let backend = backend.filter(|b| !b.is_none());
        let core: Option<Backend> = match backend {
            Some(b) => Some(
                b.cast::<PyBackend>()
                    .map_err(|_| {
                        pyo3::exceptions::PyTypeError::new_err(format!(
                            "backend must be an imp_mem Backend (FakeBackend, CudaBackend, \
                             VmmBackend) or None, got {}",
                            type_name(b)
                        ))
                    })?
                    .get()
                    .inner
                    .clone(),
            ),
            None => None,
        };
        let mut m = KVCacheManager::new(cfg, core.as_ref()).py()?;
        if host_blocks > 0 {
            m.set_host_tier(tier_io(backend, block_bytes, host_blocks)?)
                .py()?;
        }
        if let Some((dir, bytes)) =
            KvConfig::disk_tier_args(disk_dir, disk_bytes, host_blocks).py()?
        {
            m.set_disk_tier(&dir, bytes).py()?;
        }
        Ok(Self::from_core(m))
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the main pool.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> u32 {
        self.with(py, |m| m.config().num_blocks)
    }

    /// Admits `seq_id` with its prompt; returns the leading tokens already
    /// cached. Raises CapacityError (with needed/free/evictable/pinned) and
    /// changes nothing when it does not fit.
    #[pyo3(signature = (seq_id, tokens, *, lora_id = None, cache_salt = None, mm = None))]
    fn admit(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        mm: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let seq_id = seq(seq_id)?;
        let extras = extras(lora(lora_id)?, cache_salt, mm)?;
        self.admit_with(py, seq_id, tokens, extras, |a| {
            a.py().map(|a| a.cached_tokens)
        })
    }

    /// `admit`, or None (and nothing changed) when it does not fit: one
    /// call where `can_admit` then `admit` would read and hash the prompt
    /// twice, and no exception to build and catch on a refusal. Any other
    /// error (a bad argument, an id already admitted) still raises.
    #[pyo3(signature = (seq_id, tokens, *, lora_id = None, cache_salt = None, mm = None))]
    fn try_admit(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        mm: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<usize>> {
        let seq_id = seq(seq_id)?;
        let extras = extras(lora(lora_id)?, cache_salt, mm)?;
        self.admit_with(py, seq_id, tokens, extras, |a| match a {
            Ok(a) => Ok(Some(a.cached_tokens)),
            Err(MemError::KvCapacity(_) | MemError::Capacity(_)) => Ok(None),
            Err(e) => Err(e).py(),
        })
    }

    /// True when `tokens` could be admitted now.
    #[pyo3(signature = (tokens, *, lora_id = None, cache_salt = None, mm = None))]
    fn can_admit(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        mm: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        request(tokens, lora(lora_id)?, cache_salt, mm, |ids, extras| {
            Ok(py.detach(|| self.lock().can_admit(ids, &extras)))
        })
    }

    /// Cached leading tokens for `tokens` now (a hint; takes no refs).
    #[pyo3(signature = (tokens, *, lora_id = None, cache_salt = None, mm = None))]
    fn probe(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        mm: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        request(tokens, lora(lora_id)?, cache_salt, mm, |ids, extras| {
            Ok(py.detach(|| self.lock().probe(ids, &extras)) * self.block_size)
        })
    }

    /// Appends tokens to `seq_id`; all or nothing.
    fn append(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.append_impl(py, seq(seq_id)?, tokens)
    }

    /// One decode step's appends in one call: `tokens[i]` onto
    /// `seq_ids[i]`, in order, each all or nothing. Stops at the first
    /// sequence the pools cannot take and returns how many were appended
    /// (`len(seq_ids)` when all were): the caller makes room (preempts) and
    /// calls again with the rest. An unknown id or a length mismatch raises
    /// `InvalidArgument` and appends nothing.
    fn append_each(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let ids = seq_id_list(seq_ids)?;
        read_tokens(tokens, Int32Check::Now, |words, _| {
            let n = ids.len();
            self.run(py, |_| n <= SMALL_TOKENS, |m| m.append_each(&ids, words))
                .py()
        })
    }

    /// True when `n` more tokens fit `seq_id` now.
    fn can_append(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        n: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let (seq_id, n) = (seq(seq_id)?, count(n, "n")?);
        self.with(py, |m| m.can_append(seq_id, n)).py()
    }

    /// Frees `seq_id`; its full computed blocks move into the prefix cache.
    #[pyo3(signature = (seq_id, computed_tokens = None))]
    fn free(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        computed_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let computed = convert::opt(computed_tokens, "computed_tokens", count)?;
        self.free_impl(py, seq(seq_id)?, computed)
    }

    /// Shares `seq_id`'s full blocks inside its first `computed_tokens` with
    /// the prefix cache now, so concurrent requests hit them; returns the
    /// blocks newly cached.
    fn cache_computed(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<u32> {
        let (seq_id, n) = (seq(seq_id)?, count(computed_tokens, "computed_tokens")?);
        self.with(py, |m| m.cache_computed(seq_id, n)).py()
    }

    /// Releases `seq_id` without caching anything new.
    fn abort(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        self.free_impl(py, seq(seq_id)?, Some(0))
    }

    /// StreamingLLM: drops blocks `[start, end)` of `seq_id`, leaving holes.
    fn evict_middle(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        start: &Bound<'_, PyAny>,
        end: &Bound<'_, PyAny>,
    ) -> PyResult<u32> {
        let seq_id = seq(seq_id)?;
        let (start, end) = (count(start, "start")?, count(end, "end")?);
        self.with(py, |m| m.evict_middle(seq_id, start, end)).py()
    }

    /// The kernel-facing block table: block ids, -1 for a hole.
    fn block_table(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
        let seq_id = seq(seq_id)?;
        self.with(py, |m| m.block_table(seq_id).map(<[i32]>::to_vec))
            .py()
    }

    /// The block table as native-endian int32 bytes (for
    /// `numpy.frombuffer(..., dtype=numpy.int32)` or a device copy).
    fn block_table_bytes<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let seq_id = seq(seq_id)?;
        let raw = self
            .with(py, |m| {
                m.block_table(seq_id).map(|table| {
                    let mut raw = Vec::with_capacity(table.len() * 4);
                    for id in table {
                        raw.extend_from_slice(&id.to_ne_bytes());
                    }
                    raw
                })
            })
            .py()?;
        Ok(PyBytes::new(py, &raw))
    }

    /// The block tables of a whole batch in one call: row `i` of `out`
    /// gets `seq_ids[i]`'s table (`pool="full"`) or SWA table
    /// (`pool="swa"`), padded with -1. `out` is a writable, C-contiguous
    /// int32 buffer of shape `[len(seq_ids), width]` (a NumPy array, a CPU
    /// or pinned torch tensor's `.numpy()`); the call returns the columns
    /// used (the longest row). Without `out` it returns a new NumPy array
    /// of exactly that width. An unknown id or a row wider than `width` is
    /// refused with `InvalidArgument`, a non-int32 or non-buffer `out` with
    /// `TypeError`; a refused call writes nothing.
    #[pyo3(
        signature = (seq_ids, out = None, *, pool = None),
        text_signature = "(self, seq_ids, out=None, *, pool='full')"
    )]
    fn block_tables(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        pool: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let swa = convert::opt(pool, "pool", |v, _| table_pool(v))?.unwrap_or(false);
        let ids = seq_id_list(seq_ids)?;
        let rows = ids.len();
        let Some(out) = out.filter(|o| !o.is_none()) else {
            let (width, values) = self
                .with(py, |m| {
                    let mut width = 0;
                    for &id in &ids {
                        let t = if swa {
                            m.swa_table(id)
                        } else {
                            m.block_table(id)
                        };
                        width = width.max(t?.len());
                    }
                    let mut values = vec![-1i32; rows * width];
                    m.block_tables(&ids, &mut values, width, swa)?;
                    Ok::<_, imp_mem_core::MemError>((width, values))
                })
                .py()?;
            let raw: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
            let numpy = py.import("numpy")?;
            let array = numpy
                .call_method1("frombuffer", (PyBytes::new(py, &raw), "int32"))?
                .call_method1("reshape", ((rows, width),))?
                .call_method0("copy")?;
            return Ok(array.unbind());
        };
        // The direct path: the buffer lent for writing, the rows written
        // into it under the manager's lock.
        if let Some(mut view) = BufferView::get_writable(out) {
            let shape = view.shape();
            if native_int32(&view.format(), view.itemsize()) && shape.len() == 2 && shape[0] == rows
            {
                let width = shape[1];
                if let Some(values) = view.as_i32_mut() {
                    let used = self
                        .run(
                            py,
                            |_| rows <= SMALL_TOKENS,
                            |m| m.block_tables(&ids, values, width, swa),
                        )
                        .py()?;
                    return Ok(used.into_pyobject(py)?.into_any().unbind());
                }
            }
        }
        // Everything else: the refusal, or (an empty buffer, the buffer path
        // turned off) the rows written through a memoryview.
        let (view, width) = check_out(out, rows)?;
        let mut values = vec![-1i32; rows * width];
        let used = self
            .with(py, |m| m.block_tables(&ids, &mut values, width, swa))
            .py()?;
        if !values.is_empty() {
            let raw: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
            let bytes_view = view.call_method1(intern!(py, "cast"), ("B",))?;
            bytes_view.set_item(pyo3::types::PySlice::full(py), PyBytes::new(py, &raw))?;
        }
        Ok(used.into_pyobject(py)?.into_any().unbind())
    }

    /// The SWA table: positional, -1 outside the trailing window.
    fn swa_table(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
        let seq_id = seq(seq_id)?;
        self.with(py, |m| m.swa_table(seq_id).map(<[i32]>::to_vec))
            .py()
    }

    /// Tokens of `seq_id`.
    fn num_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq_id = seq(seq_id)?;
        self.with(py, |m| m.num_tokens(seq_id)).py()
    }

    /// The admitted sequence ids.
    fn sequences(&self, py: Python<'_>) -> Vec<u64> {
        self.with(py, |m| m.sequences())
    }

    /// The chained hashes of `seq_id`'s full blocks.
    fn sequence_hashes(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<u128>> {
        let seq_id = seq(seq_id)?;
        self.with(py, |m| m.sequence_hashes(seq_id).map(<[u128]>::to_vec))
            .py()
    }

    /// `(address, nbytes)` of block `index` of `seq_id`, or None for a hole.
    fn block_span(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        index: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(usize, usize)>> {
        let (seq_id, index) = (seq(seq_id)?, count(index, "index")?);
        self.with(py, |m| m.block_span(seq_id, index)).py()
    }

    /// `(hash, block_id, address or None)` of every cached block.
    fn cached_blocks(&self, py: Python<'_>) -> Vec<(BlockHash, u32, Option<usize>)> {
        self.with(py, |m| m.cached_blocks())
    }

    /// The chained hashes of the full blocks of `tokens`, computed in Rust
    /// without the GIL, as one `bytes` of 16 little-endian bytes per block
    /// (`int.from_bytes(h[16 * i : 16 * i + 16], "little")` is block i's).
    #[pyo3(signature = (tokens, *, lora_id = None, cache_salt = None, mm = None))]
    fn hash_blocks<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        mm: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let raw = request(tokens, lora(lora_id)?, cache_salt, mm, |ids, extras| {
            Ok(py.detach(|| {
                let hasher = self.lock().hasher().clone();
                let hashes = hasher.chain(ids, &extras);
                let mut raw = Vec::with_capacity(hashes.len() * 16);
                for h in hashes {
                    raw.extend_from_slice(&h.to_le_bytes());
                }
                raw
            }))
        })?;
        Ok(PyBytes::new(py, &raw))
    }

    /// Pins the cached prefix of `tokens` for `owner`; returns blocks pinned.
    #[pyo3(signature = (owner, tokens, *, lora_id = None, cache_salt = None, mm = None))]
    fn pin(
        &self,
        py: Python<'_>,
        owner: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        lora_id: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        mm: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u32> {
        let owner = convert::u64_arg(owner, "owner")?;
        request(tokens, lora(lora_id)?, cache_salt, mm, |ids, extras| {
            py.detach(|| self.lock().pin(owner, ids, &extras)).py()
        })
    }

    /// Drops every pin of `owner`; returns the pins dropped.
    fn unpin(&self, py: Python<'_>, owner: &Bound<'_, PyAny>) -> PyResult<u32> {
        let owner = convert::u64_arg(owner, "owner")?;
        Ok(self.with(py, |m| m.unpin(owner)))
    }

    /// Evicts up to `n` least recently used cached blocks; returns how many.
    /// With a host tier they are copied there, and their device blocks are
    /// free after a later `poll_copies()`.
    fn evict(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<u32> {
        let n = convert::u32_arg(n, "n")?;
        Ok(self.with(py, |m| m.evict(n)))
    }

    /// Gives about `nbytes` of the KV pool's memory back to its backend
    /// (and so to a device ledger): the free tail above the live blocks
    /// first, then prefix-cache blocks evicted a whole chunk at a time from
    /// the top, so their pages really come free; never a sequence's block.
    /// `keep_blocks` free blocks above the live ones stay (room promised to
    /// running sequences; then no cache entry is evicted).
    /// `fence`: None when nothing in flight touches the pool (synchronize
    /// first), or an `imp_mem.Fence` recorded after the last work (waited
    /// for). Returns the bytes decommitted.
    #[pyo3(signature = (nbytes, keep_blocks = None, fence = None))]
    fn give_back(
        &self,
        py: Python<'_>,
        nbytes: &Bound<'_, PyAny>,
        keep_blocks: Option<&Bound<'_, PyAny>>,
        fence: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let n = convert::bytes(nbytes, "nbytes")?;
        let keep = match keep_blocks.filter(|k| !k.is_none()) {
            Some(k) => convert::u32_arg(k, "keep_blocks")?,
            None => 0,
        };
        let fence = crate::ledger::kv_fence(fence)?;
        py.detach(|| self.lock().give_back(n, keep, fence)).py()
    }

    /// Makes at least `blocks` KV blocks free now, growing the pool (on a
    /// device ledger only as far as it grants; cached blocks evicted where
    /// growth is refused). Returns False, changing nothing, when it
    /// cannot: the room an engine promises what it admits.
    fn reserve_free(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<bool> {
        let n = convert::u32_arg(blocks, "blocks")?;
        match py.detach(|| self.lock().reserve_free(n)) {
            Ok(()) => Ok(true),
            Err(MemError::OutOfMemory(_) | MemError::KvCapacity(_)) => Ok(false),
            Err(e) => Err(crate::errors::to_py(e)),
        }
    }

    /// The device ledger's side of an engine step (a no-op off a ledger):
    /// records the bytes of live KV blocks in the tenant's slot and gives
    /// back what the ledger asks of it (`give_back`). `fence` as for
    /// `give_back`. Returns the bytes given back.
    #[pyo3(signature = (keep_blocks = None, fence = None))]
    fn ledger_tick(
        &self,
        py: Python<'_>,
        keep_blocks: Option<&Bound<'_, PyAny>>,
        fence: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let keep = match keep_blocks.filter(|k| !k.is_none()) {
            Some(k) => convert::u32_arg(k, "keep_blocks")?,
            None => 0,
        };
        let fence = crate::ledger::kv_fence(fence)?;
        py.detach(|| self.lock().ledger_tick(keep, fence)).py()
    }

    /// Writes the prefix cache to `path` (str, bytes or os.PathLike)
    /// atomically; returns entries written. The cache is snapshotted under
    /// the manager's lock and written without it, so other calls proceed
    /// during the write.
    fn save_prefix_cache(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<u64> {
        let path = convert::path(path, "path")?;
        py.detach(|| {
            let snapshot = self.lock().snapshot_prefix_cache()?;
            snapshot.write(&path)
        })
        .py()
    }

    /// Loads a saved prefix cache; refuses a bad or mismatched file whole,
    /// and refuses any file when prefix caching is off. The file is read
    /// outside the manager's lock.
    fn load_prefix_cache(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<u64> {
        let path = convert::path(path, "path")?;
        py.detach(|| {
            let target = self.lock().load_target()?;
            let file = target.verify(&path)?;
            let reserved = self.lock().reserve_load(file);
            let mut pending = reserved?;
            if let Err(e) = pending.copy_in() {
                self.lock().abandon_load(pending)?;
                return Err(e);
            }
            let loaded = self.lock().finish_load(pending);
            loaded
        })
        .py()
    }

    /// Takes the KV events recorded since the last call (one batch per
    /// engine step), oldest first, each a tuple in the field order of
    /// vLLM's events: `("BlockStored", block_hashes, parent_block_hash,
    /// token_ids, block_size, lora_id, medium)`, `("BlockRemoved",
    /// block_hashes, medium)`, `("AllBlocksCleared",)`. Hashes are the
    /// 128-bit block hashes as ints. Empty unless built with
    /// `kv_events=True`.
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.with(py, |m| m.drain_events());
        let out = PyList::empty(py);
        for e in events {
            let item = match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    lora_id,
                    medium,
                } => PyTuple::new(
                    py,
                    [
                        intern!(py, "BlockStored").clone().into_any(),
                        PyList::new(py, block_hashes)?.into_any(),
                        parent_block_hash.into_pyobject(py)?.into_any(),
                        PyList::new(py, token_ids)?.into_any(),
                        self.block_size.into_pyobject(py)?.into_any(),
                        lora_id.into_pyobject(py)?.into_any(),
                        PyString::new(py, medium.as_str()).into_any(),
                    ],
                )?,
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => PyTuple::new(
                    py,
                    [
                        intern!(py, "BlockRemoved").clone().into_any(),
                        PyList::new(py, block_hashes)?.into_any(),
                        PyString::new(py, medium.as_str()).into_any(),
                    ],
                )?,
                KvEvent::AllBlocksCleared => {
                    PyTuple::new(py, [intern!(py, "AllBlocksCleared").clone()])?
                }
            };
            out.append(item)?;
        }
        Ok(out)
    }

    /// Finishes the host tier's completed copies (all of them, waiting,
    /// with `wait=True`); returns the device blocks freed. Call once per
    /// engine step.
    #[pyo3(signature = (wait = None), text_signature = "(self, wait=False)")]
    fn poll_copies(&self, py: Python<'_>, wait: Option<&Bound<'_, PyAny>>) -> PyResult<u32> {
        let wait = convert::opt(wait, "wait", convert::flag)?.unwrap_or(false);
        py.detach(|| self.lock().poll_copies(wait)).py()
    }

    /// The host-to-device copies `seq_id`'s blocks still wait for (tickets).
    fn onboarding(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let seq_id = seq(seq_id)?;
        self.with(py, |m| m.onboarding(seq_id)).py()
    }

    /// Waits until `seq_id`'s onboarded blocks hold their bytes: on the
    /// host, or, given `stream` (a CUstream as an int, e.g. torch's
    /// `current_stream().cuda_stream`), by making that stream wait on the
    /// device. Returns the copies waited on.
    #[pyo3(signature = (seq_id, stream = None))]
    fn wait_onboarding(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u32> {
        let seq_id = seq(seq_id)?;
        let stream = convert::opt(stream, "stream", convert::usize_arg)?;
        py.detach(|| self.lock().wait_onboarding(seq_id, stream))
            .py()
    }

    /// Hashes resident in the host tier, least recently used first.
    fn host_cached_blocks(&self, py: Python<'_>) -> Vec<BlockHash> {
        self.with(py, |m| m.host_cached_blocks())
    }

    /// Hashes in the disk tier, least recently written first.
    fn disk_cached_blocks(&self, py: Python<'_>) -> Vec<BlockHash> {
        self.with(py, |m| m.disk_cached_blocks())
    }

    /// Events waiting for `drain_events`.
    fn pending_events(&self, py: Python<'_>) -> usize {
        self.with(py, |m| m.pending_events())
    }

    /// Empties the prefix cache when no sequence uses a cached block and
    /// none is pinned; returns False (and changes nothing) otherwise.
    fn reset_prefix_cache(&self, py: Python<'_>) -> bool {
        self.with(py, |m| m.reset_prefix_cache())
    }

    /// The counters, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |m| m.stats());
        stats_dict(py, &s)
    }

    /// Walks every block and ref; raises ImpMemError if an invariant broke.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |m| m.check_invariants()).py()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let s = self.with(py, |m| m.stats());
        format!(
            "<KVCacheManager {} blocks of {} tokens: {} free, {} active, {} cached, {} sequences>",
            s.capacity, self.block_size, s.free, s.active, s.cached, s.sequences
        )
    }
}

/// Registers this file's classes.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKVCacheManager>()
}

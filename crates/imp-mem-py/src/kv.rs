//! Python face of the KV cache manager: `KVCacheManager`.
//!
//! Conversions only. Token ids arrive as any buffer of integers (a NumPy
//! array, `array('i')`, a `memoryview`) or a list/tuple of ints. On Python
//! 3.11+ a buffer is read in place through the buffer protocol (see
//! `buffer.rs`): native 4-byte ids are borrowed without a copy, anything
//! else is converted straight from the exporter's memory; a buffer that
//! cannot be exported C-contiguous, and every buffer before 3.11 (where the
//! protocol is not in the limited API), is copied once to bytes
//! (`tobytes()`) and reinterpreted in Rust. Either way there is no per-token
//! Python work. Hashing, matching and allocation run with the GIL released,
//! except a small call (up to `SMALL_TOKENS` tokens) that finds the
//! manager's lock free: it keeps the GIL, which costs less than releasing
//! it (see `PyKVCacheManager::run`).

use std::ops::Deref;
use std::sync::{Mutex, MutexGuard, TryLockError};

use imp_mem_core::kv::{
    BlockHash, BlockIo, ExtraKeys, FakeBlockIo, IdSource, KVCacheManager, KvConfig, KvStats,
    MmSpan, DEFAULT_HASH_SEED,
};
use imp_mem_core::Backend;
use imp_mem_cuda::CudaBlockIo;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::backend::{PyBackend, PyFakeBackend};
use crate::buffer::{self, BufferView, WordView};
use crate::convert;
use crate::errors::{invalid, IntoPyResult};
use crate::ndarray;

static MEMORYVIEW: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
static ARRAY: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

fn out_of_range(v: i128) -> PyErr {
    invalid(format!("token id {v} is outside 0..=4294967295"))
}

/// Refuses int32 ids read as `u32` that were negative, naming the first.
/// The check is one branch-free pass (it vectorises); only a bad id is
/// looked for.
fn check_int32(ids: &[u32]) -> PyResult<()> {
    if ids.iter().fold(0u32, |acc, &v| acc | v) > i32::MAX as u32 {
        if let Some(&v) = ids.iter().find(|&&v| v > i32::MAX as u32) {
            return Err(out_of_range(v as i32 as i128));
        }
    }
    Ok(())
}

/// Reinterprets integers of `size` bytes (little- or big-endian) as token
/// ids, refusing any outside `0..=u32::MAX`.
fn ids_from_bytes(bytes: &[u8], size: usize, signed: bool, big: bool) -> PyResult<Vec<u32>> {
    let bad = out_of_range;
    // Little-endian integers of every size. Each is a loop over a zeroed
    // vector (it vectorises; a collect over the chunks did not) and a
    // branch-free check; only a bad id is looked for. (Signed 1- and 2-byte
    // ids are sign-extended, so the int32 check finds a negative one.)
    if !big {
        match (size, signed) {
            (4, _) => {
                let mut out = vec![0u32; bytes.len() / 4];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes(c.try_into().unwrap_or([0; 4]));
                }
                if signed {
                    check_int32(&out)?;
                }
                return Ok(out);
            }
            (1, _) => {
                let mut out = vec![0u32; bytes.len()];
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = if signed { b as i8 as u32 } else { u32::from(b) };
                }
                if signed {
                    check_int32(&out)?;
                }
                return Ok(out);
            }
            (2, _) => {
                let mut out = vec![0u32; bytes.len() / 2];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    let v = u16::from_le_bytes(c.try_into().unwrap_or([0; 2]));
                    *o = if signed {
                        v as i16 as u32
                    } else {
                        u32::from(v)
                    };
                }
                if signed {
                    check_int32(&out)?;
                }
                return Ok(out);
            }
            (8, _) => {
                // One pass: narrow each id and gather its high halves.
                let mut out = vec![0u32; bytes.len() / 8];
                let mut high = 0u64;
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                    let v = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
                    high |= v >> 32;
                    *o = v as u32;
                }
                if high != 0 {
                    let v = bytes
                        .chunks_exact(8)
                        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                        .map(|v| if signed { v as i64 as i128 } else { v as i128 })
                        .find(|&v| !(0..=u32::MAX as i128).contains(&v))
                        .unwrap_or(-1);
                    return Err(bad(v));
                }
                return Ok(out);
            }
            _ => {}
        }
    }
    let mut out = Vec::with_capacity(bytes.len() / size);
    for chunk in bytes.chunks_exact(size) {
        let mut word = [0u8; 8];
        let u = if big {
            word[8 - size..].copy_from_slice(chunk);
            u64::from_be_bytes(word)
        } else {
            word[..size].copy_from_slice(chunk);
            u64::from_le_bytes(word)
        };
        let shift = 64 - 8 * size as u32;
        let v: i128 = if signed {
            ((u << shift) as i64 >> shift) as i128
        } else {
            u as i128
        };
        out.push(u32::try_from(v).map_err(|_| bad(v))?);
    }
    Ok(out)
}

/// `numpy.ndarray`, once NumPy has been imported by someone.
static NDARRAY: GILOnceCell<Py<PyAny>> = GILOnceCell::new();
/// NumPy dtypes seen so far and how to read them: `(itemsize, signed,
/// big-endian)`, `None` for a non-integer dtype. Holding each dtype keeps
/// its identity (the pointer compared) from being reused.
type DtypeLayout = Option<(usize, bool, bool)>;
static DTYPES: Mutex<Vec<(Py<PyAny>, DtypeLayout)>> = Mutex::new(Vec::new());

fn ndarray_type<'py>(py: Python<'py>) -> PyResult<Option<&'py Bound<'py, PyAny>>> {
    if let Some(t) = NDARRAY.get(py) {
        return Ok(Some(t.bind(py)));
    }
    let Some(numpy) = ndarray::loaded_numpy(py)? else {
        return Ok(None);
    };
    let t = numpy.getattr("ndarray")?.unbind();
    Ok(Some(NDARRAY.get_or_init(py, || t).bind(py)))
}

/// Token ids from an exact `numpy.ndarray` of integers: one `tobytes()` and
/// two attribute reads, the dtype's layout cached. `None` for anything
/// else (and for what the buffer path refuses, so its errors stay the same).
fn ndarray_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    let py = obj.py();
    let Some(ndarray) = ndarray_type(py)? else {
        return Ok(None);
    };
    if !obj.get_type().is(ndarray) {
        return Ok(None);
    }
    let dtype = obj.getattr(intern!(py, "dtype"))?;
    let known = {
        let cache = DTYPES.lock().unwrap_or_else(|p| p.into_inner());
        cache.iter().find(|(d, _)| d.is(&dtype)).map(|(_, l)| *l)
    };
    let layout = match known {
        Some(layout) => layout,
        None => {
            let kind: String = dtype.getattr(intern!(py, "kind"))?.extract()?;
            let size: usize = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
            let order: String = dtype.getattr(intern!(py, "byteorder"))?.extract()?;
            let big = match order.as_str() {
                ">" => true,
                "<" => false,
                _ => cfg!(target_endian = "big"),
            };
            let layout = match kind.as_str() {
                "i" | "u" if matches!(size, 1 | 2 | 4 | 8) => Some((size, kind == "i", big)),
                _ => None,
            };
            let mut cache = DTYPES.lock().unwrap_or_else(|p| p.into_inner());
            if cache.len() < 32 {
                cache.push((dtype.unbind(), layout));
            }
            layout
        }
    };
    let Some((size, signed, big)) = layout else {
        return Ok(None);
    };
    let ndim: usize = obj.getattr(intern!(py, "ndim"))?.extract()?;
    if ndim > 1 {
        return Ok(None);
    }
    let raw = obj.call_method0(intern!(py, "tobytes"))?;
    ids_from_bytes(raw.downcast::<PyBytes>()?.as_bytes(), size, signed, big).map(Some)
}

/// Token ids: borrowed in place from a held buffer export, or owned.
/// Derefs to `&[u32]`. It holds the GIL lifetime and is not `Send`, so a
/// call site takes the slice (`let ids: &[u32] = &toks;`) into
/// `allow_threads` and drops the `Tokens` afterwards, with the GIL.
pub enum Tokens<'a> {
    /// Native 4-byte ids read where the exporter keeps them.
    Borrowed(WordView<'a>),
    /// Native 4-byte ids read in place from a NumPy array (`ndarray.rs`).
    InPlace(&'a [u32]),
    /// Ids converted from a list, a tuple or any other integer buffer.
    Owned(Vec<u32>),
}

impl Deref for Tokens<'_> {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        match self {
            Tokens::Borrowed(words) => words,
            Tokens::InPlace(ids) => ids,
            Tokens::Owned(ids) => ids,
        }
    }
}

/// How to read a buffer's items as ids, from its struct-module `format` and
/// `itemsize`: `(itemsize, signed, big-endian)`, or the refusal.
fn int_layout(format: &str, itemsize: usize) -> PyResult<(usize, bool, bool)> {
    let (big, code) = match format.as_bytes() {
        [b'>' | b'!', c] => (true, *c),
        [b'<' | b'=' | b'@', c] | [c] => (cfg!(target_endian = "big"), *c),
        _ => (false, b'?'),
    };
    let signed = match code {
        b'b' | b'h' | b'i' | b'l' | b'q' | b'n' => true,
        b'B' | b'H' | b'I' | b'L' | b'Q' | b'N' => false,
        _ => {
            return Err(invalid(format!(
                "tokens must be integers; the buffer's format is {format:?}"
            )))
        }
    };
    if !matches!(itemsize, 1 | 2 | 4 | 8) {
        return Err(invalid(format!("unsupported integer size {itemsize}")));
    }
    Ok((itemsize, signed, big))
}

fn one_dimensional(ndim: usize) -> PyResult<()> {
    if ndim > 1 {
        return Err(invalid(format!(
            "tokens must be one-dimensional, got {ndim} dimensions"
        )));
    }
    Ok(())
}

/// Who checks that int32 ids read in place are not negative.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Int32Check {
    /// The reader, before it hands the ids over.
    Now,
    /// The manager, once it has hashed them (`IdSource::I32`): the prompt
    /// may be cold, and the hash requests its memory ahead of its work,
    /// where a check before it would wait for every line.
    Manager,
}

/// Token ids from a held C-contiguous export: borrowed when they are
/// native-endian 4-byte integers at an aligned address (signed ones checked
/// non-negative, or left to the manager), converted from the exporter's
/// memory otherwise.
fn view_tokens(view: BufferView<'_>, check: Int32Check) -> PyResult<(Tokens<'_>, IdSource)> {
    one_dimensional(view.ndim())?;
    let (size, signed, big) = int_layout(&view.format(), view.itemsize())?;
    let view = if size == 4 && big == cfg!(target_endian = "big") {
        match view.into_words() {
            Ok(words) => {
                let source = int32_source(&words, signed, check)?;
                return Ok((Tokens::Borrowed(words), source));
            }
            Err(view) => view,
        }
    } else {
        view
    };
    let ids = ids_from_bytes(view.bytes(), size, signed, big)?;
    Ok((Tokens::Owned(ids), IdSource::U32))
}

/// Checks 4-byte ids read in place now, or says what the manager must.
fn int32_source(ids: &[u32], signed: bool, check: Int32Check) -> PyResult<IdSource> {
    match (signed, check) {
        (false, _) => Ok(IdSource::U32),
        (true, Int32Check::Manager) => Ok(IdSource::I32),
        (true, Int32Check::Now) => check_int32(ids).map(|()| IdSource::U32),
    }
}

/// Reads token ids from a list/tuple of ints or any 1-D buffer of integers.
pub fn tokens<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<Tokens<'a>> {
    if let Some((ids, signed)) = ndarray::int32_ids(obj) {
        if signed {
            check_int32(ids)?;
        }
        return Ok(Tokens::InPlace(ids));
    }
    read_other_tokens(obj, Int32Check::Now).map(|(ids, _)| ids)
}

/// [`tokens`] of anything but a NumPy array the direct reader takes, with
/// the ids' [`IdSource`]: `I32` when they are int32s read in place and
/// `check` leaves them to `KVCacheManager::admit_from`.
fn read_other_tokens<'a>(
    obj: &'a Bound<'_, PyAny>,
    check: Int32Check,
) -> PyResult<(Tokens<'a>, IdSource)> {
    let py = obj.py();
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        // `array('q', seq)` converts in C, about 5x faster than extracting
        // each int here; it refuses non-integers and values beyond int64.
        let array = ARRAY.get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("array")?.getattr("array")?.unbind())
        })?;
        let packed = array.bind(py).call1(("q", obj)).map_err(|e| {
            invalid(format!(
                "tokens must be integers in 0..=4294967295 ({})",
                e.value(py)
            ))
        })?;
        let raw = packed.call_method0(intern!(py, "tobytes"))?;
        let ids = ids_from_bytes(raw.downcast::<PyBytes>()?.as_bytes(), 8, true, false)?;
        return Ok((Tokens::Owned(ids), IdSource::U32));
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(invalid(
            "tokens must be integers (a list, a NumPy array, array('i')), not str or bytes",
        ));
    }
    if let Some(view) = BufferView::get(obj) {
        return view_tokens(view, check);
    }
    // Before 3.11, or no C-contiguous export (a strided view, or no buffer
    // at all): the copying path reads or refuses it.
    if let Some(ids) = ndarray_tokens(obj)? {
        return Ok((Tokens::Owned(ids), IdSource::U32));
    }
    let memoryview = MEMORYVIEW.get_or_try_init(py, || {
        Ok::<_, PyErr>(py.import("builtins")?.getattr("memoryview")?.unbind())
    })?;
    let view = memoryview.bind(py).call1((obj,)).map_err(|_| {
        invalid(format!(
            "tokens must be a list of ints or a buffer of integers, got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let ndim: usize = view.getattr(intern!(py, "ndim"))?.extract()?;
    one_dimensional(ndim)?;
    let format = view.getattr(intern!(py, "format"))?;
    let format = format.downcast::<PyString>()?.to_cow()?;
    let itemsize: usize = view.getattr(intern!(py, "itemsize"))?.extract()?;
    let (size, signed, big) = int_layout(&format, itemsize)?;
    let raw = view.call_method0(intern!(py, "tobytes"))?;
    let ids = ids_from_bytes(raw.downcast::<PyBytes>()?.as_bytes(), size, signed, big)?;
    Ok((Tokens::Owned(ids), IdSource::U32))
}

/// A test hook's `enabled` argument: `True` or `False`, nothing else.
fn switch(enabled: &Bound<'_, PyAny>) -> PyResult<bool> {
    match enabled.downcast::<PyBool>() {
        Ok(b) => Ok(b.is_true()),
        Err(_) => Err(invalid(format!(
            "enabled must be True or False, got {}",
            enabled
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))),
    }
}

/// Test hook: reads int32/uint32 NumPy arrays straight from the array
/// (`True`, the default) or through the buffer protocol like any other
/// buffer (`False`); returns the previous setting.
#[pyfunction(name = "_set_numpy_direct")]
fn set_numpy_direct(enabled: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(ndarray::set_enabled(switch(enabled)?))
}

/// Test hook: whether int32/uint32 NumPy arrays are being read straight
/// from the array now (the hook on, NumPy imported, its self-check passed).
#[pyfunction(name = "_numpy_direct_active")]
fn numpy_direct_active(py: Python<'_>) -> bool {
    ndarray::active(py)
}

/// Test hook: reads buffers through the buffer protocol (`True`, the
/// default on Python 3.11+) or through the copying path every version has
/// (`False`); returns the previous setting. `True` before 3.11 is refused.
#[pyfunction(name = "_set_buffer_protocol")]
fn set_buffer_protocol(py: Python<'_>, enabled: &Bound<'_, PyAny>) -> PyResult<bool> {
    buffer::set_enabled(py, switch(enabled)?)
}

/// A request's extra keys, from the methods' keyword arguments.
#[inline(always)]
fn extras(
    lora_id: Option<u64>,
    cache_salt: Option<&Bound<'_, PyAny>>,
    mm: Option<&Bound<'_, PyAny>>,
) -> PyResult<ExtraKeys> {
    // Most requests have none: built in place, without the call (the keys
    // are 64 bytes, and each move of them through a `Result` cost the hot
    // path a store-forwarding stall).
    if cache_salt.is_none() && mm.is_none() {
        return Ok(ExtraKeys {
            lora_id,
            ..ExtraKeys::default()
        });
    }
    read_extras(lora_id, cache_salt, mm)
}

/// [`extras`] with a salt or multimodal items to read.
#[inline(never)]
fn read_extras(
    lora_id: Option<u64>,
    cache_salt: Option<&Bound<'_, PyAny>>,
    mm: Option<&Bound<'_, PyAny>>,
) -> PyResult<ExtraKeys> {
    let cache_salt = match cache_salt.filter(|s| !s.is_none()) {
        None => None,
        Some(s) => {
            if s.is_instance_of::<PyString>() {
                Some(convert::text(s, "cache_salt")?.into_bytes())
            } else if let Ok(b) = s.downcast::<PyBytes>() {
                Some(b.as_bytes().to_vec())
            } else {
                return Err(invalid("cache_salt must be str or bytes"));
            }
        }
    };
    let mut spans = Vec::new();
    if let Some(items) = mm.filter(|m| !m.is_none()) {
        let items = items.try_iter().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(format!(
                "mm must be an iterable of (start, end, content_hash) triples, got {}",
                convert::type_name(items)
            ))
        })?;
        for item in items {
            let (start, end, hash): (usize, usize, u128) = item?.extract().map_err(|_| {
                invalid("mm must be a sequence of (start, end, content_hash) integer triples")
            })?;
            if start >= end {
                return Err(invalid(format!("mm span [{start}, {end}) is empty")));
            }
            spans.push(MmSpan { start, end, hash });
        }
        spans.sort_by_key(|s| s.start);
    }
    Ok(ExtraKeys {
        lora_id,
        cache_salt,
        mm: spans,
    })
}

/// A request's extra keys and token ids. The extras are read first: that
/// may run Python code (an `mm` iterable), which must not run while the ids
/// are borrowed from the caller's array.
fn request<'a>(
    tokens: &'a Bound<'_, PyAny>,
    lora_id: Option<u64>,
    cache_salt: Option<&Bound<'_, PyAny>>,
    mm: Option<&Bound<'_, PyAny>>,
) -> PyResult<(ExtraKeys, Tokens<'a>)> {
    let extras = extras(lora_id, cache_salt, mm)?;
    Ok((extras, self::tokens(tokens)?))
}

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
    d.set_item("evictions", s.evictions)?;
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
    /// once: releasing and re-taking the GIL costs more than such a call's
    /// work. Anything else — large work, or a lock another thread holds —
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
            if small(&g) {
                return f(&mut g);
            }
        }
        py.allow_threads(|| f(&mut self.lock()))
    }

    /// Runs `f` under the manager's lock: at once, keeping the GIL, when the
    /// lock is free; otherwise it waits with the GIL released (a save, a
    /// load or a large admission in another thread may hold the lock), so
    /// no thread ever waits for the lock holding the GIL. Errors are
    /// converted by the caller, after the lock is released.
    fn with<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut KVCacheManager) -> R + Send) -> R {
        self.run(py, |_| true, f)
    }

    /// `admit`, shared by the method and its fast entry (`fastcall.rs`).
    pub(crate) fn admit_impl(
        &self,
        py: Python<'_>,
        seq_id: u64,
        tokens: &Bound<'_, PyAny>,
        lora_id: Option<u64>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        mm: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        // The extras first: reading them may run Python code (an `mm`
        // iterable), which must not run while the ids are borrowed. Then
        // int32 ids read in place are left for the manager to check once
        // it has hashed them (K21). A NumPy array is handed over without
        // the `Tokens` wrapper, which is large enough (a `Py_buffer`) that
        // moving it through a `Result` cost the hot path a stall.
        let extras = extras(lora_id, cache_salt, mm)?;
        if let Some((ids, signed)) = ndarray::int32_ids(tokens) {
            let source = int32_source(ids, signed, Int32Check::Manager)?;
            return self.admit_ids(py, seq_id, ids, source, extras);
        }
        let (toks, source) = read_other_tokens(tokens, Int32Check::Manager)?;
        self.admit_ids(py, seq_id, &toks, source, extras)
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
    ) -> PyResult<usize> {
        let n = ids.len();
        self.run(
            py,
            |_| n <= SMALL_TOKENS,
            |m| m.admit_from(seq_id, ids, source, extras),
        )
        .py()
        .map(|a| a.cached_tokens)
    }

    /// `append`, shared by the method and its fast entry.
    pub(crate) fn append_impl(
        &self,
        py: Python<'_>,
        seq_id: u64,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let toks = self::tokens(tokens)?;
        let ids: &[u32] = &toks;
        let n = ids.len();
        self.run(py, |_| n <= SMALL_TOKENS, |m| m.append(seq_id, ids))
            .py()
    }

    /// `free` (and `abort`: nothing computed), shared by the methods and
    /// their fast entries.
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

/// How block contents travel for persistence on `backend`: a host copy on
/// the fake, device -> pinned host -> file on a GPU; `None` for a backend
/// with neither.
pub(crate) fn block_io(backend: &Bound<'_, PyAny>, block_bytes: usize) -> Option<Box<dyn BlockIo>> {
    if let Ok(fake) = backend.downcast::<PyFakeBackend>() {
        Some(Box::new(FakeBlockIo::new(
            fake.get().fake.clone(),
            block_bytes,
        )))
    } else if let Ok(cuda) = backend.downcast::<crate::cuda::PyCudaBackend>() {
        Some(Box::new(CudaBlockIo::new(
            cuda.get().context(),
            block_bytes,
        )))
    } else if let Ok(vmm) = backend.downcast::<crate::cuda::PyVmmBackend>() {
        Some(Box::new(CudaBlockIo::new(vmm.get().context(), block_bytes)))
    } else {
        None
    }
}

#[pymethods]
impl PyKVCacheManager {
    #[new]
    #[pyo3(
        signature = (
            num_blocks, block_size, *, backend = None, block_bytes = None, swa_blocks = None,
            swa_window = None, swa_block_bytes = None, enable_prefix_caching = None,
            hash_seed = None, pin_budget = None, model_fingerprint = None, dtype = None,
            layout = None
        ),
        text_signature = "(num_blocks, block_size, *, backend=None, block_bytes=0, \
            swa_blocks=0, swa_window=0, swa_block_bytes=0, enable_prefix_caching=True, \
            hash_seed=None, pin_budget=None, model_fingerprint='', dtype='', layout='')"
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
        cfg.enable_prefix_caching = convert::opt(
            enable_prefix_caching,
            "enable_prefix_caching",
            convert::flag,
        )?
        .unwrap_or(true);
        cfg.hash_seed =
            convert::opt(hash_seed, "hash_seed", convert::u64_arg)?.unwrap_or(DEFAULT_HASH_SEED);
        if let Some(b) = convert::opt(pin_budget, "pin_budget", convert::u32_arg)? {
            cfg.pin_budget = b;
        }
        let text = |v, what| convert::opt(v, what, convert::text).map(Option::unwrap_or_default);
        cfg.model_fingerprint = text(model_fingerprint, "model_fingerprint")?;
        cfg.dtype = text(dtype, "dtype")?;
        cfg.layout = text(layout, "layout")?;
        let block_bytes = cfg.block_bytes;
        let backend = backend.filter(|b| !b.is_none());
        let core: Option<Backend> = match backend {
            Some(b) => Some(
                b.downcast::<PyBackend>()
                    .map_err(|_| {
                        pyo3::exceptions::PyTypeError::new_err(format!(
                            "backend must be an imp_mem Backend (FakeBackend, CudaBackend, \
                             VmmBackend) or None, got {}",
                            convert::type_name(b)
                        ))
                    })?
                    .get()
                    .inner
                    .clone(),
            ),
            None => None,
        };
        let mut m = KVCacheManager::new(cfg, core.as_ref()).py()?;
        if let (Some(b), true) = (backend, block_bytes > 0) {
            if let Some(io) = block_io(b, block_bytes) {
                m.set_block_io(io).py()?;
            }
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
        let lora_id = lora(lora_id)?;
        self.admit_impl(py, seq_id, tokens, lora_id, cache_salt, mm)
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
        let (extras, toks) = request(tokens, lora(lora_id)?, cache_salt, mm)?;
        let ids: &[u32] = &toks;
        Ok(py.allow_threads(|| self.lock().can_admit(ids, &extras)))
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
        let (extras, toks) = request(tokens, lora(lora_id)?, cache_salt, mm)?;
        let ids: &[u32] = &toks;
        Ok(py.allow_threads(|| self.lock().probe(ids, &extras)) * self.block_size)
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
        let (extras, toks) = request(tokens, lora(lora_id)?, cache_salt, mm)?;
        let ids: &[u32] = &toks;
        let raw = py.allow_threads(|| {
            let hasher = self.lock().hasher().clone();
            let hashes = hasher.chain(ids, &extras);
            let mut raw = Vec::with_capacity(hashes.len() * 16);
            for h in hashes {
                raw.extend_from_slice(&h.to_le_bytes());
            }
            raw
        });
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
        let (extras, toks) = request(tokens, lora(lora_id)?, cache_salt, mm)?;
        let ids: &[u32] = &toks;
        py.allow_threads(|| self.lock().pin(owner, ids, &extras))
            .py()
    }

    /// Drops every pin of `owner`; returns the pins dropped.
    fn unpin(&self, py: Python<'_>, owner: &Bound<'_, PyAny>) -> PyResult<u32> {
        let owner = convert::u64_arg(owner, "owner")?;
        Ok(self.with(py, |m| m.unpin(owner)))
    }

    /// Evicts up to `n` least recently used cached blocks; returns how many.
    fn evict(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<u32> {
        let n = convert::u32_arg(n, "n")?;
        Ok(self.with(py, |m| m.evict(n)))
    }

    /// Writes the prefix cache to `path` (str, bytes or os.PathLike)
    /// atomically; returns entries written. The cache is snapshotted under
    /// the manager's lock and written without it, so other calls proceed
    /// during the write.
    fn save_prefix_cache(&self, py: Python<'_>, path: &Bound<'_, PyAny>) -> PyResult<u64> {
        let path = convert::path(path, "path")?;
        py.allow_threads(|| {
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
        py.allow_threads(|| {
            let target = self.lock().load_target()?;
            let file = target.verify(&path)?;
            let reserved = self.lock().reserve_load(file);
            let mut pending = reserved?;
            pending.copy_in()?;
            let loaded = self.lock().finish_load(pending);
            loaded
        })
        .py()
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

/// A sequence id.
fn seq(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    convert::u64_arg(value, "seq_id")
}

/// An optional LoRA id.
fn lora(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    convert::opt(value, "lora_id", convert::u64_arg)
}

/// A token or block count.
fn count(value: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    convert::usize_arg(value, what)
}

/// Registers this file's classes.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKVCacheManager>()?;
    crate::fastcall::install(&m.py().get_type::<PyKVCacheManager>())?;
    m.add_function(wrap_pyfunction!(crate::fastcall::fastcall_original, m)?)?;
    m.add_function(wrap_pyfunction!(set_buffer_protocol, m)?)?;
    m.add_function(wrap_pyfunction!(set_numpy_direct, m)?)?;
    m.add_function(wrap_pyfunction!(numpy_direct_active, m)?)?;
    Ok(())
}

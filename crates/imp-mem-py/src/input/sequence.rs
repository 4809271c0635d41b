//! Token ids read straight out of a list or tuple of Python ints, in one
//! pass with no intermediate object (they used to go through `array('q')`
//! and `tobytes()`, 8x the NumPy path's time on `bench_kv.py`'s churn).
//!
//! Three loops, each falling back to the next:
//!
//! * the direct loop reads the sequence's item array and each exact
//!   `int`'s value from their C structs: a list's `ob_item` pointer, a
//!   tuple's inline items, an int's header word and first 30-bit digit
//!   (the header is the signed digit count up to 3.11, `lv_tag` — the
//!   count over three flag bits — from 3.12). None of that is in the
//!   limited API, but none of it changes within a CPython version, so the
//!   loop is turned on only for CPython 3.11 (the wheel's floor) to 3.14
//!   with 30-bit digits, and only after a self-check on objects it builds
//!   agrees with what the API reads (the scheme of `ndarray.rs`). An int
//!   of one digit (below 2^30: every real vocabulary) is read in place, any
//!   other through
//!   `PyLong_AsLongLongAndOverflow`. `_core._set_list_direct(False)` turns
//!   the loop off, so the tests run it and the next;
//! * the API loop takes the items by index (`PyList_GetItem` /
//!   `PyTuple_GetItem`, borrowed) and reads each exact `int` with
//!   `PyLong_AsLongLongAndOverflow`, all in the limited API, at about three
//!   times the direct loop's cost an item (two calls into libpython).
//!
//!   Neither runs Python code (an exact int is read without calling into
//!   Python), so the sequence cannot change under them. Both narrow each
//!   value to `u32` and gather the high bits (`IdNarrower`), testing the
//!   range once at the end;
//! * the careful loop: the first item that is not an exact int, one beyond
//!   `i64`, or a failed range test sends the whole sequence here, read
//!   again from the start applying the core's rule
//!   (`kv::tokens::item_id`) to each item: a bool (`numpy.bool_` too) is
//!   refused, as a NumPy bool array is; an `int` subclass is read as its
//!   value; any other object is taken as `operator.index` gives it (a NumPy
//!   integer scalar); the first bad item is named. It runs Python code
//!   (`__index__`), so it re-reads the length at each item and holds its
//!   own reference to each.
//!
//! All run with the GIL held, as they must; the ids come out owned.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyInt, PyList, PyTuple};

use imp_mem_core::kv::tokens::{self as rule, IdNarrower, TokenItem};

use crate::convert::type_name;
use crate::errors::IntoPyResult;

/// The leading fields of CPython's `PyListObject` (3.x).
#[repr(C)]
struct ListHead {
    ob_base: ffi::PyVarObject,
    ob_item: *mut *mut ffi::PyObject,
}

/// The leading fields of CPython's `PyLongObject`: the header word (signed
/// digit count, or `lv_tag`) and the first digit.
#[repr(C)]
struct LongHead {
    ob_base: ffi::PyObject,
    header: usize,
    digit0: u32,
}

/// How this interpreter's ints and tuples are laid out.
#[derive(Clone, Copy)]
struct Layout {
    /// 3.12+: the header word is `lv_tag`.
    tagged: bool,
    /// Byte offset of a tuple's first item: right after the header, or
    /// after the cached hash that newer versions keep there (3.14), as the
    /// self-check found.
    tuple_items: usize,
}

impl Layout {
    /// The value of an exact int when it is zero or one positive digit,
    /// read in place.
    ///
    /// # Safety
    /// `int` is a live exact `int` of this interpreter, the GIL held.
    #[inline(always)]
    unsafe fn small_int(self, int: *mut ffi::PyObject) -> Option<u32> {
        let head = int as *const LongHead;
        // SAFETY: an exact int begins with the header word; the digit is
        // read only when the header says there is one.
        unsafe {
            let header = (*head).header;
            let one_digit = if self.tagged {
                // Digit count << 3 | bit 2 (reserved for an immortality
                // flag, ignored) | sign (0 positive, 1 zero, 2 negative).
                match header & !4 {
                    8 => true,
                    1 => return Some(0),
                    _ => false,
                }
            } else {
                // The signed digit count.
                match header as isize {
                    1 => true,
                    0 => return Some(0),
                    _ => false,
                }
            };
            one_digit.then(|| (*head).digit0)
        }
    }
}

/// Set once, on the first list read: `None` when the interpreter is not
/// one whose layout is known or the self-check failed.
static LAYOUT: PyOnceLock<Option<Layout>> = PyOnceLock::new();
/// The test hook's switch.
static ENABLED: AtomicBool = AtomicBool::new(true);

fn layout(py: Python<'_>) -> Option<Layout> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    *LAYOUT.get_or_init(py, || build(py).ok().flatten())
}

/// The layout for this interpreter, if it is CPython 3.11–3.14 with 30-bit
/// digits and the self-check passes.
fn build(py: Python<'_>) -> PyResult<Option<Layout>> {
    let sys = py.import("sys")?;
    let name: String = sys.getattr("implementation")?.getattr("name")?.extract()?;
    let (major, minor): (u32, u32) = sys
        .getattr("version_info")?
        .get_item(0)?
        .extract()
        .and_then(|m| Ok((m, sys.getattr("version_info")?.get_item(1)?.extract()?)))?;
    let info = sys.getattr("int_info")?;
    let bits: u32 = info.getattr("bits_per_digit")?.extract()?;
    let digit: u32 = info.getattr("sizeof_digit")?.extract()?;
    if name != "cpython" || major != 3 || !(11..=14).contains(&minor) || bits != 30 || digit != 4 {
        return Ok(None);
    }
    self_check(py, minor >= 12)
}

/// Reads ints, a list and a tuple built here both ways and compares; the
/// layout when all agree.
fn self_check(py: Python<'_>, tagged: bool) -> PyResult<Option<Layout>> {
    let mut layout = Layout {
        tagged,
        tuple_items: std::mem::size_of::<ffi::PyVarObject>(),
    };
    let int_type = std::ptr::addr_of_mut!(ffi::PyLong_Type);
    // Fresh objects (parsed from text, not constants), small cached ones
    // among them.
    let text = "0 1 5 255 256 257 1000 50000 1048579 1073741823 \
                1073741824 2147483648 4294967295 4294967296 4611686018427387904 \
                18446744073709551616 -1 -5 -1073741824 -1099511627776";
    let int = py.import("builtins")?.getattr("int")?;
    let mut values = Vec::new();
    for word in text.split_whitespace() {
        let value: i128 = word.parse().unwrap_or(-1);
        let obj = int.call1((word,))?;
        // SAFETY: `obj` is live; its type pointer is in the stable ABI's
        // header.
        if unsafe { ffi::Py_TYPE(obj.as_ptr()) } != int_type {
            return Ok(None);
        }
        // SAFETY: `obj` is a live exact int and the GIL is held. The
        // header word is read before the digit, and the digit only for a
        // header that says one.
        let read = unsafe { layout.small_int(obj.as_ptr()) };
        let single = (0..1 << 30).contains(&value);
        match read {
            Some(v) if single && i128::from(v) == value => {}
            None if !single => {}
            _ => return Ok(None),
        }
        values.push(obj);
    }
    // A list and a tuple of those ints: the item arrays must hold them.
    let list = PyList::new(py, &values)?;
    let tuple = PyTuple::new(py, &values)?;
    // SAFETY: `list` is a live exact list: its object begins with
    // `ListHead` (CPython 3.x). Its item array is read only after its
    // size field agrees with `len()`.
    let list_ok = unsafe {
        let head = list.as_ptr() as *const ListHead;
        (*head).ob_base.ob_size as usize == values.len()
            && values
                .iter()
                .enumerate()
                .all(|(i, v)| *(*head).ob_item.add(i) == v.as_ptr())
    };
    // The tuple's items right after its header, or one word later. All
    // but the last are compared at each place: that many words end inside
    // a tuple of this length in either layout.
    let header = std::mem::size_of::<ffi::PyVarObject>();
    let at = |offset: usize| {
        // SAFETY: `tuple` is a live exact tuple of `values.len()` items, so
        // at least `header + 8 * len` bytes long; the words read end at
        // `offset + 8 * (len - 1)`, at most `header + 8 * len`.
        unsafe {
            let items = tuple.as_ptr().cast::<u8>().add(offset) as *const *mut ffi::PyObject;
            (0..values.len() - 1).all(|i| *items.add(i) == values[i].as_ptr())
        }
    };
    let Some(offset) = [header, header + 8].into_iter().find(|&o| at(o)) else {
        return Ok(None);
    };
    if !list_ok {
        return Ok(None);
    }
    layout.tuple_items = offset;
    // And the loop itself: single digits read in place, larger ints
    // through the API, a negative one refused.
    let expected: Vec<u32> = [0, 1, 5, 255, 256, 257, 1000, 50000, 1048579, 1073741823]
        .into_iter()
        .chain([1073741824, 2147483648, 4294967295])
        .collect();
    let good = PyList::new(py, &values[..expected.len()])?;
    let good_tuple = PyTuple::new(py, &values[..expected.len()])?;
    let agrees = direct_ints(&good, true, layout).as_deref() == Some(&expected[..])
        && direct_ints(&good_tuple, false, layout).as_deref() == Some(&expected[..])
        && direct_ints(&list, true, layout).is_none();
    Ok(agrees.then_some(layout))
}

/// Turns the direct loop on or off (a test hook); returns whether it was on.
#[pyfunction(name = "_set_list_direct")]
fn set_list_direct(enabled: &Bound<'_, PyAny>) -> PyResult<bool> {
    let on = super::switch(enabled)?;
    Ok(ENABLED.swap(on, Ordering::Relaxed))
}

/// Whether lists and tuples are read by the direct loop now (the hook on,
/// the interpreter known, its self-check passed).
#[pyfunction(name = "_list_direct_active")]
fn list_direct_active(py: Python<'_>) -> bool {
    layout(py).is_some()
}

/// Registers the test hooks.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_list_direct, m)?)?;
    m.add_function(wrap_pyfunction!(list_direct_active, m)?)?;
    Ok(())
}

/// Ids this many or fewer are kept inline: an append's one token, or a
/// speculative step's few, allocate nothing.
const INLINE: usize = 16;

/// Token ids read from a list or tuple: inline when few, else on the heap.
/// Derefs to `&[u32]`.
pub enum Ids {
    /// Up to [`INLINE`] ids, the first `len` of `ids`.
    Inline {
        /// How many of `ids` are ids.
        len: usize,
        /// The ids, zeros after `len`.
        ids: [u32; INLINE],
    },
    /// More ids.
    Heap(Vec<u32>),
}

impl Ids {
    fn zeroed(len: usize) -> Self {
        if len <= INLINE {
            Ids::Inline {
                len,
                ids: [0; INLINE],
            }
        } else {
            Ids::Heap(vec![0; len])
        }
    }
}

impl Deref for Ids {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        match self {
            Ids::Inline { len, ids } => &ids[..*len],
            Ids::Heap(ids) => ids,
        }
    }
}

impl DerefMut for Ids {
    fn deref_mut(&mut self) -> &mut [u32] {
        match self {
            Ids::Inline { len, ids } => &mut ids[..*len],
            Ids::Heap(ids) => ids,
        }
    }
}

/// Token ids from `obj` when it is a list or a tuple (subclasses too);
/// `None` for anything else.
pub fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Option<Ids>> {
    let list = if obj.is_instance_of::<PyList>() {
        true
    } else if obj.is_instance_of::<PyTuple>() {
        false
    } else {
        return Ok(None);
    };
    let fast = match layout(obj.py()) {
        Some(layout) => direct_ints(obj, list, layout),
        None => api_ints(obj, list),
    };
    match fast {
        Some(ids) => Ok(Some(ids)),
        None => careful(obj).map(|ids| Some(Ids::Heap(ids))),
    }
}

/// An exact int's value through the API, `None` beyond `i64`.
///
/// # Safety
/// `int` is a live exact `int`, the GIL held.
#[inline(always)]
unsafe fn api_int(int: *mut ffi::PyObject) -> Option<i64> {
    let mut overflow = 0;
    // SAFETY: an exact int's value is read without calling Python code;
    // with `overflow` zero the call cannot have failed.
    let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(int, &mut overflow) };
    (overflow == 0).then_some(v)
}

/// The direct loop: the ids when every item is an exact `int` in range,
/// `None` at the first item that is not.
#[inline]
fn direct_ints(seq: &Bound<'_, PyAny>, list: bool, layout: Layout) -> Option<Ids> {
    let ptr = seq.as_ptr();
    // SAFETY: `ptr` is a live list (or tuple, as `list` says; subclasses
    // share the layout), the GIL is held, and `layout` was checked against
    // this interpreter: a list's head is `ListHead`, a tuple's items start
    // `tuple_items` bytes in, and both hold `ob_size` live items.
    let (items, len) = unsafe {
        let len = (*(ptr as *const ffi::PyVarObject)).ob_size;
        if list {
            let head = ptr as *const ListHead;
            ((*head).ob_item as *const *mut ffi::PyObject, len)
        } else {
            let items = ptr.cast::<u8>().add(layout.tuple_items);
            (items as *const *mut ffi::PyObject, len)
        }
    };
    let int_type = std::ptr::addr_of_mut!(ffi::PyLong_Type);
    narrow_all(len, |i| {
        // SAFETY: `i` is below the length read above, which holds: nothing
        // in this loop runs Python code or releases the GIL, so no one can
        // resize the sequence or drop an item. Each item is a live object
        // (a list or tuple that Python code can hand over holds no null,
        // as CPython's own `PyList_GET_ITEM` readers assume), read through
        // its stable-ABI header; `small_int` and `api_int` see only exact
        // ints.
        unsafe {
            let item = *items.add(i);
            if ffi::Py_TYPE(item) != int_type {
                return None;
            }
            match layout.small_int(item) {
                Some(v) => Some(i64::from(v)),
                None => api_int(item),
            }
        }
    })
}

/// The API loop: [`direct_ints`] through the limited API alone.
#[inline]
fn api_ints(seq: &Bound<'_, PyAny>, list: bool) -> Option<Ids> {
    let ptr = seq.as_ptr();
    // SAFETY: `ptr` is a live list (or tuple, as `list` says), checked by
    // the caller, and the GIL is held.
    let len = unsafe {
        if list {
            ffi::PyList_Size(ptr)
        } else {
            ffi::PyTuple_Size(ptr)
        }
    };
    let int_type = std::ptr::addr_of_mut!(ffi::PyLong_Type);
    narrow_all(len, |i| {
        // SAFETY: `i` is below the length read above, which holds: nothing
        // in this loop runs Python code or releases the GIL. The item is
        // borrowed from the sequence, which the caller holds, and used
        // before the next call; a non-null one is live, its type pointer in
        // the stable ABI's header, and `api_int` sees only exact ints.
        unsafe {
            let item = if list {
                ffi::PyList_GetItem(ptr, i as ffi::Py_ssize_t)
            } else {
                ffi::PyTuple_GetItem(ptr, i as ffi::Py_ssize_t)
            };
            if item.is_null() || ffi::Py_TYPE(item) != int_type {
                return None;
            }
            api_int(item)
        }
    })
}

/// The ids `read` gives for items `0..len` of a sequence whose length is
/// `len` (negative: none), narrowed with one range test at the end;
/// `None` when `read` gives up on one or the test fails.
#[inline(always)]
fn narrow_all(len: ffi::Py_ssize_t, mut read: impl FnMut(usize) -> Option<i64>) -> Option<Ids> {
    let len = usize::try_from(len).ok()?;
    let mut out = Ids::zeroed(len);
    let mut narrow = IdNarrower::default();
    for (i, o) in out.iter_mut().enumerate() {
        *o = narrow.narrow(read(i)?);
    }
    narrow.in_range().then_some(out)
}

/// The careful loop: every item through the core's rule, the first bad one
/// named.
#[cold]
fn careful(seq: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        // The length is read again at each item: `__index__` may have
        // changed the sequence.
        let item = if let Ok(list) = seq.cast::<PyList>() {
            if i >= list.len() {
                break;
            }
            list.get_item(i)?
        } else {
            let tuple = seq.cast::<PyTuple>()?;
            if i >= tuple.len() {
                break;
            }
            tuple.get_item(i)?
        };
        out.push(one_id(i, &item)?);
        i += 1;
    }
    Ok(out)
}

/// Item `index` of a sequence of ids, by the core's rule.
fn one_id(index: usize, item: &Bound<'_, PyAny>) -> PyResult<u32> {
    let py = item.py();
    if item.is_exact_instance_of::<PyBool>() {
        return rule::item_id(index, TokenItem::Bool).py();
    }
    let int = match item.cast::<PyInt>() {
        Ok(int) => int.clone(),
        Err(_) if is_numpy_bool(item)? => {
            // Older NumPy gives its bools an `__index__`; refused all the
            // same, as their arrays are.
            return rule::item_id(index, TokenItem::Bool).py();
        }
        Err(_) => {
            // SAFETY: `item` is live and the GIL is held; `PyNumber_Index`
            // returns a new reference or null with the error set, which
            // `from_owned_ptr_or_err` takes over.
            let index_of =
                unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyNumber_Index(item.as_ptr())) };
            match index_of {
                Ok(int) => int.cast_into::<PyInt>()?,
                Err(e) if e.is_instance_of::<PyTypeError>(py) => {
                    let name = type_name(item);
                    return rule::item_id(index, TokenItem::NotInteger(&name)).py();
                }
                Err(e) => return Err(e),
            }
        }
    };
    match int.extract::<i64>() {
        Ok(v) => rule::item_id(index, TokenItem::Int(v)).py(),
        Err(_) => {
            // Beyond i64: named in decimal, or by its size where Python
            // refuses to print that many digits.
            let text = match int.str() {
                Ok(s) => s.to_string(),
                Err(_) => {
                    let bits = int
                        .call_method0("bit_length")
                        .and_then(|b| b.extract::<u64>())
                        .unwrap_or(0);
                    format!("of {bits} bits")
                }
            };
            rule::item_id(index, TokenItem::Huge(&text)).py()
        }
    }
}

/// True when `obj` is a `numpy.bool_` (NumPy is looked up, never imported).
fn is_numpy_bool(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    match super::ndarray::loaded_numpy(obj.py())? {
        Some(numpy) => obj.is_instance(&numpy.getattr("bool_")?),
        None => Ok(false),
    }
}

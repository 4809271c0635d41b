//! Vectorcall entries for the KV manager's per-request methods.
//!
//! The wheel is built for abi3-py39, where pyo3 generates `METH_VARARGS`
//! methods: every call packs its arguments into a fresh tuple (and a dict
//! for keywords) that pyo3 then unpacks. `METH_FASTCALL` — arguments passed
//! as a C array — joined the stable ABI in Python 3.10. On a 3.10+
//! interpreter, [`install`] replaces `KVCacheManager.admit`, `.free`,
//! `.abort` and `.append` (once per decode step) with method descriptors
//! (`PyDescr_NewMethod`, stable ABI) whose C functions take that array.
//! They handle the calls an engine makes per request and per step —
//! positional `seq_id` and `tokens`, the keywords each method documents —
//! and run the very code the pyo3 methods run (`admit_impl`, `free_impl`,
//! `append_impl`). Any call they do not handle (a keyword they do not know,
//! an argument count or type pyo3 would refuse) is handed to the original
//! pyo3 method, so every error message stays pyo3's own. On 3.9, or if the
//! type refuses the new attributes, the pyo3 methods stay.

use std::ffi::{c_int, CString};

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyInt, PyString, PyTuple, PyType};
use pyo3::{intern, Borrowed};

use crate::errors::invalid;
use crate::kv::PyKVCacheManager;

/// `METH_FASTCALL` (stable from 3.10; pyo3-ffi declares it only for 3.10+
/// builds).
const METH_FASTCALL: c_int = 0x0080;

/// The C signature of a `METH_FASTCALL | METH_KEYWORDS` function.
type FastWithKeywords = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

/// The methods replaced, in the order of the indices below.
const METHODS: [&str; 4] = ["admit", "free", "abort", "append"];
const ADMIT: usize = 0;
const FREE: usize = 1;
const ABORT: usize = 2;
const APPEND: usize = 3;

/// The pyo3 methods replaced, for the calls the fast entries hand back.
static ORIGINALS: GILOnceCell<[Py<PyAny>; METHODS.len()]> = GILOnceCell::new();

/// Replaces the methods of [`METHODS`] on `cls` (the `KVCacheManager` type)
/// when the interpreter is 3.10 or later. Does nothing, and keeps pyo3's
/// methods, otherwise or if anything is refused.
pub fn install(cls: &Bound<'_, PyType>) -> PyResult<()> {
    let py = cls.py();
    if py.version_info() < (3, 10) || ORIGINALS.get(py).is_some() {
        return Ok(());
    }
    let entries: [FastWithKeywords; METHODS.len()] =
        [admit_entry, free_entry, abort_entry, append_entry];
    let dict = cls.getattr("__dict__")?;
    let mut originals = Vec::with_capacity(METHODS.len());
    let mut descriptors = Vec::with_capacity(METHODS.len());
    for (name, entry) in METHODS.into_iter().zip(entries) {
        let original = dict.get_item(name)?;
        let doc = original
            .getattr("__doc__")?
            .extract::<Option<String>>()?
            .unwrap_or_default();
        let signature = original
            .getattr("__text_signature__")?
            .extract::<Option<String>>()?;
        descriptors.push(descriptor(cls, name, entry, &doc, signature.as_deref())?);
        originals.push(original.unbind());
    }
    let Ok(originals) = <[Py<PyAny>; METHODS.len()]>::try_from(originals) else {
        return Ok(());
    };
    let _ = ORIGINALS.set(py, originals);
    for (name, descr) in METHODS.into_iter().zip(descriptors) {
        if cls.setattr(name, descr).is_err() {
            // An immutable type: pyo3's methods stay (whichever were set
            // already behave the same).
            return Ok(());
        }
    }
    Ok(())
}

/// Test hook: pyo3's own method `name` (one of [`METHODS`]) when a fast
/// entry replaced it, else `None`; the tests call both and compare.
#[pyfunction(name = "_fastcall_original")]
pub fn fastcall_original(py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<Option<PyObject>> {
    let Ok(name) = name.downcast::<PyString>() else {
        return Err(invalid(format!(
            "name must be a method name (str), got {}",
            name.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        )));
    };
    let name = name.to_cow()?;
    let Some(which) = METHODS.iter().position(|m| *m == name) else {
        return Ok(None);
    };
    Ok(ORIGINALS.get(py).map(|o| o[which].clone_ref(py)))
}

/// A method descriptor of `cls` for `entry`, documented like the original
/// (`name(signature)\n--\n\n` is how `inspect` finds the signature).
fn descriptor<'py>(
    cls: &Bound<'py, PyType>,
    name: &str,
    entry: FastWithKeywords,
    doc: &str,
    signature: Option<&str>,
) -> PyResult<Bound<'py, PyAny>> {
    let full_doc = match signature {
        Some(sig) => format!("{name}{sig}\n--\n\n{doc}"),
        None => doc.to_owned(),
    };
    let c = |s: String| {
        CString::new(s).map_err(|_| PyTypeError::new_err("a method name or doc holds a NUL byte"))
    };
    // The definition must outlive the type, which lives as long as the
    // module: leaked once per method per process (`install` runs once).
    let def = Box::leak(Box::new(ffi::PyMethodDef {
        ml_name: c(name.to_owned())?.into_raw(),
        ml_meth: ffi::PyMethodDefPointer {
            // SAFETY: CPython calls `ml_meth` with the signature `ml_flags`
            // names (`METH_FASTCALL | METH_KEYWORDS`), which is `entry`'s;
            // the union's field type is only how the pointer is stored.
            PyCFunction: unsafe {
                std::mem::transmute::<FastWithKeywords, ffi::PyCFunction>(entry)
            },
        },
        ml_flags: METH_FASTCALL | ffi::METH_KEYWORDS,
        ml_doc: c(full_doc)?.into_raw(),
    }));
    // SAFETY: the GIL is held; `cls` is a live type object and `def` a
    // valid, never-freed method definition (`METH_FASTCALL` is stable ABI
    // on the 3.10+ interpreters `install` admits).
    unsafe {
        Bound::from_owned_ptr_or_err(cls.py(), ffi::PyDescr_NewMethod(cls.as_ptr().cast(), def))
    }
}

/// The fast path's verdict: done (a result or a Python error of the call
/// itself), or not for it (hand the call to pyo3's method).
enum Fast<T> {
    Done(PyResult<T>),
    Pass,
}

/// The fast path for one call, or the original method for a call it
/// passes on. Runs inside pyo3's own trampoline (`entry!`), which counts the
/// GIL as held for pyo3 and turns a panic into `PanicException`, exactly as
/// for the methods pyo3 generates.
///
/// # Safety
/// Called only through a `METH_FASTCALL | METH_KEYWORDS` entry: the GIL is
/// held, `slf` is a live object, `args` holds `nargs` positional then
/// `len(kwnames)` keyword values, and `kwnames` is null or a tuple of str.
unsafe fn dispatch(
    which: usize,
    py: Python<'_>,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
    fast: FastPath,
) -> PyResult<*mut ffi::PyObject> {
    // SAFETY: the contract above.
    let (positional, keywords) = unsafe { arguments(py, args, nargs, kwnames) };
    // SAFETY: `slf` is a live object (the descriptor's instance).
    let this = unsafe { Borrowed::from_ptr(py, slf) };
    if let Ok(m) = this.downcast::<PyKVCacheManager>() {
        if let Fast::Done(result) = fast(py, m, &positional, &keywords) {
            return result.map(PyObject::into_ptr);
        }
    }
    call_original(py, which, &this, &positional, &keywords).map(PyObject::into_ptr)
}

type FastPath = for<'a, 'py> fn(
    Python<'py>,
    &Bound<'py, PyKVCacheManager>,
    &[Borrowed<'a, 'py, PyAny>],
    &[(Borrowed<'a, 'py, PyAny>, Borrowed<'a, 'py, PyAny>)],
) -> Fast<PyObject>;

/// Defines a `METH_FASTCALL | METH_KEYWORDS` C function that runs
/// [`dispatch`] for one method inside pyo3's trampoline.
macro_rules! entry {
    ($name:ident, $which:expr, $fast:expr) => {
        unsafe extern "C" fn $name(
            slf: *mut ffi::PyObject,
            args: *const *mut ffi::PyObject,
            nargs: ffi::Py_ssize_t,
            kwnames: *mut ffi::PyObject,
        ) -> *mut ffi::PyObject {
            unsafe fn body(
                py: Python<'_>,
                slf: *mut ffi::PyObject,
                args: *const *mut ffi::PyObject,
                nargs: ffi::Py_ssize_t,
                kwnames: *mut ffi::PyObject,
            ) -> PyResult<*mut ffi::PyObject> {
                // SAFETY: `body` is only run by the trampoline below, with
                // the arguments CPython passed to the entry.
                unsafe { dispatch($which, py, slf, args, nargs, kwnames, $fast) }
            }
            // SAFETY: CPython calls the entry as a `METH_FASTCALL |
            // METH_KEYWORDS` function (the descriptor's flags) with the GIL
            // held, which is what the trampoline and `dispatch` require.
            unsafe {
                pyo3::impl_::trampoline::fastcall_with_keywords(slf, args, nargs, kwnames, body)
            }
        }
    };
}

type Args<'a, 'py> = (
    Vec<Borrowed<'a, 'py, PyAny>>,
    Vec<(Borrowed<'a, 'py, PyAny>, Borrowed<'a, 'py, PyAny>)>,
);

/// The positional values, and (name, value) keyword pairs.
///
/// # Safety
/// As for [`dispatch`].
unsafe fn arguments<'a, 'py>(
    py: Python<'py>,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> Args<'a, 'py> {
    let n = usize::try_from(nargs).unwrap_or(0);
    // SAFETY: `kwnames` is null or a tuple (the calling convention).
    let names = unsafe { Borrowed::from_ptr_or_opt(py, kwnames) };
    let k = names.as_ref().map_or(0, |t| {
        // SAFETY: a tuple, as above.
        usize::try_from(unsafe { ffi::PyTuple_Size(t.as_ptr()) }).unwrap_or(0)
    });
    // SAFETY: `args` holds `n + k` live borrowed references for the call.
    let value = |i: usize| unsafe { Borrowed::from_ptr(py, *args.add(i)) };
    let positional = (0..n).map(value).collect();
    let keywords = (0..k)
        .filter_map(|i| {
            let t = names.as_ref()?;
            // SAFETY: `i < len(kwnames)`; a borrowed item of a live tuple.
            let name = unsafe { ffi::PyTuple_GetItem(t.as_ptr(), i as ffi::Py_ssize_t) };
            // SAFETY: a non-null item of the tuple, alive as long as it.
            let name = unsafe { Borrowed::from_ptr_or_opt(py, name) }?;
            Some((name, value(n + i)))
        })
        .collect();
    (positional, keywords)
}

/// Calls pyo3's original method with the same arguments.
fn call_original(
    py: Python<'_>,
    which: usize,
    this: &Borrowed<'_, '_, PyAny>,
    positional: &[Borrowed<'_, '_, PyAny>],
    keywords: &[(Borrowed<'_, '_, PyAny>, Borrowed<'_, '_, PyAny>)],
) -> PyResult<PyObject> {
    let Some(original) = ORIGINALS.get(py) else {
        return Err(PyTypeError::new_err(
            "the KV manager's methods are not set up",
        ));
    };
    let mut all = Vec::with_capacity(positional.len() + 1);
    all.push(this.to_owned());
    all.extend(positional.iter().map(|a| a.to_owned()));
    let kwargs = PyDict::new(py);
    for (name, value) in keywords {
        kwargs.set_item(name, value)?;
    }
    let args = PyTuple::new(py, all)?;
    Ok(original[which].bind(py).call(args, Some(&kwargs))?.unbind())
}

/// `None` → `None`; an exact `int` in range → `Some`; anything else (a
/// bool, a NumPy integer, a value out of range): not for the fast path (the
/// pyo3 method converts it, or names what is wrong).
fn optional<'py, T: FromPyObject<'py>>(value: &Borrowed<'_, 'py, PyAny>) -> Result<Option<T>, ()> {
    if value.is_none() {
        return Ok(None);
    }
    int(value).map(Some)
}

/// An exact `int` in range of `T`, or not for the fast path.
fn int<'py, T: FromPyObject<'py>>(value: &Borrowed<'_, 'py, PyAny>) -> Result<T, ()> {
    if !value.is_exact_instance_of::<PyInt>() {
        return Err(());
    }
    value.extract().map_err(|_| ())
}

fn is(name: &Borrowed<'_, '_, PyAny>, wanted: &Bound<'_, PyString>) -> bool {
    // Keyword names are interned by the compiler, so identity nearly always
    // decides; equality covers a name built at run time.
    name.is(wanted) || name.eq(wanted).unwrap_or(false)
}

entry!(admit_entry, ADMIT, |py, m, pos, kw| {
    let [seq_id, tokens] = pos else {
        return Fast::Pass;
    };
    let Ok(seq_id) = int::<u64>(seq_id) else {
        return Fast::Pass;
    };
    let (mut lora_id, mut cache_salt, mut mm) = (None, None, None);
    for (name, value) in kw {
        if is(name, intern!(py, "lora_id")) {
            match optional::<u64>(value) {
                Ok(v) => lora_id = v,
                Err(()) => return Fast::Pass,
            }
        } else if is(name, intern!(py, "cache_salt")) {
            cache_salt = Some(*value);
        } else if is(name, intern!(py, "mm")) {
            mm = Some(*value);
        } else {
            return Fast::Pass;
        }
    }
    let result = m.get().admit_impl(
        py,
        seq_id,
        tokens,
        lora_id,
        cache_salt.as_deref(),
        mm.as_deref(),
    );
    Fast::Done(result.and_then(|n| Ok(n.into_pyobject(py)?.into_any().unbind())))
});

entry!(free_entry, FREE, |py, m, pos, kw| {
    let (seq_id, mut computed) = match pos {
        [seq_id] => (seq_id, None),
        [seq_id, computed] => match optional::<usize>(computed) {
            Ok(c) => (seq_id, c),
            Err(()) => return Fast::Pass,
        },
        _ => return Fast::Pass,
    };
    let Ok(seq_id) = int::<u64>(seq_id) else {
        return Fast::Pass;
    };
    for (name, value) in kw {
        if pos.len() != 1 || !is(name, intern!(py, "computed_tokens")) {
            return Fast::Pass;
        }
        match optional::<usize>(value) {
            Ok(c) => computed = c,
            Err(()) => return Fast::Pass,
        }
    }
    Fast::Done(m.get().free_impl(py, seq_id, computed).map(|()| py.None()))
});

entry!(abort_entry, ABORT, |py, m, pos, kw| {
    let ([seq_id], []) = (pos, kw) else {
        return Fast::Pass;
    };
    let Ok(seq_id) = int::<u64>(seq_id) else {
        return Fast::Pass;
    };
    Fast::Done(m.get().free_impl(py, seq_id, Some(0)).map(|()| py.None()))
});

entry!(append_entry, APPEND, |py, m, pos, kw| {
    let ([seq_id, tokens], []) = (pos, kw) else {
        return Fast::Pass;
    };
    let Ok(seq_id) = int::<u64>(seq_id) else {
        return Fast::Pass;
    };
    Fast::Done(m.get().append_impl(py, seq_id, tokens).map(|()| py.None()))
});

//! Zero-copy export: DLPack capsules and `__cuda_array_interface__`.
//!
//! A capsule owns one heap context holding the `DLManagedTensor` (or
//! `DLManagedTensorVersioned`), the shape, and a keep-alive value — a clone of
//! the owning tier (an `Arc`), or a `share()` of the block — so the memory
//! behind an exported tensor stays allocated until the consumer's deleter
//! runs, whatever Python does with the span meanwhile. The keep-alive holds no
//! Python object, so the deleter is safe to run without the GIL, as DLPack
//! consumers may.
//!
//! Names and codes follow the DLPack header (v1.0): capsule `"dltensor"` /
//! `"dltensor_versioned"`, renamed `"used_…"` by the consumer once it has
//! taken ownership; `kDLCPU = 1`, `kDLCUDA = 2`, `kDLCUDAHost = 3`.

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use imp_mem_core::MemoryKind;
use imp_mem_core::Placement;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use pyo3::{ffi, IntoPyObjectExt};

use crate::errors::invalid;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// A DLPack element type.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// An element type as imp-mem names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DType {
    /// The canonical name (`float32`, `bfloat16`, …).
    pub name: &'static str,
    dl: DLDataType,
    typestr: &'static str,
}

impl DType {
    /// Bytes per element.
    pub fn itemsize(&self) -> usize {
        self.dl.bits as usize / 8
    }
}

const fn dt(name: &'static str, code: u8, bits: u8, typestr: &'static str) -> DType {
    DType {
        name,
        dl: DLDataType {
            code,
            bits,
            lanes: 1,
        },
        typestr,
    }
}

/// Raw bytes: what a span exports as when no view is asked for.
pub const UINT8: DType = dt("uint8", 1, 8, "|u1");

const DTYPES: [DType; 12] = [
    dt("bool", 6, 8, "|b1"),
    dt("int8", 0, 8, "|i1"),
    dt("int16", 0, 16, "<i2"),
    dt("int32", 0, 32, "<i4"),
    dt("int64", 0, 64, "<i8"),
    UINT8,
    dt("uint16", 1, 16, "<u2"),
    dt("uint32", 1, 32, "<u4"),
    dt("uint64", 1, 64, "<u8"),
    dt("float16", 2, 16, "<f2"),
    dt("float32", 2, 32, "<f4"),
    dt("float64", 2, 64, "<f8"),
];
const BFLOAT16: DType = dt("bfloat16", 4, 16, "<V2");

/// Reads a dtype from a name (`"float32"`), a NumPy dtype or scalar type, or
/// a torch dtype.
pub fn parse_dtype(value: &Bound<'_, PyAny>) -> PyResult<DType> {
    let text = if value.is_instance_of::<PyString>() {
        crate::convert::text(value, "dtype")?
    } else if value.is_instance_of::<pyo3::types::PyType>() {
        value.getattr("__name__")?.str()?.to_cow()?.into_owned()
    } else {
        let s = value.str()?.to_cow()?.into_owned();
        match s.strip_prefix("torch.") {
            Some(rest) => rest.to_string(),
            None => s,
        }
    };
    let name = match text.as_str() {
        "half" => "float16",
        "float" => "float32",
        "double" => "float64",
        "bool_" => "bool",
        other => other,
    };
    if name == BFLOAT16.name {
        return Ok(BFLOAT16);
    }
    DTYPES
        .iter()
        .copied()
        .find(|d| d.name == name)
        .ok_or_else(|| {
            let names: Vec<&str> = DTYPES
                .iter()
                .map(|d| d.name)
                .chain([BFLOAT16.name])
                .collect();
            invalid(format!(
                "unknown dtype {text:?}; use one of: {}",
                names.join(", ")
            ))
        })
}

/// What one export needs: where, what type and shape, and what keeps the
/// memory alive.
pub struct Export {
    /// The first byte.
    pub addr: usize,
    /// Where the memory lives.
    pub placement: Placement,
    /// The DLPack device it is exported as (see [`export_device`]).
    pub device: (i32, i32),
    /// The element type.
    pub dtype: DType,
    /// The shape (C-contiguous).
    pub shape: Vec<i64>,
    /// Dropped when the consumer is done with the tensor.
    pub keep: Box<dyn Any + Send>,
}

struct Ctx<M> {
    managed: M,
    shape: Vec<i64>,
    _keep: Box<dyn Any + Send>,
}

fn dl_tensor(e: &Export) -> DLTensor {
    let (device_type, device_id) = e.device;
    DLTensor {
        data: e.addr as *mut c_void,
        device: DLDevice {
            device_type,
            device_id,
        },
        ndim: e.shape.len() as i32,
        dtype: e.dtype.dl,
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// The two managed-tensor structs a capsule can hold (legacy and
/// versioned): everything `capsule` does, it does to either one the same way.
trait Managed: Sized {
    /// The capsule name a consumer looks for (and renames once it took it).
    const NAME: &'static CStr;
    /// The struct, pointing at `tensor` and at nothing yet (its context and
    /// shape are filled in once it is boxed).
    fn new(tensor: DLTensor) -> Self;
    /// The `manager_ctx` field.
    fn ctx(&self) -> *mut c_void;
    /// Points the struct at its context and at its shape.
    fn link(&mut self, ctx: *mut c_void, shape: *mut i64);
}

impl Managed for DLManagedTensor {
    const NAME: &'static CStr = c"dltensor";

    fn new(tensor: DLTensor) -> Self {
        DLManagedTensor {
            dl_tensor: tensor,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<Self>),
        }
    }

    fn ctx(&self) -> *mut c_void {
        self.manager_ctx
    }

    fn link(&mut self, ctx: *mut c_void, shape: *mut i64) {
        self.manager_ctx = ctx;
        self.dl_tensor.shape = shape;
    }
}

impl Managed for DLManagedTensorVersioned {
    const NAME: &'static CStr = c"dltensor_versioned";

    fn new(tensor: DLTensor) -> Self {
        DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<Self>),
            flags: 0,
            dl_tensor: tensor,
        }
    }

    fn ctx(&self) -> *mut c_void {
        self.manager_ctx
    }

    fn link(&mut self, ctx: *mut c_void, shape: *mut i64) {
        self.manager_ctx = ctx;
        self.dl_tensor.shape = shape;
    }
}

/// The deleter a consumer calls once it is done with the tensor.
unsafe extern "C" fn delete<M: Managed>(managed: *mut M) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if managed.is_null() {
            return;
        }
        // SAFETY: `managed` points into a live `Ctx` made by `into_capsule`
        // (the consumer calls the deleter once), whose address is its
        // manager_ctx.
        let ctx = unsafe { (*managed).ctx() } as *mut Ctx<M>;
        // SAFETY: `ctx` came from `Box::into_raw` in `into_capsule` and is
        // freed here only, once.
        drop(unsafe { Box::from_raw(ctx) });
    }));
}

/// Runs when the capsule is collected: if no consumer took the tensor (the
/// capsule still has its original name), the tensor is ours to delete.
unsafe extern "C" fn capsule_destructor<M: Managed>(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is the capsule being destroyed; `PyCapsule_IsValid`
    // checks its name without raising.
    if unsafe { ffi::PyCapsule_IsValid(capsule, M::NAME.as_ptr()) } == 1 {
        // SAFETY: the name matched, so the pointer is our managed struct.
        let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, M::NAME.as_ptr()) } as *mut M;
        // SAFETY: unconsumed, so nobody else will call the deleter.
        unsafe { delete(managed) };
    }
}

/// Wraps `e` in a DLPack capsule (versioned when `versioned`).
pub fn capsule(py: Python<'_>, e: Export, versioned: bool) -> PyResult<Py<PyAny>> {
    if versioned {
        into_capsule::<DLManagedTensorVersioned>(py, e)
    } else {
        into_capsule::<DLManagedTensor>(py, e)
    }
}

fn into_capsule<M: Managed>(py: Python<'_>, e: Export) -> PyResult<Py<PyAny>> {
    let managed = M::new(dl_tensor(&e));
    let Export { shape, keep, .. } = e;
    let raw = Box::into_raw(Box::new(Ctx {
        managed,
        shape,
        _keep: keep,
    }));
    // SAFETY: `raw` is a fresh, unique, live allocation; the shape vector's
    // buffer does not move while the context lives (it is never resized).
    unsafe {
        let shape = (*raw).shape.as_mut_ptr();
        (*raw).managed.link(raw as *mut c_void, shape);
    }
    // SAFETY: `managed` is a field of the live context.
    let ptr = unsafe { std::ptr::addr_of_mut!((*raw).managed) };
    // SAFETY: `ptr` is non-null and stays valid until the destructor or the
    // consumer's deleter frees it; the name is a static C string.
    let obj = unsafe {
        ffi::PyCapsule_New(
            ptr as *mut c_void,
            M::NAME.as_ptr(),
            Some(capsule_destructor::<M>),
        )
    };
    if obj.is_null() {
        // The capsule was not made, so the context is still ours to free.
        // SAFETY: `ptr` is the managed struct made above, not handed out.
        unsafe { delete(ptr) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `obj` is a new, owned reference.
    Ok(unsafe { Bound::from_owned_ptr(py, obj) }.unbind())
}

/// The DLPack device a span is exported as by default. Device memory is
/// `kDLCUDA`; pinned host memory is exported as `kDLCPU`, as PyTorch exports
/// its own pinned tensors — torch and NumPy refuse `kDLCUDAHost` — and a
/// consumer that understands `kDLCUDAHost` can ask for it with `dl_device`.
pub fn export_device(placement: Placement) -> (i32, i32) {
    match placement.kind {
        MemoryKind::PinnedHost => (MemoryKind::Host.dlpack_device_type(), 0),
        _ => placement.dlpack_device(),
    }
}

/// Checks the keyword arguments of `__dlpack__` against what a span can do;
/// returns whether to make a versioned capsule and the device to export as.
pub fn negotiate(
    placement: Placement,
    stream: Option<&Bound<'_, PyAny>>,
    max_version: Option<&Bound<'_, PyAny>>,
    dl_device: Option<&Bound<'_, PyAny>>,
    copy: Option<bool>,
) -> PyResult<(bool, (i32, i32))> {
    if copy == Some(true) {
        return Err(PyBufferError::new_err(
            "imp-mem exports zero-copy only; call with copy=None or copy=False and copy on the \
             consumer side",
        ));
    }
    if let Some(stream) = stream.filter(|s| !s.is_none()) {
        if placement.kind != MemoryKind::Device {
            return Err(PyBufferError::new_err(format!(
                "stream={stream} is only meaningful for device memory; pass stream=None for host \
                 memory"
            )));
        }
        // Tier memory is not bound to a stream: whoever wrote it ordered the
        // write on the consumer's stream, so there is nothing to wait on.
        stream
            .extract::<i64>()
            .map_err(|_| invalid("stream must be an int or None"))?;
    }
    let mut device = export_device(placement);
    if let Some(wanted) = dl_device.filter(|d| !d.is_none()) {
        let wanted: (i32, i32) = wanted
            .extract()
            .map_err(|_| invalid("dl_device must be a (type, id) tuple"))?;
        if wanted != device && wanted != placement.dlpack_device() {
            return Err(PyBufferError::new_err(format!(
                "this memory lives on DLPack device {device:?}, not {wanted:?}; imp-mem does not \
                 copy between devices"
            )));
        }
        device = wanted;
    }
    let versioned = match max_version.filter(|v| !v.is_none()) {
        Some(v) => {
            let (major, _minor): (u32, u32) = v
                .extract()
                .map_err(|_| invalid("max_version must be a (major, minor) tuple"))?;
            major >= 1
        }
        None => false,
    };
    Ok((versioned, device))
}

/// `__dlpack_device__`.
pub fn device_tuple<'py>(py: Python<'py>, placement: Placement) -> PyResult<Bound<'py, PyTuple>> {
    let (kind, id) = export_device(placement);
    PyTuple::new(py, [kind, id])
}

/// `__cuda_array_interface__` (v3) for device memory; `AttributeError`
/// otherwise, so `hasattr` tells a consumer to use DLPack instead.
pub fn cuda_array_interface<'py>(
    py: Python<'py>,
    addr: usize,
    placement: Placement,
    dtype: DType,
    shape: &[i64],
) -> PyResult<Bound<'py, PyDict>> {
    if placement.kind != MemoryKind::Device {
        return Err(pyo3::exceptions::PyAttributeError::new_err(
            "__cuda_array_interface__ is only defined for device memory; use __dlpack__",
        ));
    }
    let d = PyDict::new(py);
    d.set_item("shape", PyTuple::new(py, shape)?)?;
    d.set_item("typestr", dtype.typestr)?;
    d.set_item("data", (addr, false).into_py_any(py)?)?;
    d.set_item("version", 3)?;
    d.set_item("strides", py.None())?;
    d.set_item("stream", py.None())?;
    Ok(d)
}

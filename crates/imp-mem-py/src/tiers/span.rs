//! Spans and their exports: `StableSpan`, `DeviceSpan`, `TensorView`, and
//! the owner each span is checked against on every use.

use std::sync::Arc;

use imp_mem_core::{
    ArenaExport, ArenaSpan, PinnedBuffer, Placement, ScratchSpan, SharedArena, SharedBlockPool,
    SharedBlockRef, SharedScratchStack,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::block_pool::{PyBlockRef, PyBlockRefs};
use super::lock;
use super::pinned::PyPinnedBuffer;
use crate::convert;
use crate::dlpack::{self, DType, Export, UINT8};
use crate::errors::{invalid, IntoPyResult, StaleSpan};

/// What a span came from, and how the core checks it is still valid.
pub(super) enum Owner {
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
pub(super) struct SpanInner {
    owner: Owner,
    offset: usize,
    pub(super) len: usize,
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
        let nbytes = nbytes
            .filter(|n| !n.is_none())
            .map(|n| convert::index(n, "nbytes").map(|n| n as usize))
            .transpose()?;
        let range = imp_mem_core::span::subrange(self.len, offset, nbytes).py()?;
        Ok(Self {
            owner: self.owner.clone_ref(py),
            offset: self.offset + range.start,
            len: range.len(),
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

    pub(super) fn view(
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
    pub(super) inner: SpanInner,
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

pub(super) fn stable(owner: Owner, len: usize, exportable: bool) -> PyStableSpan {
    PyStableSpan {
        inner: SpanInner {
            owner,
            offset: 0,
            len,
            exportable,
        },
    }
}

//! Python face of the CUDA backends: `DeviceBackend`, `CudaBackend`,
//! `VmmBackend`, `Fence`, and the driver queries (version, devices, free memory).
//!
//! Both backends subclass `DeviceBackend`, which subclasses `Backend`, so they
//! share every method of `FakeBackend` (acquire, stats, phases, budget). On a
//! machine without a driver their constructors raise `BackendUnavailable`.
//! The extras are for tests and benchmarks on a GPU, written once in
//! `DeviceBackend`: `read` / `write` copy through the region's source (the
//! core's `Region` copies check the range), `mem_get_info` reads the device;
//! `VmmBackend` adds its handle cache and counters. Blocking driver waits
//! release the GIL.

use std::sync::Arc;

use imp_mem_core::{Backend, MemError, PhaseMode, Region};
use imp_mem_cuda::{CudaSource, DeviceContext, Fence, VmmConfig, VmmCore, VmmSource};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::backend::{PyBackend, PyRegion};
use crate::convert;
use crate::errors::{invalid, IntoPyResult};

fn mode(strict: bool) -> PhaseMode {
    if strict {
        PhaseMode::Strict
    } else {
        PhaseMode::Production
    }
}

/// Runs `f` on the live region `region` of `backend`, holding it.
fn with_region<T>(
    backend: &Backend,
    region: &Bound<'_, PyAny>,
    f: impl FnOnce(&mut Region) -> PyResult<T>,
) -> PyResult<T> {
    let region = region
        .cast::<PyRegion>()
        .map_err(|_| invalid("expected a Region acquired from this backend"))?;
    region.get().with_live(|r| {
        if r.backend().id() != backend.id() {
            return Err(invalid(format!(
                "the region belongs to backend #{}, not this one (#{}); read it through its own \
                 backend",
                r.backend().id(),
                backend.id()
            )));
        }
        f(r)
    })
}

fn host_usize(value: u64, what: &str) -> PyResult<usize> {
    usize::try_from(value).map_err(|_| invalid(format!("{what} does not fit this host")))
}

/// What every CUDA backend adds to `Backend`: the GPU's name, its free
/// memory, and copies in and out of a live region. `CudaBackend` and
/// `VmmBackend` subclass it; it has no constructor of its own.
#[pyclass(
    extends = PyBackend,
    subclass,
    frozen,
    name = "DeviceBackend",
    module = "imp_mem._core"
)]
pub struct PyDeviceBackend {
    backend: Backend,
    context: Arc<DeviceContext>,
}

impl PyDeviceBackend {
    /// The initializer of a subclass over `backend` on `context`.
    fn init(backend: Backend, context: Arc<DeviceContext>) -> PyClassInitializer<Self> {
        PyClassInitializer::from(PyBackend::wrap(backend.clone()))
            .add_subclass(Self { backend, context })
    }
}

#[pymethods]
impl PyDeviceBackend {
    /// The GPU's name (`cuDeviceGetName`).
    #[getter]
    fn device_name(&self) -> String {
        self.context.props().name.clone()
    }

    /// Device `(free, total)` bytes right now (`cuMemGetInfo`).
    fn mem_get_info(&self) -> PyResult<(u64, u64)> {
        self.context.mem_info().py()
    }

    /// Copies `nbytes` (default: to the end) at `offset` of `region` to host.
    #[pyo3(signature = (region, offset = None, nbytes = None), text_signature = "($self, region, offset=0, nbytes=None)")]
    fn read<'py>(
        &self,
        py: Python<'py>,
        region: &Bound<'_, PyAny>,
        offset: Option<&Bound<'_, PyAny>>,
        nbytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let offset = convert::opt(offset, "offset", convert::u64_arg)?.unwrap_or(0);
        let nbytes = convert::opt(nbytes, "nbytes", convert::u64_arg)?;
        let data = with_region(&self.backend, region, |r| {
            let offset = host_usize(offset, "offset")?;
            let n = match nbytes {
                Some(n) => host_usize(n, "nbytes")?,
                None => r.len().saturating_sub(offset),
            };
            r.read_to_vec(offset, n).py()
        })?;
        Ok(PyBytes::new(py, &data))
    }

    /// Copies a bytes-like object to `offset` of `region`.
    #[pyo3(signature = (region, data, offset = None), text_signature = "($self, region, data, offset=0)")]
    fn write(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        offset: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let offset = convert::opt(offset, "offset", convert::u64_arg)?.unwrap_or(0);
        let data = convert::bytes_like(py, data)?;
        with_region(&self.backend, region, |r| {
            r.copy_from_host(host_usize(offset, "offset")?, &data).py()
        })
    }
}

/// Device memory through `cuMemAlloc`.
#[pyclass(extends = PyDeviceBackend, frozen, name = "CudaBackend", module = "imp_mem._core")]
pub struct PyCudaBackend {}

/// A CUDA device ordinal (`None`: device 0).
fn device_arg(value: Option<&Bound<'_, PyAny>>) -> PyResult<i32> {
    convert::opt(value, "device", |v, what| {
        convert::int_in(v, what, 0, i32::MAX.into()).map(|n| n as i32)
    })
    .map(Option::unwrap_or_default)
}

#[pymethods]
impl PyCudaBackend {
    #[new]
    #[pyo3(
        signature = (device = None, budget = None, strict = false),
        text_signature = "(device=0, budget=None, strict=False)"
    )]
    fn new(
        device: Option<&Bound<'_, PyAny>>,
        budget: Option<&Bound<'_, PyAny>>,
        strict: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        let device = device_arg(device)?;
        let budget = convert::opt_bytes(budget, "budget")?;
        let source = CudaSource::new(device).py()?;
        let context = source.device().clone();
        let backend = Backend::new(Arc::new(source), mode(strict), budget).py()?;
        Ok(PyDeviceBackend::init(backend, context).add_subclass(Self {}))
    }
}

/// Growable device regions over the CUDA VMM API.
#[pyclass(extends = PyDeviceBackend, frozen, name = "VmmBackend", module = "imp_mem._core")]
pub struct PyVmmBackend {
    /// The base's context, reachable from a `PyVmmBackend` alone (fences).
    context: Arc<DeviceContext>,
    source: Arc<VmmSource>,
}

#[pymethods]
impl PyVmmBackend {
    #[new]
    #[pyo3(
        signature = (device = None, budget = None, strict = false, chunk_bytes = None, cache_chunks = None),
        text_signature = "(device=0, budget=None, strict=False, chunk_bytes=None, cache_chunks=None)"
    )]
    fn new(
        device: Option<&Bound<'_, PyAny>>,
        budget: Option<&Bound<'_, PyAny>>,
        strict: bool,
        chunk_bytes: Option<&Bound<'_, PyAny>>,
        cache_chunks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let device = device_arg(device)?;
        let budget = convert::opt_bytes(budget, "budget")?;
        let chunk_bytes = convert::opt_bytes(chunk_bytes, "chunk_bytes")?
            .map(|c| usize::try_from(c).map_err(|_| invalid("chunk_bytes does not fit this host")))
            .transpose()?;
        let config = VmmConfig {
            chunk_bytes,
            cache_chunks: match cache_chunks.filter(|c| !c.is_none()) {
                Some(c) => usize::try_from(convert::index(c, "cache_chunks")?)
                    .map_err(|_| invalid("cache_chunks does not fit this host"))?,
                None => imp_mem_cuda::vmm::DEFAULT_CACHE_CHUNKS,
            },
        };
        let driver = imp_mem_cuda::vmm::CudaVmm::new(device).py()?;
        let context = driver.context().clone();
        let source = Arc::new(VmmCore::with_driver(driver, config).py()?);
        let backend = Backend::new(source.clone(), mode(strict), budget).py()?;
        Ok(PyDeviceBackend::init(backend, context.clone()).add_subclass(Self { context, source }))
    }

    /// Bytes per physical handle (= `granularity`, what growable regions
    /// commit in).
    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.source.chunk_bytes()
    }

    /// The device's minimum VMM allocation granularity (2 MiB on an H200).
    #[getter]
    fn device_granularity(&self) -> usize {
        self.source.device_granularity()
    }

    /// Most released chunk handles kept for reuse.
    #[getter]
    fn cache_chunks(&self) -> usize {
        self.source.cache_limit_chunks()
    }

    /// Physical bytes in the handle cache (held by no region).
    #[getter]
    fn cached_bytes(&self) -> u64 {
        self.source.cached_bytes()
    }

    /// Physical bytes mapped in live regions.
    #[getter]
    fn mapped_bytes(&self) -> u64 {
        self.source.mapped_bytes()
    }

    /// Releases every cached handle now.
    fn trim_cache(&self, py: Python<'_>) {
        let source = self.source.clone();
        py.detach(move || source.trim_cache());
    }

    /// Driver-call counters: reservations, handles created / released, cache
    /// hits, maps, unmaps, set-access calls, cleanup failures.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.source.counters();
        let d = PyDict::new(py);
        d.set_item("reservations", c.reservations)?;
        d.set_item("handles_created", c.handles_created)?;
        d.set_item("handles_released", c.handles_released)?;
        d.set_item("cache_hits", c.cache_hits)?;
        d.set_item("maps", c.maps)?;
        d.set_item("unmaps", c.unmaps)?;
        d.set_item("set_access_calls", c.set_access_calls)?;
        d.set_item("cleanup_failures", c.cleanup_failures)?;
        Ok(d)
    }

    /// Records a fence on `stream` (a raw `CUstream` int, e.g.
    /// `torch.cuda.current_stream().cuda_stream`; 0 = the legacy default).
    #[pyo3(signature = (stream = 0))]
    fn record_fence(&self, stream: u64) -> PyResult<PyFence> {
        Ok(PyFence {
            inner: Arc::new(Fence::record_on(self.context.clone(), stream).py()?),
        })
    }
}

/// A CUDA event recorded on a stream: decommit a region's tail only after
/// `wait()` returns (or `is_complete()` is True).
#[pyclass(frozen, name = "Fence", module = "imp_mem._core")]
pub struct PyFence {
    inner: Arc<Fence>,
}

impl PyFence {
    /// The recorded event, for a pool's pending decommit.
    pub(crate) fn shared(&self) -> Arc<Fence> {
        self.inner.clone()
    }
}

#[pymethods]
impl PyFence {
    /// Records a fence on `stream` of `device`.
    #[new]
    #[pyo3(signature = (device = 0, stream = 0))]
    fn new(device: i32, stream: u64) -> PyResult<Self> {
        Ok(Self {
            inner: Arc::new(Fence::record(device, stream).py()?),
        })
    }

    /// True when the work queued before the record has finished.
    fn is_complete(&self) -> PyResult<bool> {
        self.inner.is_complete().py()
    }

    /// Blocks (without the GIL) until the work before the record finished.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let fence = self.inner.clone();
        py.detach(move || fence.wait()).py()
    }

    /// Device ordinal.
    #[getter]
    fn device(&self) -> i32 {
        self.inner.device()
    }

    fn __repr__(&self) -> String {
        format!("<Fence device={}>", self.inner.device())
    }
}

/// The CUDA driver version (13000 for CUDA 13.0); raises `BackendUnavailable`
/// without a driver.
#[pyfunction]
fn cuda_driver_version() -> PyResult<i32> {
    imp_mem_cuda::driver_version().py()
}

/// Number of CUDA devices: 0 without a driver (as `torch.cuda.device_count()`),
/// so a CPU machine can ask without a try; a driver that fails otherwise raises.
#[pyfunction]
fn cuda_device_count() -> PyResult<i32> {
    match imp_mem_cuda::device_count() {
        Err(MemError::BackendUnavailable(_)) => Ok(0),
        other => other.py(),
    }
}

/// Device `(free, total)` bytes (`cuMemGetInfo` in the primary context).
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn cuda_mem_get_info(device: i32) -> PyResult<(u64, u64)> {
    imp_mem_cuda::mem_get_info(device).py()
}

/// Registers this file's classes and functions.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDeviceBackend>()?;
    m.add_class::<PyCudaBackend>()?;
    m.add_class::<PyVmmBackend>()?;
    m.add_class::<PyFence>()?;
    m.add_function(wrap_pyfunction!(cuda_driver_version, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_mem_get_info, m)?)?;
    Ok(())
}

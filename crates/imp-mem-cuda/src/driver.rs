//! Loading and checking the CUDA driver; the one table of driver entry points.
//!
//! Algorithm: the first call to [`driver()`] opens `libcuda` (trying
//! `libcuda.so.1` first, so a toolkit's link-time stub `libcuda.so` on the
//! library path is not preferred over the real driver, then cudarc's list of
//! candidate names), resolves *every* entry point this crate uses into an
//! [`Api`] table, runs `cuInit(0)` and reads the driver version. Any failure —
//! no library, a missing symbol, a stub library, no device, a driver too old
//! — is remembered and returned as [`MemError::BackendUnavailable`] with the
//! reason, on this and every later call. After a successful load no driver
//! call can panic.
//!
//! Why not cudarc's `sys` functions directly: cudarc 0.19 resolves each symbol
//! lazily on its first call and panics if it is missing, and it types the
//! return value as a Rust `enum`, so a result code unknown to the bindings
//! (a newer driver's) would be undefined behaviour. Here the symbols are
//! resolved eagerly, once, and every result is a plain `c_int`; cudarc gives
//! the library names to try.
//!
//! Contexts: each device is used through its *primary* context (the one the
//! CUDA runtime, torch and CuPy use too), retained once per [`DeviceContext`]
//! and released when it drops. Every driver call that needs a context runs
//! inside [`DeviceContext::bind`], which makes the primary context current on
//! the calling thread for the duration of the call and restores whatever was
//! current before (push/pop), so a caller's own notion of the current device
//! (torch's, on that thread) is never changed behind its back. When the
//! primary context is already current, `bind` costs one `cuCtxGetCurrent`.
//!
//! Thread safety: the driver API is thread-safe, and so is everything here.
//! The [`Api`] table is immutable after loading; a [`DeviceContext`] holds
//! only handles that the driver allows any thread to use.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use imp_mem_core::{DeviceReading, MemError, SourceError};

/// A driver result code (`CUresult`), kept as the plain integer the C API
/// returns.
pub type CuResult = c_int;
/// `CUcontext`.
pub type CuContext = *mut c_void;
/// `CUstream`.
pub type CuStream = *mut c_void;
/// The context's legacy default stream (`CU_STREAM_LEGACY`), named
/// explicitly so that a per-thread default stream build cannot change it.
pub const CU_STREAM_LEGACY: CuStream = 0x1 as CuStream;
/// `CUevent`.
pub type CuEvent = *mut c_void;
/// `CUdeviceptr`.
pub type CuDevicePtr = c_ulonglong;
/// `CUmemGenericAllocationHandle`.
pub type CuMemHandle = c_ulonglong;

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_INVALID_VALUE`.
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`.
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
/// `CUDA_ERROR_DEINITIALIZED` (the process is shutting the driver down).
pub const CUDA_ERROR_DEINITIALIZED: CuResult = 4;
/// `CUDA_ERROR_STUB_LIBRARY`: the toolkit's link-time stub was loaded.
pub const CUDA_ERROR_STUB_LIBRARY: CuResult = 34;
/// `CUDA_ERROR_INSUFFICIENT_DRIVER`.
pub const CUDA_ERROR_INSUFFICIENT_DRIVER: CuResult = 35;
/// `CUDA_ERROR_DEVICE_UNAVAILABLE`.
pub const CUDA_ERROR_DEVICE_UNAVAILABLE: CuResult = 46;
/// `CUDA_ERROR_NO_DEVICE`.
pub const CUDA_ERROR_NO_DEVICE: CuResult = 100;
/// `CUDA_ERROR_INVALID_DEVICE`.
pub const CUDA_ERROR_INVALID_DEVICE: CuResult = 101;
/// `CUDA_ERROR_NOT_READY`: an event or stream has work still pending.
pub const CUDA_ERROR_NOT_READY: CuResult = 600;
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CuResult = 712;
/// `CUDA_ERROR_NOT_PERMITTED`.
pub const CUDA_ERROR_NOT_PERMITTED: CuResult = 800;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;
/// `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH`.
pub const CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: CuResult = 803;
/// `CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE`.
pub const CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: CuResult = 804;

/// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`.
pub const CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: c_int = 41;
/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
pub const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: c_int = 102;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// `CU_MEM_ALLOCATION_TYPE_PINNED` (VMM physical memory; not host pinning).
pub const CU_MEM_ALLOCATION_TYPE_PINNED: c_uint = 1;
/// `CU_MEM_HANDLE_TYPE_NONE`: no shareable OS handle is requested.
pub const CU_MEM_HANDLE_TYPE_NONE: c_uint = 0;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_uint = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_uint = 3;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
pub const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_uint = 0;
/// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
pub const CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: c_uint = 1;

/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context, not only the
/// allocating one.
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTALLOC_DEVICEMAP`.
pub const CU_MEMHOSTALLOC_DEVICEMAP: c_uint = 2;
/// `CU_MEMHOSTALLOC_WRITECOMBINED`. Never used: write-combined pages are slow
/// to read from the host, and staging buffers are read back.
pub const CU_MEMHOSTALLOC_WRITECOMBINED: c_uint = 4;
/// `CU_MEMHOSTREGISTER_PORTABLE`.
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTREGISTER_DEVICEMAP`.
pub const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 2;
/// `CU_EVENT_DISABLE_TIMING`: the cheap kind of event, for fences.
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;

/// `CUmemLocation` (CUDA 12.x–13.x layout: a type and an id).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CuMemLocation {
    /// `CUmemLocationType`.
    pub kind: c_uint,
    /// The device ordinal for a device location.
    pub id: c_int,
}

/// `CUmemAllocationProp.allocFlags`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CuMemAllocFlags {
    /// `compressionType`.
    pub compression_type: u8,
    /// `gpuDirectRDMACapable`.
    pub gpu_direct_rdma_capable: u8,
    /// `usage`.
    pub usage: u16,
    /// `reserved[4]`, zero.
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CuMemAllocationProp {
    /// `CUmemAllocationType`.
    pub kind: c_uint,
    /// `CUmemAllocationHandleType`.
    pub requested_handle_types: c_uint,
    /// Where the physical memory lives.
    pub location: CuMemLocation,
    /// Windows only; null.
    pub win32_handle_meta_data: *mut c_void,
    /// Compression, RDMA, usage: all zero.
    pub alloc_flags: CuMemAllocFlags,
}

impl CuMemAllocationProp {
    /// Plain device memory on `device`, not exportable, not compressed.
    pub fn device(device: c_int) -> Self {
        Self {
            kind: CU_MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_types: CU_MEM_HANDLE_TYPE_NONE,
            location: CuMemLocation {
                kind: CU_MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            win32_handle_meta_data: ptr::null_mut(),
            alloc_flags: CuMemAllocFlags::default(),
        }
    }
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CuMemAccessDesc {
    /// Who gets access.
    pub location: CuMemLocation,
    /// `CUmemAccess_flags`.
    pub flags: c_uint,
}

impl CuMemAccessDesc {
    /// Read-write access for `device`.
    pub fn read_write(device: c_int) -> Self {
        Self {
            location: CuMemLocation {
                kind: CU_MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }
}

macro_rules! driver_api {
    ($( $(#[$doc:meta])* $field:ident = $sym:literal : fn($($arg:ty),* $(,)?); )*) => {
        /// The driver entry points this crate uses, resolved once.
        #[allow(missing_docs)]
        pub struct Api {
            $( $(#[$doc])* pub $field: unsafe extern "C" fn($($arg),*) -> CuResult, )*
        }

        /// Every symbol [`Api`] needs, in declaration order.
        pub const SYMBOLS: &[&str] = &[$($sym),*];

        impl Api {
            /// Resolves every entry point from `lib`, or names the missing
            /// ones.
            fn resolve(lib: &libloading::Library) -> Result<Api, Vec<&'static str>> {
                let mut missing: Vec<&'static str> = Vec::new();
                $(
                    // SAFETY: the symbol is looked up under its exported C name and
                    // given the signature `cuda.h` declares for it (the arguments
                    // listed in this table, returning `CUresult` as `int`); a
                    // function pointer is what `get` returns for a function.
                    let $field = match unsafe {
                        lib.get::<unsafe extern "C" fn($($arg),*) -> CuResult>(
                            concat!($sym, "\0").as_bytes(),
                        )
                    } {
                        Ok(symbol) => Some(*symbol),
                        Err(_) => {
                            missing.push($sym);
                            None
                        }
                    };
                )*
                match ($($field,)*) {
                    ($(Some($field),)*) => Ok(Api { $($field,)* }),
                    _ => Err(missing),
                }
            }
        }
    };
}

driver_api! {
    init = "cuInit": fn(c_uint);
    driver_get_version = "cuDriverGetVersion": fn(*mut c_int);
    get_error_name = "cuGetErrorName": fn(CuResult, *mut *const c_char);
    device_get_count = "cuDeviceGetCount": fn(*mut c_int);
    device_get = "cuDeviceGet": fn(*mut c_int, c_int);
    device_get_name = "cuDeviceGetName": fn(*mut c_char, c_int, c_int);
    device_total_mem = "cuDeviceTotalMem_v2": fn(*mut usize, c_int);
    device_get_attribute = "cuDeviceGetAttribute": fn(*mut c_int, c_int, c_int);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut CuContext, c_int);
    primary_ctx_release = "cuDevicePrimaryCtxRelease_v2": fn(c_int);
    ctx_get_current = "cuCtxGetCurrent": fn(*mut CuContext);
    ctx_push_current = "cuCtxPushCurrent_v2": fn(CuContext);
    ctx_pop_current = "cuCtxPopCurrent_v2": fn(*mut CuContext);
    mem_get_info = "cuMemGetInfo_v2": fn(*mut usize, *mut usize);
    mem_alloc = "cuMemAlloc_v2": fn(*mut CuDevicePtr, usize);
    mem_free = "cuMemFree_v2": fn(CuDevicePtr);
    memcpy_htod = "cuMemcpyHtoD_v2": fn(CuDevicePtr, *const c_void, usize);
    memcpy_dtoh = "cuMemcpyDtoH_v2": fn(*mut c_void, CuDevicePtr, usize);
    mem_address_reserve = "cuMemAddressReserve": fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, c_ulonglong);
    mem_address_free = "cuMemAddressFree": fn(CuDevicePtr, usize);
    mem_create = "cuMemCreate": fn(*mut CuMemHandle, usize, *const CuMemAllocationProp, c_ulonglong);
    mem_release = "cuMemRelease": fn(CuMemHandle);
    mem_map = "cuMemMap": fn(CuDevicePtr, usize, usize, CuMemHandle, c_ulonglong);
    mem_unmap = "cuMemUnmap": fn(CuDevicePtr, usize);
    mem_set_access = "cuMemSetAccess": fn(CuDevicePtr, usize, *const CuMemAccessDesc, usize);
    mem_get_allocation_granularity = "cuMemGetAllocationGranularity": fn(*mut usize, *const CuMemAllocationProp, c_uint);
    mem_host_alloc = "cuMemHostAlloc": fn(*mut *mut c_void, usize, c_uint);
    mem_free_host = "cuMemFreeHost": fn(*mut c_void);
    mem_host_register = "cuMemHostRegister_v2": fn(*mut c_void, usize, c_uint);
    mem_host_unregister = "cuMemHostUnregister": fn(*mut c_void);
    event_create = "cuEventCreate": fn(*mut CuEvent, c_uint);
    event_record = "cuEventRecord": fn(CuEvent, CuStream);
    event_query = "cuEventQuery": fn(CuEvent);
    event_synchronize = "cuEventSynchronize": fn(CuEvent);
    event_destroy = "cuEventDestroy_v2": fn(CuEvent);
    stream_create = "cuStreamCreate": fn(*mut CuStream, c_uint);
    stream_destroy = "cuStreamDestroy_v2": fn(CuStream);
    stream_wait_event = "cuStreamWaitEvent": fn(CuStream, CuEvent, c_uint);
    stream_synchronize = "cuStreamSynchronize": fn(CuStream);
    memcpy_dtoh_async = "cuMemcpyDtoHAsync_v2": fn(*mut c_void, CuDevicePtr, usize, CuStream);
    memcpy_htod_async = "cuMemcpyHtoDAsync_v2": fn(CuDevicePtr, *const c_void, usize, CuStream);
}

/// A failed driver call: which call, and the result code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CuError {
    /// The driver function that failed.
    pub call: &'static str,
    /// Its `CUresult`.
    pub code: CuResult,
}

/// How a result code is reported to callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The device has no memory for the request.
    OutOfMemory,
    /// The driver or device cannot be used at all on this machine.
    Unavailable,
    /// Anything else: a driver error with its name.
    Driver,
}

/// Classifies a result code. Pure; the one place that decides which codes
/// mean "no usable CUDA here".
pub fn classify(code: CuResult) -> ErrorClass {
    match code {
        CUDA_ERROR_OUT_OF_MEMORY => ErrorClass::OutOfMemory,
        CUDA_ERROR_NOT_INITIALIZED
        | CUDA_ERROR_DEINITIALIZED
        | CUDA_ERROR_STUB_LIBRARY
        | CUDA_ERROR_INSUFFICIENT_DRIVER
        | CUDA_ERROR_DEVICE_UNAVAILABLE
        | CUDA_ERROR_NO_DEVICE
        | CUDA_ERROR_INVALID_DEVICE
        | CUDA_ERROR_NOT_PERMITTED
        | CUDA_ERROR_NOT_SUPPORTED
        | CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => ErrorClass::Unavailable,
        _ => ErrorClass::Driver,
    }
}

/// The symbolic name of a result code, for messages. Uses the driver's own
/// table when it is loaded, a built-in one otherwise.
pub fn error_name(code: CuResult) -> String {
    if let Some(Ok(driver)) = DRIVER.get() {
        let mut name: *const c_char = ptr::null();
        // SAFETY: `cuGetErrorName` writes a pointer to a static string (or
        // fails without writing); it needs no context.
        let rc = unsafe { (driver.api.get_error_name)(code, &mut name) };
        if rc == CUDA_SUCCESS && !name.is_null() {
            // SAFETY: on success `name` points to a NUL-terminated string the
            // driver keeps for the life of the process.
            return unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
        }
    }
    let known = match code {
        CUDA_SUCCESS => "CUDA_SUCCESS",
        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        CUDA_ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        CUDA_ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        CUDA_ERROR_DEINITIALIZED => "CUDA_ERROR_DEINITIALIZED",
        CUDA_ERROR_STUB_LIBRARY => "CUDA_ERROR_STUB_LIBRARY",
        CUDA_ERROR_INSUFFICIENT_DRIVER => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        CUDA_ERROR_DEVICE_UNAVAILABLE => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        CUDA_ERROR_NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        CUDA_ERROR_INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        CUDA_ERROR_NOT_READY => "CUDA_ERROR_NOT_READY",
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        CUDA_ERROR_NOT_PERMITTED => "CUDA_ERROR_NOT_PERMITTED",
        CUDA_ERROR_NOT_SUPPORTED => "CUDA_ERROR_NOT_SUPPORTED",
        CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        _ => return format!("CUresult {code}"),
    };
    known.to_string()
}

impl std::fmt::Display for CuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed with {} ({})",
            self.call,
            error_name(self.code),
            self.code
        )
    }
}

impl From<CuError> for MemError {
    fn from(err: CuError) -> Self {
        match classify(err.code) {
            ErrorClass::Unavailable => MemError::BackendUnavailable(format!(
                "the CUDA device cannot be used: {err}; check the driver (nvidia-smi) and \
                 CUDA_VISIBLE_DEVICES"
            )),
            // A backend maps OOM through its source with the budget arithmetic;
            // anywhere else an OOM is reported as the driver said it.
            ErrorClass::OutOfMemory | ErrorClass::Driver => MemError::Driver(err.to_string()),
        }
    }
}

impl From<CuError> for SourceError {
    fn from(err: CuError) -> Self {
        match classify(err.code) {
            ErrorClass::OutOfMemory => SourceError::OutOfMemory,
            ErrorClass::Unavailable | ErrorClass::Driver => SourceError::Driver(err.to_string()),
        }
    }
}

/// A driver error as a source reports it, such that the backend maps it
/// back to the [`MemError`] class and message the driver call has outside a
/// source (`BackendUnavailable` through `Unsupported`, the rest `Driver`).
pub fn source_error(err: impl Into<MemError>) -> SourceError {
    match err.into() {
        MemError::BackendUnavailable(msg) => SourceError::Unsupported(msg),
        MemError::Driver(msg) => SourceError::Driver(msg),
        other => SourceError::Driver(other.to_string()),
    }
}

/// Turns a result code into a `Result`.
#[inline]
pub fn check(call: &'static str, code: CuResult) -> Result<(), CuError> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CuError { call, code })
    }
}

/// The loaded driver: its entry points and version.
pub struct Driver {
    /// The entry points.
    pub api: Api,
    /// `cuDriverGetVersion`: 1000 × major + 10 × minor (13000 for CUDA 13.0).
    pub version: i32,
    // Keeps the library mapped for the life of the process; the function
    // pointers in `api` point into it.
    _lib: libloading::Library,
}

static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

/// The library names tried, in order.
fn candidates() -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    if cfg!(target_os = "linux") {
        names.push("libcuda.so.1".to_string());
    }
    let lib = if cfg!(windows) { "nvcuda" } else { "cuda" };
    for name in cudarc::get_lib_name_candidates(lib) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

fn load() -> Result<Driver, String> {
    let tried = candidates();
    let mut lib = None;
    for name in &tried {
        // SAFETY: loading libcuda runs its initialisers, which are safe to run
        // in any process; no other code of ours runs concurrently with them
        // (this runs once, inside the `OnceLock`).
        if let Ok(found) = unsafe { libloading::Library::new(name) } {
            lib = Some(found);
            break;
        }
    }
    let Some(lib) = lib else {
        let first = tried.first().map(String::as_str).unwrap_or("libcuda");
        return Err(format!(
            "no CUDA driver library on this machine ({first} and {} other names tried); install \
             the NVIDIA driver, or use FakeBackend for tests without a GPU",
            tried.len().saturating_sub(1)
        ));
    };
    let api = Api::resolve(&lib).map_err(|missing| {
        format!(
            "the CUDA driver library lacks {} (driver too old for CUDA 12/13?); update the \
             NVIDIA driver",
            missing.join(", ")
        )
    })?;
    // SAFETY: `cuInit` with flags 0 is the documented first call; it is
    // idempotent and thread-safe.
    let rc = unsafe { (api.init)(0) };
    if rc != CUDA_SUCCESS {
        return Err(format!(
            "cuInit failed with {} ({rc}); no usable NVIDIA GPU or driver here",
            error_name_builtin(rc)
        ));
    }
    let mut version: c_int = 0;
    // SAFETY: writes one int; needs no context.
    let rc = unsafe { (api.driver_get_version)(&mut version) };
    if rc != CUDA_SUCCESS {
        return Err(format!(
            "cuDriverGetVersion failed with {}",
            error_name_builtin(rc)
        ));
    }
    Ok(Driver {
        api,
        version,
        _lib: lib,
    })
}

fn error_name_builtin(code: CuResult) -> String {
    // `DRIVER` is not set yet while loading, so this uses the built-in table.
    error_name(code)
}

/// The driver, loaded on first use. On a machine without a usable driver this
/// is `BackendUnavailable`, never a panic.
pub fn driver() -> Result<&'static Driver, MemError> {
    match DRIVER.get_or_init(load) {
        Ok(driver) => Ok(driver),
        Err(reason) => Err(MemError::BackendUnavailable(reason.clone())),
    }
}

/// Number of CUDA devices visible, or the reason there are none.
pub fn device_count() -> Result<i32, MemError> {
    let driver = driver()?;
    let mut count: c_int = 0;
    // SAFETY: writes one int; the driver is initialised.
    check("cuDeviceGetCount", unsafe {
        (driver.api.device_get_count)(&mut count)
    })?;
    Ok(count)
}

/// Whether the driver loads and reports at least one device.
pub fn cuda_available() -> bool {
    matches!(device_count(), Ok(n) if n > 0)
}

/// Facts about one device, read once when its context is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProps {
    /// Ordinal.
    pub ordinal: i32,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceTotalMem`.
    pub total_memory: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Whether the device supports the VMM API.
    pub vmm_supported: bool,
    /// The driver version (`13000` for CUDA 13.0).
    pub driver_version: i32,
}

/// A device's primary context, retained for as long as this lives.
pub struct DeviceContext {
    driver: &'static Driver,
    ctx: CuContext,
    props: DeviceProps,
}

// SAFETY: a CUcontext is a process-wide handle that the driver API accepts
// from any thread (that is what cuCtxPushCurrent/SetCurrent are for); the rest
// of the struct is immutable data.
unsafe impl Send for DeviceContext {}
// SAFETY: as above; no method mutates the struct, and the driver serialises
// its own state.
unsafe impl Sync for DeviceContext {}

impl std::fmt::Debug for DeviceContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceContext")
            .field("props", &self.props)
            .finish()
    }
}

/// Open device contexts, so every source on a device shares one retain.
static CONTEXTS: Mutex<Vec<(i32, Weak<DeviceContext>)>> = Mutex::new(Vec::new());

impl DeviceContext {
    /// The primary context of device `ordinal`, retained (shared with every
    /// other user of the same device in this process).
    pub fn open(ordinal: i32) -> Result<Arc<DeviceContext>, MemError> {
        let driver = driver()?;
        let count = device_count()?;
        if count == 0 {
            return Err(MemError::BackendUnavailable(
                "the CUDA driver reports no devices; check nvidia-smi and CUDA_VISIBLE_DEVICES"
                    .into(),
            ));
        }
        if ordinal < 0 || ordinal >= count {
            return Err(MemError::invalid(format!(
                "device {ordinal} does not exist: this machine has {count} CUDA device(s), \
                 numbered 0..{count}"
            )));
        }
        let mut open = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|(_, weak)| weak.strong_count() > 0);
        if let Some(existing) = open
            .iter()
            .find(|(o, _)| *o == ordinal)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(existing);
        }
        let ctx = Self::retain(driver, ordinal)?;
        let opened = Arc::new(ctx);
        open.push((ordinal, Arc::downgrade(&opened)));
        Ok(opened)
    }

    fn retain(driver: &'static Driver, ordinal: i32) -> Result<DeviceContext, MemError> {
        let api = &driver.api;
        let mut device: c_int = 0;
        // SAFETY: writes one int; `ordinal` was checked against the count.
        check("cuDeviceGet", unsafe {
            (api.device_get)(&mut device, ordinal)
        })?;
        let mut name_buf = [0 as c_char; 256];
        // SAFETY: the buffer holds `len` chars and the driver writes at most
        // that many, NUL-terminated.
        check("cuDeviceGetName", unsafe {
            (api.device_get_name)(name_buf.as_mut_ptr(), name_buf.len() as c_int, device)
        })?;
        // SAFETY: the driver NUL-terminated the name inside the buffer, and the
        // last byte is still the zero it was initialised with.
        let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut total: usize = 0;
        // SAFETY: writes one size_t.
        check("cuDeviceTotalMem_v2", unsafe {
            (api.device_total_mem)(&mut total, device)
        })?;
        let attr = |attribute: c_int| -> Result<i32, CuError> {
            let mut value: c_int = 0;
            // SAFETY: writes one int for a valid attribute and device.
            check("cuDeviceGetAttribute", unsafe {
                (api.device_get_attribute)(&mut value, attribute, device)
            })?;
            Ok(value)
        };
        let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let vmm_supported = attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0;
        let unified = attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? != 0;
        if !unified {
            return Err(MemError::BackendUnavailable(format!(
                "device {ordinal} ({name}) has no unified addressing; imp-mem needs a 64-bit \
                 Linux or TCC device"
            )));
        }
        let mut ctx: CuContext = ptr::null_mut();
        // SAFETY: writes the primary context handle; the retain is balanced by
        // `cuDevicePrimaryCtxRelease_v2` in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            (api.primary_ctx_retain)(&mut ctx, device)
        })?;
        let props = DeviceProps {
            ordinal,
            name,
            total_memory: total as u64,
            compute_capability: (major, minor),
            vmm_supported,
            driver_version: driver.version,
        };
        Ok(DeviceContext { driver, ctx, props })
    }

    /// The driver table.
    pub fn api(&self) -> &'static Api {
        &self.driver.api
    }

    /// What the device is.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.props.ordinal
    }

    /// Makes the primary context current on this thread until the returned
    /// scope drops, then restores the previous one.
    pub fn bind(&self) -> Result<CtxScope<'_>, CuError> {
        let api = self.api();
        let mut current: CuContext = ptr::null_mut();
        // SAFETY: writes one handle (null when none is current).
        check("cuCtxGetCurrent", unsafe {
            (api.ctx_get_current)(&mut current)
        })?;
        if current == self.ctx {
            return Ok(CtxScope {
                owner: self,
                pushed: false,
                _not_send: std::marker::PhantomData,
            });
        }
        // SAFETY: `self.ctx` is a retained primary context, valid until Drop;
        // the push is undone by the scope's Drop on this same thread (the scope
        // is not Send).
        check("cuCtxPushCurrent_v2", unsafe {
            (api.ctx_push_current)(self.ctx)
        })?;
        Ok(CtxScope {
            owner: self,
            pushed: true,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Device free and total memory (`cuMemGetInfo`).
    pub fn mem_info(&self) -> Result<(u64, u64), MemError> {
        let _scope = self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two size_t; a context is current (scope above).
        check("cuMemGetInfo_v2", unsafe {
            (self.api().mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    /// [`DeviceContext::mem_info`] as a source's device reading. Its error
    /// maps back, through the backend, to the same [`MemError`] class and
    /// message (`BackendUnavailable` through `Unsupported`).
    pub fn reading(&self) -> Result<DeviceReading, SourceError> {
        let (free, total) = self.mem_info().map_err(source_error)?;
        Ok(DeviceReading { free, total })
    }

    /// Copies `len` bytes of host memory at `src` to device address `dst`
    /// and returns when they are there, whatever kind of host memory `src`
    /// is. From pinned memory `cuMemcpyHtoD` is already synchronous with
    /// the host; from pageable memory it returns once the bytes are staged,
    /// with the DMA still in flight on the legacy default stream, which a
    /// non-blocking stream (torch's side streams) is not ordered after. So
    /// the legacy stream is synchronised after the copy: for a pinned
    /// source it has nothing left to wait for.
    ///
    /// # Safety
    /// `[dst, dst + len)` is live memory of this device's context that
    /// nothing else uses during the call; `[src, src + len)` is host memory
    /// this process may read. A context is current (`bind`).
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<(), CuError> {
        // SAFETY: the caller vouches for both ranges and the current context.
        check("cuMemcpyHtoD_v2", unsafe {
            (self.api().memcpy_htod)(dst, src.cast(), len)
        })?;
        // SAFETY: `CU_STREAM_LEGACY` names the context's legacy default
        // stream, which always exists; the caller has bound the context.
        unsafe { self.synchronize(CU_STREAM_LEGACY) }
    }

    /// Blocks until the work queued on `stream` so far has finished.
    ///
    /// # Safety
    /// `stream` is a live stream of this device's context, or
    /// `CU_STREAM_LEGACY` (0 is the legacy default stream too). A context
    /// is current (`bind`).
    pub unsafe fn synchronize(&self, stream: CuStream) -> Result<(), CuError> {
        // SAFETY: the caller vouches for the stream and the current
        // context; the call only waits.
        check("cuStreamSynchronize", unsafe {
            (self.api().stream_synchronize)(stream)
        })
    }

    /// Runs `enqueue` on each of `copies` until one fails, then waits for
    /// the legacy default stream once, so that none of the copies already
    /// enqueued is in flight when the call returns; the first error wins.
    ///
    /// # Safety
    /// A context is current (`bind`).
    unsafe fn enqueue_then_sync<T: Copy>(
        &self,
        copies: &[T],
        enqueue: impl FnMut(T) -> Result<(), CuError>,
    ) -> Result<(), CuError> {
        let enqueued = copies.iter().copied().try_for_each(enqueue);
        // SAFETY: `CU_STREAM_LEGACY` always exists; the caller has bound
        // the context.
        let synced = unsafe { self.synchronize(CU_STREAM_LEGACY) };
        enqueued.and(synced)
    }

    /// Copies every `(dst, src, len)` of `copies`, host memory at `src` to
    /// device address `dst`, and returns when all are there: each is
    /// enqueued with `cuMemcpyHtoDAsync` on the legacy default stream (where
    /// [`Self::copy_htod`] copies, so the order against other streams is
    /// the same), and the stream is synchronised once at the end instead of
    /// once a copy. From pinned memory the copies run back to back at DMA
    /// speed; from pageable memory the driver stages each, still correct.
    /// On a failed enqueue the copies already enqueued are waited for
    /// before the error returns, so none is in flight after the call.
    ///
    /// # Safety
    /// Every copy meets [`Self::copy_htod`]'s contract. A context is
    /// current (`bind`).
    pub unsafe fn copy_htod_many(
        &self,
        copies: &[(usize, *const u8, usize)],
    ) -> Result<(), CuError> {
        let enqueue = |(dst, src, len): (usize, *const u8, usize)| {
            // SAFETY: the caller vouches for both ranges and the current
            // context; the host bytes stay valid until the
            // synchronisation that ends the call.
            check("cuMemcpyHtoDAsync_v2", unsafe {
                (self.api().memcpy_htod_async)(
                    dst as CuDevicePtr,
                    src.cast(),
                    len,
                    CU_STREAM_LEGACY,
                )
            })
        };
        // SAFETY: the caller has bound the context.
        unsafe { self.enqueue_then_sync(copies, enqueue) }
    }

    /// Copies every `(src, dst, len)` of `copies`, device address `src` to
    /// host memory at `dst`, and returns when all are there: enqueued with
    /// `cuMemcpyDtoHAsync` on the legacy default stream and synchronised
    /// once, as [`Self::copy_htod_many`] (into pageable memory the driver
    /// makes each copy synchronous: still correct).
    ///
    /// # Safety
    /// Every `[src, src + len)` is live memory of this device's context;
    /// every `[dst, dst + len)` is host memory this process may write, no
    /// two of them overlapping and nothing else using them during the call.
    /// A context is current (`bind`).
    pub unsafe fn copy_dtoh_many(&self, copies: &[(usize, *mut u8, usize)]) -> Result<(), CuError> {
        let enqueue = |(src, dst, len): (usize, *mut u8, usize)| {
            // SAFETY: the caller vouches for both ranges and the current
            // context; the host bytes are not read before the
            // synchronisation that ends the call.
            check("cuMemcpyDtoHAsync_v2", unsafe {
                (self.api().memcpy_dtoh_async)(
                    dst.cast(),
                    src as CuDevicePtr,
                    len,
                    CU_STREAM_LEGACY,
                )
            })
        };
        // SAFETY: the caller has bound the context.
        unsafe { self.enqueue_then_sync(copies, enqueue) }
    }
}

impl Drop for DeviceContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; the handle is not used after.
        // An error (the driver already shut down at process exit) is ignored:
        // there is nothing left to release.
        let _ = unsafe { (self.driver.api.primary_ctx_release)(self.props.ordinal) };
    }
}

/// While alive, the device's primary context is current on this thread.
pub struct CtxScope<'a> {
    owner: &'a DeviceContext,
    pushed: bool,
    // A context is current per thread: the scope must drop where it began.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for CtxScope<'_> {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: CuContext = ptr::null_mut();
            // SAFETY: pops exactly the context `bind` pushed: the scope is not
            // Send, so this runs on the thread that pushed, and scopes nest.
            let _ = unsafe { (self.owner.api().ctx_pop_current)(&mut popped) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_separates_oom_unavailable_and_the_rest() {
        assert_eq!(classify(CUDA_ERROR_OUT_OF_MEMORY), ErrorClass::OutOfMemory);
        for code in [
            CUDA_ERROR_NO_DEVICE,
            CUDA_ERROR_STUB_LIBRARY,
            CUDA_ERROR_INSUFFICIENT_DRIVER,
            803,
        ] {
            assert_eq!(classify(code), ErrorClass::Unavailable, "{code}");
        }
        assert_eq!(classify(CUDA_ERROR_INVALID_VALUE), ErrorClass::Driver);
        assert_eq!(classify(999_999), ErrorClass::Driver);
    }

    #[test]
    fn errors_map_to_the_right_values() {
        let oom = CuError {
            call: "cuMemCreate",
            code: CUDA_ERROR_OUT_OF_MEMORY,
        };
        assert_eq!(SourceError::from(oom), SourceError::OutOfMemory);
        let bad = CuError {
            call: "cuMemMap",
            code: CUDA_ERROR_INVALID_VALUE,
        };
        match SourceError::from(bad) {
            SourceError::Driver(msg) => {
                assert!(msg.contains("cuMemMap"), "{msg}");
                assert!(msg.contains("CUDA_ERROR_INVALID_VALUE"), "{msg}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let gone = CuError {
            call: "cuInit",
            code: CUDA_ERROR_NO_DEVICE,
        };
        assert!(matches!(
            MemError::from(gone),
            MemError::BackendUnavailable(_)
        ));
        assert!(matches!(MemError::from(bad), MemError::Driver(_)));
    }

    #[test]
    fn unknown_codes_are_named_by_number() {
        assert_eq!(error_name(123_456), "CUresult 123456");
    }

    #[test]
    fn the_symbol_table_is_complete_and_unique() {
        let mut names = SYMBOLS.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SYMBOLS.len());
        assert!(SYMBOLS.contains(&"cuMemSetAccess"));
    }

    #[test]
    fn abi_layouts_match_cuda_h() {
        // cuda.h: CUmemLocation {int, int} = 8; CUmemAllocationProp = 32 on
        // 64-bit; CUmemAccessDesc = 12.
        assert_eq!(std::mem::size_of::<CuMemLocation>(), 8);
        assert_eq!(std::mem::size_of::<CuMemAllocationProp>(), 32);
        assert_eq!(std::mem::align_of::<CuMemAllocationProp>(), 8);
        assert_eq!(std::mem::size_of::<CuMemAccessDesc>(), 12);
        assert_eq!(
            std::mem::size_of::<CuMemAllocationProp>(),
            std::mem::size_of::<cudarc::driver::sys::CUmemAllocationProp>()
        );
        assert_eq!(
            std::mem::size_of::<CuMemAccessDesc>(),
            std::mem::size_of::<cudarc::driver::sys::CUmemAccessDesc>()
        );
        assert!(!candidates().is_empty());
    }
}

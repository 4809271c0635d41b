//! imp-mem CUDA backends. The driver is loaded at run time, so this crate
//! builds and its users import on machines with no CUDA at all.
#![deny(missing_docs)]

/// True when the CUDA driver library can be loaded and reports a device.
pub fn cuda_available() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and
    // reports whether it loaded; it calls no CUDA function.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    cudarc::driver::result::init().is_ok()
        && cudarc::driver::result::device::get_count()
            .map(|n| n > 0)
            .unwrap_or(false)
}

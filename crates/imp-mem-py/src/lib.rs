//! `imp_mem._core`: the PyO3 bindings. Conversions, error mapping and handle
//! wrappers only; every rule lives in `imp-mem-core`.
//!
//! Each file registers its own classes; adding a capability is one new file
//! and one `register` line below.

use pyo3::prelude::*;

pub mod activations;
pub mod backend;
pub mod convert;
pub mod cuda;
pub mod dlpack;
pub mod errors;
pub mod hooks;
pub mod input;
pub mod kv;
pub mod ledger;
pub mod planner;
pub mod system;
pub mod tiers;

/// True when a CUDA driver and at least one device are present.
#[pyfunction]
fn cuda_available() -> bool {
    imp_mem_cuda::cuda_available()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    backend::register(m)?;
    kv::register(m)?;
    ledger::register(m)?;
    input::register(m)?;
    tiers::register(m)?;
    cuda::register(m)?;
    planner::register(m)?;
    system::register(m)?;
    activations::register(m)?;
    hooks::register(m)?;
    Ok(())
}

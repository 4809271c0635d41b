//! [`VmmBackend`]: a [`Backend`] over a [`VmmSource`](super::VmmSource),
//! with the source's extras (cache, counters, chunk size).

use std::sync::Arc;

use imp_mem_core::{Backend, MemError, PhaseMode};

use super::config::VmmConfig;
use super::driver::CudaVmm;
use super::regions::{VmmCore, VmmSource};

/// A [`Backend`] over a [`VmmSource`], with the source's extras (cache,
/// counters, chunk size). Derefs to the backend.
#[derive(Clone)]
pub struct VmmBackend {
    backend: Backend,
    source: Arc<VmmSource>,
}

impl std::fmt::Debug for VmmBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmBackend")
            .field("backend", &self.backend)
            .field("source", &self.source)
            .finish()
    }
}

impl VmmBackend {
    /// A VMM backend on device `device`.
    pub fn new(
        device: i32,
        mode: PhaseMode,
        budget: Option<u64>,
        config: VmmConfig,
    ) -> Result<Self, MemError> {
        let source = Arc::new(VmmCore::with_driver(CudaVmm::new(device)?, config)?);
        let backend = Backend::new(source.clone(), mode, budget)?;
        Ok(Self { backend, source })
    }

    /// The backend.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The source.
    pub fn source(&self) -> &Arc<VmmSource> {
        &self.source
    }
}

impl std::ops::Deref for VmmBackend {
    type Target = Backend;

    fn deref(&self) -> &Backend {
        &self.backend
    }
}

/// A VMM [`Backend`] on device `device` (see [`VmmBackend`] for the extras).
pub fn vmm_backend(
    device: i32,
    mode: PhaseMode,
    budget: Option<u64>,
    config: VmmConfig,
) -> Result<VmmBackend, MemError> {
    VmmBackend::new(device, mode, budget, config)
}

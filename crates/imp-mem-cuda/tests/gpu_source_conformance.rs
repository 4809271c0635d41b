//! The `MemorySource` conformance suite (`imp_mem_core::conformance`) over
//! the CUDA sources on a real device (device 0): the checks the core runs
//! over its fake (growable, and fixed as `CudaSource` is) and this crate
//! over the VMM simulator (`src/vmm/conformance.rs`).
//!
//! * `vmm`: the VMM source with the driver's granularity (2 MiB on the
//!   H200), 8 MiB chunks and a handle cache of two chunks;
//! * `cuda`: `CudaSource` (`cuMemAlloc`), which has no growable regions: the
//!   suite checks that it refuses them and sizes its requests in units of
//!   `FIXED_UNIT`.
//!
//! With no CUDA driver (this crate's CI machine) every test prints why and
//! passes without opening anything. On a GPU machine with no Rust toolchain,
//! build the binary here (`cargo test -p imp-mem-cuda --test
//! gpu_source_conformance --no-run`) and run it there with
//! `--test-threads=1`: the device refusal checks take the device's free
//! memory away, which another test in flight would feel.
//!
//! A probe reads what the source holds from the source's own books (the
//! VMM's mapped bytes and handle cache; what `CudaSource` asked of
//! `cuMemAlloc`), and "something outside took the device's memory" is a
//! real allocation: a plain `cuMemAlloc` backend of the device's free bytes
//! less what the check leaves free.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::Mutex;

use imp_mem_core::{Backend, PhaseMode, Region, Tag};
use imp_mem_cuda::{cuda_available, cuda_backend, mem_get_info};

const DEVICE: i32 = 0;

fn no_gpu() -> Option<String> {
    (!cuda_available()).then(|| "no CUDA driver on this machine".to_string())
}

/// Device memory taken "from outside": a plain backend and its region.
#[derive(Default)]
struct Ballast(Mutex<Option<(Backend, Region)>>);

impl Ballast {
    /// Takes the device's memory until `free` bytes are left (`None`: gives
    /// it back).
    fn leave_free(&self, free: Option<u64>) {
        let mut ballast = self.0.lock().unwrap();
        *ballast = None;
        let Some(free) = free else {
            return;
        };
        let (now, _) = mem_get_info(DEVICE).unwrap();
        let mut take = now.saturating_sub(free);
        // What the driver reports free is not always one allocation's
        // worth; back off a page at a time, a few times.
        for _ in 0..64 {
            if take == 0 {
                return;
            }
            let backend = cuda_backend(DEVICE, PhaseMode::Production, None).unwrap();
            if let Ok(region) = backend.acquire(take, 256, Tag::Workspace) {
                *ballast = Some((backend, region));
                return;
            }
            take = take.saturating_sub(2 << 20);
        }
        panic!("could not take the device's memory down to {free} B free");
    }
}

mod vmm {
    use std::sync::Arc;

    use imp_mem_core::conformance::{Probe, Subject};
    use imp_mem_core::{Backend, PhaseMode};
    use imp_mem_cuda::vmm::CudaVmm;
    use imp_mem_cuda::{VmmConfig, VmmSource};

    use super::{no_gpu, Ballast, DEVICE};

    struct DeviceProbe {
        source: Arc<VmmSource>,
        ballast: Ballast,
    }

    impl Probe for DeviceProbe {
        fn physical(&self) -> u64 {
            self.source.mapped_bytes() + self.source.cached_bytes()
        }

        fn leave_free(&self, free: Option<u64>) {
            self.ballast.leave_free(free);
        }

        fn settle(&self) {
            self.source.trim_cache();
        }
    }

    fn open(budget: Option<u64>) -> Subject {
        let source = Arc::new(
            VmmSource::with_driver(
                CudaVmm::new(DEVICE).unwrap(),
                VmmConfig {
                    chunk_bytes: Some(8 << 20),
                    cache_chunks: 2,
                },
            )
            .unwrap(),
        );
        let backend = Backend::new(source.clone(), PhaseMode::Strict, budget).unwrap();
        Subject {
            backend,
            source: source.clone(),
            probe: Box::new(DeviceProbe {
                source,
                ballast: Ballast::default(),
            }),
        }
    }

    imp_mem_core::memory_source_conformance!(open, cases = 32, skip = no_gpu);
}

mod cuda {
    use std::sync::Arc;

    use imp_mem_core::conformance::{Probe, Subject};
    use imp_mem_core::{Backend, PhaseMode};
    use imp_mem_cuda::CudaSource;

    use super::{no_gpu, Ballast, DEVICE};

    struct DeviceProbe {
        source: Arc<CudaSource>,
        ballast: Ballast,
    }

    impl Probe for DeviceProbe {
        fn physical(&self) -> u64 {
            self.source.held_bytes()
        }

        fn leave_free(&self, free: Option<u64>) {
            self.ballast.leave_free(free);
        }
    }

    fn open(budget: Option<u64>) -> Subject {
        let source = Arc::new(CudaSource::new(DEVICE).unwrap());
        let backend = Backend::new(source.clone(), PhaseMode::Strict, budget).unwrap();
        Subject {
            backend,
            source: source.clone(),
            probe: Box::new(DeviceProbe {
                source,
                ballast: Ballast::default(),
            }),
        }
    }

    imp_mem_core::memory_source_conformance!(open, cases = 32, skip = no_gpu);
}

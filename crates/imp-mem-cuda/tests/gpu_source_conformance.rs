//! The `MemorySource` conformance suite (`imp_mem_core::conformance`) over
//! the VMM source on a real device: the checks the core runs over its fake
//! and this crate over the VMM simulator (`src/vmm/conformance.rs`), here
//! with the driver's granularity (2 MiB on the H200), 8 MiB chunks and a
//! handle cache of two chunks, on device 0.
//!
//! With no CUDA driver (this crate's CI machine) every test prints why and
//! passes without opening anything. On a GPU machine with no Rust toolchain,
//! build the binary here (`cargo test -p imp-mem-cuda --test
//! gpu_source_conformance --no-run`) and run it there with
//! `--test-threads=1`: the device refusal check takes the device's free
//! memory away, which another test in flight would feel.
//!
//! The probe reads what the source holds from the source's own books
//! (mapped bytes and its handle cache), and "something outside took the
//! device's memory" is a real allocation: a plain `cuMemAlloc` backend of
//! the device's free bytes less what the check leaves free.
//!
//! `CudaSource` (plain `cuMemAlloc`) is not here: the suite checks growable
//! regions throughout, and that source has none.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::{Arc, Mutex};

use imp_mem_core::conformance::{Probe, Subject};
use imp_mem_core::{Backend, PhaseMode, Region, Tag};
use imp_mem_cuda::vmm::CudaVmm;
use imp_mem_cuda::{cuda_available, cuda_backend, mem_get_info, VmmConfig, VmmSource};

const DEVICE: i32 = 0;

fn no_gpu() -> Option<String> {
    (!cuda_available()).then(|| "no CUDA driver on this machine".to_string())
}

struct DeviceProbe {
    source: Arc<VmmSource>,
    /// Device memory taken "from outside": a plain backend and its region.
    ballast: Mutex<Option<(Backend, Region)>>,
}

impl Probe for DeviceProbe {
    fn physical(&self) -> u64 {
        self.source.mapped_bytes() + self.source.cached_bytes()
    }

    fn leave_free(&self, free: Option<u64>) {
        let mut ballast = self.ballast.lock().unwrap();
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
            ballast: Mutex::new(None),
        }),
    }
}

imp_mem_core::memory_source_conformance!(open, cases = 32, skip = no_gpu);

//! The `MemorySource` conformance suite (`imp_mem_core::conformance`) over
//! the VMM source on the simulated driver: the same checks the core runs
//! over its fake, here with 8 MiB chunks on 2 MiB granules and a handle
//! cache of two chunks.

use std::sync::Arc;

use imp_mem_core::conformance::{Probe, Subject};
use imp_mem_core::{Backend, PhaseMode};

use super::sim::SimDriver;
use super::{VmmConfig, VmmCore};

const MIB: usize = 1 << 20;
const GRANULE: usize = 2 * MIB;
const CHUNK: usize = 8 * MIB;
/// 64 chunks of device; the cache's two are kept out of the capacity.
const TOTAL: u64 = 64 * CHUNK as u64;

struct SimProbe {
    sim: SimDriver,
    source: Arc<VmmCore<SimDriver>>,
}

impl Probe for SimProbe {
    fn physical(&self) -> u64 {
        self.sim.lock().physical()
    }

    fn leave_free(&self, free: Option<u64>) {
        let mut s = self.sim.lock();
        s.capacity = match free {
            Some(free) => (s.physical() + free).min(TOTAL),
            None => TOTAL,
        };
    }

    fn settle(&self) {
        self.source.trim_cache();
    }
}

fn open(budget: Option<u64>) -> Subject {
    let sim = SimDriver::new(GRANULE, TOTAL);
    let source = Arc::new(
        VmmCore::with_driver(
            sim.clone(),
            VmmConfig {
                chunk_bytes: Some(CHUNK),
                cache_chunks: 2,
            },
        )
        .unwrap(),
    );
    let backend = Backend::new(source.clone(), PhaseMode::Strict, budget).unwrap();
    Subject {
        backend,
        source: source.clone(),
        probe: Box::new(SimProbe { sim, source }),
    }
}

imp_mem_core::memory_source_conformance!(open, cases = 256);

//! The `MemorySource` conformance suite (`imp_mem_core::conformance`) over
//! the fake's source. `imp-mem-cuda` runs the same suite over the VMM source
//! on its simulated driver.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use imp_mem_core::conformance::{Probe, Subject};
use imp_mem_core::{FakeBackend, FakeConfig, PhaseMode};

/// 64 KiB granules, a device of 64 of them.
const GRANULE: usize = 64 << 10;
const CAPACITY: u64 = 64 * GRANULE as u64;

struct FakeProbe(FakeBackend);

impl Probe for FakeProbe {
    fn physical(&self) -> u64 {
        self.0.device_used()
    }

    fn leave_free(&self, free: Option<u64>) {
        let external = free.map_or(0, |free| {
            CAPACITY.saturating_sub(self.0.device_used() + free)
        });
        self.0.set_external_usage(external);
    }
}

fn open(budget: Option<u64>) -> Subject {
    let fake = FakeBackend::new(FakeConfig {
        capacity: CAPACITY,
        budget,
        granularity: GRANULE,
        backed: true,
        mode: PhaseMode::Strict,
    })
    .unwrap();
    Subject {
        backend: fake.backend().clone(),
        source: fake.source().clone(),
        probe: Box::new(FakeProbe(fake)),
    }
}

imp_mem_core::memory_source_conformance!(open, cases = 256);

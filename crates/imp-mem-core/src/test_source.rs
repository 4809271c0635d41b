//! One source for the core's unit tests that need what a device source has
//! and the fake lacks: the fake's memory underneath, with a device reading,
//! charges past the ledger, pinned host memory, a stream order or no host
//! copies switched on per test, and the host address of every copy
//! recorded. It gives no KV host tier (the trait's default). With `fixed` it
//! has no growable regions either, as `cuMemAlloc` has none; the source
//! conformance suite runs over it so (`fixed_source_conformance`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::activations::FakeStreamOrder;
use crate::error::MemError;
use crate::fake::FakeSource;
use crate::pinned::FakePinnedHost;
use crate::source::{
    DeviceReading, FromHost, MemorySource, PinnedHostOps, SourceCharge, SourceError, SourceInfo,
    StreamOrder, ToHost,
};

/// The fake's source with device traits added; [`TestSource::over`] gives
/// one that behaves as the fake does.
pub(crate) struct TestSource {
    pub fake: Arc<FakeSource>,
    /// False: the copies are the trait's refusing defaults.
    pub copies: bool,
    pub pinned: Option<Arc<FakePinnedHost>>,
    /// The host address of each copy, in order.
    pub hosts: Mutex<Vec<usize>>,
    /// The length of each batch of copies (`copy_*_host_many`), in order.
    pub batches: Mutex<Vec<usize>>,
    /// What `mem_info` reads, or fails with.
    pub reading: Result<Option<DeviceReading>, SourceError>,
    /// `Some`: `extra_charges` names these bytes "held" and the rounding of
    /// the committed bytes up to whole `MiB` "rounding", as a VMM does.
    pub held: Option<Arc<AtomicU64>>,
    /// `Some`: the stream order its pools keep (a device's events).
    pub order: Option<FakeStreamOrder>,
    /// True: no growable regions (granularity 1; `reserve`, `commit` and
    /// `decommit` are the trait's refusing defaults).
    pub fixed: bool,
}

impl TestSource {
    pub fn over(fake: Arc<FakeSource>) -> Self {
        Self {
            fake,
            copies: true,
            pinned: None,
            hosts: Mutex::new(Vec::new()),
            batches: Mutex::new(Vec::new()),
            reading: Ok(None),
            held: None,
            order: None,
            fixed: false,
        }
    }

    fn record(&self, host: usize) {
        self.hosts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(host);
    }

    fn record_batch(&self, hosts: impl ExactSizeIterator<Item = usize>) {
        self.batches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hosts.len());
        hosts.for_each(|h| self.record(h));
    }

    fn refused(&self) -> SourceError {
        SourceError::Unsupported("the test source cannot copy its memory".into())
    }
}

// SAFETY: every memory operation is the fake's, which keeps the contract,
// passed the backend's arguments unchanged; the queries and the recording
// touch no memory.
unsafe impl MemorySource for TestSource {
    fn info(&self) -> SourceInfo {
        let info = self.fake.info();
        if self.fixed {
            return SourceInfo {
                granularity: 1,
                growable: false,
                ..info
            };
        }
        info
    }

    fn allocate(&self, bytes: usize, align: usize) -> Result<usize, SourceError> {
        self.fake.allocate(bytes, align)
    }

    unsafe fn free(&self, addr: usize, bytes: usize, align: usize) {
        // SAFETY: the backend's contract, passed on.
        unsafe { self.fake.free(addr, bytes, align) }
    }

    fn reserve(&self, max_bytes: usize, align: usize) -> Result<usize, SourceError> {
        if self.fixed {
            return Err(SourceError::NotGrowable);
        }
        self.fake.reserve(max_bytes, align)
    }

    fn commit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        if self.fixed {
            return Err(SourceError::NotGrowable);
        }
        self.fake.commit(base, from, to)
    }

    unsafe fn decommit(&self, base: usize, from: usize, to: usize) -> Result<(), SourceError> {
        if self.fixed {
            return Err(SourceError::NotGrowable);
        }
        // SAFETY: as in `free`.
        unsafe { self.fake.decommit(base, from, to) }
    }

    unsafe fn unreserve(&self, base: usize, max_bytes: usize, committed: usize) {
        // SAFETY: as in `free`.
        unsafe { self.fake.unreserve(base, max_bytes, committed) }
    }

    fn addressable(&self) -> bool {
        self.fake.addressable()
    }

    fn mem_info(&self) -> Result<Option<DeviceReading>, SourceError> {
        self.reading.clone()
    }

    fn extra_charges(&self, committed: u64) -> Vec<SourceCharge> {
        const MIB: u64 = 1 << 20;
        let Some(held) = &self.held else {
            return Vec::new();
        };
        vec![
            SourceCharge {
                key: "held".into(),
                label: "kept for reuse".into(),
                bytes: held.load(Ordering::Relaxed),
            },
            SourceCharge {
                key: "rounding".into(),
                label: "mapped past the ledger".into(),
                bytes: committed.div_ceil(MIB) * MIB - committed,
            },
        ]
    }

    fn pinned_host(&self) -> Option<Arc<dyn PinnedHostOps>> {
        self.pinned.clone().map(|p| p as Arc<dyn PinnedHostOps>)
    }

    fn stream_order(&self) -> Result<Arc<dyn StreamOrder>, MemError> {
        match &self.order {
            Some(order) => Ok(Arc::new(order.clone())),
            None => self.fake.stream_order(),
        }
    }

    unsafe fn copy_to_host(&self, src: usize, dst: *mut u8, len: usize) -> Result<(), SourceError> {
        if !self.copies {
            return Err(self.refused());
        }
        self.record(dst as usize);
        // SAFETY: the caller's contract, passed on.
        unsafe { self.fake.copy_to_host(src, dst, len) }
    }

    unsafe fn copy_from_host(
        &self,
        dst: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), SourceError> {
        if !self.copies {
            return Err(self.refused());
        }
        self.record(src as usize);
        // SAFETY: the caller's contract, passed on.
        unsafe { self.fake.copy_from_host(dst, src, len) }
    }

    unsafe fn copy_to_host_many(&self, copies: &[ToHost]) -> Result<(), SourceError> {
        if !self.copies {
            return Err(self.refused());
        }
        self.record_batch(copies.iter().map(|c| c.1 as usize));
        // SAFETY: the caller's contract, passed on.
        unsafe { self.fake.copy_to_host_many(copies) }
    }

    unsafe fn copy_from_host_many(&self, copies: &[FromHost]) -> Result<(), SourceError> {
        if !self.copies {
            return Err(self.refused());
        }
        self.record_batch(copies.iter().map(|c| c.1 as usize));
        // SAFETY: the caller's contract, passed on.
        unsafe { self.fake.copy_from_host_many(copies) }
    }
}

/// The source conformance suite over a source with no growable regions
/// (the shape of `CudaSource`), on the fake's memory.
#[cfg(feature = "conformance")]
mod fixed_source_conformance {
    #![allow(clippy::unwrap_used)] // test harness code: a failed unwrap is a failed test

    use std::sync::Arc;

    use super::TestSource;
    use crate::backend::Backend;
    use crate::conformance::{Probe, Subject, FIXED_UNIT};
    use crate::fake::{FakeBackend, FakeConfig};
    use crate::phase::PhaseMode;

    /// 64 of the suite's units of a fixed source.
    const CAPACITY: u64 = 64 * FIXED_UNIT;

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
            ..FakeConfig::default()
        })
        .unwrap();
        let source = Arc::new(TestSource {
            fixed: true,
            ..TestSource::over(fake.source().clone())
        });
        let backend = Backend::new(source.clone(), PhaseMode::Strict, budget).unwrap();
        Subject {
            backend,
            source,
            probe: Box::new(FakeProbe(fake)),
        }
    }

    crate::memory_source_conformance!(open, cases = 32);
}

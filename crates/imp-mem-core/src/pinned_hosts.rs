//! The process's pinned hosts: one over ordinary host memory for a backend
//! whose source has no pinned memory of its own (the fake, a machine
//! without CUDA), and one per device over that device's source, made on
//! first use. Every tier that stages through pinned memory on a device
//! (a sleep's host copy, the KV host tier, a `PinnedBuffer`) takes the same
//! `PinnedHost`, so its counters are the device's whole pinned footprint
//! and [`process_pinned_stats`] is the process's.
//!
//! Thread safety: a lock around the per-device list; nothing else is done
//! under it (the stats are read after it is released).

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::backend::Backend;
use crate::pinned::{FakePinnedHost, PinnedHost, PinnedStats};

/// The host memory a backend without pinned memory of its own stages
/// through: ordinary host memory, up to 1 TiB.
pub fn fake_pinned_host() -> PinnedHost {
    static HOST: OnceLock<PinnedHost> = OnceLock::new();
    HOST.get_or_init(|| PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 40))))
        .clone()
}

fn device_hosts() -> &'static Mutex<Vec<(i32, PinnedHost)>> {
    static HOSTS: OnceLock<Mutex<Vec<(i32, PinnedHost)>>> = OnceLock::new();
    HOSTS.get_or_init(|| Mutex::new(Vec::new()))
}

/// The pinned host memory that goes with `backend`: its device's (one
/// `PinnedHost` per device, over the first backend's source that asks), or
/// [`fake_pinned_host`] for a source with none.
pub fn pinned_host_for(backend: &Backend) -> PinnedHost {
    let Some(ops) = backend.pinned_host() else {
        return fake_pinned_host();
    };
    let device = backend.info().device;
    let mut hosts = device_hosts()
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some((_, host)) = hosts.iter().find(|(d, _)| *d == device) {
        return host.clone();
    }
    let host = PinnedHost::new(ops);
    hosts.push((device, host.clone()));
    host
}

/// Live pinned bytes and counts over the fake pinned host and every
/// device's; the peak is the sum of each one's peak.
pub fn process_pinned_stats() -> PinnedStats {
    let hosts: Vec<PinnedHost> = device_hosts()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|(_, h)| h.clone())
        .collect();
    let mut s = fake_pinned_host().stats();
    for t in hosts.iter().map(PinnedHost::stats) {
        s.live_bytes += t.live_bytes;
        s.buffers += t.buffers;
        s.registered_bytes += t.registered_bytes;
        s.registrations += t.registrations;
        s.failures += t.failures;
        s.peak_bytes += t.peak_bytes;
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use std::sync::Arc;

    use super::{pinned_host_for, process_pinned_stats};
    use crate::backend::Backend;
    use crate::fake::{FakeBackend, FakeConfig};
    use crate::phase::PhaseMode;
    use crate::pinned::FakePinnedHost;
    use crate::test_source::TestSource;

    fn with_pinned() -> Backend {
        let fake = FakeBackend::new(FakeConfig::default()).unwrap();
        let source = Arc::new(TestSource {
            pinned: Some(Arc::new(FakePinnedHost::new(1 << 30))),
            ..TestSource::over(fake.source().clone())
        });
        Backend::new(source, PhaseMode::Strict, None).unwrap()
    }

    #[test]
    fn one_device_has_one_pinned_host_and_the_process_counts_every_one() {
        // Two backends of device 0 (the fake's), each source with pinned
        // memory of its own: the first one's becomes the device's. No other
        // test asks the registry for a device's host.
        let (a, b) = (with_pinned(), with_pinned());
        let plain = FakeBackend::new(FakeConfig::default()).unwrap();
        let held = pinned_host_for(&a).allocate(4096).unwrap();
        assert_eq!(pinned_host_for(&b).stats().live_bytes, 4096);
        let before = process_pinned_stats().live_bytes;
        assert!(before >= 4096);
        // A source without pinned memory stages through the fake host,
        // which the process's figure counts too.
        let staged = pinned_host_for(plain.backend()).allocate(8192).unwrap();
        assert!(process_pinned_stats().live_bytes >= 4096 + 8192);
        drop((held, staged));
        assert_eq!(pinned_host_for(&b).stats().live_bytes, 0);
        assert_eq!(pinned_host_for(&b).stats().peak_bytes, 4096);
    }
}

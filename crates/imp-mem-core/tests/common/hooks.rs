//! What the allocator hooks' test binaries share: the hooks are
//! process-wide, so each binary runs its tests one at a time on them.

use std::sync::{Arc, Mutex, MutexGuard};

use imp_mem_core::activations::hooks;
use imp_mem_core::{ActivationConfig, ActivationPool, FakeBackend, FakeConfig, NoStreams};

/// One test at a time: they share the hooks.
static SERIAL: Mutex<()> = Mutex::new(());

/// The test's turn at the hooks (held until it ends) and a fresh fake
/// backend.
pub fn serial_on_a_fake() -> (MutexGuard<'static, ()>, FakeBackend) {
    let turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    (turn, FakeBackend::new(FakeConfig::default()).unwrap())
}

/// The hooks' counter `name` (`u64::MAX` where there is none).
pub fn count(name: &str) -> u64 {
    hooks::stats()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map_or(u64::MAX, |(_, v)| v)
}

/// A 1 MiB activation pool on `fb`.
pub fn open(fb: &FakeBackend) -> ActivationPool {
    ActivationPool::new(fb, &ActivationConfig::new(1 << 20), Arc::new(NoStreams)).unwrap()
}

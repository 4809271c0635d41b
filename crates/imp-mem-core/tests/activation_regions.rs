//! The core of `imp_mem.torch` regions (issue 24), on the fake backend: an
//! activation pool that sleeps keeping its live blocks' bytes in pinned host
//! memory and wakes at the same addresses with them, and the allocator
//! hooks routing a thread's mallocs to a region and every free back to it.
//!
//! Its own test binary: the hooks' counters and regions are process-wide.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::Arc;

use imp_mem_core::activations::hooks;
use imp_mem_core::fake::POISON;
use imp_mem_core::{
    ActivationConfig, ActivationPool, FakeBackend, FakeConfig, FakePinnedHost, MemError, NoStreams,
    PinnedHost,
};

const MIB: u64 = 1 << 20;

fn fake() -> FakeBackend {
    FakeBackend::new(FakeConfig {
        capacity: 64 * MIB,
        granularity: 64 * 1024,
        ..FakeConfig::default()
    })
    .unwrap()
}

fn region(fb: &FakeBackend, growable: bool) -> ActivationPool {
    let mut config = ActivationConfig::new(4 * MIB);
    config.growable = growable;
    config.strict = Some(true);
    ActivationPool::new(fb, &config, Arc::new(NoStreams)).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| match (i as u8).wrapping_mul(7).wrapping_add(seed) {
            b if b == POISON => 1,
            b => b,
        })
        .collect()
}

#[test]
fn a_sleep_keeping_the_bytes_restores_every_live_block_at_its_address() {
    let fb = fake();
    let host = PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 30)));
    let pool = region(&fb, true);
    let sizes = [5000usize, 70_000, 512, 100_000];
    let mut live: Vec<(usize, Vec<u8>)> = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let addr = pool.allocate(len as u64, 0).unwrap();
        let data = pattern(i as u8, len);
        fb.write(addr, &data).unwrap();
        live.push((addr, data));
    }
    // A freed block in the middle is not copied.
    let (gone, _) = live.remove(1);
    pool.free(gone, 0).unwrap();
    let copied = pool.sleep_keeping(&host).unwrap();
    let live_bytes = pool.stats().allocated;
    assert_eq!(copied, live_bytes, "exactly the live blocks");
    assert_eq!(pool.committed(), 0);
    assert_eq!(pool.asleep(), Some(1));
    assert_eq!(pool.host_bytes(), copied);
    for (addr, data) in &live {
        assert!(fb.is_poisoned(*addr, data.len()).unwrap(), "given back");
    }
    assert!(matches!(pool.allocate(64, 0), Err(MemError::Asleep(_))));
    assert!(pool.sleep_keeping(&host).is_err(), "already asleep");
    pool.wake().unwrap();
    assert_eq!(pool.committed(), pool.capacity());
    for (addr, data) in &live {
        assert_eq!(&fb.read(*addr, data.len()).unwrap(), data);
    }
    pool.check_invariants().unwrap();
    // The second sleep copies into the same buffer.
    pool.sleep_keeping(&host).unwrap();
    pool.wake().unwrap();
    assert_eq!(host.stats().buffers, 1);
    assert_eq!(pool.release_host_copy(), copied);
    assert_eq!(host.stats().live_bytes, 0);
    for (addr, _) in live {
        pool.free(addr, 0).unwrap();
    }
    assert_eq!(fb.device_used(), fb.stats().total.committed);
}

#[test]
fn a_refused_sleep_or_wake_changes_nothing_and_a_retry_works() {
    let fb = fake();
    let pool = region(&fb, true);
    let addr = pool.allocate(10_000, 0).unwrap();
    let data = pattern(9, 10_000);
    fb.write(addr, &data).unwrap();
    // The host cannot pin the copy: the pool stays awake, bytes in place.
    let small = PinnedHost::new(Arc::new(FakePinnedHost::new(1024)));
    assert!(matches!(
        pool.sleep_keeping(&small),
        Err(MemError::OutOfMemory(_))
    ));
    assert_eq!((pool.asleep(), pool.committed()), (None, pool.capacity()));
    assert_eq!(fb.read(addr, data.len()).unwrap(), data);
    // A refused recommit: it sleeps on, and a retry brings the bytes back.
    let host = PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 30)));
    pool.sleep_keeping(&host).unwrap();
    fb.fail_commits(1);
    assert!(pool.wake().is_err());
    assert_eq!((pool.asleep(), pool.committed()), (Some(1), 0));
    pool.wake().unwrap();
    assert_eq!(fb.read(addr, data.len()).unwrap(), data);
    // A fixed region cannot sleep.
    let fixed = region(&fb, false);
    assert!(matches!(
        fixed.sleep_keeping(&host),
        Err(MemError::BackendUnavailable(_))
    ));
    pool.free(addr, 0).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn the_hooks_route_a_threads_mallocs_to_its_region_and_frees_back_from_any_thread() {
    let fb = fake();
    let pool = region(&fb, true);
    hooks::add_region(pool.clone(), 0);
    assert!(hooks::set_region(Some(u64::MAX)).is_err(), "no such region");
    assert_eq!(hooks::set_region(Some(pool.id())).unwrap(), None);
    let p = hooks::malloc(3000, 0, 0);
    assert!(p != 0 && pool.contains(p));
    assert_eq!(hooks::malloc(3000, 1, 0), 0, "wrong device");
    // Another thread has not selected the region; nothing is installed.
    let other = std::thread::spawn(|| hooks::malloc(64, 0, 0))
        .join()
        .unwrap();
    assert_eq!(other, 0);
    // A free from another thread comes back to the region.
    std::thread::spawn(move || hooks::free(p, Some(3000), 0, 0))
        .join()
        .unwrap();
    assert_eq!(pool.stats().live, 0);
    // Asleep, the region refuses: torch sees null and raises its OOM.
    let host = PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 30)));
    pool.sleep_keeping(&host).unwrap();
    assert_eq!(hooks::malloc(64, 0, 0), 0);
    pool.wake().unwrap();
    assert_eq!(hooks::set_region(None).unwrap(), Some(pool.id()));
    assert!(hooks::remove_region(pool.id()));
    assert!(!hooks::remove_region(pool.id()));
    assert_eq!(hooks::current_region(), None);
}

#[test]
fn a_region_removed_with_a_live_block_and_added_again_is_no_longer_retired() {
    let fb = fake();
    let pool = region(&fb, true);
    hooks::add_region(pool.clone(), 0);
    let previous = hooks::set_region(Some(pool.id())).unwrap();
    let p = hooks::malloc(4096, 0, 0);
    assert!(p != 0 && pool.contains(p));
    hooks::set_region(previous).unwrap();
    // Removed with the block live: retired, its free still reaches it.
    assert!(hooks::remove_region(pool.id()));
    assert!(hooks::retired_pool_ids().contains(&pool.id()));
    // Added again (a Pool over the same tier reopened): a region, not
    // retired, and the block's free goes home through the regions.
    hooks::add_region(pool.clone(), 0);
    assert!(!hooks::retired_pool_ids().contains(&pool.id()));
    hooks::free(p, Some(4096), 0, 0);
    assert_eq!(pool.stats().live, 0);
    assert!(hooks::remove_region(pool.id()));
    // Nothing live: removal retires nothing, and only the test's own
    // handle keeps the pool.
    assert!(!hooks::retired_pool_ids().contains(&pool.id()));
    pool.check_invariants().unwrap();
}

/// torch_memory_saver's `get_cpu_backup` and its first pause at the line
/// rate (issue 51): the buffer pinned ahead is the one the sleep copies
/// into, and each live block's bytes are found in the copy while asleep and
/// in the kept buffer after the wake, until it is re-pinned or freed.
#[test]
fn the_host_copy_is_pinned_ahead_and_each_blocks_bytes_are_found_in_it() {
    let fb = fake();
    let host = PinnedHost::new(Arc::new(FakePinnedHost::new(1 << 30)));
    let pool = region(&fb, true);
    let a = pool.allocate(5000, 0).unwrap();
    let gap = pool.allocate(3000, 0).unwrap();
    let b = pool.allocate(9000, 0).unwrap();
    pool.free(gap, 0).unwrap();
    let (da, db) = (pattern(3, 5000), pattern(9, 9000));
    fb.write(a, &da).unwrap();
    fb.write(b, &db).unwrap();
    let live = pool.stats().allocated;
    assert_eq!(pool.host_copy_of(a - pool.base(), 16), None, "no copy yet");
    assert_eq!(pool.pin_host_copy(live as usize, &host).unwrap(), live);
    assert_eq!(
        pool.pin_host_copy(10, &host).unwrap(),
        live,
        "a large enough spare stays"
    );
    let ahead = host.stats();
    pool.sleep_keeping(&host).unwrap();
    assert_eq!(
        host.stats().buffers,
        ahead.buffers,
        "the sleep pinned nothing"
    );
    assert_eq!(
        pool.pin_host_copy(live as usize, &host).unwrap(),
        0,
        "asleep: untouched"
    );
    let read = |addr: usize, len: usize| {
        // SAFETY: the fake host's buffer is plain memory of at least the
        // copied bytes, alive while the pool keeps it (not freed below
        // before these reads).
        unsafe { std::slice::from_raw_parts(addr as *const u8, len).to_vec() }
    };
    let at_a = pool.host_copy_of(a - pool.base(), 5000).unwrap();
    let at_b = pool.host_copy_of(b - pool.base() + 100, 200).unwrap();
    assert_eq!(read(at_a, 5000), da);
    assert_eq!(read(at_b, 200), db[100..300].to_vec());
    assert_eq!(
        pool.host_copy_of(gap - pool.base(), 16),
        None,
        "a free block is not copied"
    );
    assert_eq!(
        pool.host_copy_of(a - pool.base(), 1 << 20),
        None,
        "past the block"
    );
    pool.wake().unwrap();
    assert_eq!(
        pool.host_copy_of(a - pool.base(), 5000),
        Some(at_a),
        "kept after the wake"
    );
    assert_eq!(read(at_a, 5000), da);
    assert_eq!(
        pool.pin_host_copy(live as usize * 2, &host).unwrap(),
        live * 2
    );
    assert_eq!(
        pool.host_copy_of(a - pool.base(), 5000),
        None,
        "re-pinned: nothing kept"
    );
    assert_eq!(pool.release_host_copy(), live * 2);
    assert_eq!(host.stats().live_bytes, 0);
    pool.free(a, 0).unwrap();
    pool.free(b, 0).unwrap();
}

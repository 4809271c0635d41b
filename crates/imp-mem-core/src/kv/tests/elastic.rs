//! The elastic KV pool (issue 27): loads and admissions over a growable
//! pool, giving memory back chunk by chunk, the device ledger's grants and
//! pressure, and `reserve_free`.

use super::*;

/// A manager over a growable pool of 1 KiB blocks, 8 committed (its floor),
/// up to 64, in chunks of 4 blocks (one 4 KiB granule of the fake).
fn elastic(fake: &FakeBackend) -> (crate::SharedBlockPool, KVCacheManager) {
    let cfg = crate::PoolConfig::growable(1024, 8, 64, 4).with_tag(crate::Tag::KvCache);
    let pool = crate::SharedBlockPool::new(fake.backend(), &cfg).unwrap();
    let m = KVCacheManager::with_pools(KvConfig::new(4, 64), pool.clone(), None).unwrap();
    (pool, m)
}

/// A load whose file proves corrupted only in its last block (found while
/// copying, after the reservation grew the pool) gives the growth back: the
/// refusal leaves the capacity and the committed bytes as they were.
#[test]
fn a_load_refused_part_way_gives_back_the_growth_it_made() {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let (pool, mut m) = elastic(&fake);
    m.admit(1, &toks(0..64), none()).unwrap(); // 16 blocks: grown from 8
    m.free(1, None).unwrap();
    let (_dir, path) = tmp("c.bin");
    assert_eq!(m.save_prefix_cache(&path).unwrap(), 16);
    assert_eq!(m.evict(u32::MAX), 16);
    pool.shrink_now(NothingInFlight).unwrap();
    assert_eq!(pool.stats().capacity, 8);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 16 - 7; // the last block's bytes, before the trailer
    bytes[at] ^= 0x10;
    let bad = path.with_file_name("bad.bin");
    std::fs::write(&bad, bytes).unwrap();
    let before = m.stats();
    assert!(m.load_prefix_cache(&bad).is_err());
    assert_eq!(m.stats(), before, "a refused load changes nothing");
    assert_eq!(pool.stats().capacity, 8);
    assert_eq!(pool.stats().committed_bytes, 8 * 1024);
    m.check_invariants().unwrap();
    assert_eq!(
        m.load_prefix_cache(&path).unwrap(),
        16,
        "the good file loads"
    );
    assert_eq!(pool.stats().capacity, 16);
}

#[test]
fn give_back_evicts_the_cache_chunk_by_chunk_and_keeps_live_sequences() {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let (pool, mut m) = elastic(&fake);
    m.admit(1, &toks(0..32), none()).unwrap(); // blocks 0..8
    m.admit(2, &toks(100..164), none()).unwrap(); // blocks 8..24
    m.admit(3, &toks(500..516), none()).unwrap(); // blocks 24..28
    m.free(2, None).unwrap(); // 16 blocks into the prefix cache
    assert_eq!(pool.stats().committed_bytes, 28 * 1024);
    assert_eq!(m.stats().cached, 16);
    // Sequence 3 holds the top chunk: nothing above it is free, and its
    // chunk cannot go, so nothing is given back.
    assert_eq!(m.give_back(u64::MAX, 0, NothingInFlight).unwrap(), 0);
    assert_eq!(m.stats().cached, 16, "no entry is evicted for nothing");
    m.abort(3).unwrap();
    m.admit(3, &toks(500..508), none()).unwrap(); // 2 blocks of 24..28
                                                  // Keeping 4 free blocks for running sequences: the tail above them is
                                                  // kept, and no cached chunk goes.
    assert_eq!(m.give_back(u64::MAX, 4, NothingInFlight).unwrap(), 0);
    assert_eq!(m.stats().cached, 16);
    m.abort(3).unwrap();
    // Now: the free tail first (4 blocks), then the cache's chunks from the
    // top; 8 KiB asked is met after one cached chunk.
    let given = m.give_back(8 * 1024, 0, NothingInFlight).unwrap();
    assert_eq!(given, 8 * 1024);
    assert_eq!(pool.stats().committed_bytes, 20 * 1024);
    assert_eq!(m.stats().cached, 12);
    // All of it: down to sequence 1's blocks, which are also the floor.
    let given = m.give_back(u64::MAX, 0, NothingInFlight).unwrap();
    assert_eq!(given, 12 * 1024);
    assert_eq!(pool.stats().committed_bytes, 8 * 1024);
    assert_eq!(m.stats().cached, 0);
    assert_eq!(m.num_tokens(1).unwrap(), 32);
    m.check_invariants().unwrap();
    fake.check_invariants().unwrap();
    // It grows again on demand, the cache refilled from scratch.
    m.admit(4, &toks(100..164), none()).unwrap();
    assert_eq!(m.stats().capacity, 24);
}

#[test]
fn on_a_ledger_admission_counts_the_granted_room_and_pressure_moves_memory() {
    use crate::ledger::DeviceLedger;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    // A device of 40 KiB shared by two KV tenants with 8 KiB floors.
    let ledger = DeviceLedger::open(dir.path(), "fake-elastic", 40 * 1024).unwrap();
    let fakes = [0, 1].map(|_| FakeBackend::new(FakeConfig::default()).unwrap());
    let tenants = [0, 1].map(|i| {
        let t = ledger
            .join(&format!("t{i}"), 8 * 1024, 64 * 1024, Duration::ZERO)
            .unwrap();
        let t = Arc::new(t);
        fakes[i].attach_ledger(Arc::clone(&t)).unwrap();
        t
    });
    let (pa, mut a) = elastic(&fakes[0]);
    let (_pb, mut b) = elastic(&fakes[1]);
    // a takes all the elastic room: 40 - 8 (b's floor) = 32 KiB.
    a.admit(1, &toks(0..128), none()).unwrap();
    assert_eq!(pa.stats().committed_bytes, 32 * 1024);
    a.free(1, None).unwrap();
    // b needs 16 blocks; 8 are its own, the ledger grants no more: refused
    // at admission (nothing changed), and its want presses on a.
    assert!(!b.can_admit(&toks(1000..1064), &none()));
    let err = b.admit(2, &toks(1000..1064), none()).unwrap_err();
    assert!(matches!(err, MemError::KvCapacity(_)), "{err:?}");
    assert_eq!(tenants[0].pressure().unwrap(), 8 * 1024);
    // a's step answers: evicts two cached chunks and decommits them.
    assert_eq!(a.ledger_tick(0, NothingInFlight).unwrap(), 8 * 1024);
    assert_eq!(tenants[0].record().unwrap().committed, 24 * 1024);
    assert_eq!(tenants[0].record().unwrap().kv_live, 32 * 1024);
    b.admit(2, &toks(1000..1064), none()).unwrap();
    assert_eq!(tenants[1].record().unwrap().committed, 16 * 1024);
    assert_eq!(a.ledger_tick(0, NothingInFlight).unwrap(), 0);
    let snap = ledger.snapshot().unwrap();
    assert!(snap.committed() <= snap.budget);
    a.check_invariants().unwrap();
    b.check_invariants().unwrap();
}

#[test]
fn reserve_free_commits_ahead_and_evicts_only_where_growth_is_refused() {
    let fake = FakeBackend::new(FakeConfig {
        capacity: 24 * 1024,
        ..FakeConfig::default()
    })
    .unwrap();
    let (pool, mut m) = elastic(&fake);
    m.reserve_free(12).unwrap();
    assert_eq!(pool.stats().free, 12);
    m.admit(1, &toks(0..64), none()).unwrap(); // 16 blocks
    m.free(1, None).unwrap(); // all cached; 24 KiB committed = the budget
    assert_eq!(m.stats().cached, 16);
    // 24 free: the 16 cached evicted, 8 more committed up to the budget.
    let before = m.stats().cached;
    m.reserve_free(24).unwrap();
    assert_eq!(pool.stats().free, 24);
    assert!(m.stats().cached < before);
    // More than the budget allows: refused, nothing changed.
    let stats = m.stats();
    assert!(m.reserve_free(25).is_err());
    assert_eq!(m.stats(), stats);
    m.check_invariants().unwrap();
}

//! The KV cache manager's unit tests: admission, prefix hits, eviction,
//! pins, SWA, growable and shared pools, events, the tiers' hand-offs and
//! the invariant walk. Prefix-cache persistence is tested in `persist.rs`,
//! the elastic KV pool (issue 27) in `elastic.rs`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::block_pool::SharedBlockPool;
use crate::decommit::NothingInFlight;
use crate::error::MemError;
use crate::fake::{FakeBackend, FakeConfig};
use crate::kv::persist::{HostBuf, BUFFERS};

mod elastic;
mod persist;

fn none() -> ExtraKeys {
    ExtraKeys::default()
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

fn slots(block_size: usize, blocks: u32) -> KVCacheManager {
    KVCacheManager::new(KvConfig::new(block_size, blocks), None).unwrap()
}

/// A path `name` in a fresh temporary directory (kept while the dir lives).
fn tmp(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    (dir, path)
}

/// A manager over a fake backend, with bytes per block (and so the
/// BlockIo it installs itself).
fn backed(blocks: u32, block_bytes: usize) -> (KVCacheManager, FakeBackend) {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut cfg = KvConfig::new(4, blocks);
    cfg.block_bytes = block_bytes;
    cfg.model_fingerprint = "test-model".into();
    cfg.dtype = "bf16".into();
    cfg.layout = "block-major".into();
    let m = KVCacheManager::new(cfg, Some(fake.backend())).unwrap();
    (m, fake)
}

#[test]
fn a_freed_prefix_is_cached_and_hit_by_the_next_request() {
    let mut m = slots(4, 16);
    let a = m.admit(1, &toks(0..10), none()).unwrap();
    assert_eq!((a.cached_tokens, a.blocks, a.new_blocks), (0, 3, 3));
    let t1 = m.block_table(1).unwrap().to_vec();
    m.free(1, None).unwrap();
    let s = m.stats();
    assert_eq!(
        (s.cached, s.live, s.active, s.evictable),
        (2, 2, 0, 2),
        "{s:?}"
    );

    let b = m.admit(2, &toks(0..12), none()).unwrap();
    assert_eq!((b.cached_tokens, b.new_blocks), (8, 1));
    let t2 = m.block_table(2).unwrap().to_vec();
    assert_eq!(&t2[..2], &t1[..2], "the hit blocks are the cached ones");
    assert_eq!(
        m.pool().refcount(t2[0] as u32),
        1,
        "the cache entry's ref only: the sequence is a user of the entry (K16)"
    );
    let s = m.stats();
    assert_eq!((s.evictable, s.active, s.prefix_hit_blocks), (0, 3, 2));
    m.check_invariants().unwrap();
    m.free(2, None).unwrap();
    assert_eq!(m.stats().cached, 3);
    m.check_invariants().unwrap();
}

#[test]
fn a_full_hit_still_leaves_one_token_to_compute() {
    let mut m = slots(4, 16);
    m.admit(1, &toks(0..8), none()).unwrap();
    m.free(1, None).unwrap();
    let a = m.admit(2, &toks(0..8), none()).unwrap();
    assert_eq!(a.cached_tokens, 4);
    assert_eq!(a.new_blocks, 1);
    m.check_invariants().unwrap();
}

#[test]
fn extra_keys_keep_prefixes_apart() {
    let mut m = slots(4, 16);
    let salt = |s: &str| ExtraKeys {
        cache_salt: Some(s.as_bytes().to_vec()),
        ..ExtraKeys::default()
    };
    m.admit(1, &toks(0..9), salt("a")).unwrap();
    m.free(1, None).unwrap();
    assert_eq!(m.admit(2, &toks(0..9), salt("b")).unwrap().cached_tokens, 0);
    assert_eq!(m.admit(3, &toks(0..9), salt("a")).unwrap().cached_tokens, 8);
    m.check_invariants().unwrap();
}

#[test]
fn a_refused_admission_reports_the_arithmetic_and_changes_nothing() {
    let mut m = slots(4, 8);
    m.admit(1, &toks(0..16), none()).unwrap(); // 4 blocks
    m.admit(2, &toks(100..108), none()).unwrap(); // 2 blocks
    m.free(2, None).unwrap(); // 2 cached, evictable
    m.pin(9, &toks(100..104), &none()).unwrap(); // 1 of them pinned
    let before = m.stats();
    let err = m.admit(3, &toks(200..220), none()).unwrap_err(); // 5 blocks
    match &err {
        MemError::KvCapacity(r) => {
            assert_eq!(
                (r.needed, r.free, r.evictable, r.pinned),
                (5, 2, 1, 1),
                "{err}"
            );
        }
        other => panic!("expected KvCapacity, got {other:?}"),
    }
    assert!(err.to_string().contains("nothing was changed"), "{err}");
    assert_eq!(m.stats(), before);
    assert!(!m.can_admit(&toks(200..220), &none()));
    assert!(m.can_admit(&toks(200..212), &none()));
    m.check_invariants().unwrap();
    // An append that does not fit is refused whole, too.
    let err = m.append(1, &toks(0..20)).unwrap_err();
    assert!(matches!(err, MemError::KvCapacity(_)), "{err}");
    assert_eq!(m.num_tokens(1).unwrap(), 16);
    assert_eq!(m.stats(), before);
}

#[test]
fn int32_ids_are_checked_after_hashing_and_a_refusal_changes_nothing() {
    // A negative int32 id read as u32 has its top bit set.
    let neg = |v: i32| v as u32;
    for caching in [true, false] {
        let mut cfg = KvConfig::new(4, 16);
        cfg.enable_prefix_caching = caching;
        let mut m = KVCacheManager::new(cfg, None).unwrap();
        m.admit(1, &toks(0..8), none()).unwrap();
        m.free(1, None).unwrap();
        // In a full block (the hashed part) and in the partial last block;
        // the first bad id is named.
        for (at, len) in [(2, 10), (5, 10), (9, 10), (0, 4), (3, 4)] {
            let mut ids = toks(0..len);
            ids[at] = neg(-7);
            if at + 1 < ids.len() {
                ids[at + 1] = neg(-8);
            }
            let before = m.stats();
            let err = m.admit_from(2, &ids, IdSource::I32, none()).unwrap_err();
            assert!(
                matches!(&err, MemError::InvalidArgument(msg)
                    if msg == "tokens: token id -7 is outside 0 to 4294967295 (ids are unsigned 32-bit)"),
                "caching {caching}, bad id at {at}: {err}"
            );
            assert_eq!(m.stats(), before, "a refused admission changed something");
            assert!(m.num_tokens(2).is_err());
            m.check_invariants().unwrap();
            // The same ids as u32 are ids like any other.
            m.admit_from(2, &ids, IdSource::U32, none()).unwrap();
            m.abort(2).unwrap();
        }
        let a = m
            .admit_from(2, &toks(0..10), IdSource::I32, none())
            .unwrap();
        assert_eq!(a.cached_tokens, if caching { 8 } else { 0 });
        m.check_invariants().unwrap();
    }
}

#[test]
fn allocation_evicts_lru_and_skips_pinned_and_in_use() {
    let mut cfg = KvConfig::new(2, 6);
    cfg.pin_budget = 4;
    let mut m = KVCacheManager::new(cfg, None).unwrap();
    for (id, start) in [(1u64, 0u32), (2, 10), (3, 20)] {
        m.admit(id, &toks(start..start + 4), none()).unwrap();
        m.free(id, None).unwrap();
    }
    assert_eq!(m.stats().cached, 6);
    assert_eq!(m.pin(7, &toks(0..4), &none()).unwrap(), 2);
    // Sequence 1's prefix (oldest) is pinned; 2 is older than 3.
    m.admit(4, &toks(50..54), none()).unwrap();
    let hashes_2 = m.hash_blocks(&toks(10..14), &none());
    let cached: Vec<_> = m.cached_blocks().iter().map(|c| c.0).collect();
    assert!(
        !cached.contains(&hashes_2[0]),
        "the LRU unpinned prefix went first"
    );
    assert_eq!(m.probe(&toks(0..5), &none()), 2, "the pinned one stayed");
    assert_eq!(m.unpin(7), 2);
    assert_eq!(m.stats().evictable, 4);
    assert_eq!(m.evict(10), 4);
    assert_eq!(m.stats().cached, 0);
    m.check_invariants().unwrap();
}

#[test]
fn the_pin_budget_unpins_the_oldest_owner() {
    let mut cfg = KvConfig::new(2, 16);
    cfg.pin_budget = 3;
    let mut m = KVCacheManager::new(cfg, None).unwrap();
    for (id, start) in [(1u64, 0u32), (2, 10)] {
        m.admit(id, &toks(start..start + 5), none()).unwrap();
        m.free(id, None).unwrap();
    }
    assert_eq!(m.pin(1, &toks(0..4), &none()).unwrap(), 2);
    assert_eq!(m.pin(2, &toks(10..14), &none()).unwrap(), 2);
    let s = m.stats();
    assert_eq!((s.pins, s.pinned), (2, 2), "owner 1 made room");
    assert_eq!(m.unpin(1), 0);
    assert!(matches!(
        m.pin(3, &toks(0..6), &none()),
        Ok(2) // only two blocks of that prefix are cached
    ));
    m.check_invariants().unwrap();
    let mut tight = KvConfig::new(2, 16);
    tight.pin_budget = 1;
    let mut m = KVCacheManager::new(tight, None).unwrap();
    m.admit(1, &toks(0..5), none()).unwrap();
    m.free(1, None).unwrap();
    assert!(matches!(
        m.pin(1, &toks(0..4), &none()),
        Err(MemError::Capacity(_))
    ));
}

#[test]
fn evict_middle_leaves_holes_and_keeps_post_hole_blocks_out_of_the_cache() {
    let mut m = slots(2, 16);
    m.admit(1, &toks(0..9), none()).unwrap(); // 5 blocks, 4 full
    assert_eq!(m.evict_middle(1, 1, 3).unwrap(), 2);
    assert_eq!(m.block_table(1).unwrap().len(), 5);
    let t = m.block_table(1).unwrap().to_vec();
    assert_eq!((t[1], t[2]), (-1, -1));
    assert!(t[0] >= 0 && t[3] >= 0);
    assert_eq!(m.cacheable_limit(1).unwrap(), Some(4));
    m.append(1, &toks(9..13)).unwrap(); // fills block 4, adds block 5 (full) and 6
    m.check_invariants().unwrap();
    assert!(m.evict_middle(1, 0, 9).is_err(), "only full blocks");
    m.free(1, None).unwrap();
    // Blocks 0 and 3 (computed before the eviction) are cached; 4 and 5 are not.
    let cached: Vec<_> = m.cached_blocks().iter().map(|c| c.0).collect();
    let h = m.hash_blocks(&toks(0..13), &none());
    assert!(cached.contains(&h[0]) && cached.contains(&h[3]));
    assert!(!cached.contains(&h[4]) && !cached.contains(&h[5]));
    assert_eq!(cached.len(), 2);
    m.check_invariants().unwrap();
}

#[test]
fn abort_and_partial_compute_cache_nothing_uncomputed() {
    let mut m = slots(2, 16);
    m.admit(1, &toks(0..8), none()).unwrap();
    m.abort(1).unwrap();
    assert_eq!(m.stats().cached, 0);
    m.admit(2, &toks(0..8), none()).unwrap();
    m.free(2, Some(5)).unwrap();
    assert_eq!(m.stats().cached, 2, "two full blocks were computed");
    assert_eq!(m.stats().live, 2);
    m.check_invariants().unwrap();
}

#[test]
fn swa_keeps_only_the_trailing_window_in_its_own_id_space() {
    let mut cfg = KvConfig::new(4, 32);
    cfg.swa_blocks = 6;
    cfg.swa_window = 8;
    let mut m = KVCacheManager::new(cfg, None).unwrap();
    m.admit(1, &toks(0..10), none()).unwrap(); // blocks 0..3; window [2, 10) → blocks 0..3
    assert_eq!(
        m.swa_table(1).unwrap().iter().filter(|&&b| b >= 0).count(),
        3
    );
    m.append(1, &toks(10..30)).unwrap(); // 30 tokens, 8 blocks; window [22, 30) → blocks 5..8
    let swa = m.swa_table(1).unwrap().to_vec();
    assert_eq!(swa.len(), 8);
    assert_eq!(&swa[..5], &[-1; 5]);
    assert!(swa[5..].iter().all(|&b| b >= 0));
    assert_eq!(m.stats().swa_live, 3);
    m.check_invariants().unwrap();
    // The SWA pool is its own id space: 6 blocks, and a second sequence
    // whose window needs 3 more fits, a third does not.
    m.admit(2, &toks(100..130), none()).unwrap();
    let err = m.admit(3, &toks(200..212), none()).unwrap_err();
    match err {
        MemError::KvCapacity(r) => assert_eq!(r.pool, "swa"),
        other => panic!("{other:?}"),
    }
    m.free(1, None).unwrap();
    m.free(2, None).unwrap();
    let s = m.stats();
    assert_eq!((s.swa_live, s.swa_free), (0, 6));
    // Cached main blocks never include an SWA block: SWA tokens cannot reach
    // the cache (their wrapper has no way in, and the cache refuses a token
    // of another pool).
    let swa_pool = m.swa_pool().unwrap().clone();
    let mut stray = None;
    swa_pool.allocate_tokens(1, |t| stray = Some(t)).unwrap();
    let mut cache = prefix::PrefixCache::new(m.pool());
    let (_, back) = cache.insert(1, stray.unwrap(), 0).unwrap_err();
    assert_eq!(cache.len(), 0);
    swa_pool.release_tokens([back]).unwrap();
    assert_eq!(swa_pool.stats().live, 0, "the refused token came back");
    m.check_invariants().unwrap();
}

#[test]
fn a_failed_construction_releases_what_it_acquired() {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut cfg = KvConfig::new(4, 8);
    cfg.block_bytes = 64;
    cfg.swa_blocks = 4;
    cfg.swa_window = 8;
    cfg.swa_block_bytes = 64;
    fake.fail_nth(Some(2)).unwrap(); // the SWA pool's region
    assert!(matches!(
        KVCacheManager::new(cfg.clone(), Some(fake.backend())),
        Err(MemError::OutOfMemory(_))
    ));
    assert_eq!(fake.live(), 0, "the main pool's region was released");
    let m = KVCacheManager::new(cfg, Some(fake.backend())).unwrap();
    assert!(fake.live() >= 12 * 64);
    drop(m);
    assert_eq!(fake.live(), 0);
}

#[test]
fn bad_configs_say_what_to_change() {
    for cfg in [
        KvConfig::new(0, 8),
        KvConfig::new(4, 0),
        KvConfig {
            swa_blocks: 4,
            ..KvConfig::new(4, 8)
        },
        KvConfig {
            pin_budget: 9,
            ..KvConfig::new(4, 8)
        },
        KvConfig {
            block_bytes: 64,
            ..KvConfig::new(4, 8)
        },
    ] {
        assert!(
            matches!(
                KVCacheManager::new(cfg.clone(), None),
                Err(MemError::InvalidArgument(_))
            ),
            "{cfg:?}"
        );
    }
}

#[test]
fn duplicate_and_unknown_sequences_are_refused() {
    let mut m = slots(4, 8);
    m.admit(1, &toks(0..5), none()).unwrap();
    assert!(matches!(
        m.admit(1, &toks(0..5), none()),
        Err(MemError::InvalidArgument(_))
    ));
    assert!(m.free(2, None).is_err());
    assert!(m.block_table(2).is_err());
    assert_eq!(m.stats().sequences, 1);
    m.check_invariants().unwrap();
}

#[test]
fn blocks_cached_while_running_are_hit_by_concurrent_requests() {
    let mut m = slots(4, 32);
    m.admit(1, &toks(0..14), none()).unwrap(); // 3 full blocks + 2 tokens
    assert_eq!(m.admit(2, &toks(0..14), none()).unwrap().cached_tokens, 0);
    m.abort(2).unwrap();
    // The engine computed 9 tokens: two full blocks may be cached now.
    assert_eq!(m.cache_computed(1, 9).unwrap(), 2);
    assert_eq!(m.cache_computed(1, 9).unwrap(), 0, "offered once");
    let s = m.stats();
    assert_eq!(
        (s.cached, s.evictable, s.active),
        (2, 0, 4),
        "in use, not evictable"
    );
    let a = m.admit(3, &toks(0..14), none()).unwrap();
    assert_eq!(a.cached_tokens, 8);
    let t1 = m.block_table(1).unwrap().to_vec();
    let t3 = m.block_table(3).unwrap().to_vec();
    assert_eq!(
        t1[..2],
        t3[..2],
        "running sequences share through the cache"
    );
    assert_eq!(
        m.pool().refcount(t1[0] as u32),
        1,
        "users of the entry hold no ref"
    );
    m.check_invariants().unwrap();
    m.free(1, None).unwrap(); // caches block 2 too
    m.check_invariants().unwrap();
    m.abort(3).unwrap();
    let s = m.stats();
    assert_eq!((s.cached, s.evictable, s.active, s.live), (3, 3, 0, 3));
    m.check_invariants().unwrap();
}

/// A growable pool of 8 committed blocks that can grow to 32, 4 at a time.
fn growable_pool(fake: &FakeBackend) -> crate::SharedBlockPool {
    let cfg = crate::PoolConfig::growable(1024, 8, 32, 4).with_tag(crate::Tag::KvCache);
    crate::SharedBlockPool::new(fake.backend(), &cfg).unwrap()
}

#[test]
fn a_manager_over_a_growable_pool_admits_into_the_room_it_can_grow() {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let pool = growable_pool(&fake);
    // The pool decides the sizes; the config's are replaced.
    let mut m = KVCacheManager::with_pools(KvConfig::new(4, 1), pool.clone(), None).unwrap();
    assert_eq!(m.config().num_blocks, 32);
    assert_eq!(m.config().block_bytes, 1024);
    let s = m.stats();
    assert_eq!((s.capacity, s.max_blocks, s.free), (8, 32, 8), "{s:?}");

    // 20 blocks: more than the 8 committed, within the 32 it can grow to.
    assert!(m.can_admit(&toks(0..80), &none()));
    let a = m.admit(1, &toks(0..80), none()).unwrap();
    assert_eq!(a.new_blocks, 20);
    assert!(pool.stats().growths > 0);
    assert!(m.stats().capacity >= 20);
    m.check_invariants().unwrap();

    // 13 more would pass the maximum: refused, with the room in the report.
    let before = m.stats();
    match m.admit(2, &toks(1000..1052), none()) {
        Err(MemError::KvCapacity(r)) => {
            assert_eq!(r.needed, 13);
            assert_eq!(r.free + r.growable, 12, "{r:?}");
            assert!(r.to_string().contains("uncommitted"), "{r}");
        }
        other => panic!("expected a KV capacity refusal, got {other:?}"),
    }
    assert!(!m.can_admit(&toks(1000..1052), &none()));
    assert_eq!(m.stats(), before, "a refusal changes nothing");
    // 12 fit exactly (free + room).
    m.admit(2, &toks(1000..1048), none()).unwrap();
    assert_eq!(m.stats().capacity, 32);
    assert!(!m.can_append(2, 1).unwrap());
    m.check_invariants().unwrap();
    m.abort(1).unwrap();
    m.abort(2).unwrap();
    assert_eq!(pool.stats().live, 0);
}

#[test]
fn appends_grow_the_pool_and_a_refused_growth_changes_nothing() {
    // A budget that lets the pool commit 16 of its 32 blocks.
    let fake = FakeBackend::new(FakeConfig {
        capacity: 16 * 1024,
        ..FakeConfig::default()
    })
    .unwrap();
    let pool = growable_pool(&fake);
    let mut m = KVCacheManager::with_pools(KvConfig::new(4, 32), pool.clone(), None).unwrap();
    m.admit(1, &toks(0..32), none()).unwrap();
    m.append(1, &toks(32..64)).unwrap();
    assert_eq!(pool.stats().capacity, 16);
    // Admission counts the room up to the pool's maximum; the backend's
    // budget refuses the commit, and the append changes nothing.
    assert!(m.can_append(1, 4).unwrap());
    let before = m.stats();
    let err = m.append(1, &toks(64..68)).unwrap_err();
    assert!(matches!(err, MemError::OutOfMemory(_)), "{err:?}");
    assert_eq!(m.stats(), before);
    assert_eq!(m.num_tokens(1).unwrap(), 64);
    m.check_invariants().unwrap();
}

#[test]
fn with_pools_refuses_pools_it_cannot_account_for() {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let pool = growable_pool(&fake);
    let held = pool.allocate().unwrap();
    let err = KVCacheManager::with_pools(KvConfig::new(4, 32), pool.clone(), None).unwrap_err();
    assert!(err.to_string().contains("live block"), "{err}");
    drop(held);
    // The SWA pool is a second id space, never the main pool.
    let mut cfg = KvConfig::new(4, 32);
    cfg.swa_window = 8;
    let err =
        KVCacheManager::with_pools(cfg.clone(), pool.clone(), Some(pool.clone())).unwrap_err();
    assert!(err.to_string().contains("own id space"), "{err}");
    // A window without an SWA pool, or an SWA pool without a window.
    let err = KVCacheManager::with_pools(cfg, pool.clone(), None).unwrap_err();
    assert!(err.to_string().contains("swa_window"), "{err}");
    let swa = crate::SharedBlockPool::slots(8).unwrap();
    let err = KVCacheManager::with_pools(KvConfig::new(4, 32), pool, Some(swa)).unwrap_err();
    assert!(err.to_string().contains("swa_window"), "{err}");
}

#[test]
fn a_manager_over_existing_pools_serves_swa_from_its_own_pool() {
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let pool = growable_pool(&fake);
    let swa = crate::SharedBlockPool::new(
        fake.backend(),
        &crate::PoolConfig::fixed(64, 8).with_tag(crate::Tag::SwaCache),
    )
    .unwrap();
    let mut cfg = KvConfig::new(4, 0);
    cfg.swa_window = 8;
    let mut m = KVCacheManager::with_pools(cfg, pool, Some(swa.clone())).unwrap();
    assert_eq!((m.config().swa_blocks, m.config().swa_block_bytes), (8, 64));
    m.admit(1, &toks(0..20), none()).unwrap();
    assert_eq!(
        m.swa_table(1).unwrap().iter().filter(|&&b| b >= 0).count(),
        2
    );
    assert_eq!(swa.stats().live, 2);
    m.check_invariants().unwrap();
    m.free(1, None).unwrap();
    assert_eq!(swa.stats().live, 0);
}

#[test]
fn an_evicted_block_moves_straight_to_the_new_sequence() {
    // K16: the pool is full of cached blocks; a new request takes the LRU
    // entries' blocks as they are (no release and re-allocation).
    let mut m = slots(4, 4);
    m.admit(1, &toks(0..17), none()).unwrap_err(); // 5 blocks: too many
    m.admit(1, &toks(0..16), none()).unwrap();
    let old = m.block_table(1).unwrap().to_vec();
    m.free(1, None).unwrap();
    assert_eq!((m.stats().cached, m.stats().free), (4, 0));
    let a = m.admit(2, &toks(100..116), none()).unwrap();
    assert_eq!((a.cached_tokens, a.new_blocks), (0, 4));
    let mut new = m.block_table(2).unwrap().to_vec();
    let mut was = old.clone();
    new.sort_unstable();
    was.sort_unstable();
    assert_eq!(new, was, "the evicted blocks, reused");
    let s = m.stats();
    assert_eq!((s.cached, s.evictions, s.live, s.free), (0, 4, 4, 0));
    for id in new {
        assert_eq!(m.pool().refcount(id as u32), 1);
    }
    m.check_invariants().unwrap();
}

#[test]
fn dropping_the_manager_gives_every_block_back_to_pools_it_shares() {
    // Over pools opened elsewhere (a MemorySystem's), the manager's tokens
    // do not release on their own: its Drop must hand everything back.
    let main = SharedBlockPool::slots(32).unwrap();
    let swa = SharedBlockPool::slots(16).unwrap();
    let mut cfg = KvConfig::new(4, 32);
    cfg.swa_window = 8;
    let mut m = KVCacheManager::with_pools(cfg, main.clone(), Some(swa.clone())).unwrap();
    m.admit(1, &toks(0..20), none()).unwrap();
    m.cache_computed(1, 20).unwrap();
    m.admit(2, &toks(0..13), none()).unwrap(); // hits seq 1's blocks
    m.admit(3, &toks(50..62), none()).unwrap();
    m.free(3, None).unwrap(); // cached, evictable
    m.evict_middle(1, 1, 2).unwrap();
    m.check_invariants().unwrap();
    assert!(main.stats().live > 0 && swa.stats().live > 0);
    drop(m);
    assert_eq!((main.stats().live, main.stats().refs), (0, 0));
    assert_eq!((swa.stats().live, swa.stats().refs), (0, 0));
    main.check_invariants().unwrap();
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "dropped without being released")]
fn a_leaked_token_panics_in_debug_builds() {
    let pool = SharedBlockPool::slots(4).unwrap();
    let mut held = Vec::new();
    pool.allocate_tokens(1, |t| held.push(t)).unwrap();
    drop(held);
}

#[test]
fn eviction_shortens_a_freed_prefix_from_its_end() {
    // Freed in reverse, a sequence's last block is its LRU entry: evicting
    // one block keeps the rest of the prefix reachable.
    let mut cfg = KvConfig::new(2, 8);
    cfg.pin_budget = 8;
    let mut m = KVCacheManager::new(cfg, None).unwrap();
    m.admit(1, &toks(0..9), none()).unwrap(); // 4 full blocks + 1 token
    m.free(1, None).unwrap();
    assert_eq!(m.probe(&toks(0..9), &none()), 4);
    assert_eq!(m.evict(1), 1);
    assert_eq!(m.probe(&toks(0..9), &none()), 3, "blocks 0..3 still hit");
    assert_eq!(m.evict(2), 2);
    assert_eq!(m.probe(&toks(0..9), &none()), 1);
    // A prefix hit's entries are released the same way.
    m.admit(2, &toks(0..9), none()).unwrap();
    m.free(2, None).unwrap();
    assert_eq!(m.evict(3), 3);
    assert_eq!(m.probe(&toks(0..9), &none()), 1);
    // And so are unpinned ones.
    m.admit(3, &toks(0..9), none()).unwrap();
    m.free(3, None).unwrap();
    assert_eq!(m.pin(5, &toks(0..9), &none()).unwrap(), 4);
    assert_eq!(m.unpin(5), 4);
    assert_eq!(m.evict(1), 1);
    assert_eq!(m.probe(&toks(0..9), &none()), 3);
    m.check_invariants().unwrap();
}

#[test]
fn an_overflowed_event_log_resyncs_with_the_cached_set() {
    use crate::kv::events::{KvEvent, Medium};
    let mut cfg = KvConfig::new(4, 32);
    cfg.kv_events = true;
    let mut m = KVCacheManager::new(cfg, None).unwrap();
    m.events.set_limit(5);
    for id in 0..4u64 {
        m.admit(id, &toks(id as u32 * 100..id as u32 * 100 + 9), none())
            .unwrap();
        m.free(id, None).unwrap();
    }
    m.evict(1);
    let events = m.drain_events();
    assert_eq!(events[0], KvEvent::AllBlocksCleared);
    let mut replayed: Vec<BlockHash> = events[1..]
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                medium: Medium::Device,
                ..
            } => block_hashes.clone(),
            other => panic!("a resync stores only: {other:?}"),
        })
        .collect();
    let mut cached: Vec<BlockHash> = m.cached_blocks().iter().map(|c| c.0).collect();
    replayed.sort_unstable();
    cached.sort_unstable();
    assert_eq!((replayed.len(), replayed), (7, cached));
    // Back to normal recording after the resync.
    assert_eq!(m.evict(1), 1);
    assert!(matches!(
        &m.drain_events()[..],
        [KvEvent::BlockRemoved { .. }]
    ));
}

#[test]
fn block_tables_write_a_batch_padded_and_refuse_without_writing() {
    let mut cfg = KvConfig::new(4, 32);
    cfg.swa_blocks = 8;
    cfg.swa_window = 8;
    let mut m = KVCacheManager::new(cfg, None).unwrap();
    m.admit(1, &toks(0..10), none()).unwrap(); // 3 blocks
    m.admit(2, &toks(100..130), none()).unwrap(); // 8 blocks, window in 5..8
    m.evict_middle(2, 1, 2).unwrap(); // a hole at block 1
    let mut out = vec![9i32; 2 * 10];
    assert_eq!(m.block_tables(&[2, 1], &mut out, 10, false).unwrap(), 8);
    let t2 = m.block_table(2).unwrap().to_vec();
    let t1 = m.block_table(1).unwrap().to_vec();
    assert_eq!(t2[1], -1, "the hole");
    assert_eq!(&out[..8], &t2[..]);
    assert_eq!(&out[8..10], &[-1, -1]);
    assert_eq!(&out[10..13], &t1[..]);
    assert!(out[13..].iter().all(|&b| b == -1));

    let mut swa = vec![0i32; 2 * 8];
    assert_eq!(m.block_tables(&[1, 2], &mut swa, 8, true).unwrap(), 8);
    assert_eq!(&swa[8..], m.swa_table(2).unwrap());
    assert_eq!(&swa[..3], m.swa_table(1).unwrap());
    assert_eq!(&swa[3..8], &[-1; 5]);

    // Too narrow, unknown, or a wrong length: refused, nothing written.
    let mut out = vec![5i32; 2 * 7];
    let err = m.block_tables(&[1, 2], &mut out, 7, false).unwrap_err();
    assert!(err.to_string().contains("at least 8"), "{err}");
    assert!(out.iter().all(|&b| b == 5));
    let err = m.block_tables(&[1, 3], &mut out, 7, false).unwrap_err();
    assert!(err.to_string().contains("no sequence 3"), "{err}");
    assert!(out.iter().all(|&b| b == 5));
    assert!(m.block_tables(&[1], &mut out, 7, false).is_err());
    assert_eq!(m.block_tables(&[], &mut [], 0, false).unwrap(), 0);
    let mut plain = slots(4, 8);
    plain.admit(1, &toks(0..4), none()).unwrap();
    let err = plain.block_tables(&[1], &mut [0; 4], 4, true).unwrap_err();
    assert!(err.to_string().contains("no SWA pool"), "{err}");
}

#[test]
fn append_each_stops_at_the_first_sequence_that_does_not_fit() {
    let mut m = slots(4, 4);
    m.admit(1, &toks(0..4), none()).unwrap(); // 1 block, full
    m.admit(2, &toks(10..13), none()).unwrap(); // 1 block, room for 1
    m.admit(3, &toks(20..28), none()).unwrap(); // 2 blocks, full: the pool is full
                                                // 2 fits in its block; 1 needs a new block: stop there.
    assert_eq!(m.append_each(&[2, 1, 3], &[7, 8, 9]).unwrap(), 1);
    assert_eq!(m.num_tokens(2).unwrap(), 4);
    assert_eq!((m.num_tokens(1).unwrap(), m.num_tokens(3).unwrap()), (4, 8));
    m.free(3, None).unwrap();
    assert_eq!(m.append_each(&[1, 2], &[8, 8]).unwrap(), 2);
    assert_eq!((m.num_tokens(1).unwrap(), m.num_tokens(2).unwrap()), (5, 5));
    // An unknown id or a length mismatch appends nothing.
    assert!(m.append_each(&[1, 9], &[1, 1]).is_err());
    assert!(m.append_each(&[1], &[1, 1]).is_err());
    assert_eq!(m.num_tokens(1).unwrap(), 5);
    m.check_invariants().unwrap();
}
// ------------------------------------------------------ issue 14 (hardening)

#[test]
fn a_second_manager_on_one_pool_is_refused_until_the_first_drops() {
    let pool = SharedBlockPool::slots(16).unwrap();
    let first = KVCacheManager::with_pools(KvConfig::new(4, 16), pool.clone(), None).unwrap();
    let err = KVCacheManager::with_pools(KvConfig::new(4, 16), pool.clone(), None).unwrap_err();
    assert!(
        err.to_string().contains("already serves a KV manager"),
        "{err}"
    );
    let err = pool.allocate().unwrap_err();
    assert!(err.to_string().contains("belongs to a KV manager"), "{err}");
    assert!(pool.allocate_many(2).is_err());
    drop(first);
    assert!(!pool.is_claimed());
    KVCacheManager::with_pools(KvConfig::new(4, 16), pool, None).unwrap();
}

#[test]
fn a_snapshot_held_across_evictions_is_counted_by_the_invariant_walk() {
    let (mut m, _fake) = backed(16, 32);
    m.admit(1, &toks(0..16), none()).unwrap();
    m.free(1, None).unwrap();
    let snap = m.snapshot_prefix_cache().unwrap();
    m.check_invariants().unwrap();
    // Evicting every entry leaves the snapshot's refs as the only ones.
    assert_eq!(m.evict(16), 4);
    m.check_invariants().unwrap();
    assert_eq!(m.stats().free, 12);
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(snap.write(&dir.path().join("c.bin")).unwrap(), 4);
    assert_eq!(m.stats().free, 16);
    m.check_invariants().unwrap();
}

#[test]
fn a_load_in_steps_is_counted_while_its_blocks_are_lent() {
    let (mut m, _fake) = backed(16, 32);
    m.admit(1, &toks(0..16), none()).unwrap();
    m.free(1, None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.bin");
    m.save_prefix_cache(&path).unwrap();
    let (mut other, _fake2) = backed(16, 32);
    let file = other.load_target().unwrap().verify(&path).unwrap();
    let mut pending = other.reserve_load(file).unwrap();
    other.check_invariants().unwrap();
    pending.copy_in().unwrap();
    // Meanwhile the same prefix was cached here: the loaded duplicate is
    // released, not inserted twice.
    other.admit(2, &toks(0..8), none()).unwrap();
    other.free(2, None).unwrap();
    other.check_invariants().unwrap();
    assert_eq!(other.finish_load(pending).unwrap(), 2);
    other.check_invariants().unwrap();
    assert_eq!(other.stats().cached, 4);
}

#[test]
fn loading_with_prefix_caching_off_is_refused() {
    let (mut m, _fake) = backed(16, 32);
    m.admit(1, &toks(0..16), none()).unwrap();
    m.free(1, None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.bin");
    m.save_prefix_cache(&path).unwrap();
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut cfg = KvConfig::new(4, 16);
    cfg.block_bytes = 32;
    cfg.enable_prefix_caching = false;
    let mut off = KVCacheManager::new(cfg, Some(fake.backend())).unwrap();
    let err = off.load_prefix_cache(&path).unwrap_err();
    assert!(err.to_string().contains("prefix caching off"), "{err}");
    assert_eq!(off.stats().live, 0);
}

#[test]
fn a_directory_is_not_a_prefix_cache_file() {
    let (mut m, _fake) = backed(16, 32);
    let dir = tempfile::tempdir().unwrap();
    let err = m.load_prefix_cache(dir.path()).unwrap_err();
    assert!(err.to_string().contains("not a regular file"), "{err}");
    let err = m.save_prefix_cache(dir.path()).unwrap_err();
    assert!(err.to_string().contains("not a regular file"), "{err}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]

    /// `can_append` is the block arithmetic done in `u128`, for any count:
    /// nothing wraps or truncates into a count that fits.
    #[test]
    fn can_append_is_exact_for_any_count(
        blocks in 1u32..64,
        bs in 1usize..32,
        have in 1usize..2048,
        n in proptest::prop_oneof![0usize..4096, proptest::prelude::any::<usize>()],
    ) {
        let mut m = slots(bs, blocks);
        let have = have.min(blocks as usize * bs);
        m.admit(1, &toks(0..have as u32), none()).unwrap();
        let used = have.div_ceil(bs) as u128;
        let need = (have as u128 + n as u128).div_ceil(bs as u128) - used;
        proptest::prop_assert_eq!(m.can_append(1, n).unwrap(), need <= blocks as u128 - used);
    }
}

// ------------------------------------- issue 14 x issue 17 (merge of both)

#[test]
fn lent_refs_and_offloads_in_flight_are_both_counted_and_a_load_leaves_one_tier() {
    use crate::kv::events::{KvEvent, Medium};
    use crate::kv::FakeTierIo;
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut cfg = KvConfig::new(4, 16);
    cfg.block_bytes = 32;
    cfg.kv_events = true;
    let mut m = KVCacheManager::new(cfg, Some(fake.backend())).unwrap();
    // Copies run only when told (or waited for).
    let tier = FakeTierIo::new(fake.clone(), 32, 8, false).unwrap();
    m.set_host_tier(Box::new(tier.clone())).unwrap();
    m.admit(1, &toks(0..16), none()).unwrap();
    m.free(1, None).unwrap();
    let snap = m.snapshot_prefix_cache().unwrap();
    // Two entries evicted into the host tier: their copies are in flight
    // while the snapshot still lends a ref on every block.
    assert_eq!(m.evict(2), 2);
    assert_eq!(m.offloading(), 2);
    m.check_invariants().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.bin");
    assert_eq!(snap.write(&path).unwrap(), 4);
    m.check_invariants().unwrap();
    tier.advance(8).unwrap();
    m.poll_copies(true).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.host_cached_blocks().len(), 2);
    let _ = m.drain_events();

    // The load brings the two evicted blocks back onto the device: stored
    // there, and dropped from the host tier (one tier per hash).
    assert_eq!(m.load_prefix_cache(&path).unwrap(), 2);
    m.check_invariants().unwrap();
    assert!(m.host_cached_blocks().is_empty());
    assert_eq!(m.stats().cached, 4);
    let events = m.drain_events();
    let count = |want: Medium, stored: bool| {
        events
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } if stored && *medium == want => block_hashes.len(),
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } if !stored && *medium == want => block_hashes.len(),
                _ => 0,
            })
            .sum::<usize>()
    };
    assert_eq!(count(Medium::Device, true), 2, "{events:?}");
    assert_eq!(count(Medium::Host, false), 2, "{events:?}");
}

#[test]
fn an_older_offload_of_a_host_hit_finishing_during_its_admission_frees_its_slot() {
    // The minimal form of a `kv_host_props` failure: a prefix block evicted
    // twice (a miss recomputed it while its first offload was in flight),
    // the first copy resident on the host, the second still in flight when
    // an admission takes the resident copy as a host hit and must wait for
    // the offloads to make room. The second offload completes inside the
    // admission, before the onboarded block is a device entry: it must
    // not make the hash resident again beside the onboarded copy.
    use crate::kv::events::{KvEvent, Medium};
    use crate::kv::FakeTierIo;
    use std::collections::HashSet;
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut cfg = KvConfig::new(4, 4);
    cfg.block_bytes = 32;
    cfg.kv_events = true;
    let mut m = KVCacheManager::new(cfg, Some(fake.backend())).unwrap();
    // Copies run only when told (or waited for).
    let tier = FakeTierIo::new(fake.clone(), 32, 4, false).unwrap();
    m.set_host_tier(Box::new(tier.clone())).unwrap();
    let head = m.hash_blocks(&toks(0..4), &none())[0];
    for id in [1, 2] {
        let a = m.admit(id, &toks(0..5), none()).unwrap();
        assert_eq!(a.cached_tokens, 0, "the first offload is still in flight");
        m.free(id, None).unwrap();
        assert_eq!(m.evict(1), 1);
    }
    assert_eq!(m.offloading(), 2);
    // The first offload completes: the hash is a host hit.
    assert_eq!(tier.advance(1).unwrap(), 1);
    assert_eq!(m.poll_copies(false).unwrap(), 1);
    assert_eq!(m.host_cached_blocks(), vec![head]);
    // Four blocks, one a host hit: the free three are short by the block
    // the second offload holds, so the admission waits for it.
    let a = m.admit(3, &toks(0..13), none()).unwrap();
    assert_eq!((a.cached_tokens, a.onboarded_blocks), (4, 1));
    assert_eq!(m.offloading(), 0);
    m.check_invariants().unwrap();
    assert!(m.host_cached_blocks().is_empty(), "one tier per hash");
    assert_eq!(m.stats().host_free, 3, "the second copy's slot is free");
    m.wait_onboarding(3, None).unwrap();
    m.poll_copies(true).unwrap();
    assert_eq!(m.stats().host_free, 4);
    m.check_invariants().unwrap();
    // The router's view agrees: the hash is on the device only.
    let mut index = HashSet::new();
    for e in m.drain_events() {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                medium,
                ..
            } => {
                for h in block_hashes {
                    assert!(
                        index.insert((h, medium)),
                        "{h:x} stored twice on {medium:?}"
                    );
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                for h in block_hashes {
                    assert!(
                        index.remove(&(h, medium)),
                        "{h:x} removed from {medium:?} unstored"
                    );
                }
            }
            KvEvent::AllBlocksCleared => index.clear(),
        }
    }
    assert_eq!(index, HashSet::from([(head, Medium::Device)]));
}

#[test]
fn an_admission_refused_after_an_older_offload_of_its_host_hit_finished_restores_one_copy() {
    // As above, with the onboarding copies refused: the admission gives the
    // host hit back, and the second offload, finished meanwhile, must not
    // have taken a second slot for the hash (the restore would overwrite
    // it, and the slot would be lost).
    use crate::kv::host_tier::{CopyTicket, TierIo};
    use crate::kv::FakeTierIo;
    #[derive(Debug)]
    struct NoOnboard(FakeTierIo);
    impl TierIo for NoOnboard {
        fn block_bytes(&self) -> usize {
            self.0.block_bytes()
        }
        fn slots(&self) -> u32 {
            self.0.slots()
        }
        fn offload(&mut self, dev_addr: usize, slot: u32) -> Result<CopyTicket, MemError> {
            self.0.offload(dev_addr, slot)
        }
        fn onboard(&mut self, _: u32, _: usize) -> Result<CopyTicket, MemError> {
            Err(MemError::invalid("no onboarding copies here"))
        }
        fn onboard_many(&mut self, _: &[(u32, usize)]) -> Result<Vec<CopyTicket>, MemError> {
            Err(MemError::invalid("no onboarding copies here"))
        }
        fn is_done(&mut self, ticket: CopyTicket) -> Result<bool, MemError> {
            self.0.is_done(ticket)
        }
        fn wait(&mut self, ticket: CopyTicket) -> Result<(), MemError> {
            self.0.wait(ticket)
        }
        fn read_slot(&mut self, slot: u32, dst: &mut [u8]) -> Result<(), MemError> {
            self.0.read_slot(slot, dst)
        }
        fn write_slot(&mut self, slot: u32, src: &[u8]) -> Result<(), MemError> {
            self.0.write_slot(slot, src)
        }
    }
    let fake = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut cfg = KvConfig::new(4, 4);
    cfg.block_bytes = 32;
    let mut m = KVCacheManager::new(cfg, Some(fake.backend())).unwrap();
    let tier = FakeTierIo::new(fake.clone(), 32, 4, false).unwrap();
    m.set_host_tier(Box::new(NoOnboard(tier.clone()))).unwrap();
    let head = m.hash_blocks(&toks(0..4), &none())[0];
    for id in [1, 2] {
        m.admit(id, &toks(0..5), none()).unwrap();
        m.free(id, None).unwrap();
        assert_eq!(m.evict(1), 1);
    }
    assert_eq!(tier.advance(1).unwrap(), 1);
    m.poll_copies(false).unwrap();
    assert_eq!(m.host_cached_blocks(), vec![head]);
    let err = m.admit(3, &toks(0..13), none()).unwrap_err();
    assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
    m.check_invariants().unwrap();
    assert_eq!(m.host_cached_blocks(), vec![head], "the hit is back, once");
    let s = m.stats();
    assert_eq!((s.host_cached, s.host_free, s.host_offloading), (1, 3, 0));
    assert_eq!((s.free, s.live), (4, 0));
}

#[test]
fn block_copies_stage_through_one_pinned_buffer_where_the_source_has_one() {
    use crate::source::MemorySource;
    for pin_fails in [false, true] {
        let fb = FakeBackend::new(FakeConfig::default()).unwrap();
        // The fake with pinned host memory, as a device source has.
        let source = Arc::new(crate::test_source::TestSource {
            pinned: Some(Arc::new(crate::pinned::FakePinnedHost::new(1 << 20))),
            ..crate::test_source::TestSource::over(fb.source().clone())
        });
        if pin_fails {
            source.pinned.as_ref().unwrap().fail_nth(Some(1));
        }
        let backend = crate::Backend::new(source.clone(), crate::PhaseMode::Strict, None).unwrap();
        let pool = SharedBlockPool::new(&backend, &crate::PoolConfig::fixed(64, 4)).unwrap();
        let io = PoolBlockIo::new(64);
        let blocks: Vec<_> = (0..4).map(|_| pool.allocate().unwrap()).collect();
        for (i, b) in blocks.iter().enumerate() {
            io.write_block(b, &[i as u8 + 1; 64]).unwrap();
        }
        for (i, b) in blocks.iter().enumerate() {
            let mut out = [0u8; 64];
            io.read_block(b, &mut out).unwrap();
            assert_eq!(out, [i as u8 + 1; 64], "block {i} (pin fails: {pin_fails})");
        }
        // A block of another length is refused whichever way it goes.
        assert!(io.read_block(&blocks[0], &mut [0u8; 32]).is_err());
        let hosts = source.hosts.lock().unwrap().clone();
        assert_eq!(hosts.len(), 8);
        let distinct: std::collections::BTreeSet<_> = hosts.iter().collect();
        if pin_fails {
            // Pinning failed once: every copy went straight to the caller's
            // buffers, and no staging buffer was kept.
            assert_eq!(source.pinned.as_ref().unwrap().live_allocations(), 0);
            assert!(distinct.len() > 1, "{hosts:?}");
        } else {
            // One pinned buffer, made at the first copy, served all eight.
            assert_eq!(source.pinned.as_ref().unwrap().live_allocations(), 1);
            assert_eq!(distinct.len(), 1, "{hosts:?}");
            assert_eq!(source.pinned_host().map(|_| ()), Some(()));
        }
        drop(io);
        assert_eq!(
            source.pinned.as_ref().unwrap().live_allocations(),
            0,
            "the buffer goes with the io"
        );
        drop(blocks);
        pool.check_invariants().unwrap();
    }
}

#[test]
fn the_host_tier_copies_with_the_engine_its_backends_source_gives() {
    use crate::phase::PhaseMode;
    use crate::tag::Tag;
    let fb = FakeBackend::new(FakeConfig {
        capacity: 1 << 20,
        ..FakeConfig::default()
    })
    .unwrap();
    // A source with no host tier (the trait's default), over the same memory.
    let plain = crate::backend::Backend::new(
        Arc::new(crate::test_source::TestSource::over(fb.source().clone())),
        PhaseMode::Strict,
        None,
    )
    .unwrap();
    // Refused without a backend, without block bytes, over a source without
    // a host tier: one message, naming the argument.
    for (backend, block_bytes) in [(None, 64), (Some(fb.backend()), 0), (Some(&plain), 64)] {
        let err = host_tier_io(backend, block_bytes, 4).unwrap_err();
        assert!(matches!(err, MemError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("host_blocks=4"), "{err}");
    }
    // The fake's: host memory copies that run as they are enqueued.
    let mut io = host_tier_io(Some(fb.backend()), 64, 4).unwrap();
    assert_eq!((io.block_bytes(), io.slots()), (64, 4));
    let block = fb.acquire(64, 64, Tag::KvCache).unwrap();
    fb.write(block.base(), &[7u8; 64]).unwrap();
    let ticket = io.offload(block.base(), 2).unwrap();
    assert!(io.is_done(ticket).unwrap());
    let mut back = vec![0u8; 64];
    io.read_slot(2, &mut back).unwrap();
    assert_eq!(back, vec![7u8; 64]);
    io.write_slot(1, &[9u8; 64]).unwrap();
    let ticket = io.onboard(1, block.base()).unwrap();
    io.wait(ticket).unwrap();
    assert_eq!(fb.read(block.base(), 64).unwrap(), vec![9u8; 64]);
}

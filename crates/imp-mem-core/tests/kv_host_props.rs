//! The host tier as a proptest state machine over the fake backend: random
//! admit / append / free / abort / commit / evict-middle / pin / unpin /
//! evict (into the host tier) / copy progress / poll / wait, with copies
//! held in flight on a fake copy stream that runs only when told.
//!
//! After every operation: the manager's walk (V4 on the pool, every ref held
//! by a sequence, a cache entry or an offload in flight, the host slots
//! partitioned, no hash cached in both tiers); a refused operation changes
//! nothing (V5); a router index replaying the KV events equals the cached
//! set of both tiers. Whenever the copy stream is idle, every cached device
//! block — onboarded ones included — holds the bytes the engine wrote for
//! its hash, so an onboarded block's bytes are the evicted block's.

use std::collections::HashSet;

use imp_mem_core::kv::{
    BlockHash, ExtraKeys, FakeTierIo, KVCacheManager, KvConfig, KvEvent, KvStats, Medium,
};
use imp_mem_core::{FakeBackend, FakeConfig, MemError};
use proptest::prelude::*;

const BS: usize = 4;
const BLOCKS: u32 = 12;
const HOST: u32 = 10;
/// The host tier in front of a disk tier: small, so that it spills.
const HOST_BEFORE_DISK: u32 = 4;
const BYTES: usize = 32;

#[derive(Debug, Clone)]
enum Op {
    Admit { fam: u8, len: usize },
    Append { seed: usize, n: usize },
    Free { seed: usize, pct: Option<u8> },
    Abort { seed: usize },
    Commit { seed: usize, pct: u8 },
    EvictMiddle { seed: usize, a: usize, b: usize },
    Pin { owner: u8, fam: u8, len: usize },
    Unpin { owner: u8 },
    Evict { n: u32 },
    Advance { n: usize },
    Poll { wait: bool },
    Wait { seed: usize },
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..6, 1usize..30).prop_map(|(fam, len)| Op::Admit { fam, len }),
        3 => (any::<usize>(), 1usize..10).prop_map(|(seed, n)| Op::Append { seed, n }),
        4 => (any::<usize>(), proptest::option::of(0u8..=100)).prop_map(|(seed, pct)| Op::Free { seed, pct }),
        1 => any::<usize>().prop_map(|seed| Op::Abort { seed }),
        2 => (any::<usize>(), 0u8..=100).prop_map(|(seed, pct)| Op::Commit { seed, pct }),
        1 => (any::<usize>(), 0usize..6, 0usize..6).prop_map(|(seed, a, b)| Op::EvictMiddle { seed, a, b }),
        2 => (0u8..3, 0u8..6, 1usize..30).prop_map(|(owner, fam, len)| Op::Pin { owner, fam, len }),
        1 => (0u8..3).prop_map(|owner| Op::Unpin { owner }),
        3 => (0u32..6).prop_map(|n| Op::Evict { n }),
        3 => (0usize..4).prop_map(|n| Op::Advance { n }),
        2 => any::<bool>().prop_map(|wait| Op::Poll { wait }),
        1 => any::<usize>().prop_map(|seed| Op::Wait { seed }),
        1 => Just(Op::Reset),
    ]
}

/// Families share their first 8 tokens pairwise, so prefixes overlap.
fn tokens(fam: u8, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if i < 8 {
                (fam as u32 / 2) * 100 + i
            } else {
                fam as u32 * 1000 + i
            }
        })
        .collect()
}

fn pattern(h: BlockHash) -> Vec<u8> {
    (0..BYTES)
        .map(|k| (h.wrapping_shr((k * 7) as u32 % 128) as u8) ^ (k as u8).wrapping_mul(13))
        .collect()
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

struct Seq {
    id: u64,
    written: usize,
}

struct Harness {
    fake: FakeBackend,
    tier: FakeTierIo,
    m: KVCacheManager,
    seqs: Vec<Seq>,
    next_id: u64,
    index: HashSet<(BlockHash, Medium)>,
    host: u32,
    _dir: Option<tempfile::TempDir>,
}

type Snapshot = (
    KvStats,
    Vec<(u64, Vec<i32>)>,
    Vec<BlockHash>,
    Vec<BlockHash>,
    Vec<BlockHash>,
);

impl Harness {
    fn new() -> Result<Self, TestCaseError> {
        Self::build(false)
    }

    /// `disk`: a host tier of [`HOST_BEFORE_DISK`] blocks that spills to a
    /// disk tier of about eight block files.
    fn build(disk: bool) -> Result<Self, TestCaseError> {
        let fake = FakeBackend::new(FakeConfig::default()).map_err(fail)?;
        let mut cfg = KvConfig::new(BS, BLOCKS);
        cfg.block_bytes = BYTES;
        cfg.pin_budget = 4;
        cfg.kv_events = true;
        let mut m = KVCacheManager::new(cfg, Some(fake.backend())).map_err(fail)?;
        let host = if disk { HOST_BEFORE_DISK } else { HOST };
        let tier = FakeTierIo::new(fake.clone(), BYTES, host, false).map_err(fail)?;
        m.set_host_tier(Box::new(tier.clone())).map_err(fail)?;
        let dir = if disk {
            let dir = tempfile::tempdir().map_err(fail)?;
            m.set_disk_tier(dir.path(), 8 * (BYTES as u64 + 600))
                .map_err(fail)?;
            Some(dir)
        } else {
            None
        };
        Ok(Self {
            host,
            _dir: dir,
            fake,
            tier,
            m,
            seqs: Vec::new(),
            next_id: 1,
            index: HashSet::new(),
        })
    }

    fn snapshot(&mut self) -> Result<Snapshot, TestCaseError> {
        let mut tables = Vec::new();
        for s in &self.seqs {
            tables.push((s.id, self.m.block_table(s.id).map_err(fail)?.to_vec()));
        }
        let cached = self.m.cached_blocks().iter().map(|c| c.0).collect();
        Ok((
            self.m.stats(),
            tables,
            cached,
            self.m.host_cached_blocks(),
            self.m.disk_cached_blocks(),
        ))
    }

    /// The engine computes the newly full blocks of a sequence, after its
    /// onboarding (its blocks' bytes must be there first).
    fn compute(&mut self, idx: usize) -> Result<(), TestCaseError> {
        let id = self.seqs[idx].id;
        let hashes = self.m.sequence_hashes(id).map_err(fail)?.to_vec();
        let limit = self
            .m
            .cacheable_limit(id)
            .map_err(fail)?
            .unwrap_or(usize::MAX);
        for (i, &h) in hashes.iter().enumerate().skip(self.seqs[idx].written) {
            if let Some((addr, _)) = self.m.block_span(id, i).map_err(fail)? {
                let bytes = if i < limit { pattern(h) } else { pattern(!h) };
                self.fake.write(addr, &bytes).map_err(fail)?;
            }
        }
        self.seqs[idx].written = hashes.len();
        Ok(())
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        self.m.check_invariants().map_err(fail)?;
        let s = self.m.stats();
        prop_assert_eq!(s.free + s.live, s.capacity, "V4 on the device pool");
        prop_assert_eq!(
            s.host_free + s.host_cached + s.host_offloading + s.host_onboarding,
            self.host,
            "V4 on the host tier"
        );
        prop_assert!(
            s.live >= s.active + s.evictable + s.host_offloading,
            "a block in flight is neither active nor evictable: {:?}",
            s
        );
        if self.tier.queued() == 0 {
            for (h, _, addr) in self.m.cached_blocks() {
                let addr = addr.ok_or_else(|| fail("a backed pool has addresses"))?;
                prop_assert_eq!(
                    self.fake.read(addr, BYTES).map_err(fail)?,
                    pattern(h),
                    "a cached (maybe onboarded) block's bytes"
                );
            }
        }
        let events = self.m.drain_events();
        for e in events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    ..
                } => {
                    for h in block_hashes {
                        prop_assert!(self.index.insert((h, medium)), "stored twice");
                    }
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    for h in block_hashes {
                        prop_assert!(self.index.remove(&(h, medium)), "removed unknown");
                    }
                }
                KvEvent::AllBlocksCleared => self.index.clear(),
            }
        }
        let mut want: HashSet<(BlockHash, Medium)> = self
            .m
            .cached_blocks()
            .into_iter()
            .map(|c| (c.0, Medium::Device))
            .collect();
        want.extend(
            self.m
                .host_cached_blocks()
                .into_iter()
                .map(|h| (h, Medium::Host)),
        );
        want.extend(
            self.m
                .disk_cached_blocks()
                .into_iter()
                .map(|h| (h, Medium::Disk)),
        );
        prop_assert_eq!(&self.index, &want, "the router's index of both tiers");
        Ok(())
    }

    fn pick(&self, seed: usize) -> Option<usize> {
        (!self.seqs.is_empty()).then(|| seed % self.seqs.len())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        let before = self.snapshot()?;
        let result: Result<(), MemError> = match op {
            Op::Admit { fam, len } => {
                let id = self.next_id;
                self.next_id += 1;
                let ids = tokens(fam, len);
                let fits = self.m.can_admit(&ids, &ExtraKeys::default());
                let probe = self.m.probe(&ids, &ExtraKeys::default());
                match self.m.admit(id, &ids, ExtraKeys::default()) {
                    Ok(a) => {
                        prop_assert!(fits, "can_admit agrees with admit");
                        prop_assert_eq!(a.cached_tokens, probe * BS, "probe counts host hits");
                        prop_assert!(a.cached_tokens < len);
                        let pending = self.m.onboarding(id).map_err(fail)?;
                        prop_assert!(pending.len() >= a.onboarded_blocks);
                        self.seqs.push(Seq {
                            id,
                            written: a.cached_tokens / BS,
                        });
                        let idx = self.seqs.len() - 1;
                        self.compute(idx)?;
                        Ok(())
                    }
                    Err(e) => {
                        prop_assert!(!fits, "can_admit agrees with admit: {}", e);
                        Err(e)
                    }
                }
            }
            Op::Append { seed, n } => match self.pick(seed) {
                Some(idx) => {
                    let id = self.seqs[idx].id;
                    let start = self.m.num_tokens(id).map_err(fail)? as u32;
                    let more: Vec<u32> = (start..start + n as u32).map(|t| t * 7 + 3).collect();
                    let fits = self.m.can_append(id, n).map_err(fail)?;
                    let r = self.m.append(id, &more);
                    prop_assert_eq!(fits, r.is_ok(), "can_append agrees with append");
                    if r.is_ok() {
                        self.compute(idx)?;
                    }
                    r
                }
                None => Ok(()),
            },
            Op::Free { seed, pct } => match self.pick(seed) {
                Some(idx) => {
                    let id = self.seqs[idx].id;
                    let n = self.m.num_tokens(id).map_err(fail)?;
                    let r = self.m.free(id, pct.map(|p| n * p as usize / 100));
                    if r.is_ok() {
                        self.seqs.swap_remove(idx);
                    }
                    r
                }
                None => Ok(()),
            },
            Op::Abort { seed } => match self.pick(seed) {
                Some(idx) => {
                    let r = self.m.abort(self.seqs[idx].id);
                    if r.is_ok() {
                        self.seqs.swap_remove(idx);
                    }
                    r
                }
                None => Ok(()),
            },
            Op::Commit { seed, pct } => match self.pick(seed) {
                Some(idx) => {
                    let id = self.seqs[idx].id;
                    let n = self.m.num_tokens(id).map_err(fail)?;
                    self.m
                        .cache_computed(id, n * pct as usize / 100)
                        .map(|_| ())
                }
                None => Ok(()),
            },
            Op::EvictMiddle { seed, a, b } => match self.pick(seed) {
                Some(idx) => self.m.evict_middle(self.seqs[idx].id, a, b).map(|_| ()),
                None => Ok(()),
            },
            Op::Pin { owner, fam, len } => self
                .m
                .pin(owner as u64, &tokens(fam, len), &ExtraKeys::default())
                .map(|_| ()),
            Op::Unpin { owner } => {
                self.m.unpin(owner as u64);
                Ok(())
            }
            Op::Evict { n } => {
                let evictable = self.m.stats().evictable;
                prop_assert_eq!(self.m.evict(n), n.min(evictable));
                Ok(())
            }
            Op::Advance { n } => {
                self.tier.advance(n).map_err(fail)?;
                Ok(())
            }
            Op::Poll { wait } => {
                self.m.poll_copies(wait).map_err(fail)?;
                if wait {
                    prop_assert_eq!(self.tier.queued(), 0);
                    let s = self.m.stats();
                    prop_assert_eq!((s.host_offloading, s.host_onboarding), (0, 0));
                }
                Ok(())
            }
            Op::Wait { seed } => match self.pick(seed) {
                Some(idx) => {
                    let id = self.seqs[idx].id;
                    let pending = self.m.onboarding(id).map_err(fail)?.len() as u32;
                    prop_assert_eq!(self.m.wait_onboarding(id, None).map_err(fail)?, pending);
                    prop_assert!(self.m.onboarding(id).map_err(fail)?.is_empty() || pending > 0);
                    // Every block the sequence reads is there now: its hits
                    // (onboarded ones included) and what it computed.
                    let hashes = self.m.sequence_hashes(id).map_err(fail)?.to_vec();
                    let limit = self
                        .m
                        .cacheable_limit(id)
                        .map_err(fail)?
                        .unwrap_or(usize::MAX);
                    for (i, &h) in hashes.iter().enumerate().take(self.seqs[idx].written) {
                        if let Some((addr, _)) = self.m.block_span(id, i).map_err(fail)? {
                            let want = if i < limit { pattern(h) } else { pattern(!h) };
                            prop_assert_eq!(
                                self.fake.read(addr, BYTES).map_err(fail)?,
                                want,
                                "block {} of sequence {} after its onboarding",
                                i,
                                id
                            );
                        }
                    }
                    Ok(())
                }
                None => Ok(()),
            },
            Op::Reset => {
                let idle = self.m.stats().evictable == self.m.stats().cached;
                prop_assert_eq!(self.m.reset_prefix_cache(), idle);
                if idle {
                    let s = self.m.stats();
                    prop_assert_eq!((s.cached, s.host_cached, s.disk_cached), (0, 0, 0));
                }
                Ok(())
            }
        };
        if let Err(e) = result {
            prop_assert!(
                matches!(
                    e,
                    MemError::KvCapacity(_) | MemError::Capacity(_) | MemError::InvalidArgument(_)
                ),
                "unexpected error {e}"
            );
            prop_assert_eq!(
                self.snapshot()?,
                before,
                "a refused operation changed something (V5)"
            );
        }
        self.check()
    }
}

fn run(ops: Vec<Op>, disk: bool) -> Result<(), TestCaseError> {
    let mut h = Harness::build(disk)?;
    for op in ops {
        h.apply(op)?;
    }
    // Drain: everything freed and unpinned, copies waited for, both tiers
    // emptied — the pool and the host tier are back to their baselines.
    for s in std::mem::take(&mut h.seqs) {
        h.m.free(s.id, None).map_err(fail)?;
    }
    for owner in 0..3 {
        h.m.unpin(owner);
    }
    h.m.poll_copies(true).map_err(fail)?;
    prop_assert!(h.m.reset_prefix_cache());
    let s = h.m.stats();
    prop_assert_eq!((s.live, s.free, s.cached, s.host_cached), (0, BLOCKS, 0, 0));
    prop_assert_eq!((s.host_free, s.disk_cached), (h.host, 0));
    h.check()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn host_tier_state_machine(ops in proptest::collection::vec(op(), 1..100)) {
        run(ops, false)?;
    }

    #[test]
    fn host_tier_over_a_disk_tier_state_machine(ops in proptest::collection::vec(op(), 1..100)) {
        run(ops, true)?;
    }
}

#[test]
fn an_evicted_prefix_comes_back_from_the_host_with_its_bytes() {
    let mut h = Harness::new().unwrap();
    let t = tokens(0, 13);
    h.apply(Op::Admit { fam: 0, len: 13 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.stats().cached, 3);
    assert_eq!(h.m.evict(3), 3);
    let s = h.m.stats();
    assert_eq!((s.cached, s.host_offloading, s.free), (0, 3, BLOCKS - 3));
    // Scribble over the device memory the blocks used: only the host copy
    // can bring the bytes back.
    h.m.poll_copies(true).unwrap();
    let s = h.m.stats();
    assert_eq!((s.host_cached, s.free, s.offloads), (3, BLOCKS, 3));
    assert_eq!(s.offload_bytes, 3 * BYTES as u64);
    h.m.admit(99, &tokens(5, 48), ExtraKeys::default()).unwrap();
    for i in 0..12 {
        if let Some((addr, _)) = h.m.block_span(99, i).unwrap() {
            h.fake.write(addr, &[0xAB; BYTES]).unwrap();
        }
    }
    h.m.abort(99).unwrap();
    let a = h.m.admit(7, &t, ExtraKeys::default()).unwrap();
    assert_eq!((a.cached_tokens, a.onboarded_blocks), (12, 3));
    assert_eq!(h.m.onboarding(7).unwrap().len(), 3);
    assert_eq!(h.m.wait_onboarding(7, None).unwrap(), 3);
    let hashes = h.m.sequence_hashes(7).unwrap().to_vec();
    for (i, &hash) in hashes.iter().enumerate() {
        let (addr, _) = h.m.block_span(7, i).unwrap().unwrap();
        assert_eq!(h.fake.read(addr, BYTES).unwrap(), pattern(hash));
    }
    let s = h.m.stats();
    assert_eq!(
        (s.host_hit_blocks, s.onboards, s.prefix_hit_tokens),
        (3, 3, 12)
    );
    h.m.poll_copies(false).unwrap();
    assert_eq!(h.m.stats().host_free, HOST);
    h.m.check_invariants().unwrap();
}

#[test]
fn a_prefix_spilled_to_disk_comes_back_with_its_bytes() {
    let mut h = Harness::build(true).unwrap();
    let a = tokens(0, 17);
    h.apply(Op::Admit { fam: 0, len: 17 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.evict(4), 4);
    h.apply(Op::Poll { wait: true }).unwrap();
    assert_eq!(h.m.stats().host_cached, 4);
    // Another prefix pushes the first one's tail out of the host tier, to
    // the disk.
    h.apply(Op::Admit { fam: 3, len: 9 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.evict(2), 2);
    h.apply(Op::Poll { wait: true }).unwrap();
    let s = h.m.stats();
    assert_eq!((s.host_cached, s.disk_cached, s.disk_spills), (4, 2, 2));
    let hashes = h.m.hash_blocks(&a, &ExtraKeys::default());
    let on_disk: HashSet<BlockHash> = h.m.disk_cached_blocks().into_iter().collect();
    assert_eq!(on_disk, hashes[2..4].iter().copied().collect());
    // Scribble over the device blocks.
    h.m.admit(50, &tokens(5, 48), ExtraKeys::default()).unwrap();
    for i in 0..BLOCKS as usize {
        if let Some((addr, _)) = h.m.block_span(50, i).unwrap() {
            h.fake.write(addr, &[0x5A; BYTES]).unwrap();
        }
    }
    h.m.abort(50).unwrap();
    assert_eq!(h.m.probe(&a, &ExtraKeys::default()), 4);
    let got = h.m.admit(51, &a, ExtraKeys::default()).unwrap();
    assert_eq!((got.cached_tokens, got.onboarded_blocks), (16, 4));
    h.m.wait_onboarding(51, None).unwrap();
    for (i, &hash) in hashes.iter().enumerate() {
        let (addr, _) = h.m.block_span(51, i).unwrap().unwrap();
        assert_eq!(
            h.fake.read(addr, BYTES).unwrap(),
            pattern(hash),
            "block {i}"
        );
    }
    let s = h.m.stats();
    assert_eq!(s.disk_loads, 2);
    // Staging took the host slots of the other prefix, which went to disk.
    assert_eq!(s.disk_cached, 2);
    h.m.check_invariants().unwrap();
    h.check().unwrap();
}

#[test]
fn a_bad_block_file_in_a_reloaded_prefix_stops_the_reload_there() {
    // As above, with the second of the two disk blocks' files corrupted:
    // the reload (read on worker threads) stages the first, drops the bad
    // one, and the prefix's last block is computed again.
    let mut h = Harness::build(true).unwrap();
    let a = tokens(0, 17);
    h.apply(Op::Admit { fam: 0, len: 17 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.evict(4), 4);
    h.apply(Op::Poll { wait: true }).unwrap();
    h.apply(Op::Admit { fam: 3, len: 9 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.evict(2), 2);
    h.apply(Op::Poll { wait: true }).unwrap();
    let hashes = h.m.hash_blocks(&a, &ExtraKeys::default());
    let dir = h._dir.as_ref().unwrap().path().to_path_buf();
    let bad = dir.join(format!("{:032x}.impkv", hashes[3]));
    let mut bytes = std::fs::read(&bad).unwrap();
    let at = bytes.len() - 20; // inside the block's bytes
    bytes[at] ^= 0x10;
    std::fs::write(&bad, bytes).unwrap();
    let got = h.m.admit(51, &a, ExtraKeys::default()).unwrap();
    assert_eq!((got.cached_tokens, got.onboarded_blocks), (12, 3));
    h.m.wait_onboarding(51, None).unwrap();
    for (i, &hash) in hashes.iter().enumerate().take(3) {
        let (addr, _) = h.m.block_span(51, i).unwrap().unwrap();
        assert_eq!(
            h.fake.read(addr, BYTES).unwrap(),
            pattern(hash),
            "block {i}"
        );
    }
    let s = h.m.stats();
    assert_eq!(s.disk_loads, 1);
    assert!(!bad.exists(), "the bad file is dropped");
    assert!(!h.m.disk_cached_blocks().contains(&hashes[3]));
    h.m.check_invariants().unwrap();
    h.check().unwrap();
}

#[test]
fn files_read_ahead_past_a_bad_one_stay_on_disk_and_indexed() {
    // A prefix's four blocks on disk (another prefix spilled them and went
    // back to the device, freeing the host slots), the second file
    // corrupted: the workers read all four at once, the reload stops at
    // the bad one, and the two read ahead of it (their files closed off the
    // staging thread, not deleted) stay indexed with their files, each of
    // which loads as a prefix-cache file of one entry.
    let mut h = Harness::build(true).unwrap();
    let a = tokens(0, 17);
    let b = tokens(3, 17);
    h.apply(Op::Admit { fam: 0, len: 17 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.evict(4), 4);
    h.apply(Op::Poll { wait: true }).unwrap();
    h.apply(Op::Admit { fam: 3, len: 17 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.evict(4), 4);
    h.apply(Op::Poll { wait: true }).unwrap();
    let hashes = h.m.hash_blocks(&a, &ExtraKeys::default());
    let on_disk: HashSet<BlockHash> = h.m.disk_cached_blocks().into_iter().collect();
    assert_eq!(on_disk, hashes[..4].iter().copied().collect());
    let got = h.m.admit(52, &b, ExtraKeys::default()).unwrap();
    assert_eq!(got.onboarded_blocks, 4);
    h.m.wait_onboarding(52, None).unwrap();
    h.m.poll_copies(true).unwrap();
    assert_eq!(h.m.stats().host_free, HOST_BEFORE_DISK);
    let dir = h._dir.as_ref().unwrap().path().to_path_buf();
    let file = |i: usize| dir.join(format!("{:032x}.impkv", hashes[i]));
    let bad = file(1);
    let mut bytes = std::fs::read(&bad).unwrap();
    let at = bytes.len() - 20; // inside the block's bytes
    bytes[at] ^= 0x10;
    std::fs::write(&bad, bytes).unwrap();
    let got = h.m.admit(51, &a, ExtraKeys::default()).unwrap();
    assert_eq!((got.cached_tokens, got.onboarded_blocks), (4, 1));
    h.m.wait_onboarding(51, None).unwrap();
    let (addr, _) = h.m.block_span(51, 0).unwrap().unwrap();
    assert_eq!(h.fake.read(addr, BYTES).unwrap(), pattern(hashes[0]));
    assert!(!file(0).exists() && !bad.exists(), "read back, and dropped");
    let on_disk: HashSet<BlockHash> = h.m.disk_cached_blocks().into_iter().collect();
    assert_eq!(on_disk, hashes[2..4].iter().copied().collect());
    assert!(file(2).exists() && file(3).exists());
    assert_eq!(h.m.stats().disk_loads, 1);
    for i in 2..4 {
        let mut other = KVCacheManager::new(h.m.config().clone(), Some(h.fake.backend())).unwrap();
        assert_eq!(
            other.load_prefix_cache(&file(i)).unwrap(),
            1,
            "block {i}'s file"
        );
    }
    h.m.check_invariants().unwrap();
    h.check().unwrap();
}

#[test]
fn a_spill_whose_write_fails_is_dropped_counted_and_reported_removed() {
    // The tier's directory goes away: the writer threads' writes fail. The
    // spilled blocks were indexed at once; the next poll takes them out,
    // each with a BlockRemoved on disk, as if there were no disk tier.
    let mut h = Harness::build(true).unwrap();
    h.apply(Op::Admit { fam: 0, len: 17 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.evict(4), 4);
    h.apply(Op::Poll { wait: true }).unwrap();
    std::fs::remove_dir_all(h._dir.as_ref().unwrap().path()).unwrap();
    let _ = h.m.drain_events();
    h.apply(Op::Admit { fam: 3, len: 9 }).unwrap();
    h.apply(Op::Free { seed: 0, pct: None }).unwrap();
    assert_eq!(h.m.evict(2), 2);
    h.m.poll_copies(true).unwrap();
    let s = h.m.stats();
    assert_eq!((s.disk_cached, s.disk_spills), (0, 0));
    let removed: HashSet<BlockHash> =
        h.m.drain_events()
            .into_iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium: Medium::Disk,
                } => Some(block_hashes),
                _ => None,
            })
            .flatten()
            .collect();
    assert_eq!(removed.len(), 2, "both failed spills reported");
    h.m.check_invariants().unwrap();
}

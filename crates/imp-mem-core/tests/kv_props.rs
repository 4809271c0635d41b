//! The KV cache manager as a proptest state machine over the fake backend:
//! random admit / append / free / abort / evict-middle / pin / unpin / evict /
//! save / load, with, after every operation, V4 (free + live == capacity),
//! the manager's own ownership walk, an independent check that a block is in
//! two sequences only where both name the same prefix hash, and that every
//! cached or computed block's bytes are the ones written for its hash. A
//! refused operation must change nothing (V5).
//!
//! The "engine" here writes `pattern(hash)` into each block when it becomes
//! full — except blocks filled after a middle eviction, which get a
//! different pattern, as their real KV would differ. A bleed (a block handed
//! to a second request while still referenced, or cached under the wrong
//! hash) shows up as a byte mismatch.

use std::collections::HashMap;

use imp_mem_core::decommit::{DecommitPolicy, NothingInFlight};
use imp_mem_core::kv::{BlockHash, ExtraKeys, IdSource, KVCacheManager, KvConfig};
use imp_mem_core::{FakeBackend, FakeConfig, KvStats, MemError, PoolConfig, SharedBlockPool, Tag};
use proptest::prelude::*;

const BS: usize = 4;
const BLOCKS: u32 = 24;
const BYTES: usize = 32;

#[derive(Debug, Clone)]
enum Op {
    /// `int32`: the ids come as int32s read in place (`IdSource::I32`);
    /// `negative`: then one of them, at this index (mod `len`), is negative.
    Admit {
        fam: u8,
        len: usize,
        salt: bool,
        int32: bool,
        negative: Option<usize>,
    },
    Append {
        seed: usize,
        n: usize,
    },
    Free {
        seed: usize,
        computed: Option<u8>,
    },
    Abort {
        seed: usize,
    },
    Commit {
        seed: usize,
        pct: u8,
    },
    EvictMiddle {
        seed: usize,
        a: usize,
        b: usize,
    },
    Pin {
        owner: u8,
        fam: u8,
        len: usize,
    },
    Unpin {
        owner: u8,
    },
    Evict {
        n: u32,
    },
    SaveLoad {
        corrupt: bool,
    },
    Unknown,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..4, 1usize..30, any::<bool>(), any::<bool>(), proptest::option::weighted(0.1, any::<usize>()))
            .prop_map(|(fam, len, salt, int32, negative)| Op::Admit { fam, len, salt, int32, negative }),
        5 => (any::<usize>(), 1usize..10).prop_map(|(seed, n)| Op::Append { seed, n }),
        3 => (any::<usize>(), proptest::option::of(0u8..=100)).prop_map(|(seed, computed)| Op::Free { seed, computed }),
        2 => any::<usize>().prop_map(|seed| Op::Abort { seed }),
        2 => (any::<usize>(), 0u8..=100).prop_map(|(seed, pct)| Op::Commit { seed, pct }),
        2 => (any::<usize>(), 0usize..8, 0usize..8).prop_map(|(seed, a, b)| Op::EvictMiddle { seed, a, b }),
        2 => (0u8..3, 0u8..4, 1usize..30).prop_map(|(owner, fam, len)| Op::Pin { owner, fam, len }),
        1 => (0u8..3).prop_map(|owner| Op::Unpin { owner }),
        1 => (0u32..6).prop_map(|n| Op::Evict { n }),
        1 => any::<bool>().prop_map(|corrupt| Op::SaveLoad { corrupt }),
        1 => Just(Op::Unknown),
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
        .map(|k| (h.wrapping_shr((k * 5) as u32 % 128) as u8) ^ (k as u8).wrapping_mul(31))
        .collect()
}

fn stale_pattern(h: BlockHash) -> Vec<u8> {
    pattern(!h)
}

struct Seq {
    id: u64,
    written: usize,
}

struct Harness {
    fake: FakeBackend,
    m: KVCacheManager,
    seqs: Vec<Seq>,
    next_id: u64,
    dir: tempfile::TempDir,
}

type Snapshot = (KvStats, Vec<(u64, Vec<i32>, usize)>, Vec<BlockHash>);

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

impl Harness {
    fn new(swa: bool) -> Result<Self, TestCaseError> {
        Self::build(swa, false)
    }

    /// `growable`: the main pool is opened elsewhere (`with_pools`), starts
    /// at 4 of its 24 blocks, grows by 4 (one granule) and shrinks with no
    /// hysteresis, stepped after every operation.
    fn build(swa: bool, growable: bool) -> Result<Self, TestCaseError> {
        let fake = FakeBackend::new(FakeConfig {
            granularity: if growable { 4 * BYTES } else { 4096 },
            ..FakeConfig::default()
        })
        .map_err(fail)?;
        let mut cfg = KvConfig::new(BS, BLOCKS);
        cfg.block_bytes = BYTES;
        cfg.pin_budget = 6;
        cfg.model_fingerprint = "prop".into();
        if swa {
            cfg.swa_blocks = 10;
            cfg.swa_window = 6;
        }
        let m = if growable {
            let pool = SharedBlockPool::new(
                fake.backend(),
                &PoolConfig::growable(BYTES, 4, BLOCKS, 4).with_tag(Tag::KvCache),
            )
            .map_err(fail)?;
            pool.set_decommit_policy(DecommitPolicy {
                min_idle_steps: 1,
                keep_chunks: 0,
            });
            let swa_pool = if swa {
                Some(SharedBlockPool::slots(10).map_err(fail)?)
            } else {
                None
            };
            KVCacheManager::with_pools(cfg, pool, swa_pool).map_err(fail)?
        } else {
            KVCacheManager::new(cfg, Some(fake.backend())).map_err(fail)?
        };
        Ok(Self {
            fake,
            m,
            seqs: Vec::new(),
            next_id: 1,
            dir: tempfile::tempdir().map_err(fail)?,
        })
    }

    fn snapshot(&mut self) -> Result<Snapshot, TestCaseError> {
        let mut tables = Vec::new();
        for s in &self.seqs {
            let t = self.m.block_table(s.id).map_err(fail)?.to_vec();
            tables.push((s.id, t, self.m.num_tokens(s.id).map_err(fail)?));
        }
        let cached = self.m.cached_blocks().iter().map(|c| c.0).collect();
        Ok((self.m.stats(), tables, cached))
    }

    /// The engine computes the newly full blocks of `seq` (from `written`).
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
                let bytes = if i < limit {
                    pattern(h)
                } else {
                    stale_pattern(h)
                };
                self.fake.write(addr, &bytes).map_err(fail)?;
            }
        }
        self.seqs[idx].written = hashes.len();
        Ok(())
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        self.m.check_invariants().map_err(fail)?;
        let s = self.m.stats();
        prop_assert_eq!(s.free + s.live, s.capacity, "V4");
        prop_assert_eq!(s.sequences as usize, self.seqs.len());
        for (h, _, addr) in self.m.cached_blocks() {
            let addr = addr.ok_or_else(|| fail("a backed pool has addresses"))?;
            prop_assert_eq!(
                self.fake.read(addr, BYTES).map_err(fail)?,
                pattern(h),
                "a cached block's bytes"
            );
        }
        // Who holds which block, independently of the manager's own walk.
        let mut holders: HashMap<i32, Vec<BlockHash>> = HashMap::new();
        for s in &self.seqs {
            let hashes = self.m.sequence_hashes(s.id).map_err(fail)?.to_vec();
            let limit = self
                .m
                .cacheable_limit(s.id)
                .map_err(fail)?
                .unwrap_or(usize::MAX);
            let table = self.m.block_table(s.id).map_err(fail)?.to_vec();
            for (i, &b) in table.iter().enumerate() {
                if b < 0 {
                    continue;
                }
                let h = hashes.get(i).copied();
                holders
                    .entry(b)
                    .or_default()
                    .push(h.unwrap_or(u128::MAX - i as u128));
                if let (Some(h), true) = (h, i < limit && i < s.written) {
                    let (addr, _) = self
                        .m
                        .block_span(s.id, i)
                        .map_err(fail)?
                        .ok_or_else(|| fail("hole"))?;
                    prop_assert_eq!(
                        self.fake.read(addr, BYTES).map_err(fail)?,
                        pattern(h),
                        "a computed block's bytes"
                    );
                }
            }
        }
        // The batch form writes every row the per-sequence form returns,
        // padded with -1 to the widest.
        let ids: Vec<u64> = self.seqs.iter().map(|s| s.id).collect();
        let width = ids
            .iter()
            .map(|&id| self.m.block_table(id).map(|t| t.len()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?
            .into_iter()
            .max()
            .unwrap_or(0);
        let mut out = vec![7i32; ids.len() * (width + 1)];
        let used = self
            .m
            .block_tables(&ids, &mut out, width + 1, false)
            .map_err(fail)?;
        prop_assert_eq!(used, width);
        for (i, &id) in ids.iter().enumerate() {
            let row = &out[i * (width + 1)..(i + 1) * (width + 1)];
            let table = self.m.block_table(id).map_err(fail)?;
            prop_assert_eq!(&row[..table.len()], table);
            prop_assert!(row[table.len()..].iter().all(|&b| b == -1));
        }
        for (b, hs) in holders {
            prop_assert!(
                hs.windows(2).all(|w| w[0] == w[1]),
                "block {} is in two sequences under different hashes",
                b
            );
        }
        Ok(())
    }

    fn pick(&self, seed: usize) -> Option<usize> {
        (!self.seqs.is_empty()).then(|| seed % self.seqs.len())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        let before = self.snapshot()?;
        let result: Result<(), MemError> = match op {
            Op::Admit {
                fam,
                len,
                salt,
                int32,
                negative,
            } => {
                let extras = ExtraKeys {
                    cache_salt: salt.then(|| b"s".to_vec()),
                    ..ExtraKeys::default()
                };
                let id = self.next_id;
                self.next_id += 1;
                let mut ids = tokens(fam, len);
                let source = if int32 { IdSource::I32 } else { IdSource::U32 };
                let bad = negative.filter(|_| int32).map(|at| at % len);
                if let Some(at) = bad {
                    ids[at] = -(at as i32) as u32 | 0x8000_0000;
                }
                let fits = self.m.can_admit(&ids, &extras);
                let admitted = self.m.admit_from(id, &ids, source, extras);
                if bad.is_some() {
                    // Refused whatever the room; the harness checks that
                    // nothing changed.
                    prop_assert!(
                        matches!(&admitted, Err(MemError::InvalidArgument(m)) if m.contains("token id -")),
                        "a negative int32 id: {:?}",
                        admitted
                    );
                } else {
                    prop_assert_eq!(fits, admitted.is_ok(), "can_admit agrees with admit");
                }
                match admitted {
                    Ok(a) => {
                        prop_assert_eq!(a.cached_tokens % BS, 0);
                        prop_assert!(a.cached_tokens < len, "one token is always computed");
                        // Hits arrive computed: check, do not write.
                        self.seqs.push(Seq {
                            id,
                            written: a.cached_tokens / BS,
                        });
                        let idx = self.seqs.len() - 1;
                        self.compute(idx)?;
                        Ok(())
                    }
                    Err(e) => Err(e),
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
            Op::Free { seed, computed } => match self.pick(seed) {
                Some(idx) => {
                    let id = self.seqs[idx].id;
                    let n = self.m.num_tokens(id).map_err(fail)?;
                    let computed = computed.map(|p| n * p as usize / 100);
                    let r = self.m.free(id, computed);
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
                let done = self.m.evict(n);
                prop_assert_eq!(done, n.min(evictable));
                Ok(())
            }
            Op::SaveLoad { corrupt } => {
                let path = self.dir.path().join("cache.bin");
                let saved: Vec<BlockHash> = self.m.cached_blocks().iter().map(|c| c.0).collect();
                self.m.save_prefix_cache(&path).map_err(fail)?;
                if corrupt {
                    let mut bytes = std::fs::read(&path).map_err(fail)?;
                    let at = bytes.len() / 2;
                    bytes[at] ^= 0x40;
                    std::fs::write(&path, bytes).map_err(fail)?;
                    self.m.evict(u32::MAX);
                    let mid = self.snapshot()?;
                    prop_assert!(self.m.load_prefix_cache(&path).is_err());
                    prop_assert_eq!(self.snapshot()?, mid, "a corrupted file loads nothing");
                } else {
                    self.m.evict(u32::MAX);
                    let mid = self.snapshot()?;
                    match self.m.load_prefix_cache(&path) {
                        Ok(_) => {
                            let now: Vec<BlockHash> =
                                self.m.cached_blocks().iter().map(|c| c.0).collect();
                            for h in &saved {
                                prop_assert!(now.contains(h), "a saved block came back");
                            }
                        }
                        Err(MemError::KvCapacity(_)) => prop_assert_eq!(self.snapshot()?, mid),
                        Err(e) => return Err(fail(e)),
                    }
                }
                Ok(())
            }
            Op::Unknown => {
                prop_assert!(self.m.free(u64::MAX, None).is_err());
                prop_assert!(self.m.append(u64::MAX, &[1]).is_err());
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

fn run(ops: Vec<Op>, swa: bool) -> Result<(), TestCaseError> {
    let mut h = Harness::new(swa)?;
    for op in ops {
        h.apply(op)?;
    }
    drain(h)
}

/// The state machine over a growable pool that shrinks between operations:
/// admission counts the room it can grow into, a refusal still changes
/// nothing, and no live or cached block is ever decommitted (its bytes
/// would be poisoned and fail the content check).
fn run_growable(ops: Vec<Op>, swa: bool) -> Result<(), TestCaseError> {
    let mut h = Harness::build(swa, true)?;
    for op in ops {
        h.apply(op)?;
        h.m.pool().step(NothingInFlight).map_err(fail)?;
        h.check()?;
    }
    for s in std::mem::take(&mut h.seqs) {
        h.m.free(s.id, None).map_err(fail)?;
    }
    for owner in 0..3 {
        h.m.unpin(owner);
    }
    h.m.evict(u32::MAX);
    h.m.pool().shrink_now(NothingInFlight).map_err(fail)?;
    let s = h.m.stats();
    prop_assert_eq!((s.live, s.cached, s.swa_live), (0, 0, 0));
    prop_assert_eq!((s.capacity, s.free, s.max_blocks), (4, 4, BLOCKS));
    h.m.check_invariants().map_err(fail)?;
    Ok(())
}

fn drain(mut h: Harness) -> Result<(), TestCaseError> {
    // Drain: every sequence freed, every cache entry unpinned and evicted —
    // the pool is back to its baseline.
    for s in std::mem::take(&mut h.seqs) {
        h.m.free(s.id, None).map_err(fail)?;
    }
    for owner in 0..3 {
        h.m.unpin(owner);
    }
    h.m.evict(u32::MAX);
    let s = h.m.stats();
    prop_assert_eq!((s.live, s.free, s.cached, s.swa_live), (0, BLOCKS, 0, 0));
    h.m.check_invariants().map_err(fail)?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn kv_manager_state_machine(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, false)?;
    }

    #[test]
    fn kv_manager_state_machine_with_swa(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, true)?;
    }

    #[test]
    fn kv_manager_state_machine_over_a_shrinking_pool(
        ops in proptest::collection::vec(op(), 1..80),
        swa in any::<bool>(),
    ) {
        run_growable(ops, swa)?;
    }
}

//! KV events as a proptest state machine: random admit / append / free /
//! abort / commit / evict / evict-middle / pin / unpin / reset, and after
//! every operation a router-side index that only replays the drained events
//! must hold exactly the manager's cached set. Each `BlockStored` that
//! carries token ids must name the hashes those ids chain to.

use std::collections::HashSet;

use imp_mem_core::kv::{BlockHash, ExtraKeys, KVCacheManager, KvConfig, KvEvent, Medium};
use imp_mem_core::MemError;
use proptest::prelude::*;

const BS: usize = 4;
const BLOCKS: u32 = 20;

#[derive(Debug, Clone)]
enum Op {
    Admit { fam: u8, len: usize, lora: bool },
    Append { seed: usize, n: usize },
    Free { seed: usize, pct: Option<u8> },
    Abort { seed: usize },
    Commit { seed: usize, pct: u8 },
    EvictMiddle { seed: usize, a: usize, b: usize },
    Pin { owner: u8, fam: u8, len: usize },
    Unpin { owner: u8 },
    Evict { n: u32 },
    Reset,
    Drain,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..4, 1usize..30, any::<bool>()).prop_map(|(fam, len, lora)| Op::Admit { fam, len, lora }),
        4 => (any::<usize>(), 1usize..10).prop_map(|(seed, n)| Op::Append { seed, n }),
        4 => (any::<usize>(), proptest::option::of(0u8..=100)).prop_map(|(seed, pct)| Op::Free { seed, pct }),
        1 => any::<usize>().prop_map(|seed| Op::Abort { seed }),
        2 => (any::<usize>(), 0u8..=100).prop_map(|(seed, pct)| Op::Commit { seed, pct }),
        1 => (any::<usize>(), 0usize..6, 0usize..6).prop_map(|(seed, a, b)| Op::EvictMiddle { seed, a, b }),
        2 => (0u8..3, 0u8..4, 1usize..30).prop_map(|(owner, fam, len)| Op::Pin { owner, fam, len }),
        1 => (0u8..3).prop_map(|owner| Op::Unpin { owner }),
        2 => (0u32..6).prop_map(|n| Op::Evict { n }),
        1 => Just(Op::Reset),
        3 => Just(Op::Drain),
    ]
}

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

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

struct Router {
    index: HashSet<(BlockHash, Medium)>,
}

impl Router {
    fn replay(&mut self, m: &KVCacheManager, events: Vec<KvEvent>) -> Result<(), TestCaseError> {
        for e in events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    lora_id,
                    medium,
                } => {
                    prop_assert!(!block_hashes.is_empty());
                    if !token_ids.is_empty() {
                        prop_assert_eq!(token_ids.len(), block_hashes.len() * BS);
                        if parent_block_hash.is_none() {
                            let extras = ExtraKeys {
                                lora_id,
                                ..ExtraKeys::default()
                            };
                            prop_assert_eq!(
                                m.hash_blocks(&token_ids, &extras),
                                block_hashes.clone(),
                                "a stored chain's tokens hash to its hashes"
                            );
                        }
                    }
                    for h in block_hashes {
                        prop_assert!(self.index.insert((h, medium)), "stored twice: {h:x}");
                    }
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                } => {
                    for h in block_hashes {
                        prop_assert!(self.index.remove(&(h, medium)), "removed unknown {h:x}");
                    }
                }
                KvEvent::AllBlocksCleared => self.index.clear(),
            }
        }
        Ok(())
    }
}

fn cached(m: &KVCacheManager) -> HashSet<(BlockHash, Medium)> {
    m.cached_blocks()
        .into_iter()
        .map(|(h, _, _)| (h, Medium::Device))
        .collect()
}

fn run(ops: Vec<Op>, drain_every_op: bool) -> Result<(), TestCaseError> {
    let mut cfg = KvConfig::new(BS, BLOCKS);
    cfg.kv_events = true;
    cfg.pin_budget = 6;
    let mut m = KVCacheManager::new(cfg, None).map_err(fail)?;
    let mut router = Router {
        index: HashSet::new(),
    };
    let mut seqs: Vec<u64> = Vec::new();
    let mut next = 1u64;
    let pick = |seqs: &Vec<u64>, seed: usize| (!seqs.is_empty()).then(|| seed % seqs.len());
    for op in ops {
        let r: Result<(), MemError> = match op {
            Op::Admit { fam, len, lora } => {
                let extras = ExtraKeys {
                    lora_id: lora.then_some(7),
                    ..ExtraKeys::default()
                };
                let r = m.admit(next, &tokens(fam, len), extras);
                if r.is_ok() {
                    seqs.push(next);
                }
                next += 1;
                r.map(|_| ())
            }
            Op::Append { seed, n } => match pick(&seqs, seed) {
                Some(i) => {
                    let start = m.num_tokens(seqs[i]).map_err(fail)? as u32;
                    let more: Vec<u32> = (start..start + n as u32).map(|t| t * 7 + 3).collect();
                    m.append(seqs[i], &more)
                }
                None => Ok(()),
            },
            Op::Free { seed, pct } => match pick(&seqs, seed) {
                Some(i) => {
                    let n = m.num_tokens(seqs[i]).map_err(fail)?;
                    let id = seqs.swap_remove(i);
                    m.free(id, pct.map(|p| n * p as usize / 100))
                }
                None => Ok(()),
            },
            Op::Abort { seed } => match pick(&seqs, seed) {
                Some(i) => m.abort(seqs.swap_remove(i)),
                None => Ok(()),
            },
            Op::Commit { seed, pct } => match pick(&seqs, seed) {
                Some(i) => {
                    let n = m.num_tokens(seqs[i]).map_err(fail)?;
                    m.cache_computed(seqs[i], n * pct as usize / 100)
                        .map(|_| ())
                }
                None => Ok(()),
            },
            Op::EvictMiddle { seed, a, b } => match pick(&seqs, seed) {
                Some(i) => m.evict_middle(seqs[i], a, b).map(|_| ()),
                None => Ok(()),
            },
            Op::Pin { owner, fam, len } => m
                .pin(owner as u64, &tokens(fam, len), &ExtraKeys::default())
                .map(|_| ()),
            Op::Unpin { owner } => {
                m.unpin(owner as u64);
                Ok(())
            }
            Op::Evict { n } => {
                m.evict(n);
                Ok(())
            }
            Op::Reset => {
                let idle = m.stats().evictable == m.stats().cached;
                prop_assert_eq!(m.reset_prefix_cache(), idle);
                if idle {
                    prop_assert_eq!(m.stats().cached, 0);
                }
                Ok(())
            }
            Op::Drain => Ok(()),
        };
        if let Err(e) = r {
            prop_assert!(
                matches!(
                    e,
                    MemError::KvCapacity(_) | MemError::Capacity(_) | MemError::InvalidArgument(_)
                ),
                "unexpected error {e}"
            );
        }
        m.check_invariants().map_err(fail)?;
        // Without draining after every operation, the harness drains once
        // events have piled up (several engine steps' worth in one batch).
        if drain_every_op || m.pending_events() > 8 {
            let events = m.drain_events();
            router.replay(&m, events)?;
            prop_assert_eq!(&router.index, &cached(&m), "the replayed index");
            prop_assert_eq!(m.pending_events(), 0);
        }
    }
    let events = m.drain_events();
    router.replay(&m, events)?;
    prop_assert_eq!(&router.index, &cached(&m), "the replayed index at the end");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn replayed_events_reproduce_the_cached_set(
        ops in proptest::collection::vec(op(), 1..100),
        every in any::<bool>(),
    ) {
        run(ops, every)?;
    }
}

#[test]
fn events_off_records_nothing() {
    let mut m = KVCacheManager::new(KvConfig::new(BS, BLOCKS), None).unwrap();
    m.admit(1, &tokens(0, 17), ExtraKeys::default()).unwrap();
    m.free(1, None).unwrap();
    assert_eq!(m.stats().cached, 4);
    assert_eq!(m.pending_events(), 0);
    assert!(m.drain_events().is_empty());
}

#[test]
fn a_freed_prompt_is_one_chain_with_its_tokens() {
    let mut cfg = KvConfig::new(BS, BLOCKS);
    cfg.kv_events = true;
    let mut m = KVCacheManager::new(cfg, None).unwrap();
    let t = tokens(1, 13);
    m.admit(1, &t, ExtraKeys::default()).unwrap();
    m.free(1, None).unwrap();
    let hashes = m.hash_blocks(&t, &ExtraKeys::default());
    assert_eq!(
        m.drain_events(),
        vec![KvEvent::BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash: None,
            token_ids: t[..12].to_vec(),
            lora_id: None,
            medium: Medium::Device,
        }]
    );
    // A hit on the first two blocks, then the tail computed: the new third
    // block's parent is the second.
    let mut u = t[..8].to_vec();
    u.extend([900, 901, 902, 903, 904]);
    assert_eq!(
        m.admit(2, &u, ExtraKeys::default()).unwrap().cached_tokens,
        8
    );
    m.free(2, None).unwrap();
    let uh = m.hash_blocks(&u, &ExtraKeys::default());
    assert_eq!(
        m.drain_events(),
        vec![KvEvent::BlockStored {
            block_hashes: vec![uh[2]],
            parent_block_hash: Some(uh[1]),
            token_ids: u[8..12].to_vec(),
            lora_id: None,
            medium: Medium::Device,
        }]
    );
    assert_eq!(m.evict(2), 2);
    assert!(matches!(
        &m.drain_events()[..],
        [KvEvent::BlockRemoved { block_hashes, medium: Medium::Device }] if block_hashes.len() == 2
    ));
    assert!(m.reset_prefix_cache());
    assert_eq!(m.drain_events(), vec![KvEvent::AllBlocksCleared]);
}

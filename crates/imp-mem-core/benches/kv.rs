//! The KV manager's hot paths in Rust alone, the three workloads of
//! `benches/bench_kv.py` without the binding: a churn request (hash +
//! lookup + allocate + cache + free, 64 blocks of 16 tokens, the first 32
//! from one of 8 shared prompts), allocate + free of 16 blocks (a 256-token
//! request admitted and aborted, caching off), and the chained hash of a
//! 64-block prompt. The same-run peer and the ratios are the Python
//! script's (the goals are set against a plain-Python manager); this tracks
//! what the core costs. Run: `cargo bench -p imp-mem-core --bench kv`.

#![allow(clippy::unwrap_used)] // a benchmark that cannot set up should stop loudly

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use imp_mem_core::kv::{ExtraKeys, KVCacheManager, KvConfig};

const BS: usize = 16;
const BLOCKS: u32 = 10_000;
/// Distinct requests cycled through: far more than the cache holds (about
/// 310 requests' suffixes), so every suffix misses.
const RING: usize = 4096;

fn churn_requests() -> Vec<Vec<u32>> {
    let systems: Vec<Vec<u32>> = (0..8u32)
        .map(|s| (0..32 * BS as u32).map(|t| s * 100_000 + t).collect())
        .collect();
    (0..RING as u32)
        .map(|i| {
            let mut t = systems[(i % 8) as usize].clone();
            t.extend((0..32 * BS as u32).map(|k| 1_000_000 + i * 1024 + k));
            t
        })
        .collect()
}

fn kv(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv manager");

    let reqs = churn_requests();
    let mut m = KVCacheManager::new(KvConfig::new(BS, BLOCKS), None).unwrap();
    let mut next = 0u64;
    g.bench_function("churn request (64 blocks, half hit)", |b| {
        b.iter(|| {
            let toks = &reqs[next as usize % RING];
            let a = m.admit(next, toks, ExtraKeys::default()).unwrap();
            m.free(next, None).unwrap();
            next += 1;
            black_box(a.cached_tokens)
        })
    });
    m.check_invariants().unwrap();
    assert!(m.stats().prefix_hit_blocks >= 31 * (next - 16));

    let mut m = KVCacheManager::new(
        KvConfig {
            enable_prefix_caching: false,
            ..KvConfig::new(BS, BLOCKS)
        },
        None,
    )
    .unwrap();
    let toks: Vec<u32> = (0..16 * BS as u32).collect();
    g.bench_function("admit + abort, 16 blocks (caching off)", |b| {
        b.iter(|| {
            let a = m.admit(0, &toks, ExtraKeys::default()).unwrap();
            m.abort(0).unwrap();
            black_box(a.blocks)
        })
    });

    let h = m.hasher().clone();
    let prompt = &reqs[1];
    g.bench_function("chained hash, 64 blocks", |b| {
        b.iter(|| black_box(h.chain(black_box(prompt), &ExtraKeys::default())))
    });
    g.finish();
}

criterion_group!(benches, kv);
criterion_main!(benches);

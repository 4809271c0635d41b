//! Times the KV manager's hot paths in Rust alone (no Python), to separate
//! the core's cost from the binding's: `cargo run --release --example kv_churn`
//! (`-- --kv-only` skips the pool costs; `-- --churn-only` loops the churn
//! alone and `-- --alloc-only` runs the allocate + free loop longer, for a
//! profiler).

use std::time::Instant;

use imp_mem_core::kv::{ExtraKeys, KVCacheManager, KvConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mode = std::env::args().nth(1).unwrap_or_default();
    if mode.is_empty() {
        pool_costs()?;
    }
    const BS: usize = 16;
    let n = 20_000u32;
    let systems: Vec<Vec<u32>> = (0..8u32)
        .map(|s| (0..32 * BS as u32).map(|t| s * 100_000 + t).collect())
        .collect();
    let reqs: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            let mut t = systems[(i % 8) as usize].clone();
            t.extend((0..32 * BS as u32).map(|k| 1_000_000 + i * 1024 + k));
            t
        })
        .collect();
    let pool_blocks: u32 = std::env::var("KV_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let mut m = KVCacheManager::new(KvConfig::new(BS, pool_blocks), None)?;
    // `KV_CYCLE=k` cycles through the first k prompts (16 MB for 4000, as
    // many as `bench_kv.py` admits; all 20 000 are 80 MB). From ~1000 up
    // a cycle changes no outcome: the pool holds the suffixes of ~310
    // requests, so each is evicted before its prompt comes round again.
    let cycle: usize = std::env::var("KV_CYCLE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n as usize)
        .clamp(1, n as usize);
    let t0 = Instant::now();
    for i in 0..n as usize {
        let toks = &reqs[i % cycle];
        m.admit(i as u64, toks, ExtraKeys::default())?;
        m.free(i as u64, None)?;
    }
    let per = t0.elapsed().as_secs_f64() / n as f64;
    println!(
        "churn: {:.2} µs/request ({:.0} req/s)",
        per * 1e6,
        1.0 / per
    );
    if mode == "--churn-only" {
        for round in 1..20u64 {
            for (i, toks) in reqs.iter().enumerate() {
                let id = round * n as u64 + i as u64;
                m.admit(id, toks, ExtraKeys::default())?;
                m.free(id, None)?;
            }
        }
        return Ok(());
    }

    let h = m.hasher().clone();
    let t0 = Instant::now();
    let mut sink = 0u128;
    for toks in reqs.iter().take(5000) {
        sink ^= h.chain(toks, &ExtraKeys::default())[63];
    }
    let per = t0.elapsed().as_secs_f64() / 5000.0 / 64.0;
    println!("hash: {:.1} ns/block ({sink:x})", per * 1e9);

    let mut m = KVCacheManager::new(
        KvConfig {
            enable_prefix_caching: false,
            ..KvConfig::new(BS, 10_000)
        },
        None,
    )?;
    let toks: Vec<u32> = (0..256).collect();
    let rounds = if mode == "--alloc-only" {
        3_000_000
    } else {
        100_000u64
    };
    let t0 = Instant::now();
    for i in 0..rounds {
        m.admit(i, &toks, ExtraKeys::default())?;
        m.abort(i)?;
    }
    let per = t0.elapsed().as_secs_f64() / rounds as f64 / 16.0;
    println!("alloc16+free: {:.1} ns/block", per * 1e9);
    Ok(())
}

#[allow(dead_code)]
fn pool_costs() -> Result<(), Box<dyn std::error::Error>> {
    let pool = imp_mem_core::SharedBlockPool::slots(10_000)?;
    let base = pool.allocate()?;
    let t0 = Instant::now();
    for _ in 0..1_000_000 {
        let r = base.share()?;
        drop(r);
    }
    println!("share+drop: {:.1} ns", t0.elapsed().as_secs_f64() * 1e3);
    let t0 = Instant::now();
    for _ in 0..100_000 {
        let b = pool.allocate_many(32)?.into_refs();
        drop(b);
    }
    println!(
        "alloc32+into_refs+drop each: {:.1} ns/block",
        t0.elapsed().as_secs_f64() * 1e9 / 3_200_000.0
    );
    Ok(())
}

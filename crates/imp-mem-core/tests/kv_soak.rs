//! The seed's acceptance criterion 4 as a soak on the id-space pool: 100 000
//! requests drawn from shared system prompts, up to 48 in flight, 30 %
//! aborted at a random point of their life. Afterwards the pool is back to
//! its post-load baseline (no sequence holds a block; evicting the cache
//! frees every block), and no ref was ever released twice (the pool's own
//! walk, run periodically, finds every count accounted for).
//!
//! `IMP_KV_SOAK_REQUESTS` overrides the count.

use imp_mem_core::kv::{ExtraKeys, KVCacheManager, KvConfig};
use imp_mem_core::MemError;

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Live {
    id: u64,
    remaining: u32,
    abort_at: Option<u32>,
}

fn requests() -> u64 {
    let default = 100_000;
    std::env::var("IMP_KV_SOAK_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn criterion_4_live_blocks_return_to_baseline_under_heavy_cancellation() {
    const BS: usize = 16;
    let mut cfg = KvConfig::new(BS, 2048);
    cfg.pin_budget = 64;
    let mut m = KVCacheManager::new(cfg, None).unwrap();
    let baseline = m.stats();
    assert_eq!(baseline.live, 0);

    let systems: Vec<Vec<u32>> = (0..32u32)
        .map(|s| {
            (0..(BS as u32 * (2 + s % 7)))
                .map(|t| s * 10_000 + t)
                .collect()
        })
        .collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<Live> = Vec::new();
    let total = requests();
    let (mut admitted, mut refused, mut aborted, mut finished) = (0u64, 0u64, 0u64, 0u64);
    let mut next_id = 0u64;
    let mut step = 0u64;
    while admitted + refused < total || !live.is_empty() {
        step += 1;
        let admit_now = admitted + refused < total && (live.len() < 48 && rng.below(3) != 0);
        if admit_now {
            let sys = &systems[rng.below(systems.len() as u64) as usize];
            let mut prompt = sys.clone();
            let suffix = 1 + rng.below(3 * BS as u64) as u32;
            let salt = rng.next() as u32;
            prompt.extend((0..suffix).map(|t| 1_000_000 + (salt % 5000) * 64 + t));
            next_id += 1;
            if m.probe(&prompt, &ExtraKeys::default()) > 0 && rng.below(50) == 0 {
                let _ = m.pin(rng.below(4), &prompt, &ExtraKeys::default());
            }
            match m.admit(next_id, &prompt, ExtraKeys::default()) {
                Ok(_) => {
                    admitted += 1;
                    if rng.below(2) == 0 {
                        // Prefill done: its blocks serve concurrent requests.
                        m.cache_computed(next_id, prompt.len()).unwrap();
                    }
                    let remaining = 1 + rng.below(40) as u32;
                    let abort_at =
                        (rng.below(10) < 3).then(|| rng.below(remaining as u64 + 1) as u32);
                    live.push(Live {
                        id: next_id,
                        remaining,
                        abort_at,
                    });
                }
                Err(MemError::KvCapacity(_)) => refused += 1,
                Err(e) => panic!("unexpected {e}"),
            }
        } else if !live.is_empty() {
            let i = rng.below(live.len() as u64) as usize;
            let r = &mut live[i];
            if r.abort_at.is_some_and(|at| r.remaining <= at) {
                m.abort(r.id).unwrap();
                live.swap_remove(i);
                aborted += 1;
            } else if r.remaining == 0 {
                m.free(r.id, None).unwrap();
                live.swap_remove(i);
                finished += 1;
            } else {
                let n = 1 + rng.below(4) as u32;
                let n = n.min(r.remaining);
                let toks: Vec<u32> = (0..n).map(|k| 2_000_000 + k).collect();
                match m.append(r.id, &toks) {
                    Ok(()) => r.remaining -= n,
                    // Preempted: the engine would requeue it; here it is aborted.
                    Err(MemError::KvCapacity(_)) => {
                        m.abort(r.id).unwrap();
                        live.swap_remove(i);
                        aborted += 1;
                    }
                    Err(e) => panic!("unexpected {e}"),
                }
                if rng.below(200) == 0 {
                    let id = live[i.min(live.len().saturating_sub(1))].id;
                    let full = m.num_tokens(id).unwrap() / BS;
                    if full > 2 {
                        m.evict_middle(id, 1, full - 1).unwrap();
                    }
                }
            }
        }
        if step % 5000 == 0 {
            m.check_invariants().unwrap();
            let s = m.stats();
            assert_eq!(s.free + s.live, s.capacity, "V4");
        }
    }
    m.check_invariants().unwrap();
    let s = m.stats();
    assert!(
        (0.27..0.40).contains(&(aborted as f64 / admitted as f64)),
        "{aborted} of {admitted} aborted"
    );
    assert!(
        s.prefix_hit_blocks > admitted,
        "prefixes were shared: {s:?}"
    );
    assert_eq!(admitted, aborted + finished);
    // Drained: no sequence holds a block; what is live is the cache.
    assert_eq!((s.sequences, s.active), (0, 0), "{s:?}");
    assert_eq!(s.live, s.cached);
    for owner in 0..4 {
        m.unpin(owner);
    }
    m.evict(u32::MAX);
    let s = m.stats();
    assert_eq!(
        (s.live, s.free, s.cached),
        (baseline.live, baseline.free, 0),
        "{s:?}"
    );
    assert_eq!(m.pool().stats().refs, 0, "every ref released exactly once");
    m.pool().check_invariants().unwrap();
    eprintln!(
        "soak: {admitted} admitted ({refused} refused at admission), {aborted} aborted, \
         {finished} finished; {} prefix blocks hit of {} asked; {} evictions",
        s.prefix_hit_blocks, s.prefix_query_blocks, s.evictions
    );
}

//! The tier hot paths in Rust (goal: tens of nanoseconds), each beside a
//! peer measured in the same run: a plain `Vec` free list with a refcount
//! array, the least a block allocator can do, and `Vec::with_capacity` for the
//! bump paths. Run: `cargo bench -p imp-mem-core --bench tiers`.

#![allow(clippy::unwrap_used)] // a benchmark that cannot set up should stop loudly

use std::hint::black_box;

use criterion::{criterion_group, Criterion};
use imp_mem_core::{
    Arena, BlockPool, FakeBackend, FakeConfig, PoolConfig, ScratchStack, SharedArena,
    SharedBlockPool, Tier,
};

const BLOCKS: u32 = 10_000;

/// The peer: a free list and refcounts with no handles, no checks, no
/// identity.
struct PlainFreeList {
    free: Vec<u32>,
    refs: Vec<u32>,
}

impl PlainFreeList {
    fn new(n: u32) -> Self {
        Self {
            free: (0..n).rev().collect(),
            refs: vec![0; n as usize],
        }
    }
    fn allocate(&mut self) -> Option<u32> {
        let id = self.free.pop()?;
        self.refs[id as usize] = 1;
        Some(id)
    }
    fn release(&mut self, id: u32) {
        self.refs[id as usize] -= 1;
        if self.refs[id as usize] == 0 {
            self.free.push(id);
        }
    }
}

fn unbacked() -> FakeBackend {
    FakeBackend::new(FakeConfig {
        capacity: 1 << 40,
        backed: false,
        ..FakeConfig::default()
    })
    .unwrap()
}

fn blocks(c: &mut Criterion) {
    let fb = unbacked();
    let mut g = c.benchmark_group("block allocate+release");

    let mut plain = PlainFreeList::new(BLOCKS);
    g.bench_function("peer: plain Vec free list, single", |b| {
        b.iter(|| {
            let id = plain.allocate().unwrap();
            plain.release(black_box(id));
        })
    });
    let pool = BlockPool::new(&fb, &PoolConfig::fixed(4096, BLOCKS)).unwrap();
    g.bench_function("BlockPool (borrowed), single", |b| {
        b.iter(|| drop(black_box(pool.allocate().unwrap())))
    });
    let slots = BlockPool::slots(BLOCKS).unwrap();
    g.bench_function("BlockPool slots, single", |b| {
        b.iter(|| drop(black_box(slots.allocate().unwrap())))
    });
    let shared = SharedBlockPool::new(&fb, &PoolConfig::fixed(4096, BLOCKS)).unwrap();
    g.bench_function("SharedBlockPool, single", |b| {
        b.iter(|| drop(black_box(shared.allocate().unwrap())))
    });

    g.bench_function("peer: plain Vec free list, x16", |b| {
        b.iter(|| {
            let ids: Vec<u32> = (0..16).map(|_| plain.allocate().unwrap()).collect();
            for id in black_box(ids) {
                plain.release(id);
            }
        })
    });
    g.bench_function("BlockPool (borrowed), x16", |b| {
        b.iter(|| drop(black_box(pool.allocate_many(16).unwrap())))
    });
    g.bench_function("SharedBlockPool batch, x16", |b| {
        b.iter(|| drop(black_box(shared.allocate_many(16).unwrap())))
    });
    g.finish();
}

fn bumps(c: &mut Criterion) {
    let fb = unbacked();
    let mut g = c.benchmark_group("bump take");
    const N: usize = 4096;

    g.bench_function("peer: Vec::with_capacity(64) + drop", |b| {
        b.iter(|| drop(black_box(Vec::<u8>::with_capacity(64))))
    });
    let mut arena = Arena::new(&fb, Tier::EnginePersistent, 64 * N as u64, None).unwrap();
    g.bench_function("Arena take 64 B (reset every 4096)", |b| {
        b.iter_custom(|iters| {
            let start = std::time::Instant::now();
            let mut left = iters;
            while left > 0 {
                let n = left.min(N as u64);
                for _ in 0..n {
                    black_box(arena.take(64, 64).map(|s| s.addr()).unwrap_or(0));
                }
                arena.reset();
                left -= n;
            }
            start.elapsed()
        })
    });
    let shared = SharedArena::new(&fb, Tier::EnginePersistent, 64 * N as u64, None).unwrap();
    g.bench_function("SharedArena take 64 B (reset every 4096)", |b| {
        b.iter_custom(|iters| {
            let start = std::time::Instant::now();
            let mut left = iters;
            while left > 0 {
                let n = left.min(N as u64);
                for _ in 0..n {
                    black_box(shared.take(64, 64).map(|t| t.len()).unwrap_or(0));
                }
                shared.reset();
                left -= n;
            }
            start.elapsed()
        })
    });
    let stack = ScratchStack::new(&fb, 64 * N as u64, None).unwrap();
    g.bench_function("ScratchStack take 64 B (one mark per 4096)", |b| {
        b.iter_custom(|iters| {
            let start = std::time::Instant::now();
            let mut left = iters;
            while left > 0 {
                let n = left.min(N as u64);
                let mark = stack.mark().unwrap();
                for _ in 0..n {
                    black_box(mark.take(64, 64).map(|s| s.addr()).unwrap_or(0));
                }
                drop(mark);
                left -= n;
            }
            start.elapsed()
        })
    });
    g.bench_function("ScratchStack mark + take + rewind", |b| {
        b.iter(|| {
            let mark = stack.mark().unwrap();
            black_box(mark.take(64, 64).map(|s| s.addr()).unwrap_or(0));
        })
    });
    g.finish();
}

/// ns per operation: the median of 5 runs of `iters` calls.
fn per_op(iters: u32, mut f: impl FnMut()) -> f64 {
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let start = std::time::Instant::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

/// The same pairs again, printed as ratios (criterion prints each alone).
fn ratios() {
    let fb = unbacked();
    let mut plain = PlainFreeList::new(BLOCKS);
    let pool = BlockPool::new(&fb, &PoolConfig::fixed(4096, BLOCKS)).unwrap();
    let shared = SharedBlockPool::new(&fb, &PoolConfig::fixed(4096, BLOCKS)).unwrap();
    let n = 200_000;
    let rows = [
        (
            "block alloc+release, single",
            per_op(n, || drop(black_box(pool.allocate().unwrap()))),
            per_op(n, || {
                let id = plain.allocate().unwrap();
                plain.release(black_box(id));
            }),
        ),
        (
            "block alloc+release, x16 (per block)",
            per_op(n / 16, || {
                drop(black_box(shared.allocate_many(16).unwrap()))
            }) / 16.0,
            per_op(n / 16, || {
                let ids: Vec<u32> = (0..16).map(|_| plain.allocate().unwrap()).collect();
                for id in black_box(ids) {
                    plain.release(id);
                }
            }) / 16.0,
        ),
    ];
    println!(
        "\n{:40} {:>9} {:>9} {:>10}",
        "ratios (peer: bare Vec free list)", "ours ns", "peer ns", "peer/ours"
    );
    for (name, ours, peer) in rows {
        println!("{name:40} {ours:9.1} {peer:9.1} {:9.2}x", peer / ours);
    }
    let mut arena = Arena::new(&fb, Tier::EnginePersistent, 64 << 20, None).unwrap();
    let ours = per_op(n, || {
        black_box(arena.take(64, 64).map(|s| s.addr()).unwrap_or(0));
    });
    arena.reset();
    let peer = per_op(n, || drop(black_box(Vec::<u8>::with_capacity(64))));
    println!(
        "{:40} {ours:9.1} {peer:9.1} {:9.2}x  (peer: Vec::with_capacity)",
        "arena take 64 B",
        peer / ours
    );
}

criterion_group!(benches, blocks, bumps);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    ratios();
}

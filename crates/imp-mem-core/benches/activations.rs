//! The activation pool's allocate + free pair, and the same pair through
//! the C hooks' routing (`activations::hooks`: what `imp_mem_torch_malloc` /
//! `imp_mem_torch_free` run inside their `catch_unwind`), goal: tens of
//! nanoseconds, beside the system allocator (`std::alloc`, glibc malloc here) asked for
//! the same sizes and alignment in the same run, printed as ratios. Run:
//! `cargo bench -p imp-mem-core --bench activations`.

#![allow(clippy::unwrap_used)] // a benchmark that cannot set up should stop loudly

use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, Criterion};
use imp_mem_core::activations::{hooks, ActivationConfig, ActivationPool, NoStreams};
use imp_mem_core::{FakeBackend, FakeConfig};

const SIZES: [u64; 3] = [512, 64 << 10, 4 << 20];
const RING: usize = 64;

fn pool() -> ActivationPool {
    let fb = FakeBackend::new(FakeConfig {
        capacity: 1 << 40,
        backed: false,
        ..FakeConfig::default()
    })
    .unwrap();
    ActivationPool::new(&fb, &ActivationConfig::new(8 << 30), Arc::new(NoStreams)).unwrap()
}

fn system_pair(size: u64) {
    let layout = Layout::from_size_align(size as usize, 512).unwrap();
    // SAFETY: the layout is non-zero-sized; the pointer is freed with it.
    unsafe {
        let p = alloc(layout);
        black_box(p);
        if !p.is_null() {
            dealloc(p, layout);
        }
    }
}

/// Sizes for the ring workload: a deterministic mix of 512 B .. 8 MiB,
/// skewed small the way a forward pass's temporaries are.
fn ring_sizes() -> Vec<u64> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let shift = 9 + (x % 15);
            (1u64 << shift) + (x >> 40) % (1 << shift)
        })
        .collect()
}

/// A ring of `RING` live allocations: each step frees the oldest and
/// allocates the next size. Returns ns per allocate + free pair.
fn ring_pool(p: &ActivationPool, sizes: &[u64], steps: usize) -> f64 {
    let mut live = vec![0usize; RING];
    for (i, slot) in live.iter_mut().enumerate() {
        *slot = p.allocate(sizes[i], 0).unwrap();
    }
    let start = std::time::Instant::now();
    for i in 0..steps {
        let k = i % RING;
        p.free(live[k], 0).unwrap();
        live[k] = p.allocate(sizes[(i + RING) % sizes.len()], 0).unwrap();
    }
    let ns = start.elapsed().as_nanos() as f64 / steps as f64;
    for addr in live {
        p.free(addr, 0).unwrap();
    }
    ns
}

fn ring_system(sizes: &[u64], steps: usize) -> f64 {
    let layout = |s: u64| Layout::from_size_align(s as usize, 512).unwrap();
    // SAFETY: every pointer is freed once, with the layout it was made with.
    unsafe {
        let mut live: Vec<(*mut u8, Layout)> = (0..RING)
            .map(|i| (alloc(layout(sizes[i])), layout(sizes[i])))
            .collect();
        let start = std::time::Instant::now();
        for i in 0..steps {
            let k = i % RING;
            dealloc(live[k].0, live[k].1);
            let l = layout(sizes[(i + RING) % sizes.len()]);
            live[k] = (alloc(l), l);
        }
        let ns = start.elapsed().as_nanos() as f64 / steps as f64;
        for (p, l) in live {
            dealloc(p, l);
        }
        ns
    }
}

fn pairs(c: &mut Criterion) {
    let p = pool();
    let mut g = c.benchmark_group("activation allocate+free");
    for size in SIZES {
        g.bench_function(format!("ours {size} B"), |b| {
            b.iter(|| {
                let a = p.allocate(black_box(size), 0).unwrap();
                p.free(black_box(a), 0).unwrap();
            })
        });
        g.bench_function(format!("peer: std::alloc {size} B"), |b| {
            b.iter(|| system_pair(black_box(size)))
        });
    }
    g.finish();
    hooks::install(p.clone(), 0, None);
    let mut g = c.benchmark_group("C hook malloc+free");
    for size in SIZES {
        g.bench_function(format!("ours {size} B"), |b| {
            b.iter(|| {
                let a = hooks::malloc_signed(black_box(size as i64), 0, 0);
                hooks::free(black_box(a), Some(size as i64), 0, 0);
            })
        });
    }
    g.finish();
    hooks::uninstall();
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

fn median(mut runs: Vec<f64>) -> f64 {
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

/// The same pairs, printed as ratios (criterion prints each alone).
fn ratios() {
    let p = pool();
    let n = 500_000;
    println!(
        "\n{:44} {:>9} {:>9} {:>10}",
        "ratios (peer: std::alloc, align 512)", "ours ns", "peer ns", "peer/ours"
    );
    for size in SIZES {
        let ours = per_op(n, || {
            let a = p.allocate(black_box(size), 0).unwrap();
            p.free(black_box(a), 0).unwrap();
        });
        let peer = per_op(n, || system_pair(black_box(size)));
        let name = format!("allocate+free {size} B");
        println!("{name:44} {ours:9.1} {peer:9.1} {:9.2}x", peer / ours);
    }
    hooks::install(p.clone(), 0, None);
    for size in SIZES {
        let ours = per_op(n, || {
            let a = hooks::malloc_signed(black_box(size as i64), 0, 0);
            hooks::free(black_box(a), Some(size as i64), 0, 0);
        });
        let peer = per_op(n, || system_pair(black_box(size)));
        let name = format!("C hook malloc+free {size} B");
        println!("{name:44} {ours:9.1} {peer:9.1} {:9.2}x", peer / ours);
    }
    hooks::uninstall();
    let sizes = ring_sizes();
    let steps = 200_000;
    let ours = median((0..5).map(|_| ring_pool(&p, &sizes, steps)).collect());
    let peer = median((0..5).map(|_| ring_system(&sizes, steps)).collect());
    let name = format!("ring of {RING} live, 512 B..8 MiB mix");
    println!("{name:44} {ours:9.1} {peer:9.1} {:9.2}x", peer / ours);
    p.check_invariants().unwrap();
}

criterion_group!(benches, pairs);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    ratios();
}

//! The hooks' counters: per-thread shards, written by their thread without
//! a locked instruction (a relaxed load and store) and summed on read, so
//! counting costs the hot path almost nothing and no count is lost.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

macro_rules! counters {
    ($( $name:ident, )*) => {
        /// The counters, as indices into a shard.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy)]
        pub(super) enum C { $( $name, )* }

        const NAMES: &[&str] = &[$( stringify!($name), )*];
    };
}

const N: usize = 24;
const _: () = assert!(NAMES.len() == N, "N must count the counters");

/// One thread's counters. Only its thread writes them (a load and a store,
/// no read-modify-write: the hot path pays no locked instruction); readers
/// sum every shard.
struct Shard([AtomicU64; N]);

impl Shard {
    fn new() -> Self {
        Shard(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

/// Every thread's shard, kept after the thread exits so its counts stay.
static SHARDS: Mutex<Vec<Arc<Shard>>> = Mutex::new(Vec::new());
/// Counts from threads whose shard is gone (a hook called while the
/// thread's locals are being destroyed): shared, so read-modify-write.
static SHARED: Mutex<Option<Arc<Shard>>> = Mutex::new(None);
/// What `reset_stats` subtracts.
static BASELINE: Mutex<[u64; N]> = Mutex::new([0; N]);

thread_local! {
    static MINE: Arc<Shard> = {
        let shard = Arc::new(Shard::new());
        SHARDS.lock().unwrap_or_else(|p| p.into_inner()).push(shard.clone());
        shard
    };
}

#[inline]
pub(super) fn add(c: C, n: u64) {
    let i = c as usize;
    let done = MINE.try_with(|s| {
        let v = s.0[i].load(Ordering::Relaxed);
        s.0[i].store(v.wrapping_add(n), Ordering::Relaxed);
    });
    if done.is_err() {
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        shared.get_or_insert_with(|| Arc::new(Shard::new())).0[i].fetch_add(n, Ordering::Relaxed);
    }
}

#[inline]
pub(super) fn bump(c: C) {
    add(c, 1);
}

fn sums() -> [u64; N] {
    let mut out = [0u64; N];
    let shards = SHARDS.lock().unwrap_or_else(|p| p.into_inner());
    let shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    for shard in shards.iter().chain(shared.iter()) {
        for (o, c) in out.iter_mut().zip(shard.0.iter()) {
            *o = o.wrapping_add(c.load(Ordering::Relaxed));
        }
    }
    out
}

/// Every counter by name, in a fixed order, since the last `reset_stats`.
pub fn stats() -> Vec<(&'static str, u64)> {
    let now = sums();
    let base = *BASELINE.lock().unwrap_or_else(|p| p.into_inner());
    NAMES
        .iter()
        .zip(now.iter().zip(base.iter()))
        .map(|(name, (n, b))| (*name, n.wrapping_sub(*b)))
        .collect()
}

/// Starts every counter from zero (by remembering the current sums).
pub fn reset_stats() {
    let now = sums();
    *BASELINE.lock().unwrap_or_else(|p| p.into_inner()) = now;
}

counters! {
    mallocs,
    malloc_ok,
    frees,
    free_ok,
    not_installed,
    free_not_installed,
    zero_size,
    negative_size,
    absurd_size,
    wrong_device,
    ooms,
    malloc_errors,
    null_frees,
    foreign_frees,
    double_frees,
    bad_stream_frees,
    size_mismatches,
    weights_takes,
    weights_bytes,
    weights_refused,
    stranded_frees,
    stranded_bytes,
    panics,
    retired_frees,
}

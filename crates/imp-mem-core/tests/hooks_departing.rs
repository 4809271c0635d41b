//! The allocator hooks while a pool is leaving them: a free of its block
//! reaches it whichever thread still holds a copy of the hooks' handle to
//! it, and the pool goes once both its last block and the last copy are
//! gone.
//!
//! Its own test binary: the hooks' slot, regions and retired list are
//! process-wide.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::sync::mpsc::channel;
use std::sync::Arc;

mod common;

use common::hooks::{count, open, serial_on_a_fake};
use imp_mem_core::activations::hooks;
use imp_mem_core::tag::Tag;
use imp_mem_core::{ActivationConfig, ActivationPool, FakeBackend, NoStreams};

/// Frees the 4 KiB block at `ptr` through the hooks and checks that the
/// free was counted under `counter`, not as foreign.
fn free_counted_as(ptr: usize, counter: &str) {
    let (foreign, before) = (count("foreign_frees"), count(counter));
    hooks::free(ptr, Some(4096), 0, 0);
    assert_eq!(count("foreign_frees"), foreign, "a free taken for foreign");
    assert_eq!(
        count(counter),
        before + 1,
        "a free not counted in {counter}"
    );
}

fn activations_live(fb: &FakeBackend) -> u64 {
    fb.stats().tags.get(&Tag::Activations).map_or(0, |t| t.live)
}

/// A worker thread that makes one hook call (so it holds a copy of what is
/// installed), then waits; at `release` it calls once more (letting go of
/// its copy) and ends.
fn worker_holding_a_copy() -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let (go, wait) = channel::<()>();
    let (done, called) = channel::<()>();
    let worker = std::thread::spawn(move || {
        let p = hooks::malloc(4096, 0, 0);
        assert_ne!(p, 0);
        hooks::free(p, Some(4096), 0, 0);
        done.send(()).unwrap();
        wait.recv().unwrap();
        let q = hooks::malloc(64, 0, 0);
        hooks::free(q, Some(64), 0, 0);
    });
    called.recv().unwrap();
    (go, worker)
}

#[test]
fn a_replaced_pools_block_freed_while_another_thread_holds_it_goes_home() {
    let (_serial, fb) = serial_on_a_fake();
    let (a, b) = (open(&fb), open(&fb));
    let a_id = a.id();
    hooks::install(a, 0, None);
    let (release, worker) = worker_holding_a_copy();
    let kept = hooks::malloc(4096, 0, 0);
    assert_ne!(kept, 0);
    hooks::install(b, 0, None);
    // The worker still holds a copy of a's handle; the free must reach a.
    free_counted_as(kept, "retired_frees");
    assert_eq!(
        activations_live(&fb),
        2 << 20,
        "a is held by the worker's copy"
    );
    release.send(()).unwrap();
    worker.join().unwrap();
    assert!(
        !hooks::retired_pool_ids().contains(&a_id),
        "nothing of a is live: it is not kept"
    );
    assert_eq!(activations_live(&fb), 1 << 20, "a released with the copy");
    assert!(hooks::uninstall());
    assert_eq!(activations_live(&fb), 0);
}

#[test]
fn an_uninstalled_pool_keeps_a_block_freed_after_the_last_copy_goes() {
    let (_serial, fb) = serial_on_a_fake();
    let a = open(&fb);
    let a_id = a.id();
    hooks::install(a, 0, None);
    let (release, worker) = worker_holding_a_copy();
    let (early, late) = (hooks::malloc(4096, 0, 0), hooks::malloc(4096, 0, 0));
    assert!(hooks::uninstall());
    let unknown = count("free_not_installed");
    hooks::free(early, Some(4096), 0, 0);
    assert_eq!(
        count("free_not_installed"),
        unknown,
        "a's block taken for nobody's"
    );
    release.send(()).unwrap();
    worker.join().unwrap();
    // The copy is gone with a block still live: kept for that block.
    assert_eq!(hooks::retired_pool_ids(), vec![a_id]);
    assert_eq!(activations_live(&fb), 1 << 20);
    hooks::free(late, Some(4096), 0, 0);
    assert!(hooks::retired_pool_ids().is_empty());
    assert_eq!(activations_live(&fb), 0);
    assert_eq!(count("free_not_installed"), unknown);
}

#[test]
fn a_t1_take_freed_while_another_thread_holds_the_old_install_is_still_the_arenas() {
    use imp_mem_core::activations::hooks::Route;
    use imp_mem_core::{SharedArena, Tier};

    let (_serial, fb) = serial_on_a_fake();
    let (a, b) = (open(&fb), open(&fb));
    let t1 = SharedArena::new(&fb, Tier::ModelResident, 1 << 20, None).unwrap();
    let t1_live = |fb: &FakeBackend| fb.stats().tags.get(&Tag::Weights).map_or(0, |t| t.live);
    hooks::install(a, 0, Some(t1.clone()));
    let (release, worker) = worker_holding_a_copy();
    hooks::set_route(Route::Weights);
    let (w1, w2) = (hooks::malloc(4096, 0, 0), hooks::malloc(4096, 0, 0));
    hooks::set_route(Route::Activations);
    assert!(w1 != 0 && w2 != 0);
    // Replaced by a pool without an arena while the worker holds the old
    // install: the take's free is still the arena's (stranded), not foreign.
    hooks::install(b, 0, None);
    drop(t1);
    free_counted_as(w1, "stranded_frees");
    release.send(()).unwrap();
    worker.join().unwrap();
    assert_eq!(hooks::retired_arena_count(), 1, "kept for w2");
    assert_eq!(t1_live(&fb), 1 << 20);
    hooks::free(w2, Some(4096), 0, 0);
    assert_eq!(hooks::retired_arena_count(), 0);
    assert_eq!(t1_live(&fb), 0, "released with its last take");
    assert!(hooks::uninstall());
}

#[test]
fn the_weights_route_is_the_loading_threads_alone() {
    use imp_mem_core::activations::hooks::Route;
    use imp_mem_core::{SharedArena, Tier};

    let (_serial, fb) = serial_on_a_fake();
    let a = open(&fb);
    let t1 = SharedArena::new(&fb, Tier::ModelResident, 1 << 20, None).unwrap();
    hooks::install(a.clone(), 0, Some(t1.clone()));
    hooks::set_route(Route::Weights);
    // Another thread's forward while this one loads: its blocks are
    // activations, never takes of the bump arena.
    let other = std::thread::spawn(|| {
        let p = hooks::malloc(4096, 0, 0);
        (p, hooks::route())
    })
    .join()
    .unwrap();
    let w = hooks::malloc(4096, 0, 0);
    hooks::set_route(Route::Activations);
    assert_eq!(other.1, Route::Activations);
    assert!(
        other.0 != 0 && a.contains(other.0),
        "another thread's block went to T1"
    );
    assert!(
        w != 0 && !a.contains(w),
        "the loading thread's take is T1's"
    );
    hooks::free(other.0, Some(4096), 0, 0);
    assert_eq!(a.stats().live, 0);
    hooks::free(w, Some(4096), 0, 0);
    assert!(hooks::uninstall());
}

#[test]
fn a_regions_fallback_block_goes_home_by_its_address() {
    let (_serial, fb) = serial_on_a_fake();
    let installed = open(&fb);
    // A tier that falls back to the backend when full (a serve()-made or
    // engine tier is one), routed to as a region.
    let mut config = ActivationConfig::new(1 << 20);
    config.strict = Some(false);
    let region = ActivationPool::new(&fb, &config, Arc::new(NoStreams)).unwrap();
    hooks::install(installed.clone(), 0, None);
    hooks::add_region(region.clone(), 0);
    let previous = hooks::set_region(Some(region.id())).unwrap();
    let big = hooks::malloc(2 << 20, 0, 0);
    hooks::set_region(previous).unwrap();
    assert!(big != 0 && !region.contains(big), "served past the region");
    assert_eq!(region.stats().live, 1);
    let foreign = count("foreign_frees");
    hooks::free(big, Some(2 << 20), 0, 0);
    assert_eq!(
        count("foreign_frees"),
        foreign,
        "the fallback block taken for foreign"
    );
    assert_eq!(region.stats().live, 0);
    assert!(hooks::remove_region(region.id()));
    assert!(hooks::uninstall());
}

#[test]
fn threads_allocating_while_pools_are_swapped_lose_no_free_and_no_pool() {
    use std::sync::atomic::{AtomicBool, Ordering};

    let (_serial, fb) = serial_on_a_fake();
    let pools: Vec<ActivationPool> = (0..3).map(|_| open(&fb)).collect();
    let misrouted = || {
        (
            count("foreign_frees"),
            count("double_frees"),
            count("free_not_installed"),
        )
    };
    let before = misrouted();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let p = hooks::malloc(512 * (1 + (i + w) % 8), 0, 0);
                    if p != 0 {
                        held.push(p);
                    }
                    // Frees lag the mallocs, so blocks outlive the pool
                    // they came from.
                    if held.len() > 6 {
                        hooks::free(held.remove(0), None, 0, 0);
                    }
                }
                for p in held {
                    hooks::free(p, None, 0, 0);
                }
            })
        })
        .collect();
    for round in 0..3000u64 {
        match round % 7 {
            0 | 3 => {
                hooks::uninstall();
            }
            _ => hooks::install(pools[(round % 3) as usize].clone(), 0, None),
        }
        if round % 11 == 0 {
            std::thread::yield_now();
        }
    }
    hooks::uninstall();
    drop(pools);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(misrouted(), before, "a free missed its pool");
    assert!(
        hooks::retired_pool_ids().is_empty(),
        "a pool kept after its last block"
    );
    assert_eq!(
        activations_live(&fb),
        0,
        "a pool outlived every handle and block"
    );
}

//! `hooks::free_owned`, the free of a caller that sees every free in the
//! process (the LD_PRELOAD interposer's `cudaFree`): a block the hooks
//! handed out goes home from any thread, whatever the thread's region, at
//! its own device; any other pointer is left to its allocator, uncounted.
//!
//! Its own test binary: the hooks' slot, regions and retired list are
//! process-wide.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

mod common;

use common::hooks::{count, open, serial_on_a_fake};
use imp_mem_core::activations::hooks;

#[test]
fn a_regions_block_goes_home_from_another_thread_outside_any_region() {
    let (_serial, fb) = serial_on_a_fake();
    let region = open(&fb);
    let id = region.id();
    // A region of device 1: the free knows no device and needs none.
    hooks::add_region(region.clone(), 1);
    hooks::set_region(Some(id)).unwrap();
    let p = hooks::malloc(4096, 1, 0);
    hooks::set_region(None).unwrap();
    assert!(p != 0 && region.contains(p));
    assert_eq!(region.stats().live, 1);
    let (frees, ok) = (count("frees"), count("free_ok"));
    let home = std::thread::spawn(move || hooks::free_owned(p, 0))
        .join()
        .unwrap();
    assert!(home, "the region's block is the hooks'");
    assert_eq!(region.stats().live, 0);
    assert_eq!((count("frees"), count("free_ok")), (frees + 1, ok + 1));
    // Freed twice: still the hooks' pointer (never another allocator's),
    // refused and counted as a double free.
    let doubles = count("double_frees");
    assert!(hooks::free_owned(p, 0));
    assert_eq!(count("double_frees"), doubles + 1);
    assert!(hooks::remove_region(id));
}

#[test]
fn a_pointer_the_hooks_never_handed_out_is_left_alone_and_not_counted() {
    let (_serial, fb) = serial_on_a_fake();
    let pool = open(&fb);
    hooks::install(pool.clone(), 0, None);
    let region = open(&fb);
    hooks::add_region(region.clone(), 0);
    let before = hooks::stats();
    let elsewhere = Box::new([0u8; 64]);
    let foreign = elsewhere.as_ptr() as usize;
    assert!(!hooks::free_owned(foreign, 0));
    assert!(!hooks::free_owned(0, 0), "null is the real cudaFree's");
    assert_eq!(hooks::stats(), before, "nothing counted");
    // The installed pool's block goes home too.
    let q = hooks::malloc(1000, 0, 0);
    assert!(q != 0 && pool.contains(q));
    assert!(hooks::free_owned(q, 0));
    assert_eq!(pool.stats().live, 0);
    assert!(hooks::remove_region(region.id()));
    assert!(hooks::uninstall());
}

#[test]
fn a_retired_pools_block_goes_home_after_its_region_is_removed() {
    let (_serial, fb) = serial_on_a_fake();
    let region = open(&fb);
    let id = region.id();
    hooks::add_region(region.clone(), 0);
    hooks::set_region(Some(id)).unwrap();
    let p = hooks::malloc(4096, 0, 0);
    hooks::set_region(None).unwrap();
    assert!(hooks::remove_region(id));
    assert_eq!(hooks::retired_pool_ids(), vec![id]);
    let retired = count("retired_frees");
    assert!(hooks::free_owned(p, 0));
    assert_eq!(count("retired_frees"), retired + 1);
    assert!(hooks::retired_pool_ids().is_empty(), "gone with its block");
    assert!(!hooks::free_owned(p, 0), "nothing knows it any more");
}

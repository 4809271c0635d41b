//! The interposer's decisions against stand-ins: a "real" runtime that
//! counts its calls (per thread) and imp-mem hooks that hand out addresses
//! from a range of their own and remember which are live (process-wide, so
//! another thread's free can be checked).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::cell::Cell;
use std::collections::HashSet;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::*;
use crate::next::{RealFree, RealGetDevice, RealMalloc, RealSynchronize};

thread_local! {
    static REAL_MALLOCS: Cell<u32> = const { Cell::new(0) };
    static REAL_FREES: Cell<u32> = const { Cell::new(0) };
    static SYNCS: Cell<u32> = const { Cell::new(0) };
    /// The last hook malloc's (size, device, stream).
    static HOOK_CALL: Cell<(isize, c_int, usize)> = const { Cell::new((0, -1, 1)) };
}

/// Addresses the "hooks" hand out: 4 KiB apart from 1 TiB up, never what
/// the "real" malloc returns.
static NEXT_HOOK_ADDR: AtomicUsize = AtomicUsize::new(1 << 40);
static HOOK_LIVE: Mutex<Option<HashSet<usize>>> = Mutex::new(None);
const REAL_ADDR: usize = 0x1000;
const DEVICE: c_int = 3;

fn hook_live() -> std::sync::MutexGuard<'static, Option<HashSet<usize>>> {
    HOOK_LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

unsafe extern "C" fn real_malloc(dev_ptr: *mut *mut c_void, _size: usize) -> c_int {
    REAL_MALLOCS.with(|c| c.set(c.get() + 1));
    // SAFETY: the tests pass a live pointer slot.
    unsafe { dev_ptr.write(REAL_ADDR as *mut c_void) };
    code::SUCCESS
}

unsafe extern "C" fn real_free(_dev_ptr: *mut c_void) -> c_int {
    REAL_FREES.with(|c| c.set(c.get() + 1));
    code::SUCCESS
}

unsafe extern "C" fn real_get_device(device: *mut c_int) -> c_int {
    // SAFETY: `route::malloc` passes a live c_int.
    unsafe { device.write(DEVICE) };
    code::SUCCESS
}

unsafe extern "C" fn real_synchronize() -> c_int {
    SYNCS.with(|c| c.set(c.get() + 1));
    code::SUCCESS
}

unsafe extern "C" fn hook_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    HOOK_CALL.with(|c| c.set((size, device, stream as usize)));
    if size > 1 << 30 {
        return std::ptr::null_mut();
    }
    let addr = NEXT_HOOK_ADDR.fetch_add(4096, Ordering::Relaxed);
    hook_live().get_or_insert_with(HashSet::new).insert(addr);
    addr as *mut c_void
}

unsafe extern "C" fn hook_free_owned(ptr: *mut c_void, _stream: *mut c_void) -> c_int {
    let taken = hook_live()
        .get_or_insert_with(HashSet::new)
        .remove(&(ptr as usize));
    c_int::from(taken)
}

/// The stand-in runtime; a field left None is a symbol not found.
#[derive(Clone, Copy)]
struct Fake {
    malloc: Option<RealMalloc>,
    free: Option<RealFree>,
    get_device: Option<RealGetDevice>,
    synchronize: Option<RealSynchronize>,
}

impl Fake {
    fn runtime() -> Self {
        Fake {
            malloc: Some(real_malloc),
            free: Some(real_free),
            get_device: Some(real_get_device),
            synchronize: Some(real_synchronize),
        }
    }

    fn without_anything() -> Self {
        Fake {
            malloc: None,
            free: None,
            get_device: None,
            synchronize: None,
        }
    }
}

impl Next for Fake {
    fn malloc(&self) -> Option<RealMalloc> {
        self.malloc
    }
    fn free(&self) -> Option<RealFree> {
        self.free
    }
    fn get_device(&self) -> Option<RealGetDevice> {
        self.get_device
    }
    fn synchronize(&self) -> Option<RealSynchronize> {
        self.synchronize
    }
}

fn hooks() -> Hooks {
    Hooks {
        malloc: Some(hook_malloc),
        free_owned: Some(hook_free_owned),
    }
}

/// `route::malloc` through the fakes: (code, address).
fn malloc_with(next: &Fake, hooks: &Hooks, size: usize) -> (c_int, usize) {
    let mut p: *mut c_void = 7 as *mut c_void;
    // SAFETY: `p` is a live slot; the fakes have their declared signatures.
    let rc = unsafe { malloc(next, hooks, &mut p, size) };
    (rc, p as usize)
}

fn free_with(next: &Fake, hooks: &Hooks, ptr: usize) -> c_int {
    // SAFETY: the fakes have their declared signatures.
    unsafe { free(next, hooks, ptr as *mut c_void) }
}

fn real_mallocs() -> u32 {
    REAL_MALLOCS.with(Cell::get)
}

fn real_frees() -> u32 {
    REAL_FREES.with(Cell::get)
}

fn is_hooks(addr: usize) -> bool {
    hook_live().as_ref().is_some_and(|l| l.contains(&addr))
}

/// Runs `f` inside one routing scope of this thread.
fn routed<R>(f: impl FnOnce() -> R) -> R {
    assert!(enter() >= 1);
    let out = f();
    assert!(exit() >= 0);
    out
}

#[test]
fn outside_routing_a_malloc_reaches_the_real_runtime() {
    let (rc, p) = malloc_with(&Fake::runtime(), &hooks(), 4096);
    assert_eq!((rc, p), (code::SUCCESS, REAL_ADDR));
    assert_eq!(real_mallocs(), 1);
    assert_eq!(HOOK_CALL.with(Cell::get).1, -1, "the hook was not called");
}

#[test]
fn inside_routing_a_malloc_reaches_the_hook_on_the_current_device() {
    let (rc, p) = routed(|| malloc_with(&Fake::runtime(), &hooks(), 5000));
    assert_eq!(rc, code::SUCCESS);
    assert!(is_hooks(p), "the hook's address");
    assert_eq!(HOOK_CALL.with(Cell::get), (5000, DEVICE, 0));
    assert_eq!(real_mallocs(), 0);
    // Its free goes home without reaching the real runtime.
    assert_eq!(free_with(&Fake::runtime(), &hooks(), p), code::SUCCESS);
    assert!(!is_hooks(p));
    assert_eq!((real_frees(), SYNCS.with(Cell::get)), (0, 1));
}

#[test]
fn routing_nests_and_an_unmatched_exit_changes_nothing() {
    assert_eq!(depth(), 0);
    assert_eq!(exit(), -1);
    assert_eq!(depth(), 0);
    assert_eq!((enter(), enter()), (1, 2));
    assert_eq!(exit(), 1);
    let (_, p) = malloc_with(&Fake::runtime(), &hooks(), 64);
    assert!(is_hooks(p), "still routed inside the outer scope");
    assert_eq!(exit(), 0);
    let (_, q) = malloc_with(&Fake::runtime(), &hooks(), 64);
    assert_eq!(q, REAL_ADDR, "not routed after the outer exit");
    // Another thread has a depth of its own.
    assert_eq!(enter(), 1);
    let elsewhere = std::thread::spawn(depth).join().unwrap();
    assert_eq!((elsewhere, exit()), (0, 0));
}

#[test]
fn an_owned_block_goes_home_from_a_thread_outside_routing() {
    let (_, p) = routed(|| malloc_with(&Fake::runtime(), &hooks(), 1 << 20));
    assert!(is_hooks(p));
    let (rc, real, routed_there) = std::thread::spawn(move || {
        let rc = free_with(&Fake::runtime(), &hooks(), p);
        (rc, real_frees(), depth())
    })
    .join()
    .unwrap();
    assert_eq!((rc, real, routed_there), (code::SUCCESS, 0, 0));
    assert!(!is_hooks(p), "freed at home");
}

#[test]
fn a_foreign_pointer_and_null_go_to_the_real_free_routed_or_not() {
    assert_eq!(
        free_with(&Fake::runtime(), &hooks(), REAL_ADDR),
        code::SUCCESS
    );
    routed(|| free_with(&Fake::runtime(), &hooks(), REAL_ADDR));
    assert_eq!(real_frees(), 2);
    let syncs = SYNCS.with(Cell::get);
    // cudaFree(NULL) (a context's first touch) is the runtime's alone.
    assert_eq!(free_with(&Fake::runtime(), &hooks(), 0), code::SUCCESS);
    assert_eq!((real_frees(), SYNCS.with(Cell::get)), (3, syncs));
    // Without registered hooks every free is the real one's.
    assert_eq!(
        free_with(&Fake::runtime(), &Hooks::default(), REAL_ADDR),
        code::SUCCESS
    );
    assert_eq!((real_frees(), SYNCS.with(Cell::get)), (4, syncs));
}

#[test]
fn an_absent_real_symbol_is_an_error_code_not_a_crash() {
    let none = Fake::without_anything();
    assert_eq!(malloc_with(&none, &hooks(), 64).0, code::SYMBOL_NOT_FOUND);
    assert_eq!(
        free_with(&none, &hooks(), REAL_ADDR),
        code::SYMBOL_NOT_FOUND
    );
    assert_eq!(
        free_with(&none, &Hooks::default(), REAL_ADDR),
        code::SYMBOL_NOT_FOUND
    );
    // Routed, the current device is needed.
    let no_device = Fake {
        get_device: None,
        ..Fake::runtime()
    };
    let (rc, p) = routed(|| malloc_with(&no_device, &hooks(), 64));
    assert_eq!((rc, p), (code::SYMBOL_NOT_FOUND, 7), "dev_ptr untouched");
    // An owned block is not given back unsynchronised.
    let (_, q) = routed(|| malloc_with(&Fake::runtime(), &hooks(), 64));
    let no_sync = Fake {
        synchronize: None,
        ..Fake::runtime()
    };
    assert_eq!(free_with(&no_sync, &hooks(), q), code::SYMBOL_NOT_FOUND);
    assert!(is_hooks(q));
    assert_eq!(free_with(&Fake::runtime(), &hooks(), q), code::SUCCESS);
}

#[test]
fn a_refused_or_unroutable_malloc_says_why() {
    let rt = Fake::runtime();
    routed(|| {
        let (rc, p) = malloc_with(&rt, &hooks(), 2 << 30);
        assert_eq!((rc, p), (code::MEMORY_ALLOCATION, 0), "the hook's null");
        let (rc, _) = malloc_with(&rt, &hooks(), usize::MAX);
        assert_eq!(rc, code::MEMORY_ALLOCATION, "above ssize_t");
        // SAFETY: a null slot is what is being refused.
        let rc = unsafe { malloc(&rt, &hooks(), std::ptr::null_mut(), 64) };
        assert_eq!(rc, code::INVALID_VALUE);
        let (rc, p) = malloc_with(&rt, &Hooks::default(), 64);
        assert_eq!((rc, p), (code::INITIALIZATION_ERROR, 7));
        // Size 0 is the runtime's to answer.
        assert_eq!(malloc_with(&rt, &hooks(), 0), (code::SUCCESS, REAL_ADDR));
    });
    assert_eq!(real_mallocs(), 1);
}

/// The one test that touches the process's registration and the exported
/// entry points (the test binary loads no libcudart after itself).
#[test]
fn registration_and_the_exported_entry_points() {
    // SAFETY: null addresses are what is being refused.
    let refused = unsafe { register(std::ptr::null(), hook_free_owned as *const c_void) };
    assert_eq!(refused, code::INVALID_VALUE);
    assert_eq!(crate::imp_mem_preload_registered(), 0);
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a live slot; no real runtime is found (an error code).
    let rc = unsafe { crate::cudaMalloc(&mut p, 64) };
    assert_eq!(rc, code::SYMBOL_NOT_FOUND);
    // SAFETY: the hooks are functions of their declared signatures, static.
    let rc = unsafe {
        crate::imp_mem_preload_register(
            hook_malloc as *const c_void,
            hook_free_owned as *const c_void,
        )
    };
    assert_eq!(
        (rc, crate::imp_mem_preload_registered()),
        (code::SUCCESS, 1)
    );
    assert_eq!(crate::imp_mem_preload_enter(), 1);
    assert_eq!(crate::imp_mem_preload_depth(), 1);
    // Routed: the device comes from the real cudaGetDevice, absent here.
    // SAFETY: a live slot, as above.
    let rc = unsafe { crate::cudaMalloc(&mut p, 64) };
    assert_eq!(rc, code::SYMBOL_NOT_FOUND);
    assert_eq!(crate::imp_mem_preload_exit(), 0);
    assert_eq!(crate::imp_mem_preload_exit(), -1);
    // A free of the hooks' block needs the real cudaDeviceSynchronize.
    let (_, owned) = routed(|| malloc_with(&Fake::runtime(), &hooks(), 64));
    // SAFETY: the hooks' pointer; the stand-in hooks would take it.
    let rc = unsafe { crate::cudaFree(owned as *mut c_void) };
    assert_eq!(rc, code::SYMBOL_NOT_FOUND);
    assert!(is_hooks(owned), "kept: not freed unsynchronised");
}

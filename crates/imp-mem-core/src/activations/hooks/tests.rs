//! The hooks' one in-crate test: misuse is counted and refused, the weights
//! route strands its frees, and pools leave the slot into the retired list
//! and back (the process-wide slot, so one test in this binary).

use std::sync::Arc;

use super::retired::RETIRED;
use super::*;
use crate::activations::{ActivationConfig, NoStreams};
use crate::arena::SharedArena;
use crate::fake::{FakeBackend, FakeConfig};
use crate::tag::Tag;
use crate::tier::Tier;

fn count(name: &str) -> u64 {
    stats()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map_or(u64::MAX, |(_, v)| v)
}

// The only test touching the process-wide slot in this binary.
#[test]
fn misuse_is_counted_and_refused_and_the_weights_route_strands() {
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let pool =
        ActivationPool::new(&fb, &ActivationConfig::new(1 << 20), Arc::new(NoStreams)).unwrap();
    reset_stats();
    assert_eq!(malloc(64, 0, 0), 0);
    assert_eq!(count("not_installed"), 1);
    install(pool.clone(), 0, None);
    let p = malloc(1000, 0, 0);
    assert_ne!(p, 0);
    assert_eq!(malloc(0, 0, 0), 0);
    assert_eq!(malloc_signed(-5, 0, 0), 0);
    assert_eq!(malloc(u64::MAX, 0, 0), 0);
    assert_eq!(malloc(64, 1, 0), 0);
    assert_eq!(malloc(2 << 20, 0, 0), 0);
    free(p, Some(999), 0, 0);
    free(p, Some(1000), 0, 0);
    free(8, Some(8), 0, 0);
    free(0, None, 0, 0);
    for (name, n) in [
        ("zero_size", 1),
        ("negative_size", 1),
        ("absurd_size", 1),
        ("wrong_device", 1),
        ("ooms", 1),
        ("size_mismatches", 1),
        ("double_frees", 1),
        ("foreign_frees", 1),
        ("null_frees", 1),
        ("free_ok", 1),
        ("malloc_ok", 1),
        ("panics", 0),
    ] {
        assert_eq!(count(name), n, "{name}");
    }
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().live, 0);

    let arena = SharedArena::new(&fb, Tier::ModelResident, 1 << 20, None).unwrap();
    install(pool.clone(), 0, Some(arena.clone()));
    set_route(Route::Weights);
    let w = malloc(3000, 0, 0);
    assert!(w != 0 && !pool.contains(w));
    assert_eq!(malloc(2 << 20, 0, 0), 0);
    set_route(Route::Activations);
    free(w, Some(3000), 0, 0);
    free(w, Some(3000), 0, 0);
    assert_eq!(
        (count("stranded_frees"), count("stranded_bytes")),
        (1, 3000)
    );
    assert_eq!((count("weights_refused"), count("foreign_frees")), (1, 2));
    assert_eq!(installed_pool_id(), Some(pool.id()));
    assert!(uninstall());
    assert!(!uninstall());

    // Another thread's copy: after an uninstall its next call refuses
    // and lets go of the pool, whose region is then released.
    let fb2 = FakeBackend::new(FakeConfig::default()).unwrap();
    let pool2 =
        ActivationPool::new(&fb2, &ActivationConfig::new(1 << 20), Arc::new(NoStreams)).unwrap();
    install(pool2, 0, None);
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let (done, called) = std::sync::mpsc::channel::<usize>();
    let worker = std::thread::spawn(move || {
        let p = malloc(4096, 0, 0);
        free(p, Some(4096), 0, 0);
        done.send(p).unwrap();
        wait.recv().unwrap();
        done.send(malloc(4096, 0, 0)).unwrap();
    });
    assert_ne!(called.recv().unwrap(), 0);
    let region = |fb: &FakeBackend| fb.stats().tags.get(&Tag::Activations).map_or(0, |t| t.live);
    assert!(uninstall());
    assert_eq!(region(&fb2), 1 << 20, "the worker still holds the pool");
    go.send(()).unwrap();
    assert_eq!(called.recv().unwrap(), 0, "refused after the uninstall");
    worker.join().unwrap();
    assert_eq!(region(&fb2), 0, "released with the worker's copy");

    // A pool that leaves the hooks with a live block is retired: the
    // block's free still reaches it, whatever is installed then, and
    // the pool goes with that last block.
    let fb3 = FakeBackend::new(FakeConfig::default()).unwrap();
    let open = |fb: &FakeBackend| {
        ActivationPool::new(fb, &ActivationConfig::new(1 << 20), Arc::new(NoStreams)).unwrap()
    };
    let (a, b) = (open(&fb3), open(&fb3));
    let (a_id, b_id) = (a.id(), b.id());
    install(a, 0, None);
    let kept = malloc(4096, 0, 0);
    let gone = malloc(4096, 0, 0);
    free(gone, Some(4096), 0, 0);
    install(b, 0, None);
    assert_eq!(retired_pool_ids(), vec![a_id], "replaced with a live block");
    assert_eq!(region(&fb3), 2 << 20, "both pools' regions held");
    let on_b = malloc(4096, 0, 0);
    assert!(on_b != 0 && on_b != kept);
    free(kept, Some(4096), 0, 0);
    assert_eq!(count("retired_frees"), 1);
    assert!(retired_pool_ids().is_empty(), "gone with its last block");
    assert_eq!(region(&fb3), 1 << 20, "a's region released");
    free(kept, Some(4096), 0, 0);
    assert_eq!(
        count("retired_frees"),
        1,
        "a second free is not a retired one"
    );
    // Uninstalled with a live block, then installed again: no longer
    // retired, its frees go through the slot.
    assert!(uninstall());
    assert_eq!(retired_pool_ids(), vec![b_id]);
    let b_again = {
        let all = RETIRED.read().unwrap();
        all[0].pool.clone()
    };
    install(b_again, 0, None);
    assert!(retired_pool_ids().is_empty(), "installed again");
    free(on_b, Some(4096), 0, 0);
    assert_eq!(count("retired_frees"), 1);
    // A region removed with a live block.
    let c = open(&fb3);
    let c_id = c.id();
    add_region(c, 0);
    set_region(Some(c_id)).unwrap();
    let in_c = malloc(4096, 0, 0);
    set_region(None).unwrap();
    assert!(remove_region(c_id));
    assert_eq!(retired_pool_ids(), vec![c_id]);
    free(in_c, Some(4096), 0, 0);
    assert_eq!(count("retired_frees"), 2);
    assert!(retired_pool_ids().is_empty());
    assert!(uninstall());
    assert!(
        retired_pool_ids().is_empty(),
        "nothing live: released, not retired"
    );
    assert_eq!(region(&fb3), 0);

    // A block another thread's call was still placing in the pool when
    // it was uninstalled: the pool is retired when that thread lets go
    // of it, not judged at the uninstall.
    let pool5 = open(&fb3);
    let id5 = pool5.id();
    install(pool5.clone(), 0, None);
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let (done, called) = std::sync::mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        let p = malloc(4096, 0, 0);
        free(p, Some(4096), 0, 0);
        done.send(()).unwrap();
        wait.recv().unwrap();
        assert_eq!(malloc(4096, 0, 0), 0, "refused: uninstalled");
    });
    called.recv().unwrap();
    assert!(uninstall());
    assert_eq!(
        retired_pool_ids(),
        vec![id5],
        "listed while the worker's copy may still place a block"
    );
    // What the worker's call on its copy would have done in between.
    let late = pool5.allocate(4096, 0).unwrap();
    drop(pool5);
    go.send(()).unwrap();
    worker.join().unwrap();
    assert_eq!(
        retired_pool_ids(),
        vec![id5],
        "retired with the worker's copy"
    );
    assert_eq!(region(&fb3), 1 << 20);
    free(late, Some(4096), 0, 0);
    assert!(retired_pool_ids().is_empty());
    assert_eq!(region(&fb3), 0);

    // A T1 arena that leaves the hooks with takes live is kept for them.
    let fb4 = FakeBackend::new(FakeConfig::default()).unwrap();
    let pool4 = open(&fb4);
    let t1 = SharedArena::new(&fb4, Tier::ModelResident, 1 << 20, None).unwrap();
    let t1_live = |fb: &FakeBackend| fb.stats().tags.get(&Tag::Weights).map_or(0, |t| t.live);
    install(pool4.clone(), 0, Some(t1.clone()));
    set_route(Route::Weights);
    let (w1, w2) = (malloc(4096, 0, 0), malloc(4096, 0, 0));
    set_route(Route::Activations);
    // Installed again with the same arena: its takes are still its own.
    install(pool4.clone(), 0, Some(t1.clone()));
    let (stranded, retired) = (count("stranded_frees"), count("retired_frees"));
    free(w1, Some(4096), 0, 0);
    assert_eq!(count("stranded_frees"), stranded + 1);
    assert!(uninstall());
    assert_eq!(retired_arena_count(), 1);
    drop(t1);
    assert_eq!(t1_live(&fb4), 1 << 20, "kept for the live take");
    free(w2, Some(4096), 0, 0);
    assert_eq!(retired_arena_count(), 0);
    assert_eq!(t1_live(&fb4), 0, "released with its last take");
    assert_eq!(
        (count("stranded_frees"), count("retired_frees")),
        (stranded + 2, retired + 1)
    );
    let unknown = count("free_not_installed");
    free(w2, Some(4096), 0, 0);
    assert_eq!(
        count("free_not_installed"),
        unknown + 1,
        "gone: nothing knows it"
    );
    assert_eq!(count("panics"), 0);
}

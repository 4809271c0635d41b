use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::fake::{FakeBackend, FakeConfig};
use crate::tag::Tag;

const MIB: u64 = 1 << 20;

fn ledger(budget: u64) -> (tempfile::TempDir, DeviceLedger) {
    let dir = tempfile::tempdir().unwrap();
    let l = DeviceLedger::open(dir.path(), "fake-gpu0", budget).unwrap();
    (dir, l)
}

#[test]
fn floors_that_do_not_fit_are_refused_naming_every_tenant() {
    let (_d, l) = ledger(100 * MIB);
    let _a = l
        .join("alpha", 40 * MIB, 100 * MIB, Duration::ZERO)
        .unwrap();
    let _b = l.join("beta", 30 * MIB, 100 * MIB, Duration::ZERO).unwrap();
    let err = l
        .join("gamma", 31 * MIB, 100 * MIB, Duration::ZERO)
        .unwrap_err();
    let MemError::LedgerFull(refusal) = &err else {
        panic!("expected LedgerFull, got {err:?}");
    };
    assert_eq!(refusal.tenants.len(), 2);
    let text = err.to_string();
    for needle in ["alpha", "beta", "gamma", "40.0 MiB", "30.0 MiB", "31.0 MiB"] {
        assert!(text.contains(needle), "{needle} missing from {text}");
    }
    // Exactly the room left fits.
    let _c = l
        .join("gamma", 30 * MIB, 100 * MIB, Duration::ZERO)
        .unwrap();
}

#[test]
fn growth_within_the_floor_always_succeeds_and_the_rest_is_first_come() {
    let (_d, l) = ledger(100 * MIB);
    let a = l.join("a", 20 * MIB, 100 * MIB, Duration::ZERO).unwrap();
    let b = l.join("b", 30 * MIB, 60 * MIB, Duration::ZERO).unwrap();
    // a takes all that b's floor leaves.
    assert_eq!(a.headroom().unwrap(), 70 * MIB);
    a.grow(70 * MIB).unwrap().unwrap();
    let refused = a.grow(MIB).unwrap().unwrap_err();
    assert_eq!(refused.headroom, 0);
    // A tenant that wants more is not asked to give back; a stops asking.
    assert_eq!(a.pressure().unwrap(), 0);
    a.clear_want().unwrap();
    // b's floor is still there for it.
    b.grow(30 * MIB).unwrap().unwrap();
    assert!(b.grow(MIB).unwrap().is_err());
    // b presses on a: a's share of the deficit is what b wants.
    assert_eq!(a.pressure().unwrap(), MIB);
    assert_eq!(b.pressure().unwrap(), 0);
    a.shrink(10 * MIB).unwrap();
    assert_eq!(a.pressure().unwrap(), 0);
    b.grow(10 * MIB).unwrap().unwrap();
    // b's cap holds even with room.
    a.shrink(50 * MIB).unwrap();
    assert_eq!(b.headroom().unwrap(), 20 * MIB);
    let snap = l.snapshot().unwrap();
    assert_eq!(snap.committed(), 10 * MIB + 40 * MIB);
    assert!(snap.reserved() <= snap.budget);
}

#[test]
fn a_tenant_dropped_or_dead_gives_its_share_back() {
    let (_d, l) = ledger(100 * MIB);
    let a = l.join("a", 10 * MIB, 100 * MIB, Duration::ZERO).unwrap();
    a.grow(80 * MIB).unwrap().unwrap();
    drop(a);
    assert!(l.snapshot().unwrap().tenants.is_empty());
    // A slot whose liveness lock nobody holds is a dead tenant's.
    {
        let locked = l.lock().unwrap();
        let corpse = Slot {
            state: SlotState::Live,
            pid: 1,
            generation: 9,
            floor: 50 * MIB,
            cap: 100 * MIB,
            committed: 90 * MIB,
            name: "corpse".into(),
            ..Slot::default()
        };
        locked.write_slot(5, &corpse).unwrap();
    }
    let b = l.join("b", 10 * MIB, 100 * MIB, Duration::ZERO).unwrap();
    b.grow(90 * MIB).unwrap().unwrap();
    let snap = l.snapshot().unwrap();
    assert_eq!(snap.tenants.len(), 1);
    assert_eq!(snap.tenants[0].record.name, "b");
}

#[test]
fn a_join_waits_for_elastic_memory_and_gives_up_after_its_wait() {
    let (_d, l) = ledger(100 * MIB);
    let a = l.join("a", 10 * MIB, 100 * MIB, Duration::ZERO).unwrap();
    a.grow(90 * MIB).unwrap().unwrap();
    let err = l
        .join("b", 40 * MIB, 100 * MIB, Duration::from_millis(20))
        .unwrap_err();
    assert!(matches!(err, MemError::Capacity(_)), "{err:?}");
    // While b waits, a is pressed for the 30 MiB b lacks and gives it back.
    let l2 = l.clone();
    let waiter =
        std::thread::spawn(move || l2.join("b", 40 * MIB, 100 * MIB, Duration::from_secs(5)));
    let mut pressed = 0;
    for _ in 0..2000 {
        pressed = a.pressure().unwrap();
        if pressed > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(pressed, 30 * MIB);
    // Meanwhile a cannot grow into the room b waits for.
    assert!(a.grow(MIB).unwrap().is_err());
    a.clear_want().unwrap();
    a.shrink(pressed).unwrap();
    let b = waiter.join().unwrap().unwrap();
    assert_eq!(b.record().unwrap().state, SlotState::Live);
    assert_eq!(l.snapshot().unwrap().reserved(), 100 * MIB);
}

#[test]
fn a_backend_on_the_ledger_commits_only_what_it_grants() {
    let (_d, l) = ledger(64 * MIB);
    let other = l.join("other", 16 * MIB, 64 * MIB, Duration::ZERO).unwrap();
    let fb = FakeBackend::new(FakeConfig {
        capacity: 256 * MIB,
        granularity: 2 * MIB as usize,
        ..FakeConfig::default()
    })
    .unwrap();
    let weights = fb.acquire(4 * MIB, 256, Tag::Weights).unwrap();
    let t = Arc::new(l.join("me", 8 * MIB, 64 * MIB, Duration::ZERO).unwrap());
    fb.attach_ledger(Arc::clone(&t)).unwrap();
    assert_eq!(t.record().unwrap().committed, 4 * MIB);
    assert!(fb.attach_ledger(Arc::clone(&t)).is_err());
    let mut kv = fb.acquire_growable(64 * MIB, 0, Tag::KvCache).unwrap();
    // 64 - 16 (other's floor) - 4 (weights) = 44 MiB for the KV region.
    assert_eq!(fb.headroom().unwrap(), 44 * MIB);
    kv.commit(44 * MIB).unwrap();
    let err = kv.commit(46 * MIB).unwrap_err();
    let MemError::OutOfMemory(report) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(report.ledger_headroom, Some(0));
    assert!(err.to_string().contains("device ledger"), "{err}");
    assert_eq!(t.record().unwrap().committed, 48 * MIB);
    kv.decommit(20 * MIB).unwrap();
    assert_eq!(t.record().unwrap().committed, 24 * MIB);
    other.grow(40 * MIB).unwrap().unwrap();
    assert!(fb.detach_ledger().is_err());
    drop(kv);
    drop(weights);
    assert_eq!(t.record().unwrap().committed, 0);
    assert!(fb.detach_ledger().unwrap().is_some());
    assert!(fb.tenant().is_none());
    fb.check_invariants().unwrap();
}

#[test]
fn a_foreign_file_and_a_bad_key_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("x.ledger"), vec![7u8; TABLE_BYTES]).unwrap();
    assert!(matches!(
        DeviceLedger::open(dir.path(), "x", MIB),
        Err(MemError::BackendUnavailable(_))
    ));
    for key in ["", "../etc", ".hidden", "a/b"] {
        assert!(matches!(
            DeviceLedger::open(dir.path(), key, MIB),
            Err(MemError::InvalidArgument(_))
        ));
    }
    assert!(DeviceLedger::open(dir.path(), "ok", 0).is_err());
    let l = DeviceLedger::open(dir.path(), "gpu-1", 10 * MIB).unwrap();
    assert!(l.join("x", 5 * MIB, MIB, Duration::ZERO).is_err());
    // A second opener with another budget is refused; one without takes
    // the first one's.
    assert!(DeviceLedger::open(dir.path(), "gpu-1", MIB).is_err());
    assert_eq!(
        DeviceLedger::open_existing(dir.path(), "gpu-1")
            .unwrap()
            .budget(),
        10 * MIB
    );
    assert_eq!(
        list_devices(dir.path()).unwrap(),
        vec!["gpu-1".to_string(), "x".to_string()]
    );
}

#[test]
fn a_floor_rises_when_the_reservations_still_fit() {
    let (_d, l) = ledger(100 * MIB);
    let a = l.join("a", 20 * MIB, 40 * MIB, Duration::ZERO).unwrap();
    let b = l.join("b", 30 * MIB, 100 * MIB, Duration::ZERO).unwrap();
    // Bytes a already holds past its floor: always granted.
    a.grow(25 * MIB).unwrap().unwrap();
    a.raise_floor(5 * MIB).unwrap().unwrap();
    assert_eq!(a.record().unwrap().floor, 25 * MIB);
    // Past its commitment: granted while b's reservation leaves room, and
    // the cap follows the floor.
    a.raise_floor(45 * MIB).unwrap().unwrap();
    let rec = a.record().unwrap();
    assert_eq!((rec.floor, rec.cap), (70 * MIB, 70 * MIB));
    // b takes its floor: nothing is left for a's floor to rise into.
    b.grow(30 * MIB).unwrap().unwrap();
    let refused = a.raise_floor(MIB).unwrap().unwrap_err();
    assert_eq!(refused.asked, MIB);
    assert_eq!(refused.headroom, 0);
    assert_eq!(a.record().unwrap().floor, 70 * MIB);
    // A new tenant now meets the raised floor at its join.
    let err = l.join("c", MIB, MIB, Duration::ZERO).unwrap_err();
    assert!(matches!(err, MemError::LedgerFull(_)), "{err:?}");
    let snap = l.snapshot().unwrap();
    assert!(snap.reserved() <= snap.budget);
    drop(b);
    let _c = l.join("c", 30 * MIB, 30 * MIB, Duration::ZERO).unwrap();
}

#[test]
fn a_second_opener_with_another_budget_is_refused_and_none_takes_the_tables() {
    let dir = tempfile::tempdir().unwrap();
    let err = DeviceLedger::open_existing(dir.path(), "fake-b")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no ledger for device"), "{err}");
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    let first = DeviceLedger::open(dir.path(), "fake-b", 10 * MIB).unwrap();
    assert_eq!(
        DeviceLedger::open(dir.path(), "fake-b", 10 * MIB)
            .unwrap()
            .budget(),
        10 * MIB
    );
    let err = DeviceLedger::open(dir.path(), "fake-b", 20 * MIB)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("already shares 10.0 MiB") && err.contains("not 20.0 MiB"),
        "{err}"
    );
    let existing = DeviceLedger::open_existing(dir.path(), "fake-b").unwrap();
    assert_eq!(existing.budget(), first.budget());
}

#[test]
fn a_grow_past_the_tenants_own_cap_names_that_cap_and_its_commitment() {
    // Issue 55: cap 8 on a 10 MiB ledger, 7 committed, no other tenant.
    let (_d, l) = ledger(10 * MIB);
    let t = l.join("alone", MIB, 8 * MIB, Duration::ZERO).unwrap();
    t.grow(7 * MIB).unwrap().unwrap();
    let refused = t.grow(2 * MIB).unwrap().unwrap_err();
    let text = MemError::OutOfMemory(crate::error::OomReport {
        asked: 2 * MIB,
        live: refused.committed,
        budget: 10 * MIB,
        capacity: 10 * MIB,
        tag: Tag::Workspace,
        device_refused: false,
        ledger_headroom: Some(refused.headroom),
        ledger_tenant: Some(refused.share(false)),
    })
    .to_string();
    assert!(
        text.contains("past its own cap of 8.00 MiB") && text.contains("7.00 MiB committed"),
        "{text}"
    );
    assert!(
        !text.contains("workspace") && !text.contains("other tenants"),
        "{text}"
    );
}

#[test]
fn a_floor_over_the_whole_budget_with_no_tenant_does_not_say_stop_a_tenant() {
    let (_d, l) = ledger(10 * MIB);
    let err = l
        .join("big", 20 * MIB, 20 * MIB, Duration::ZERO)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("more than the ledger's whole budget"), "{err}");
    assert!(!err.contains("stop a tenant"), "{err}");
}

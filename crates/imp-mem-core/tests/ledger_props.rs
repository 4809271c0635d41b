//! The device ledger against a model of it, in one process (issue 27):
//! random joins, grows, shrinks, floor raises and lowerings and leaves of up to four
//! tenants. Each answer is the model's (a join refused with `LedgerFull`
//! exactly when the floors do not fit, one whose floor fits but finds the
//! room held refused with `Capacity`; a grow granted exactly within its
//! headroom; a floor raised exactly when every reservation still fits), and
//! after every step the table equals the model, the reservations fit the
//! budget and nothing is committed past a cap. (`ledger_processes.rs` runs
//! tenants in separate processes, with SIGKILL.)

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::time::Duration;

use imp_mem_core::error::MemError;
use imp_mem_core::ledger::{DeviceLedger, Tenant};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;
const BUDGET: u64 = 100 * MIB;

#[derive(Debug, Clone)]
enum Op {
    Join { floor: u64, extra: u64 },
    Grow(u64),
    Shrink(u64),
    RaiseFloor(u64),
    LowerFloor(u64),
    Leave,
}

fn op() -> impl Strategy<Value = (usize, Op)> {
    let mib = |hi: u64| (0..=hi).prop_map(|m| m * MIB);
    let kind = prop_oneof![
        (mib(60), mib(60)).prop_map(|(floor, extra)| Op::Join { floor, extra }),
        mib(50).prop_map(Op::Grow),
        mib(50).prop_map(Op::Shrink),
        mib(40).prop_map(Op::RaiseFloor),
        mib(40).prop_map(Op::LowerFloor),
        Just(Op::Leave),
    ];
    (0..4usize, kind)
}

/// The model's view of a live tenant.
#[derive(Debug, Clone, Copy)]
struct Model {
    floor: u64,
    cap: u64,
    committed: u64,
}

impl Model {
    fn reserved(&self) -> u64 {
        self.committed.max(self.floor)
    }
}

fn others(models: &[Option<Model>], me: usize, f: impl Fn(&Model) -> u64) -> u64 {
    models
        .iter()
        .enumerate()
        .filter(|&(j, _)| j != me)
        .filter_map(|(_, m)| m.as_ref().map(&f))
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_ledger_answers_as_its_model(ops in prop::collection::vec(op(), 1..48)) {
        let dir = tempfile::tempdir().unwrap();
        let ledger = DeviceLedger::open(dir.path(), "fake-props", BUDGET).unwrap();
        let mut tenants: Vec<Option<Tenant>> = (0..4).map(|_| None).collect();
        let mut models: Vec<Option<Model>> = vec![None; 4];
        for (i, op) in ops {
            match (op, tenants[i].is_some()) {
                (Op::Join { floor, extra }, false) => {
                    let floors = others(&models, i, |m| m.floor);
                    let reserved = others(&models, i, Model::reserved);
                    let cap = floor + extra;
                    match ledger.join(&format!("t{i}"), floor, cap, Duration::ZERO) {
                        Ok(t) => {
                            prop_assert!(reserved + floor <= BUDGET, "joined past the room");
                            tenants[i] = Some(t);
                            models[i] = Some(Model { floor, cap: cap.min(BUDGET), committed: 0 });
                        }
                        Err(MemError::LedgerFull(_)) => {
                            prop_assert!(floors + floor > BUDGET, "refused, floors fit");
                        }
                        Err(MemError::Capacity(_)) => {
                            prop_assert!(floors + floor <= BUDGET);
                            prop_assert!(reserved + floor > BUDGET, "waited, room free");
                        }
                        Err(e) => prop_assert!(false, "join: {e}"),
                    }
                }
                (Op::Grow(bytes), true) => {
                    let m = models[i].unwrap();
                    let taken = others(&models, i, Model::reserved);
                    let by_budget = BUDGET
                        .saturating_sub(taken)
                        .saturating_sub(m.committed)
                        .max(m.floor.saturating_sub(m.committed));
                    let room = by_budget.min(m.cap - m.committed);
                    let t = tenants[i].as_ref().unwrap();
                    prop_assert_eq!(t.headroom().unwrap(), room);
                    match t.grow(bytes).unwrap() {
                        Ok(()) => {
                            prop_assert!(bytes <= room);
                            models[i].as_mut().unwrap().committed += bytes;
                        }
                        Err(refused) => {
                            prop_assert!(bytes > room);
                            prop_assert_eq!(refused.headroom, room);
                            t.clear_want().unwrap();
                        }
                    }
                }
                (Op::Shrink(bytes), true) => {
                    let m = models[i].as_mut().unwrap();
                    let bytes = bytes.min(m.committed);
                    tenants[i].as_ref().unwrap().shrink(bytes).unwrap();
                    m.committed -= bytes;
                }
                (Op::RaiseFloor(bytes), true) => {
                    let m = models[i].unwrap();
                    let taken = others(&models, i, Model::reserved);
                    let fits = m.committed.max(m.floor + bytes) + taken <= BUDGET;
                    match tenants[i].as_ref().unwrap().raise_floor(bytes).unwrap() {
                        Ok(()) => {
                            prop_assert!(fits, "raised past the budget");
                            let m = models[i].as_mut().unwrap();
                            m.floor += bytes;
                            m.cap = m.cap.max(m.floor);
                        }
                        Err(refused) => {
                            prop_assert!(!fits, "refused, fits");
                            prop_assert_eq!(refused.asked, bytes);
                        }
                    }
                }
                (Op::LowerFloor(bytes), true) => {
                    tenants[i].as_ref().unwrap().lower_floor(bytes).unwrap();
                    let m = models[i].as_mut().unwrap();
                    m.floor = m.floor.saturating_sub(bytes);
                }
                (Op::Leave, true) => {
                    tenants[i] = None;
                    models[i] = None;
                }
                _ => {}
            }
            let snap = ledger.snapshot().unwrap();
            prop_assert!(snap.reserved() <= BUDGET, "{:?}", snap);
            prop_assert!(snap.committed() <= BUDGET);
            prop_assert_eq!(snap.tenants.len(), models.iter().flatten().count());
            for (t, m) in tenants.iter().zip(&models) {
                if let (Some(t), Some(m)) = (t, m) {
                    let rec = t.record().unwrap();
                    prop_assert_eq!((rec.floor, rec.cap, rec.committed), (m.floor, m.cap, m.committed));
                    prop_assert!(rec.committed <= rec.cap);
                }
            }
        }
    }
}

//! Block refs held outside the manager's lock while a file is written or
//! read ([`LentRefs`]), registered so that the manager's invariant check
//! counts them.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::block_pool::{BlockId, SharedBlockRef};
use crate::kv::prefix::FastMap;

/// Block refs held outside the manager's lock (a save's snapshot, a load's
/// fresh blocks), registered so that the manager's invariant check counts
/// them. Registration and release happen under the registry's lock, which
/// the check holds while it reads the pool's refcounts.
#[derive(Debug, Default)]
pub(crate) struct Lent {
    ids: Mutex<FastMap<BlockId, u32>>,
}

impl Lent {
    /// The registry, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, FastMap<BlockId, u32>> {
        self.ids.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Refs lent out of a manager; see [`Lent`]. Dropping them releases them.
#[derive(Debug)]
pub struct LentRefs {
    pub(super) refs: Vec<SharedBlockRef>,
    lent: Arc<Lent>,
}

impl LentRefs {
    pub(crate) fn new(refs: Vec<SharedBlockRef>, lent: &Arc<Lent>) -> Self {
        let mut ids = lent.lock();
        for r in &refs {
            *ids.entry(r.id()).or_default() += 1;
        }
        drop(ids);
        Self {
            refs,
            lent: lent.clone(),
        }
    }

    /// Takes the refs back under the manager's lock (unregistered).
    pub(crate) fn take(&mut self) -> Vec<SharedBlockRef> {
        let mut ids = self.lent.lock();
        for r in &self.refs {
            unregister(&mut ids, r.id());
        }
        std::mem::take(&mut self.refs)
    }
}

fn unregister(ids: &mut FastMap<BlockId, u32>, id: BlockId) {
    if let Some(n) = ids.get_mut(&id) {
        *n -= 1;
        if *n == 0 {
            ids.remove(&id);
        }
    }
}

impl Drop for LentRefs {
    fn drop(&mut self) {
        let mut ids = self.lent.lock();
        for r in self.refs.drain(..) {
            unregister(&mut ids, r.id());
            drop(r);
        }
    }
}

//! Errors are values: every failure the core can report, with the numbers
//! that explain it and what to change.
//!
//! The Python binding maps each variant, once, to the exception hierarchy
//! under `imp_mem.ImpMemError`.

use crate::phase::Phase;
use crate::tag::Tag;
use crate::units::human_bytes;

/// The arithmetic of a refused acquisition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OomReport {
    /// Bytes asked for.
    pub asked: u64,
    /// Bytes live on the backend when it was asked.
    pub live: u64,
    /// The backend's budget.
    pub budget: u64,
    /// The device's capacity.
    pub capacity: u64,
    /// What the bytes were for.
    pub tag: Tag,
    /// True when the device itself refused (its memory is used by something
    /// outside this backend), false when the budget cap refused.
    pub device_refused: bool,
    /// `Some(headroom)` when the device ledger refused: the bytes it could
    /// grant this tenant then (other tenants hold the rest).
    pub ledger_headroom: Option<u64>,
    /// With `ledger_headroom`: the refused tenant's own share, so the
    /// message can say whether its cap or the other tenants refused.
    pub ledger_tenant: Option<TenantShare>,
}

/// A ledger tenant's share when the ledger refused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantShare {
    /// What the tenant had committed when it asked.
    pub committed: u64,
    /// Its cap.
    pub cap: u64,
    /// Whether the bytes were asked for the report's tag (through a
    /// backend), or straight of the tenant (no tag to name).
    pub for_tag: bool,
}

impl std::fmt::Display for OomReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            asked,
            live,
            budget,
            capacity,
            tag,
            device_refused,
            ledger_headroom,
            ledger_tenant,
        } = *self;
        if let (Some(headroom), Some(share)) = (ledger_headroom, ledger_tenant) {
            let what = if share.for_tag {
                format!(" for tag '{tag}'")
            } else {
                String::new()
            };
            if share.committed.saturating_add(asked) > share.cap {
                write!(
                    f,
                    "out of memory: {} asked{what} would take this tenant past its own cap of \
                     {}: it has {} committed ({} left under the cap); join with a larger cap, \
                     or give memory back first",
                    human_bytes(asked),
                    human_bytes(share.cap),
                    human_bytes(share.committed),
                    human_bytes(headroom)
                )
            } else {
                write!(
                    f,
                    "out of memory: the device ledger grants this tenant {} more, and {} was \
                     asked{what}; it has {} committed (cap {}) and the device's other tenants \
                     hold the rest — wait for them to give memory back, or plan a smaller \
                     configuration",
                    human_bytes(headroom),
                    human_bytes(asked),
                    human_bytes(share.committed),
                    human_bytes(share.cap)
                )
            }
        } else if let Some(headroom) = ledger_headroom {
            write!(
                f,
                "out of memory: the device ledger grants this tenant {} more, and {} was asked \
                 for tag '{tag}' with {} live (tenant cap {}); the device's other tenants hold \
                 the rest — wait for them to give memory back, or plan a smaller configuration",
                human_bytes(headroom),
                human_bytes(asked),
                human_bytes(live),
                human_bytes(budget)
            )
        } else if device_refused {
            write!(
                f,
                "out of memory: the device refused {} for tag '{tag}' with {} live on this backend \
                 (budget {}, capacity {}); memory outside this backend is in use — lower the \
                 budget to what the device can really give, or free memory elsewhere",
                human_bytes(asked),
                human_bytes(live),
                human_bytes(budget),
                human_bytes(capacity)
            )
        } else {
            let over = live.saturating_add(asked).saturating_sub(budget);
            write!(
                f,
                "out of memory: asked {} for tag '{tag}' with {} live; that exceeds the budget of {} \
                 by {} (capacity {}); release regions, raise the budget, or plan a smaller \
                 configuration",
                human_bytes(asked),
                human_bytes(live),
                human_bytes(budget),
                human_bytes(over),
                human_bytes(capacity)
            )
        }
    }
}

/// The block arithmetic of a refused KV admission or append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCapacityReport {
    /// What was refused (e.g. "admit sequence 7").
    pub what: String,
    /// Blocks the operation needed from the pool.
    pub needed: u32,
    /// Blocks on the free list.
    pub free: u32,
    /// Blocks a growable pool could still commit (0 for a fixed pool).
    pub growable: u32,
    /// Cached blocks that eviction could have freed for it.
    pub evictable: u32,
    /// Cached blocks kept by pins (not evictable).
    pub pinned: u32,
    /// Which pool refused: "kv" or "swa".
    pub pool: &'static str,
}

impl std::fmt::Display for KvCapacityReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cannot {}: it needs {} {} block(s); {} free + {} uncommitted (a growable pool) + {} \
             evictable cached = {} available ({} more cached block(s) are pinned); nothing was \
             changed — free or abort sequences, unpin prefixes, or plan a larger pool",
            self.what,
            self.needed,
            self.pool,
            self.free,
            self.growable,
            self.evictable,
            self.free as u64 + self.growable as u64 + self.evictable as u64,
            self.pinned
        )
    }
}

/// Who holds a device's memory, when a new tenant's floor does not fit
/// beside theirs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerRefusal {
    /// The device key.
    pub key: String,
    /// The budget.
    pub budget: u64,
    /// The tenant refused.
    pub name: String,
    /// Its floor.
    pub floor: u64,
    /// Every tenant admitted: (name, pid, floor, committed).
    pub tenants: Vec<(String, u32, u64, u64)>,
}

impl std::fmt::Display for LedgerRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let floors: u64 = self.tenants.iter().map(|t| t.2).sum();
        if self.tenants.is_empty() {
            // No tenant to stop: the floor alone is over the whole budget.
            return write!(
                f,
                "device ledger {}: tenant '{}' needs a floor of {}, more than the ledger's \
                 whole budget of {}; plan this model smaller (max_seq_len, kv_dtype, \
                 max_batch), or open the ledger with a larger budget",
                self.key,
                self.name,
                human_bytes(self.floor),
                human_bytes(self.budget),
            );
        }
        write!(
            f,
            "device ledger {}: tenant '{}' needs a floor of {}, but the floors of the {} tenant(s) \
             already admitted take {} of the {} budget ({} left):",
            self.key,
            self.name,
            human_bytes(self.floor),
            self.tenants.len(),
            human_bytes(floors),
            human_bytes(self.budget),
            human_bytes(self.budget.saturating_sub(floors)),
        )?;
        for (name, pid, floor, committed) in &self.tenants {
            write!(
                f,
                "\n  {name} (pid {pid}): floor {}, committed {}",
                human_bytes(*floor),
                human_bytes(*committed)
            )?;
        }
        write!(
            f,
            "\nplan this model smaller (max_seq_len, kv_dtype, max_batch), or stop a tenant"
        )
    }
}

/// Every failure of the core.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemError {
    /// The budget or the device refused an acquisition.
    #[error("{0}")]
    OutOfMemory(OomReport),
    /// An acquisition while serving, in strict mode, or a phase transition
    /// that is not allowed.
    #[error("{message}")]
    PhaseViolation {
        /// The phase the backend was in.
        phase: Phase,
        /// What was refused and what to do instead.
        message: String,
    },
    /// A caller passed something unusable; the message says what to change.
    #[error("{0}")]
    InvalidArgument(String),
    /// A span or handle used after the memory behind it was reset or released.
    #[error("{0}")]
    StaleSpan(String),
    /// A capacity check refused: the pool cannot hold what was asked.
    #[error("{0}")]
    Capacity(String),
    /// The KV cache manager refused an admission or an append, with the block
    /// arithmetic; nothing was changed. Python raises it as `CapacityError`.
    #[error("{0}")]
    KvCapacity(KvCapacityReport),
    /// The device backend cannot be used on this machine.
    #[error("{0}")]
    BackendUnavailable(String),
    /// A tenant's floor does not fit on its device beside the floors of
    /// the tenants already there (the device ledger's admission).
    #[error("{0}")]
    LedgerFull(Box<LedgerRefusal>),
    /// The driver reported an error.
    #[error("driver error: {0}")]
    Driver(String),
    /// A tier put to sleep ([`MemorySystem::sleep`](crate::system::MemorySystem::sleep))
    /// was used before [`MemorySystem::wake`](crate::system::MemorySystem::wake).
    /// Python raises it as `Asleep`, a `PhaseViolation`.
    #[error("{0}")]
    Asleep(String),
    /// The host refused the bookkeeping a pool or a manager sizes up front
    /// from a caller's count (an entry per block). Python raises it as
    /// `OutOfMemory`, with `asked` set to `bytes`.
    #[error(
        "out of host memory: {what} needs {} of host bookkeeping, which the host refused; ask \
         for fewer blocks",
        human_bytes(*bytes)
    )]
    HostOutOfMemory {
        /// What was being built (e.g. "a pool of 4294967294 blocks").
        what: String,
        /// The bytes of bookkeeping asked for.
        bytes: u64,
    },
    /// An internal invariant was found broken. Always a bug in imp-mem.
    #[error("internal invariant broken (a bug in imp-mem, please report it): {0}")]
    Invariant(String),
}

impl MemError {
    /// Shorthand for an [`MemError::InvalidArgument`].
    pub fn invalid(message: impl Into<String>) -> Self {
        MemError::InvalidArgument(message.into())
    }
}

/// Reserves room for `more` entries of `v` fallibly: a count from a caller
/// must never abort the process for want of host memory.
pub(crate) fn try_reserve<T>(v: &mut Vec<T>, more: usize, what: &str) -> Result<(), MemError> {
    v.try_reserve_exact(more)
        .map_err(|_| MemError::HostOutOfMemory {
            what: what.to_string(),
            bytes: (more as u64).saturating_mul(std::mem::size_of::<T>() as u64),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_message_has_the_arithmetic_and_a_remedy() {
        let report = OomReport {
            asked: 3 << 30,
            live: 6 << 30,
            budget: 8 << 30,
            capacity: 80 << 30,
            tag: Tag::KvCache,
            device_refused: false,
            ledger_headroom: None,
            ledger_tenant: None,
        };
        let text = MemError::OutOfMemory(report).to_string();
        assert!(text.contains("3.00 GiB"), "{text}");
        assert!(text.contains("by 1.00 GiB"), "{text}");
        assert!(text.contains("kv_cache"), "{text}");
        assert!(text.contains("raise the budget"), "{text}");
    }

    #[test]
    fn an_impossible_reservation_is_refused_not_aborted() {
        let mut v: Vec<u64> = Vec::new();
        let err = try_reserve(&mut v, usize::MAX / 16, "a test").unwrap_err();
        assert!(matches!(err, MemError::HostOutOfMemory { .. }), "{err}");
        assert!(err.to_string().contains("a test"), "{err}");
    }
}

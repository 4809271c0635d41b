//! The memory system: one [`MemoryPlan`] opened as tiers on one [`Backend`]
//! (seed A4.2, A4.3, I7, criteria 3 and 6).
//!
//! [`MemorySystem::open`] acquires every tier the plan sizes, in the seed's
//! order of allocation (A4.2): the library reserve and the CUDA context are
//! charges that are already gone, then T2 (engine-persistent arena), T1
//! (model-resident arena), the fixed T3 pools (the SWA pool, the per-sequence
//! state pools), T4 (the scratch stack), T4a (the activation pool, when the
//! plan measured one), and the KV pool last, because it is
//! the one sized from the residual. On a growable backend the KV pool
//! reserves the plan's bytes and commits a first part; it grows inside its
//! reservation while serving, which is a commit and not an acquisition (R5).
//! If any step fails, every tier opened before it is released before the
//! error is returned ([`OpenError`] names the step), so a refused open leaves
//! the backend as it found it.
//!
//! The backend's budget is lowered, for the system's life, to the plan's
//! budget minus the two charges no allocator sees (context and library
//! reserve): A4.3's "the plan either fits it or fails, and the backend
//! refuses any acquisition that would exceed it". It is restored on close.
//!
//! Reporting is one snapshot ([`MemorySystem::report`]) rendered three ways:
//! a text table ([`MemReport::text`]), plain data (`serde`), and Prometheus
//! text ([`MemReport::metrics`]). Attribution (criterion 6) counts as
//! attributed every byte the backend has committed (each region has a tag),
//! plus the named charges outside it: the measured context and library
//! reserve and any charge the caller names ([`MemorySystem::set_charge`]).
//! Against a device reading (`total - free`, less what other processes
//! hold) the remainder is the unattributed residual.
//!
//! Thread safety: the tiers are the `Shared*` forms (`Arc` + mutex); the
//! system itself is `Send + Sync` and its methods take `&self` except
//! [`MemorySystem::close`]. A report reads the backend's ledger under one
//! lock and each tier under its own, one after the other.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use std::sync::Arc;

use crate::activations::{ActivationConfig, ActivationPool, NoStreams, StreamOrder};
use crate::backend::Backend;
use crate::block_pool::{PoolConfig, SharedBlockPool, MAX_BLOCKS};
use crate::decommit::FenceLike;
use crate::error::MemError;
use crate::kv::{KVCacheManager, KvConfig};
use crate::phase::Phase;
use crate::planner::MemoryPlan;
use crate::scratch::SharedScratchStack;
use crate::tag::Tag;
use crate::tier::Tier;
use crate::units::{human_bytes, round_up, MIB};
use crate::SharedArena;

/// Criterion 6: at least this share of the memory in use is attributed.
pub const ATTRIBUTION_TARGET: f64 = 0.95;
/// What a growable KV pool adds per growth step, at least (before rounding
/// to whole blocks): SPEC's VMM figures favour chunks of tens of MiB.
pub const KV_GROW_BYTES: u64 = 64 * MIB;

/// The stream order an activation pool opened by a system uses (see
/// [`StreamOrder`]); compared by identity.
#[derive(Clone)]
pub struct ActivationOrder(pub Arc<dyn StreamOrder>);

impl std::fmt::Debug for ActivationOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ActivationOrder(..)")
    }
}

impl PartialEq for ActivationOrder {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ActivationOrder {}

/// How to open a system. The defaults follow the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemOptions {
    /// The measured CUDA context, reported as a charge; default: the plan's.
    pub context_bytes: Option<u64>,
    /// The measured library reserve, reported as a charge; default: the
    /// plan's.
    pub library_reserve_bytes: Option<u64>,
    /// Whether the KV pool grows inside a reservation; default: when the
    /// backend is growable and the plan's headroom covers rounding the pool
    /// up to the backend's granularity (a growable region commits whole
    /// granules). `Some(true)` is still refused where the rounding does not
    /// fit.
    pub kv_growable: Option<bool>,
    /// Blocks a growable KV pool commits at open; default: a quarter of the
    /// plan's blocks, at least one full sequence.
    pub kv_initial_blocks: Option<u32>,
    /// Blocks a growable KV pool adds per growth step; default: one
    /// sequence or [`KV_GROW_BYTES`], whichever is more.
    pub kv_grow_blocks: Option<u32>,
    /// Lower the backend's budget to what the plan gives the tiers.
    pub apply_budget: bool,
    /// Open T1 over a growable region, reserved for the largest T1 a
    /// compatible plan can give (so a model swap resizes it in place) and
    /// able to sleep; default: when the backend is growable and the plan's
    /// headroom covers rounding T1 up to the granularity. `Some(true)` is
    /// still refused where it does not fit.
    pub sleepable: Option<bool>,
    /// The activation pool's strictness; default: the backend's phase mode.
    pub activation_strict: Option<bool>,
    /// The activation pool's stream order; default: none ([`NoStreams`]),
    /// right for host memory. A device caller passes its driver's.
    pub activation_order: Option<ActivationOrder>,
}

impl Default for SystemOptions {
    fn default() -> Self {
        Self {
            context_bytes: None,
            library_reserve_bytes: None,
            kv_growable: None,
            kv_initial_blocks: None,
            kv_grow_blocks: None,
            apply_budget: true,
            sleepable: None,
            activation_strict: None,
            activation_order: None,
        }
    }
}

/// A refused open: which step failed, and why. Nothing is left acquired.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "cannot open the memory system: step {step} ({what}) failed; every tier opened before it was \
     released. {error}"
)]
pub struct OpenError {
    /// 1-based step of the open order; 0 for the checks before any
    /// acquisition.
    pub step: usize,
    /// What the step opens.
    pub what: String,
    /// The underlying error, whose kind the caller sees.
    pub error: MemError,
}

/// A tier of the system, by what it holds.
#[derive(Debug, Clone)]
enum Handle {
    Arena(SharedArena),
    Pool(SharedBlockPool),
    Scratch(SharedScratchStack),
    Activations(ActivationPool),
}

#[derive(Debug, Clone)]
struct Slot {
    key: String,
    label: String,
    tier: Tier,
    tag: Tag,
    planned: u64,
    /// The tier's geometry (sizes and pool configuration): a model swap
    /// keeps a tier whose layout the new plan does not change.
    layout: String,
    handle: Handle,
}

/// A charge outside the backend: memory in use on the device that no
/// allocator of this library holds, named so that it is attributed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChargeLine {
    /// Stable key (`context`, `library_reserve`, or the caller's).
    pub key: String,
    /// What the report prints.
    pub label: String,
    /// Bytes charged.
    pub bytes: u64,
    /// What the plan charged for it, if the plan has the line.
    pub planned: Option<u64>,
    /// True when the figure was measured (passed in), false when it is the
    /// plan's estimate.
    pub measured: bool,
}

/// A T3 pool's block counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockLine {
    /// Blocks that exist now (grows with a growable pool).
    pub capacity: u32,
    /// The most blocks the pool can grow to.
    pub max_blocks: u32,
    /// Blocks on the free list.
    pub free: u32,
    /// Blocks with at least one ref.
    pub live: u32,
    /// The most blocks ever live at once.
    pub high_water: u32,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Growth steps taken.
    pub growths: u32,
}

/// One tier of the system: plan against actual.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TierLine {
    /// Stable key: `engine_persistent`, `model_resident`, `swa_pool`,
    /// `state`, `scratch`, `kv_pool`.
    pub key: String,
    /// What the report prints.
    pub label: String,
    /// The tier's label (`T1` ... `T4`).
    pub tier: &'static str,
    /// The tag its region is charged to.
    pub tag: &'static str,
    /// Bytes the plan gave it.
    pub planned: u64,
    /// Address space held.
    pub reserved: u64,
    /// Physical memory committed.
    pub committed: u64,
    /// Bytes in use inside the tier (arena takes, live blocks, open scratch).
    pub in_use: u64,
    /// The most ever in use.
    pub high_water: u64,
    /// The largest the region's committed bytes have been (its tag's peak).
    pub peak: u64,
    /// Block counters, for a pool.
    pub blocks: Option<BlockLine>,
    /// The sleep level while the tier sleeps, 0 when awake.
    pub asleep: u8,
}

/// Per-tag counters from the backend's ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TagLine {
    /// The tag.
    pub tag: &'static str,
    /// Address space reserved.
    pub reserved: u64,
    /// Physical memory committed.
    pub committed: u64,
    /// Bytes held by live regions.
    pub live: u64,
    /// The largest `live` has been.
    pub peak: u64,
    /// Acquisitions so far.
    pub acquisitions: u64,
    /// Releases so far.
    pub releases: u64,
    /// Acquisitions while serving (criterion 3: zero).
    pub steady_state_allocations: u64,
}

/// A device reading, taken by the caller (the core never queries a
/// device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceReading {
    /// Free bytes (`cuMemGetInfo`).
    pub free: u64,
    /// Total bytes.
    pub total: u64,
}

/// What a report adds to the system's own state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReportInput {
    /// The device reading, if there is a device.
    pub device: Option<DeviceReading>,
    /// Bytes other processes hold on the device (left out of the
    /// denominator).
    pub other_processes: u64,
    /// Charges for this report only (a backend's handle cache, ...), as
    /// `(key, label, bytes)`.
    pub extra: Vec<(String, String, u64)>,
}

/// The device side of a report: what is in use, and how much of it is
/// attributed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceLine {
    /// Total device bytes.
    pub total: u64,
    /// Free device bytes.
    pub free: u64,
    /// `total - free`.
    pub used: u64,
    /// Held by other processes (passed in).
    pub other_processes: u64,
    /// `used - other_processes`: this process's memory.
    pub own_used: u64,
    /// `own_used - attributed`; negative means something is counted twice.
    pub unattributed: i64,
    /// `attributed / own_used`, in percent.
    pub attribution_pct: f64,
    /// Whether criterion 6 (>= 95 %) holds.
    pub meets_target: bool,
}

/// Memory acquired through the backend but not by one of the system's
/// tiers; still attributed, by its tag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutsideLine {
    /// The tag.
    pub tag: &'static str,
    /// Bytes committed under it outside the tiers.
    pub committed: u64,
}

/// One snapshot of the whole system (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemReport {
    /// The backend's source (`fake`, `cuda`, `vmm`).
    pub backend: String,
    /// Device ordinal.
    pub device_ordinal: i32,
    /// The phase now.
    pub phase: &'static str,
    /// Whether the system has been closed.
    pub closed: bool,
    /// The device's capacity, as the backend knows it.
    pub capacity: u64,
    /// The backend's budget cap now.
    pub budget: u64,
    /// The budget the plan was made for.
    pub plan_budget: u64,
    /// The plan's total.
    pub plan_total: u64,
    /// The plan's headroom.
    pub plan_headroom: u64,
    /// The tiers, in open order.
    pub tiers: Vec<TierLine>,
    /// Backend memory outside the tiers, by tag.
    pub outside: Vec<OutsideLine>,
    /// Charges outside the backend (context, library reserve, the caller's).
    pub charges: Vec<ChargeLine>,
    /// Every tag of the backend's ledger.
    pub tags: Vec<TagLine>,
    /// Everything the backend has committed.
    pub backend_committed: u64,
    /// `backend_committed` + every charge that was measured or acquired.
    pub attributed: u64,
    /// Charges that are the plan's estimate only (a library reserve or a
    /// context nobody measured or claimed): shown, not attributed.
    pub planned_unclaimed: u64,
    /// Acquisitions while serving, over every tag (criterion 3).
    pub steady_state_allocations_total: u64,
    /// The device reading and the attribution, if a reading was given.
    pub device: Option<DeviceLine>,
    /// The keys of the tiers asleep now.
    pub asleep: Vec<String>,
    /// What the sleeping tiers had committed, now given back.
    pub asleep_released: u64,
    /// T5b: pinned host bytes held for sleeping tiers (T1's level-1 copy);
    /// host memory, so not part of `attributed`.
    pub sleep_host: u64,
    /// What the plan gives T5b for it.
    pub sleep_host_planned: u64,
}

/// What `close` released, and what someone else still holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CloseReport {
    /// Bytes the backend has live less than before the close.
    pub released: u64,
    /// Per tier tag, bytes still live: a block ref, a span export or a
    /// tier handle kept elsewhere holds them; they are released when it is
    /// dropped.
    pub still_held: Vec<(Tag, u64)>,
}

/// The tiers of one plan on one backend.
#[derive(Debug)]
pub struct MemorySystem {
    backend: Backend,
    plan: MemoryPlan,
    options: SystemOptions,
    slots: Vec<Slot>,
    charges: Vec<ChargeLine>,
    previous_budget: Option<u64>,
    closed: bool,
}

fn to_u32(value: u64, what: &str) -> Result<u32, MemError> {
    if value > u64::from(MAX_BLOCKS) {
        return Err(MemError::invalid(format!(
            "{what}: {value} blocks is more than one pool holds ({MAX_BLOCKS}); use larger blocks"
        )));
    }
    Ok(value as u32)
}

fn to_usize(value: u64, what: &str) -> Result<usize, MemError> {
    usize::try_from(value).map_err(|_| MemError::invalid(format!("{what} does not fit this host")))
}

/// Opens one tier.
type Opener = Box<dyn FnOnce(&Backend) -> Result<Handle, MemError>>;

/// One step of the open order, before it runs.
struct Step {
    key: String,
    label: String,
    tier: Tier,
    tag: Tag,
    planned: u64,
    /// The most it can commit on this backend (a growable region commits
    /// whole granules).
    cost: u64,
    /// See [`Slot::layout`].
    layout: String,
    open: Opener,
}

impl MemorySystem {
    /// Opens every tier of `plan` on `backend`, in the order of the module
    /// documentation, or none of them.
    pub fn open(
        backend: &Backend,
        plan: &MemoryPlan,
        options: SystemOptions,
    ) -> Result<MemorySystem, OpenError> {
        let before = |error: MemError| OpenError {
            step: 0,
            what: "checks before any acquisition".into(),
            error,
        };
        if backend.phase() == Phase::Serving {
            return Err(before(MemError::PhaseViolation {
                phase: Phase::Serving,
                message: "open the memory system while LOADING or PLANNING: its tiers are \
                          acquisitions, and nothing is acquired while SERVING"
                    .into(),
            }));
        }
        let steps = Self::steps(backend, plan, &options).map_err(before)?;
        let tiers_total: u64 = steps.iter().map(|s| s.cost).sum();
        let previous_budget = if options.apply_budget {
            let budget = backend.budget();
            let for_tiers = plan
                .budget
                .saturating_sub(plan.context)
                .saturating_sub(plan.library_reserve)
                .min(budget);
            backend.set_budget(for_tiers).map_err(before)?;
            Some(budget)
        } else {
            None
        };
        let restore = |error: OpenError| {
            if let Some(budget) = previous_budget {
                let _ = backend.set_budget(budget);
            }
            error
        };
        let stats = backend.stats();
        let room = stats.budget.saturating_sub(stats.total.committed);
        if tiers_total > room {
            return Err(restore(before(MemError::invalid(format!(
                "the plan gives its tiers {} but the backend has {} of budget left ({} budget, {} \
                 committed); plan with this backend's budget, or release what it holds",
                human_bytes(tiers_total),
                human_bytes(room),
                human_bytes(stats.budget),
                human_bytes(stats.total.committed),
            )))));
        }
        // Tiers opened so far; dropped (released, newest first) on failure.
        let mut slots: Vec<Slot> = Vec::with_capacity(steps.len());
        for (i, step) in steps.into_iter().enumerate() {
            match (step.open)(backend) {
                Ok(handle) => slots.push(Slot {
                    key: step.key,
                    label: step.label,
                    tier: step.tier,
                    tag: step.tag,
                    planned: step.planned,
                    layout: step.layout,
                    handle,
                }),
                Err(error) => {
                    while let Some(slot) = slots.pop() {
                        drop(slot);
                    }
                    return Err(restore(OpenError {
                        step: i + 1,
                        what: format!(
                            "{} {} ({}, {})",
                            step.tier.label(),
                            step.label,
                            step.tag,
                            human_bytes(step.planned)
                        ),
                        error,
                    }));
                }
            }
        }
        let charges = vec![
            ChargeLine {
                key: "context".into(),
                label: "CUDA context + driver".into(),
                bytes: options.context_bytes.unwrap_or(plan.context),
                planned: Some(plan.context),
                measured: options.context_bytes.is_some(),
            },
            ChargeLine {
                key: "library_reserve".into(),
                label: "library reserve".into(),
                bytes: options
                    .library_reserve_bytes
                    .unwrap_or(plan.library_reserve),
                planned: Some(plan.library_reserve),
                measured: options.library_reserve_bytes.is_some(),
            },
        ];
        Ok(MemorySystem {
            backend: backend.clone(),
            plan: plan.clone(),
            options,
            slots,
            charges,
            previous_budget,
            closed: false,
        })
    }

    /// The open order, each step with its size and how to open it. Checks
    /// every size first, so a plan this host cannot represent fails before
    /// anything is acquired.
    fn steps(
        backend: &Backend,
        plan: &MemoryPlan,
        options: &SystemOptions,
    ) -> Result<Vec<Step>, MemError> {
        let mut steps: Vec<Step> = Vec::new();
        let granule = backend.info().granularity.max(1) as u64;
        let round = |bytes: u64| bytes.div_ceil(granule).saturating_mul(granule);
        // What the plan leaves for rounding growable regions up to granules.
        let mut spare = plan.headroom;
        let arena = |tier: Tier, tag: Tag, bytes: u64| -> Opener {
            Box::new(move |b: &Backend| {
                SharedArena::new(b, tier, bytes, Some(tag)).map(Handle::Arena)
            })
        };
        if plan.engine_persistent > 0 {
            steps.push(Step {
                key: "engine_persistent".into(),
                label: "engine-persistent arena".into(),
                tier: Tier::EnginePersistent,
                tag: Tag::Workspace,
                planned: plan.engine_persistent,
                cost: plan.engine_persistent,
                layout: format!("arena {}", plan.engine_persistent),
                open: arena(
                    Tier::EnginePersistent,
                    Tag::Workspace,
                    plan.engine_persistent,
                ),
            });
        }
        if plan.model_resident > 0 {
            let bytes = plan.model_resident;
            let rounded = round(bytes);
            let sleepable = options.sleepable.unwrap_or_else(|| backend.info().growable)
                && rounded - bytes <= spare;
            let (cost, open) = if sleepable {
                spare -= rounded - bytes;
                // Address space for the largest T1 a plan with this budget,
                // context, library reserve and T2 can give: a swap to a
                // larger model commits more of it, at the same base.
                // (Never past the backend's budget: nothing could commit it.)
                let reserve = round(
                    plan.budget
                        .saturating_sub(plan.context)
                        .saturating_sub(plan.library_reserve)
                        .saturating_sub(plan.engine_persistent)
                        .min(backend.budget())
                        .max(bytes),
                );
                let limit = to_usize(bytes, "T1")?;
                let open: Opener = Box::new(move |b: &Backend| {
                    let region = b.acquire_growable(reserve, bytes, Tag::Weights)?;
                    SharedArena::from_region_limited(Tier::ModelResident, region, limit)
                        .map(Handle::Arena)
                });
                (rounded, open)
            } else {
                (bytes, arena(Tier::ModelResident, Tag::Weights, bytes))
            };
            steps.push(Step {
                key: "model_resident".into(),
                label: "model-resident arena".into(),
                tier: Tier::ModelResident,
                tag: Tag::Weights,
                planned: bytes,
                cost,
                layout: format!("arena {bytes}"),
                open,
            });
        }
        let fixed_pool = |block_bytes: u64, blocks: u64, tag: Tag, what: &str| {
            let config = PoolConfig::fixed(to_usize(block_bytes, what)?, to_u32(blocks, what)?)
                .with_tag(tag);
            let layout = format!("{config:?}");
            let open: Opener =
                Box::new(move |b: &Backend| SharedBlockPool::new(b, &config).map(Handle::Pool));
            Ok::<_, MemError>((open, layout))
        };
        if let Some(swa) = plan
            .swa
            .as_ref()
            .filter(|s| s.blocks > 0 && s.block_bytes > 0)
        {
            let (open, layout) =
                fixed_pool(swa.block_bytes, swa.blocks, Tag::SwaCache, "SWA pool")?;
            steps.push(Step {
                key: "swa_pool".into(),
                label: "SWA KV pool".into(),
                tier: Tier::Pooled,
                tag: Tag::SwaCache,
                planned: swa.bytes,
                cost: swa.bytes,
                layout,
                open,
            });
        }
        for (i, pool) in plan.pools.iter().enumerate() {
            if pool.slots == 0 || pool.bytes_per_slot == 0 {
                continue;
            }
            let (open, layout) =
                fixed_pool(pool.bytes_per_slot, pool.slots, Tag::State, &pool.name)?;
            steps.push(Step {
                key: if i == 0 {
                    "state".into()
                } else {
                    format!("state_{i}")
                },
                label: format!("{} pool", pool.name),
                tier: Tier::Pooled,
                tag: Tag::State,
                planned: pool.bytes,
                cost: pool.bytes,
                layout,
                open,
            });
        }
        if plan.scratch > 0 {
            let bytes = plan.scratch;
            steps.push(Step {
                key: "scratch".into(),
                label: "scratch stack".into(),
                tier: Tier::Scratch,
                tag: Tag::Scratch,
                planned: bytes,
                cost: bytes,
                layout: format!("scratch {bytes}"),
                open: Box::new(move |b: &Backend| {
                    SharedScratchStack::new(b, bytes, Some(Tag::Scratch)).map(Handle::Scratch)
                }),
            });
        }
        if plan.activations > 0 {
            let bytes = plan.activations;
            let mut config = ActivationConfig::new(bytes);
            config.strict = options.activation_strict;
            // Growable (so it can sleep) where the headroom covers rounding
            // it to a granule, as for T1.
            let rounded = round(bytes);
            config.growable = options.sleepable.unwrap_or_else(|| backend.info().growable)
                && rounded - bytes <= spare;
            let cost = if config.growable {
                spare -= rounded - bytes;
                rounded
            } else {
                bytes
            };
            let order: Arc<dyn StreamOrder> = match &options.activation_order {
                Some(o) => o.0.clone(),
                None => Arc::new(NoStreams),
            };
            steps.push(Step {
                key: "activations".into(),
                label: "activation pool".into(),
                tier: Tier::Activations,
                tag: Tag::Activations,
                planned: bytes,
                cost,
                layout: format!("activations {bytes}"),
                open: Box::new(move |b: &Backend| {
                    ActivationPool::new(b, &config, order).map(Handle::Activations)
                }),
            });
        }
        let kv = &plan.kv;
        if kv.blocks > 0 && kv.block_bytes > 0 {
            let blocks = to_u32(kv.blocks, "KV pool")?;
            let block_bytes = to_usize(kv.block_bytes, "KV block")?;
            // A growable region commits whole granules, so at full growth it
            // holds the plan's blocks rounded up to one: grow only where the
            // plan's headroom covers that rounding, else hold the exact
            // bytes in a fixed region.
            let exact = kv.blocks.saturating_mul(kv.block_bytes);
            let rounded = round(exact);
            let growable = options
                .kv_growable
                .unwrap_or_else(|| backend.info().growable)
                && blocks > 1
                && rounded <= kv.bytes.saturating_add(spare);
            let cost = if growable { rounded } else { exact };
            let config = if growable {
                let per_seq = to_u32(kv.blocks_per_sequence.max(1), "KV pool")?;
                let initial = options
                    .kv_initial_blocks
                    .unwrap_or_else(|| (blocks / 4).max(per_seq))
                    .clamp(1, blocks);
                let chunk = KV_GROW_BYTES.div_ceil(kv.block_bytes).max(1);
                let grow = options
                    .kv_grow_blocks
                    .unwrap_or_else(|| per_seq.max(chunk.min(u64::from(blocks)) as u32))
                    .max(1);
                PoolConfig::growable(block_bytes, initial, blocks, grow)
            } else {
                PoolConfig::fixed(block_bytes, blocks)
            }
            .with_tag(Tag::KvCache);
            let layout = format!("{config:?} {:?} {}", kv.dtype, kv.block_size);
            steps.push(Step {
                key: "kv_pool".into(),
                label: if config.max_blocks > config.blocks {
                    "KV pool (growable)".into()
                } else {
                    "KV pool".into()
                },
                tier: Tier::Pooled,
                tag: Tag::KvCache,
                planned: kv.bytes,
                cost,
                layout,
                open: Box::new(move |b: &Backend| {
                    SharedBlockPool::new(b, &config).map(Handle::Pool)
                }),
            });
        }
        Ok(steps)
    }

    /// The backend.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The plan it was opened from.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// The options it was opened with.
    pub fn options(&self) -> &SystemOptions {
        &self.options
    }

    /// Whether [`MemorySystem::close`] ran.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    fn closed_error(&self) -> MemError {
        MemError::invalid("the memory system is closed; open a new one")
    }

    fn slot(&self, key: &str) -> Option<&Slot> {
        self.slots.iter().find(|s| s.key == key)
    }

    fn arena(&self, key: &str) -> Option<SharedArena> {
        match self.slot(key).map(|s| &s.handle) {
            Some(Handle::Arena(a)) => Some(a.clone()),
            _ => None,
        }
    }

    fn pool(&self, key: &str) -> Option<SharedBlockPool> {
        match self.slot(key).map(|s| &s.handle) {
            Some(Handle::Pool(p)) => Some(p.clone()),
            _ => None,
        }
    }

    /// T1: the model-resident arena the caller loads the weights into.
    pub fn weights_arena(&self) -> Option<SharedArena> {
        self.arena("model_resident")
    }

    /// T2: the engine-persistent arena.
    pub fn engine_arena(&self) -> Option<SharedArena> {
        self.arena("engine_persistent")
    }

    /// T3: the paged KV pool.
    pub fn kv_pool(&self) -> Option<SharedBlockPool> {
        self.pool("kv_pool")
    }

    /// T3: the sliding-window KV pool, if the plan has one.
    pub fn swa_pool(&self) -> Option<SharedBlockPool> {
        self.pool("swa_pool")
    }

    /// T3: the per-sequence state pools (linear attention / SSM), if any.
    pub fn state_pools(&self) -> Vec<SharedBlockPool> {
        self.slots
            .iter()
            .filter(|s| s.tag == Tag::State)
            .filter_map(|s| match &s.handle {
                Handle::Pool(p) => Some(p.clone()),
                _ => None,
            })
            .collect()
    }

    /// The pools that can shrink (they grew, or can grow, past the blocks
    /// they opened with): today the KV pool on a growable backend.
    pub fn growable_pools(&self) -> Vec<SharedBlockPool> {
        self.slots
            .iter()
            .filter_map(|s| match &s.handle {
                Handle::Pool(p) => Some(p.clone()),
                _ => None,
            })
            .filter(|p| {
                let st = p.stats();
                st.max_blocks > st.min_blocks
            })
            .collect()
    }

    /// One engine step for every growable pool ([`SharedBlockPool::step`]:
    /// the KV pool's hysteretic, fenced shrink). Call it once per engine
    /// step with a fence recorded after the step's work was enqueued
    /// ([`NothingInFlight`](crate::decommit::NothingInFlight) when none can
    /// touch the pools). Every pool is stepped even if one fails; the first
    /// error is returned. Returns the bytes decommitted during this call.
    pub fn step<F: FenceLike + Send + Sync + 'static>(&self, fence: F) -> Result<u64, MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        let fence = Arc::new(fence);
        let mut bytes = 0u64;
        let mut first_error = None;
        for pool in self.growable_pools() {
            match pool.step(fence.clone()) {
                Ok(n) => bytes += n,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(bytes), Err)
    }

    /// The [`KvConfig`] the plan implies for [`MemorySystem::kv_manager`]:
    /// the plan's tokens per block, its KV dtype, and the sliding window
    /// when the plan has an SWA pool; everything else at its default.
    pub fn kv_config(&self) -> Result<KvConfig, MemError> {
        let pool = self.kv_pool().ok_or_else(|| self.no_kv_pool())?;
        let kv = &self.plan.kv;
        let block_size = to_usize(kv.block_size.into(), "block size")?;
        let mut config = KvConfig::new(block_size, pool.stats().max_blocks);
        config.dtype = kv.dtype.name().to_string();
        if self.swa_pool().is_some() {
            let window = self.plan.swa.as_ref().and_then(|s| s.window).unwrap_or(0);
            config.swa_window = to_usize(window, "sliding window")?;
        }
        Ok(config)
    }

    fn no_kv_pool(&self) -> MemError {
        if self.closed {
            self.closed_error()
        } else {
            MemError::invalid("this system has no KV pool: its plan gives the KV cache no blocks")
        }
    }

    /// A [`KVCacheManager`] over this system's KV pool (and SWA pool, if the
    /// plan has one): [`KVCacheManager::with_pools`], so its blocks are the
    /// system's, attributed to `kv_cache` / `swa_cache` in the report. Start
    /// from [`MemorySystem::kv_config`]. `block_size` must be the plan's (the
    /// pool's blocks hold that many tokens), and `swa_window` is set exactly
    /// when the system has an SWA pool. The manager holds the pools alive:
    /// drop it before [`MemorySystem::close`], or the close reports the
    /// blocks as still held.
    pub fn kv_manager(&self, config: KvConfig) -> Result<KVCacheManager, MemError> {
        let pool = self.kv_pool().ok_or_else(|| self.no_kv_pool())?;
        let planned = self.plan.kv.block_size as usize;
        if config.block_size != planned {
            return Err(MemError::invalid(format!(
                "block_size={} but the plan's KV blocks hold {planned} tokens each; build the \
                 manager with the plan's block size (or plan with block_size={})",
                config.block_size, config.block_size
            )));
        }
        let swa = self.swa_pool();
        if let (Some(_), Some(plan)) = (&swa, &self.plan.swa) {
            if plan.block_size as usize != planned {
                return Err(MemError::invalid(format!(
                    "the plan's SWA blocks hold {} tokens but its KV blocks {planned}; one \
                     manager needs one block size",
                    plan.block_size
                )));
            }
        }
        match (&swa, config.swa_window) {
            (Some(_), 0) => {
                return Err(MemError::invalid(format!(
                    "this system has an SWA pool; set swa_window (the plan's is {} tokens)",
                    self.plan.swa.as_ref().and_then(|s| s.window).unwrap_or(0)
                )))
            }
            (None, w) if w > 0 => {
                return Err(MemError::invalid(format!(
                    "swa_window={w} but this system has no SWA pool (the plan has no sliding \
                     window layers)"
                )))
            }
            _ => {}
        }
        KVCacheManager::with_pools(config, pool, swa)
    }

    /// T4: the scratch stack.
    pub fn scratch(&self) -> Option<SharedScratchStack> {
        match self.slot("scratch").map(|s| &s.handle) {
            Some(Handle::Scratch(s)) => Some(s.clone()),
            _ => None,
        }
    }

    /// T4a: the activation pool, if the plan has one.
    pub fn activations(&self) -> Option<ActivationPool> {
        match self.slot("activations").map(|s| &s.handle) {
            Some(Handle::Activations(p)) => Some(p.clone()),
            _ => None,
        }
    }

    /// The keys of the opened tiers, in open order.
    pub fn tier_keys(&self) -> Vec<&str> {
        self.slots.iter().map(|s| s.key.as_str()).collect()
    }

    /// `LOADING → PLANNING` (a no-op if already planning).
    pub fn begin_planning(&self) -> Result<(), MemError> {
        match self.backend.phase() {
            Phase::Loading => self.backend.begin_planning(),
            Phase::Planning => Ok(()),
            Phase::Serving => self.backend.advance(Phase::Planning),
        }
    }

    /// Through `PLANNING` to `SERVING` (a no-op if already serving). From
    /// here on the tiers are fixed: an acquisition is a phase violation
    /// (strict) or counted in `steady_state_allocations_total` (production).
    pub fn begin_serving(&self) -> Result<(), MemError> {
        if self.closed {
            return Err(self.closed_error());
        }
        match self.backend.phase() {
            Phase::Serving => Ok(()),
            Phase::Loading => {
                self.backend.begin_planning()?;
                self.backend.begin_serving()
            }
            Phase::Planning => self.backend.begin_serving(),
        }
    }

    /// Names a charge outside the backend (another allocator's pool, a
    /// library's workspace), so that it is attributed; `bytes = 0` removes
    /// it. `context` and `library_reserve` replace the measured figures.
    pub fn set_charge(&mut self, key: &str, label: &str, bytes: u64) -> Result<(), MemError> {
        if key.is_empty() {
            return Err(MemError::invalid("a charge needs a key"));
        }
        if let Some(line) = self.charges.iter_mut().find(|c| c.key == key) {
            line.bytes = bytes;
            line.measured = true;
            if !label.is_empty() && line.planned.is_none() {
                line.label = label.to_string();
            }
            if bytes == 0 && line.planned.is_none() {
                self.charges.retain(|c| c.key != key);
            }
            return Ok(());
        }
        if bytes > 0 {
            self.charges.push(ChargeLine {
                key: key.to_string(),
                label: if label.is_empty() { key } else { label }.to_string(),
                bytes,
                planned: None,
                measured: true,
            });
        }
        Ok(())
    }

    fn tag_owners(&self) -> BTreeMap<Tag, usize> {
        let mut owners = BTreeMap::new();
        for slot in &self.slots {
            *owners.entry(slot.tag).or_insert(0) += 1;
        }
        owners
    }

    fn tier_line(
        &self,
        slot: &Slot,
        tags: &BTreeMap<Tag, crate::TagStats>,
        sole: bool,
    ) -> TierLine {
        let tag = tags.get(&slot.tag).copied().unwrap_or_default();
        let asleep = slot_asleep(slot);
        let (reserved, committed, in_use, high_water, blocks) = match &slot.handle {
            Handle::Arena(a) => {
                let s = a.stats();
                (
                    a.reserved() as u64,
                    s.committed as u64,
                    s.used as u64,
                    s.high_water as u64,
                    None,
                )
            }
            Handle::Scratch(st) => {
                let s = st.stats();
                let cap = s.capacity as u64;
                (cap, cap, s.used as u64, s.high_water as u64, None)
            }
            Handle::Activations(p) => {
                let s = p.stats();
                (
                    s.capacity,
                    p.committed(),
                    s.allocated,
                    s.allocated_peak,
                    None,
                )
            }
            Handle::Pool(p) => {
                let s = p.stats();
                let bb = s.block_bytes as u64;
                let lower = u64::from(s.capacity) * bb;
                let (reserved, committed) = if sole {
                    (tag.reserved, tag.committed)
                } else {
                    (u64::from(s.max_blocks) * bb, lower)
                };
                (
                    reserved,
                    committed,
                    u64::from(s.live) * bb,
                    u64::from(s.high_water) * bb,
                    Some(BlockLine {
                        capacity: s.capacity,
                        max_blocks: s.max_blocks,
                        free: s.free,
                        live: s.live,
                        high_water: s.high_water,
                        block_bytes: bb,
                        growths: s.growths,
                    }),
                )
            }
        };
        TierLine {
            key: slot.key.clone(),
            label: slot.label.clone(),
            tier: slot.tier.label(),
            tag: slot.tag.name(),
            planned: slot.planned,
            reserved,
            committed,
            in_use,
            high_water,
            peak: if sole { tag.peak } else { committed },
            blocks,
            asleep,
        }
    }

    /// One snapshot of everything: the tiers plan against actual, the
    /// backend's tags, the charges, and — given a device reading — the
    /// attribution.
    pub fn report(&self, input: &ReportInput) -> MemReport {
        let stats = self.backend.stats();
        let owners = self.tag_owners();
        let tiers: Vec<TierLine> = self
            .slots
            .iter()
            .map(|slot| {
                let sole = owners.get(&slot.tag) == Some(&1);
                self.tier_line(slot, &stats.tags, sole)
            })
            .collect();
        let mut in_tiers: BTreeMap<Tag, u64> = BTreeMap::new();
        for (slot, line) in self.slots.iter().zip(&tiers) {
            *in_tiers.entry(slot.tag).or_insert(0) += line.committed;
        }
        let outside = stats
            .tags
            .iter()
            .filter_map(|(tag, t)| {
                let extra = t
                    .committed
                    .saturating_sub(in_tiers.get(tag).copied().unwrap_or(0));
                (extra > 0).then(|| OutsideLine {
                    tag: tag.name(),
                    committed: extra,
                })
            })
            .collect();
        let mut charges = self.charges.clone();
        for (key, label, bytes) in &input.extra {
            if *bytes > 0 {
                charges.push(ChargeLine {
                    key: key.clone(),
                    label: label.clone(),
                    bytes: *bytes,
                    planned: None,
                    measured: true,
                });
            }
        }
        let tags: Vec<TagLine> = Tag::ALL
            .iter()
            .map(|&tag| {
                let t = stats.tags.get(&tag).copied().unwrap_or_default();
                TagLine {
                    tag: tag.name(),
                    reserved: t.reserved,
                    committed: t.committed,
                    live: t.live,
                    peak: t.peak,
                    acquisitions: t.acquisitions,
                    releases: t.releases,
                    steady_state_allocations: stats
                        .steady_state_allocations_total
                        .get(&tag)
                        .copied()
                        .unwrap_or(0),
                }
            })
            .collect();
        let backend_committed = stats.total.committed;
        // Only what was measured or acquired is attributed: a planned
        // estimate nobody claimed would count memory that may not exist.
        let attributed = charges
            .iter()
            .filter(|c| c.measured)
            .fold(backend_committed, |acc, c| acc.saturating_add(c.bytes));
        let planned_unclaimed = charges
            .iter()
            .filter(|c| !c.measured)
            .fold(0u64, |acc, c| acc.saturating_add(c.bytes));
        let device = input.device.map(|d| {
            let used = d.total.saturating_sub(d.free);
            let own_used = used.saturating_sub(input.other_processes);
            let unattributed = own_used as i128 - attributed as i128;
            let pct = if own_used == 0 {
                100.0
            } else {
                attributed as f64 * 100.0 / own_used as f64
            };
            DeviceLine {
                total: d.total,
                free: d.free,
                used,
                other_processes: input.other_processes,
                own_used,
                unattributed: unattributed.clamp(i64::MIN as i128, i64::MAX as i128) as i64,
                attribution_pct: pct,
                meets_target: pct >= ATTRIBUTION_TARGET * 100.0,
            }
        });
        let info = self.backend.info();
        MemReport {
            backend: info.name.clone(),
            device_ordinal: info.device,
            phase: stats.phase.name(),
            closed: self.closed,
            capacity: stats.capacity,
            budget: stats.budget,
            plan_budget: self.plan.budget,
            plan_total: self.plan.total,
            plan_headroom: self.plan.headroom,
            tiers,
            outside,
            charges,
            tags,
            backend_committed,
            attributed,
            planned_unclaimed,
            steady_state_allocations_total: stats.steady_state_allocations_total.values().sum(),
            device,
            asleep: self
                .slots
                .iter()
                .filter(|s| slot_asleep(s) > 0)
                .map(|s| s.key.clone())
                .collect(),
            sleep_host: self
                .slots
                .iter()
                .map(|s| match &s.handle {
                    Handle::Arena(a) => a.host_bytes(),
                    _ => 0,
                })
                .sum(),
            sleep_host_planned: self.plan.sleep_host,
            asleep_released: self.sleep_released(),
        }
    }

    /// Checks the invariants of the whole system: the backend's (V1, tag
    /// sums, budget), every pool's (V4, refcounts), and the system's own —
    /// no tier holds more than its tag has committed, and none has grown
    /// past what the plan gave it (V8, to the backend's granularity).
    pub fn check(&self) -> Result<(), MemError> {
        self.backend.check_invariants()?;
        let granule = self.backend.info().granularity.max(1);
        let report = self.report(&ReportInput::default());
        for (slot, line) in self.slots.iter().zip(&report.tiers) {
            match &slot.handle {
                Handle::Pool(pool) => pool.check_invariants()?,
                Handle::Activations(pool) => pool.check_invariants()?,
                _ => {}
            }
            // A sleeping tier has given its memory back, its takes kept.
            if line.asleep == 0 && line.in_use > line.committed {
                return Err(MemError::Invariant(format!(
                    "{} {}: {} B in use but {} B committed",
                    slot.tier.label(),
                    slot.label,
                    line.in_use,
                    line.committed
                )));
            }
            let allowed = round_up(to_usize(slot.planned, "planned bytes")?, granule)
                .map(|v| v as u64)
                .unwrap_or(u64::MAX);
            if line.committed > allowed {
                return Err(MemError::Invariant(format!(
                    "V8: {} {} has {} B committed, past the {} B its plan gave it",
                    slot.tier.label(),
                    slot.label,
                    line.committed,
                    slot.planned
                )));
            }
        }
        let in_tiers: u64 = report.tiers.iter().map(|t| t.committed).sum();
        if in_tiers > report.backend_committed {
            return Err(MemError::Invariant(format!(
                "the tiers hold {in_tiers} B but the backend has only {} B committed",
                report.backend_committed
            )));
        }
        Ok(())
    }

    fn release(&mut self) {
        while let Some(slot) = self.slots.pop() {
            drop(slot);
        }
        if let Some(budget) = self.previous_budget.take() {
            let _ = self.backend.set_budget(budget);
        }
        self.closed = true;
    }

    /// Releases every tier, newest first, and restores the backend's budget.
    /// Memory still referenced elsewhere (a block ref, an exported span, a
    /// tier handle) stays live until that reference is dropped; the report
    /// says how much, per tag.
    pub fn close(&mut self) -> CloseReport {
        let tags: Vec<Tag> = self.slots.iter().map(|s| s.tag).collect();
        let before = self.backend.live();
        self.release();
        let stats = self.backend.stats();
        let mut still_held: Vec<(Tag, u64)> = Vec::new();
        for tag in tags {
            let live = stats.tags.get(&tag).map_or(0, |t| t.live);
            if live > 0 && !still_held.iter().any(|(t, _)| *t == tag) {
                still_held.push((tag, live));
            }
        }
        CloseReport {
            released: before.saturating_sub(stats.total.live),
            still_held,
        }
    }
}

impl Drop for MemorySystem {
    fn drop(&mut self) {
        self.release();
    }
}

/// A slot's sleep level, 0 when awake.
fn slot_asleep(slot: &Slot) -> u8 {
    match &slot.handle {
        Handle::Arena(a) => a.asleep().unwrap_or(0),
        Handle::Pool(p) => p.stats().asleep,
        Handle::Activations(p) => p.asleep().unwrap_or(0),
        Handle::Scratch(_) => 0,
    }
}

const COMMITTED_LABEL: &str = "backend committed (every region, by tag)";

fn mib1(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / MIB as f64)
}

impl MemReport {
    /// The report as a text table in MiB, in the style of seed A4.3.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "imp-mem memory report: {} backend, device {}, phase {}{}",
            self.backend,
            self.device_ordinal,
            self.phase,
            if self.closed { " (closed)" } else { "" }
        );
        let _ = writeln!(
            out,
            "budget {} MiB for the tiers (plan: {} MiB budget, {} MiB total, {} MiB headroom)",
            mib1(self.budget),
            mib1(self.plan_budget),
            mib1(self.plan_total),
            mib1(self.plan_headroom)
        );
        if !self.asleep.is_empty() {
            let _ = writeln!(
                out,
                "asleep: {}; T5b pinned host copy {} MiB (plan: {} MiB)",
                self.asleep.join(", "),
                mib1(self.sleep_host),
                mib1(self.sleep_host_planned)
            );
        }
        let _ = writeln!(out);
        let w = self
            .tiers
            .iter()
            .map(|t| t.label.len())
            .chain(self.charges.iter().map(|c| c.label.len() + 11))
            .max()
            .unwrap_or(0)
            .max(COMMITTED_LABEL.len() + 2);
        let _ = writeln!(
            out,
            "  {:<w$} {:<4} {:<10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "tier", "", "tag", "planned", "reserved", "committed", "in use", "high-water"
        );
        for t in &self.tiers {
            let _ = writeln!(
                out,
                "    {:<w2$} {:<4} {:<10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                t.label,
                t.tier,
                t.tag,
                mib1(t.planned),
                mib1(t.reserved),
                mib1(t.committed),
                mib1(t.in_use),
                mib1(t.high_water),
                w2 = w - 2
            );
            if let Some(b) = &t.blocks {
                let _ = writeln!(
                    out,
                    "      blocks: {} live, {} free, {} of at most {} ({} B each), high-water {}",
                    b.live, b.free, b.capacity, b.max_blocks, b.block_bytes, b.high_water
                );
            }
        }
        for o in &self.outside {
            let _ = writeln!(
                out,
                "    {:<w2$} {:<4} {:<10} {:>10} {:>10} {:>10}",
                "outside the tiers",
                "-",
                o.tag,
                "-",
                "-",
                mib1(o.committed),
                w2 = w - 2
            );
        }
        let _ = writeln!(out);
        let _ = writeln!(out, "  {:<w$} {:>10} {:>10}", "charge", "planned", "MiB");
        for c in &self.charges {
            let how = if c.measured { "measured" } else { "plan" };
            let label = format!("{} ({how})", c.label);
            let _ = writeln!(
                out,
                "    {:<w2$} {:>10} {:>10}",
                label,
                c.planned.map_or_else(|| "-".to_string(), mib1),
                mib1(c.bytes),
                w2 = w - 2
            );
        }
        let _ = writeln!(
            out,
            "    {:<w2$} {:>10} {:>10}",
            "",
            "",
            "-----",
            w2 = w - 2
        );
        let _ = writeln!(
            out,
            "    {:<w2$} {:>10} {:>10}",
            COMMITTED_LABEL,
            "",
            mib1(self.backend_committed),
            w2 = w - 2
        );
        let _ = writeln!(
            out,
            "    {:<w2$} {:>10} {:>10}",
            "attributed",
            "",
            mib1(self.attributed),
            w2 = w - 2
        );
        if self.planned_unclaimed > 0 {
            let _ = writeln!(
                out,
                "    {:<w2$} {:>10} {:>10}",
                "planned, not claimed (estimate)",
                mib1(self.planned_unclaimed),
                "",
                w2 = w - 2
            );
        }
        match &self.device {
            Some(d) => {
                let _ = writeln!(
                    out,
                    "    {:<w2$} {:>10} {:>10}",
                    "device used (total - free)",
                    "",
                    mib1(d.used),
                    w2 = w - 2
                );
                if d.other_processes > 0 {
                    let _ = writeln!(
                        out,
                        "    {:<w2$} {:>10} {:>10}",
                        "other processes",
                        "",
                        mib1(d.other_processes),
                        w2 = w - 2
                    );
                }
                let _ = writeln!(
                    out,
                    "    {:<w2$} {:>10} {:>10}",
                    "unattributed residual",
                    "",
                    format!("{:.1}", d.unattributed as f64 / MIB as f64),
                    w2 = w - 2
                );
                let _ = writeln!(
                    out,
                    "  attribution {:.1} % of {} MiB in use (target >= {:.0} %): {}",
                    d.attribution_pct,
                    mib1(d.own_used),
                    ATTRIBUTION_TARGET * 100.0,
                    if d.meets_target { "met" } else { "NOT met" }
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "  no device reading: attribution is computed against a device's total - free"
                );
            }
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "  {:<12} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>12}",
            "tag", "reserved", "committed", "live", "peak", "acquired", "released", "steady-state"
        );
        for t in self
            .tags
            .iter()
            .filter(|t| t.acquisitions > 0 || t.steady_state_allocations > 0)
        {
            let _ = writeln!(
                out,
                "    {:<10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>12}",
                t.tag,
                mib1(t.reserved),
                mib1(t.committed),
                mib1(t.live),
                mib1(t.peak),
                t.acquisitions,
                t.releases,
                t.steady_state_allocations
            );
        }
        let _ = writeln!(
            out,
            "  steady-state allocations while serving: {}",
            self.steady_state_allocations_total
        );
        out
    }

    /// The report as JSON.
    pub fn to_json(&self) -> Result<String, MemError> {
        serde_json::to_string_pretty(self)
            .map_err(|err| MemError::Invariant(format!("memory report does not serialise: {err}")))
    }

    /// Prometheus text exposition (format 0.0.4) of this snapshot: base
    /// units, `_bytes` / `_total` suffixes, labels `tier` and `tag` only.
    pub fn metrics(&self) -> String {
        let mut m = Metrics::default();
        m.gauge(
            "imp_mem_budget_bytes",
            "The backend's budget cap.",
            &[(None, self.budget as f64)],
        );
        m.gauge(
            "imp_mem_capacity_bytes",
            "The device's capacity.",
            &[(None, self.capacity as f64)],
        );
        m.gauge(
            "imp_mem_plan_budget_bytes",
            "The budget the plan was made for.",
            &[(None, self.plan_budget as f64)],
        );
        m.gauge(
            "imp_mem_plan_total_bytes",
            "The plan's total over every charge.",
            &[(None, self.plan_total as f64)],
        );
        let device_tiers = [
            Tier::ModelResident,
            Tier::EnginePersistent,
            Tier::Pooled,
            Tier::Scratch,
            Tier::Activations,
        ];
        let per_tier = |f: &dyn Fn(&TierLine) -> u64| -> Vec<(Option<(&str, String)>, f64)> {
            device_tiers
                .iter()
                .map(|tier| {
                    let sum: u64 = self
                        .tiers
                        .iter()
                        .filter(|t| t.tier == tier.label())
                        .map(f)
                        .sum();
                    (Some(("tier", tier.name().to_ascii_lowercase())), sum as f64)
                })
                .collect()
        };
        m.gauge(
            "imp_mem_tier_planned_bytes",
            "Bytes the plan gives each tier.",
            &per_tier(&|t| t.planned),
        );
        m.gauge(
            "imp_mem_tier_reserved_bytes",
            "Address space each tier holds.",
            &per_tier(&|t| t.reserved),
        );
        m.gauge(
            "imp_mem_tier_committed_bytes",
            "Physical memory each tier holds.",
            &per_tier(&|t| t.committed),
        );
        m.gauge(
            "imp_mem_tier_live_bytes",
            "Bytes in use inside each tier (arena takes, live blocks, open scratch).",
            &per_tier(&|t| t.in_use),
        );
        m.gauge(
            "imp_mem_tier_high_water_bytes",
            "The most ever in use inside each tier.",
            &per_tier(&|t| t.high_water),
        );
        let per_tag = |f: &dyn Fn(&TagLine) -> u64| -> Vec<(Option<(&str, String)>, f64)> {
            self.tags
                .iter()
                .map(|t| (Some(("tag", t.tag.to_string())), f(t) as f64))
                .collect()
        };
        m.gauge(
            "imp_mem_reserved_bytes",
            "Address space reserved through the backend, per tag.",
            &per_tag(&|t| t.reserved),
        );
        m.gauge(
            "imp_mem_live_bytes",
            "Bytes held by live regions, per tag.",
            &per_tag(&|t| t.live),
        );
        m.gauge(
            "imp_mem_high_water_bytes",
            "The most bytes ever live, per tag.",
            &per_tag(&|t| t.peak),
        );
        m.counter(
            "imp_mem_acquisitions_total",
            "Acquisitions from the backend, per tag.",
            &per_tag(&|t| t.acquisitions),
        );
        m.counter(
            "imp_mem_releases_total",
            "Releases to the backend, per tag.",
            &per_tag(&|t| t.releases),
        );
        m.counter(
            "imp_mem_steady_state_allocations_total",
            "Acquisitions while SERVING, per tag (criterion 3: zero).",
            &per_tag(&|t| t.steady_state_allocations),
        );
        let pools: Vec<(&TierLine, &BlockLine)> = self
            .tiers
            .iter()
            .filter_map(|t| t.blocks.as_ref().map(|b| (t, b)))
            .collect();
        let per_pool = |f: &dyn Fn(&BlockLine) -> u64| -> Vec<(Option<(&str, String)>, f64)> {
            pools
                .iter()
                .map(|(t, b)| (Some(("tag", t.tag.to_string())), f(b) as f64))
                .collect()
        };
        if !pools.is_empty() {
            m.gauge(
                "imp_mem_pool_capacity_blocks",
                "Blocks that exist in each T3 pool now.",
                &per_pool(&|b| u64::from(b.capacity)),
            );
            m.gauge(
                "imp_mem_pool_max_blocks",
                "Blocks each T3 pool can grow to.",
                &per_pool(&|b| u64::from(b.max_blocks)),
            );
            m.gauge(
                "imp_mem_pool_free_blocks",
                "Blocks on each T3 pool's free list.",
                &per_pool(&|b| u64::from(b.free)),
            );
            m.gauge(
                "imp_mem_pool_live_blocks",
                "Blocks with at least one ref in each T3 pool.",
                &per_pool(&|b| u64::from(b.live)),
            );
            m.gauge(
                "imp_mem_pool_block_bytes",
                "Bytes per block of each T3 pool.",
                &per_pool(&|b| b.block_bytes),
            );
        }
        let charge = |key: &str| {
            self.charges
                .iter()
                .filter(|c| c.key == key)
                .map(|c| c.bytes)
                .sum::<u64>()
        };
        let named: u64 = self
            .charges
            .iter()
            .filter(|c| c.key != "context" && c.key != "library_reserve")
            .map(|c| c.bytes)
            .sum();
        m.gauge(
            "imp_mem_context_bytes",
            "The CUDA context and driver (measured, or the plan's figure).",
            &[(None, charge("context") as f64)],
        );
        m.gauge(
            "imp_mem_library_reserve_bytes",
            "The libraries' own reservation (measured, or the plan's figure).",
            &[(None, charge("library_reserve") as f64)],
        );
        m.gauge(
            "imp_mem_named_charges_bytes",
            "Other named charges outside the backend.",
            &[(None, named as f64)],
        );
        m.gauge(
            "imp_mem_asleep_committed_bytes",
            "Bytes the sleeping tiers committed before they slept, given back to the device.",
            &[(None, self.asleep_released as f64)],
        );
        m.gauge(
            "imp_mem_sleep_host_bytes",
            "Pinned host memory held for sleeping tiers (T5b).",
            &[(None, self.sleep_host as f64)],
        );
        m.gauge(
            "imp_mem_attributed_bytes",
            "Backend-committed bytes plus every named charge.",
            &[(None, self.attributed as f64)],
        );
        if let Some(d) = &self.device {
            m.gauge(
                "imp_mem_device_total_bytes",
                "Device memory in all.",
                &[(None, d.total as f64)],
            );
            m.gauge(
                "imp_mem_device_used_bytes",
                "Device memory in use (total - free).",
                &[(None, d.used as f64)],
            );
            m.gauge(
                "imp_mem_device_other_processes_bytes",
                "Device memory other processes hold.",
                &[(None, d.other_processes as f64)],
            );
            m.gauge(
                "imp_mem_unattributed_bytes",
                "Memory this process uses that no charge names.",
                &[(None, d.unattributed as f64)],
            );
            m.gauge(
                "imp_mem_attribution_ratio",
                "Attributed / memory this process uses (criterion 6: >= 0.95).",
                &[(None, d.attribution_pct / 100.0)],
            );
        }
        m.out
    }
}

#[derive(Default)]
struct Metrics {
    out: String,
}

impl Metrics {
    fn family(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        samples: &[(Option<(&str, String)>, f64)],
    ) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
        for (label, value) in samples {
            let value = if value.fract() == 0.0 && value.abs() < 9.0e15 {
                format!("{}", *value as i64)
            } else {
                format!("{value}")
            };
            match label {
                Some((key, v)) => {
                    let _ = writeln!(self.out, "{name}{{{key}=\"{v}\"}} {value}");
                }
                None => {
                    let _ = writeln!(self.out, "{name} {value}");
                }
            }
        }
    }

    fn gauge(&mut self, name: &str, help: &str, samples: &[(Option<(&str, String)>, f64)]) {
        self.family(name, "gauge", help, samples);
    }

    fn counter(&mut self, name: &str, help: &str, samples: &[(Option<(&str, String)>, f64)]) {
        self.family(name, "counter", help, samples);
    }
}

mod sleep;
mod swap;
#[cfg(test)]
mod tests;

pub use sleep::{SleepReport, SleptTier, DEFAULT_SLEEP_TIERS};
pub use swap::SwapReport;

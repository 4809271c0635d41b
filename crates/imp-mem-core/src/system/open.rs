//! Opening a plan as tiers, in the seed's order (A4.2), and closing it:
//! the options, the refused open ([`OpenError`]), the open order's steps,
//! and [`CloseReport`].

use std::sync::Arc;

use super::report::ChargeLine;
use super::{Handle, MemorySystem, Slot, KV_GROW_BYTES};
use crate::activations::{ActivationConfig, ActivationPool, NoStreams, StreamOrder};
use crate::backend::Backend;
use crate::block_pool::{PoolConfig, SharedBlockPool, MAX_BLOCKS};
use crate::error::MemError;
use crate::phase::Phase;
use crate::planner::MemoryPlan;
use crate::scratch::SharedScratchStack;
use crate::tag::Tag;
use crate::tier::Tier;
use crate::units::human_bytes;
use crate::SharedArena;

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
    /// able to sleep, and the activations tier and a KV pool that does not
    /// grow over growable regions committed whole at open (so they can
    /// sleep too); default: when the backend is growable and the plan's
    /// headroom covers rounding each up to the granularity. `Some(true)` is
    /// still refused where it does not fit.
    pub sleepable: Option<bool>,
    /// The activation pool's strictness; default: the backend's phase mode.
    pub activation_strict: Option<bool>,
    /// The activation pool's stream order; default: the backend's source's
    /// ([`Backend::stream_order`]: none for host memory, the driver's
    /// events on a device), asked once at open when the plan has an
    /// activation pool and kept in the system's options for its swaps.
    pub activation_order: Option<ActivationOrder>,
    /// Open the activation pool as a *measured* tier: the plan's activation
    /// line is reserved as address space and committed in chunks of this
    /// many bytes as the warm-up asks, and `begin_serving` fixes it at its
    /// high-water plus `activation_margin` (see
    /// [`ActivationPool::freeze`]). Needs a growable backend; `None`: the
    /// tier is committed whole at open.
    pub activation_measure: Option<u64>,
    /// The margin (bytes) a measured activation tier keeps above its
    /// high-water when `begin_serving` freezes it.
    pub activation_margin: u64,
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
            activation_measure: None,
            activation_margin: 0,
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

/// What `plan` gives its tiers of the backend's budget: the plan's budget
/// less the three lines no allocator of the system sees (the CUDA context,
/// the library reserve and the warm-up). The open lowers the backend's
/// budget to it, and a re-plan ([`MemorySystem::adopt_replan`]) lowers it
/// again when its warm-up line grew.
pub(super) fn tiers_budget(plan: &MemoryPlan) -> u64 {
    plan.budget
        .saturating_sub(plan.context)
        .saturating_sub(plan.library_reserve)
        .saturating_sub(plan.warmup)
}

pub(super) fn to_u32(value: u64, what: &str) -> Result<u32, MemError> {
    if value > u64::from(MAX_BLOCKS) {
        return Err(MemError::invalid(format!(
            "{what}: {value} blocks is more than one pool holds ({MAX_BLOCKS}); use larger blocks"
        )));
    }
    Ok(value as u32)
}

pub(super) fn to_usize(value: u64, what: &str) -> Result<usize, MemError> {
    usize::try_from(value).map_err(|_| MemError::invalid(format!("{what} does not fit this host")))
}

/// Opens one tier.
type Opener = Box<dyn FnOnce(&Backend) -> Result<Handle, MemError>>;

/// One step of the open order, before it runs.
pub(super) struct Step {
    pub(super) key: String,
    pub(super) label: String,
    pub(super) tier: Tier,
    pub(super) tag: Tag,
    pub(super) planned: u64,
    /// The most it can commit on this backend (a growable region commits
    /// whole granules).
    pub(super) cost: u64,
    /// See [`Slot::layout`].
    pub(super) layout: String,
    pub(super) open: Opener,
}

impl MemorySystem {
    /// Opens every tier of `plan` on `backend`, in the order of the module
    /// documentation, or none of them.
    pub fn open(
        backend: &Backend,
        plan: &MemoryPlan,
        mut options: SystemOptions,
    ) -> Result<MemorySystem, OpenError> {
        let before = |error: MemError| OpenError {
            step: 0,
            what: "checks before any acquisition".into(),
            error,
        };
        if options.activation_order.is_none() && plan.activations > 0 {
            let order = backend.stream_order().map_err(before)?;
            options.activation_order = Some(ActivationOrder(order));
        }
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
            let for_tiers = tiers_budget(plan).min(budget);
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
                    cost: step.cost,
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
        let mut charges = vec![
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
        if plan.warmup > 0 {
            // Claimed by the engine's measurement (`set_charge("warmup")`).
            charges.push(ChargeLine {
                key: "warmup".into(),
                label: "warm-up: graph pools, activations, kernel modules".into(),
                bytes: plan.warmup,
                planned: Some(plan.warmup),
                measured: false,
            });
        }
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
    pub(super) fn steps(
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
                    tiers_budget(plan)
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
            // Committed whole in a growable region where it must be able to
            // sleep with the KV pool (as a KV pool that does not grow).
            let exact = swa.blocks.saturating_mul(swa.block_bytes);
            let rounded = round(exact);
            let sleepable = options.sleepable.unwrap_or_else(|| backend.info().growable)
                && rounded <= swa.bytes.saturating_add(spare);
            let (open, layout, cost) = if sleepable {
                spare -= rounded.saturating_sub(swa.bytes);
                let blocks = to_u32(swa.blocks, "SWA pool")?;
                let config = PoolConfig::fixed(to_usize(swa.block_bytes, "SWA pool")?, blocks)
                    .sleepable()
                    .with_tag(Tag::SwaCache);
                let layout = format!("{config:?}");
                let open: Opener =
                    Box::new(move |b: &Backend| SharedBlockPool::new(b, &config).map(Handle::Pool));
                (open, layout, rounded)
            } else {
                let (open, layout) =
                    fixed_pool(swa.block_bytes, swa.blocks, Tag::SwaCache, "SWA pool")?;
                (open, layout, swa.bytes)
            };
            steps.push(Step {
                key: "swa_pool".into(),
                label: "SWA KV pool".into(),
                tier: Tier::Pooled,
                tag: Tag::SwaCache,
                planned: swa.bytes,
                cost,
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
                && rounded - bytes <= spare
                && options.activation_measure.is_none();
            config.measure_chunk = options.activation_measure;
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
            let fits_rounded = rounded <= kv.bytes.saturating_add(spare);
            let growable = options
                .kv_growable
                .unwrap_or_else(|| backend.info().growable)
                && blocks > 1
                && fits_rounded;
            // A pool that does not grow is still held in a growable region,
            // committed whole at open, where it must be able to sleep: only
            // such a region gives its memory back and takes it again at the
            // same addresses.
            let sleepable = !growable
                && options.sleepable.unwrap_or_else(|| backend.info().growable)
                && fits_rounded;
            let cost = if growable || sleepable {
                rounded
            } else {
                exact
            };
            let config = if sleepable {
                PoolConfig::fixed(block_bytes, blocks).sleepable()
            } else if growable {
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

//! The report: one snapshot of the backend, every tier and the named
//! charges ([`MemorySystem::report`] into [`MemReport`]), with the
//! attribution arithmetic of criterion 6.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{slot_asleep, Handle, MemorySystem, Slot, ATTRIBUTION_TARGET};
use crate::error::MemError;
use crate::tag::Tag;

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

pub use crate::source::DeviceReading;

/// What a report adds to the system's own state. Build it with
/// [`MemorySystem::report_input`] to read the backend (its device and its
/// own charges), or by hand to pass figures in.
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

/// Where a report's device reading comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceQuery {
    /// The backend's own reading ([`Backend::mem_info`](crate::Backend::mem_info));
    /// none for a backend without a device.
    #[default]
    Backend,
    /// A reading the caller took.
    Given(DeviceReading),
    /// No device line.
    Skip,
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

/// One line of what stays on the device while tiers sleep
/// ([`MemReport::asleep_stays`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StayLine {
    /// A tier key, `outside:<tag>`, or a charge's key.
    pub key: String,
    /// What the report prints.
    pub label: String,
    /// Bytes still on the device.
    pub bytes: u64,
}

/// A measured tier (the activation pool opened with
/// `SystemOptions::activation_measure`): growing while measuring, fixed by
/// `begin_serving` at its high-water plus the margin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MeasuredLine {
    /// The tier's key (`activations`).
    pub tier: String,
    /// `measuring` (it still grows) or `frozen`.
    pub state: &'static str,
    /// The highest end offset any block reached: the measured figure.
    pub high_water: u64,
    /// The margin the freeze added (0 while measuring).
    pub margin: u64,
    /// The tier's size: the reservation while measuring, the frozen size
    /// after.
    pub size: u64,
    /// Bytes committed now.
    pub committed: u64,
    /// Bytes the freeze decommitted.
    pub decommitted: u64,
}

/// The activation pool's planned pass (`activations/plan.rs`): the layout
/// it follows and how the allocations since took its hints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PassLine {
    /// Allocations the recorded pass made.
    pub allocations: u64,
    /// The live bytes' peak over the pass.
    pub live_peak: u64,
    /// The layout's top (bytes).
    pub top: u64,
    /// How high the pass reached placed as it came.
    pub recorded_high_water: u64,
    /// Whether the layout is followed (it beat the recorded high-water, or
    /// fits a fixed tier).
    pub installed: bool,
    /// Hints (one a recorded allocation).
    pub hints: u64,
    /// Allocations placed where their hint said.
    pub hits: u64,
    /// Allocations with no hint of their size near the cursor.
    pub misses: u64,
    /// Allocations whose hint could not be taken.
    pub refused: u64,
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
    /// What the open added to the plan's tiers by rounding each growable
    /// region up to the backend's whole granules (decided before anything
    /// was acquired, taken from the headroom): `plan_total` plus this is
    /// what the tiers and charges can hold on this backend.
    pub granule_rounding: u64,
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
    /// While a tier sleeps: what stays on the device — each awake tier with
    /// memory committed (T2, T4 scratch, ...), what the backend holds
    /// outside the tiers, and every charge (context, library reserve, graph
    /// pools, NCCL: `set_charge`; the plan's estimate where none was
    /// measured). They add up to `attributed + planned_unclaimed`. Empty
    /// while nothing sleeps.
    pub asleep_stays: Vec<StayLine>,
    /// The measured tiers: what each needed, and what it was fixed at.
    pub measured: Vec<MeasuredLine>,
    /// The activation pool's planned pass, if one was laid out.
    pub pass_plan: Option<PassLine>,
}

impl MemorySystem {
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

    /// The input of a report taken now: the device reading `device` names,
    /// `other_processes`, and what the backend's source holds beyond its
    /// ledger ([`Backend::extra_charges`](crate::Backend::extra_charges): a
    /// VMM backend's handle cache and chunk rounding). Fails only when the
    /// device cannot be read.
    pub fn report_input(
        &self,
        device: DeviceQuery,
        other_processes: u64,
    ) -> Result<ReportInput, MemError> {
        let device = match device {
            DeviceQuery::Backend => self.backend.mem_info()?,
            DeviceQuery::Given(reading) => Some(reading),
            DeviceQuery::Skip => None,
        };
        let extra = self
            .backend
            .extra_charges()
            .into_iter()
            .map(|c| (c.key, c.label, c.bytes))
            .collect();
        Ok(ReportInput {
            device,
            other_processes,
            extra,
        })
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
        let outside: Vec<OutsideLine> = stats
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
        let asleep: Vec<String> = self
            .slots
            .iter()
            .filter(|s| slot_asleep(s) > 0)
            .map(|s| s.key.clone())
            .collect();
        let asleep_stays = if asleep.is_empty() {
            Vec::new()
        } else {
            stays(&tiers, &outside, &charges)
        };
        let measured = self.measured();
        let pass_plan = self.activations().and_then(|p| {
            let plan = p.pass_plan()?;
            let h = p.pass_hints().unwrap_or_default();
            Some(PassLine {
                allocations: plan.allocations,
                live_peak: plan.live_peak,
                top: plan.top,
                recorded_high_water: plan.recorded_high_water,
                installed: plan.installed,
                hints: h.hints,
                hits: h.hits,
                misses: h.misses,
                refused: h.refused,
            })
        });
        let info = self.backend.info();
        MemReport {
            measured,
            pass_plan,
            backend: info.name.clone(),
            device_ordinal: info.device,
            phase: stats.phase.name(),
            closed: self.closed,
            capacity: stats.capacity,
            budget: stats.budget,
            plan_budget: self.plan.budget,
            plan_total: self.plan.total,
            plan_headroom: self.plan.headroom,
            granule_rounding: self
                .slots
                .iter()
                .map(|s| s.cost.saturating_sub(s.planned))
                .sum(),
            tiers,
            outside,
            charges,
            tags,
            backend_committed,
            attributed,
            planned_unclaimed,
            steady_state_allocations_total: stats.steady_state_allocations_total.values().sum(),
            device,
            asleep,
            asleep_stays,
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
}

/// What stays on the device while tiers sleep (see
/// [`MemReport::asleep_stays`]).
fn stays(tiers: &[TierLine], outside: &[OutsideLine], charges: &[ChargeLine]) -> Vec<StayLine> {
    let tiers = tiers.iter().filter(|t| t.committed > 0).map(|t| StayLine {
        key: t.key.clone(),
        label: format!("{} {}", t.tier, t.label),
        bytes: t.committed,
    });
    let outside = outside.iter().map(|o| StayLine {
        key: format!("outside:{}", o.tag),
        label: format!("outside the tiers ({})", o.tag),
        bytes: o.committed,
    });
    let charges = charges.iter().filter(|c| c.bytes > 0).map(|c| StayLine {
        key: c.key.clone(),
        label: format!(
            "{} ({})",
            c.label,
            if c.measured { "measured" } else { "plan" }
        ),
        bytes: c.bytes,
    });
    tiers.chain(outside).chain(charges).collect()
}

//! [`ActivationPool`]: the handle, opening the region, the accessors,
//! sleep / wake, the counters and the description.

use std::sync::atomic::{AtomicU64, Ordering};

use super::config::Frozen;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::{Backend, Region, DEFAULT_ALIGNMENT, MAX_ALIGNMENT};
use crate::error::MemError;
use crate::phase::PhaseMode;
use crate::tag::Tag;
use crate::units::human_bytes;

use super::blocks::{Core, Counters, OffsetMap};
use super::config::{ActivationConfig, ActivationStats};
use super::stream::StreamOrder;
use super::tlsf::{Block, BlockState, Lane, NONE};
use super::{DEFAULT_ACTIVATION_ALIGN, FRESH_STREAM, INITIAL_BLOCKS, INITIAL_LANES};

pub(super) struct Inner {
    id: u64,
    pub(super) base: usize,
    /// Bytes the blocks tile: fixed, except that a measured pool's freeze
    /// lowers it once (under the state lock) to its frozen size.
    pub(super) capacity: AtomicU64,
    /// A measured pool's commit granule (a multiple of the backend's
    /// granularity); 0 for a pool committed whole.
    pub(super) chunk: u64,
    pub(super) align: u64,
    pub(super) shift: u32,
    pub(super) strict: bool,
    pub(super) backend: Backend,
    pub(super) order: Arc<dyn StreamOrder>,
    /// Whether a pass is being recorded (`plan.rs`): read without the lock
    /// on every allocation and free, set under it.
    pub(super) recording: std::sync::atomic::AtomicBool,
    /// Live fallback blocks (outside the region), stored under the state
    /// lock: a free of an address outside every region asks only the pools
    /// that have some.
    pub(super) fallbacks: std::sync::atomic::AtomicUsize,
    state: Mutex<Core>,
    /// The host copy of a sleep that keeps the live bytes (`pause.rs`).
    pub(super) backup: Mutex<super::pause::Backup>,
    /// Declared last: released after the state (and its fallbacks) is gone.
    /// Locked after `state` (a sleep decommits it), never before.
    region: Mutex<Region>,
}

/// The activation pool (see the module documentation). Cloning gives
/// another handle to the same pool.
#[derive(Clone)]
pub struct ActivationPool {
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for ActivationPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivationPool")
            .field("id", &self.inner.id)
            .field("base", &format_args!("{:#x}", self.inner.base))
            .field("capacity", &self.capacity())
            .field("align", &self.inner.align)
            .field("strict", &self.inner.strict)
            .finish()
    }
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

pub(super) fn reserve_err(what: &str) -> MemError {
    MemError::Capacity(format!(
        "the activation pool could not allocate host memory for its {what}; the host is out of \
         memory"
    ))
}

impl ActivationPool {
    /// Acquires a region of `config.capacity` bytes (tag `activations`) from
    /// `backend` and opens a pool over it. `order` orders streams for
    /// cross-stream reuse ([`NoStreams`](super::NoStreams) where there is one stream or none).
    pub fn new(
        backend: &Backend,
        config: &ActivationConfig,
        order: Arc<dyn StreamOrder>,
    ) -> Result<Self, MemError> {
        let align = config.align;
        if align == 0 || !align.is_power_of_two() || align > MAX_ALIGNMENT {
            return Err(MemError::invalid(format!(
                "align must be a power of two up to 1 GiB, got {align}; use e.g. \
                 {DEFAULT_ACTIVATION_ALIGN}"
            )));
        }
        let capacity = config.capacity / align * align;
        if capacity == 0 {
            return Err(MemError::invalid(format!(
                "capacity of {} B holds no block of align {align} B; give the activation pool at \
                 least {align} B",
                config.capacity
            )));
        }
        let strict = config
            .strict
            .unwrap_or_else(|| backend.stats().mode == PhaseMode::Strict);
        let mut slab: Vec<Block> = Vec::new();
        slab.try_reserve(INITIAL_BLOCKS)
            .map_err(|_| reserve_err("block metadata"))?;
        let mut lanes: Vec<Lane> = Vec::new();
        lanes
            .try_reserve(INITIAL_LANES)
            .map_err(|_| reserve_err("stream lanes"))?;
        let mut live: OffsetMap<u32> = OffsetMap::default();
        live.try_reserve(INITIAL_BLOCKS)
            .map_err(|_| reserve_err("pointer map"))?;
        let chunk = match config.measure_chunk {
            Some(chunk) => {
                let granule = backend.info().granularity.max(1) as u64;
                if !backend.info().growable {
                    return Err(MemError::BackendUnavailable(
                        "a measured activation pool grows by commits inside one reservation; \
                         this backend cannot (open it on a VMM backend, or the fake one with \
                         growth), or give the pool a fixed capacity instead"
                            .into(),
                    ));
                }
                if chunk == 0 || chunk > capacity {
                    return Err(MemError::invalid(format!(
                        "measure_chunk of {chunk} B: expected 1 B up to the capacity ({capacity} B); \
                         e.g. 2 MiB"
                    )));
                }
                chunk.div_ceil(granule) * granule
            }
            None => 0,
        };
        let region = if chunk > 0 {
            backend.acquire_growable(capacity, 0, Tag::Activations)?
        } else if config.growable {
            backend.acquire_growable(capacity, capacity, Tag::Activations)?
        } else {
            backend.acquire(
                capacity,
                align.max(DEFAULT_ALIGNMENT as u64),
                Tag::Activations,
            )?
        };
        let mut core = Core {
            slab,
            spare: NONE,
            lanes,
            live,
            fallback: OffsetMap::default(),
            parked: Vec::new(),
            c: Counters {
                reserved_peak: capacity,
                ..Counters::default()
            },
            asleep: None,
            measuring: chunk > 0,
            extent_peak: 0,
            frozen: None,
            recording: None,
            plan: None,
            last_plan: None,
        };
        core.slab.push(Block {
            offset: 0,
            size: capacity,
            ..Block::spare()
        });
        core.put_free(0, FRESH_STREAM, align.trailing_zeros());
        Ok(Self {
            inner: Arc::new(Inner {
                id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
                base: region.base(),
                capacity: AtomicU64::new(capacity),
                chunk,
                align,
                shift: align.trailing_zeros(),
                strict,
                backend: backend.clone(),
                order,
                recording: std::sync::atomic::AtomicBool::new(false),
                fallbacks: std::sync::atomic::AtomicUsize::new(0),
                state: Mutex::new(core),
                backup: Mutex::default(),
                region: Mutex::new(region),
            }),
        })
    }

    pub(super) fn core(&self) -> MutexGuard<'_, Core> {
        // A poisoned lock means a panic elsewhere while it was held; the
        // structure is only ever changed by code that does not panic, so it
        // is still consistent (check_invariants says so if not).
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A process-unique id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The region's first address.
    pub fn base(&self) -> usize {
        self.inner.base
    }

    /// Bytes of the region the blocks tile (a measured pool: its
    /// reservation until the freeze, its frozen size after).
    pub fn capacity(&self) -> u64 {
        self.inner.capacity.load(Ordering::Acquire)
    }

    /// The alignment and size granule.
    pub fn align(&self) -> u64 {
        self.inner.align
    }

    /// Whether exhaustion is refused (true) or falls back to the backend.
    pub fn is_strict(&self) -> bool {
        self.inner.strict
    }

    /// The backend the region came from.
    pub fn backend(&self) -> &Backend {
        &self.inner.backend
    }

    pub(super) fn region(&self) -> MutexGuard<'_, Region> {
        self.inner
            .region
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Bytes of the region committed now (0 while it sleeps).
    pub fn committed(&self) -> u64 {
        self.region().len() as u64
    }

    /// The sleep level, `None` when awake.
    pub fn asleep(&self) -> Option<u8> {
        self.core().asleep.map(|(level, _)| level)
    }

    /// What a sleeping pool had committed (0 when awake).
    pub fn sleeping_committed(&self) -> usize {
        self.core().asleep.map_or(0, |(_, committed)| committed)
    }

    /// Gives the region's physical memory back, keeping its addresses and
    /// every block's bookkeeping: the bytes of live blocks are dropped (an
    /// activation or a graph's intermediate is rewritten before it is read;
    /// a tensor that must survive is copied out first), and allocations are
    /// refused with [`MemError::Asleep`] (the C hooks return null) until
    /// [`ActivationPool::wake`]. Fallback regions are not touched. Needs a
    /// growable region ([`MemError::BackendUnavailable`] otherwise).
    /// Returns the bytes decommitted.
    pub fn sleep(&self, level: u8) -> Result<u64, MemError> {
        let mut core = self.core();
        if let Some((level, _)) = core.asleep {
            return Err(MemError::invalid(format!(
                "the activation pool already sleeps (level {level}); call wake() first"
            )));
        }
        let mut region = self.region();
        if !region.is_growable() {
            return Err(MemError::BackendUnavailable(
                "the activation pool cannot sleep: its region is fixed; open the system on a \
                 VMM backend"
                    .into(),
            ));
        }
        let committed = region.len();
        region.decommit(0)?;
        core.asleep = Some((level, committed));
        Ok(committed as u64)
    }

    /// Recommits the region at the same base (and, after
    /// [`ActivationPool::sleep_keeping`], copies the live blocks' bytes
    /// back); a no-op when awake. On failure it sleeps on.
    pub fn wake(&self) -> Result<(), MemError> {
        let mut core = self.core();
        let Some((_, committed)) = core.asleep else {
            return Ok(());
        };
        let mut region = self.region();
        region.commit(committed as u64)?;
        // After `sleep_keeping`, the live blocks' bytes come back.
        if let Err(err) = self.backup().restore(&mut region) {
            let _ = region.decommit(0);
            return Err(err);
        }
        core.asleep = None;
        Ok(())
    }

    /// Whether the pool is a measured one that has not been frozen: it
    /// commits chunks as blocks reach past its committed end.
    pub fn measuring(&self) -> bool {
        self.core().measuring
    }

    /// The highest end offset any block has reached (the bytes a measured
    /// pool needed).
    pub fn high_water(&self) -> u64 {
        self.core().extent_peak
    }

    /// Starts the high-water again from the blocks live now (the highest
    /// end of a live block): what ran before (a compile, a first warm-up
    /// whose temporaries are gone) no longer counts, and a freeze after it
    /// decommits the chunks only that needed. Nothing moves; a no-op on a
    /// pool that does not measure.
    pub fn reset_high_water(&self) {
        let mut core = self.core();
        if core.measuring {
            core.extent_peak = core.live_extent();
        }
    }

    /// What the freeze fixed, once it ran.
    pub fn frozen(&self) -> Option<Frozen> {
        self.core().frozen
    }

    /// Fixes a measured pool at its high-water plus `margin` bytes, rounded
    /// up to whole chunks (at most the reservation): the free top block is
    /// cut there and the capacity lowered, the commit becomes exactly that
    /// size (chunks past it decommitted, the margin committed now), and the
    /// pool commits nothing after. No live block moves or changes. Refused
    /// with `InvalidArgument` on a pool that does not measure (or was
    /// frozen) and while it sleeps; a refused commit of the margin leaves
    /// the pool measuring.
    pub fn freeze(&self, margin: u64) -> Result<Frozen, MemError> {
        let mut core = self.core();
        if !core.measuring {
            return Err(MemError::invalid(match core.frozen {
                Some(f) => format!(
                    "the activation pool is already frozen at {}; freeze it once",
                    human_bytes(f.size)
                ),
                None => "the activation pool does not measure (it is committed whole); open it \
                         with a measure chunk to freeze it"
                    .into(),
            }));
        }
        if let Some((level, _)) = core.asleep {
            return Err(MemError::invalid(format!(
                "the activation pool sleeps (level {level}); wake() it before the freeze"
            )));
        }
        let chunk = self.inner.chunk;
        let cap = self.capacity();
        let target = core
            .extent_peak
            .saturating_add(margin)
            .max(1)
            .div_ceil(chunk)
            .saturating_mul(chunk)
            .min(cap);
        // Round to the alignment too: the blocks are multiples of it.
        let target = (target / self.inner.align * self.inner.align).max(self.inner.align);
        if core.live_extent() > target {
            return Err(MemError::Invariant(format!(
                "activation pool freeze: a live block ends at {} B, past the high-water {} B",
                core.live_extent(),
                core.extent_peak
            )));
        }
        // Commit or decommit first (a refusal leaves the pool as it was):
        // everything past `target` is free, and the state lock keeps it so
        // until the cut.
        let mut region = self.region();
        let committed_before = region.len() as u64;
        region.commit(target)?;
        region.decommit(target)?;
        if !core.trim_top(cap, target, self.inner.shift) {
            return Err(MemError::Invariant(format!(
                "activation pool freeze: the blocks past {target} B are not free blocks ending at \
                 the capacity {cap} B"
            )));
        }
        self.inner.capacity.store(target, Ordering::Release);
        let frozen = Frozen {
            high_water: core.extent_peak,
            margin,
            size: target,
            committed_before,
            decommitted: committed_before.saturating_sub(region.len() as u64),
        };
        core.measuring = false;
        core.frozen = Some(frozen);
        Ok(frozen)
    }

    /// Whether blocks of this pool live outside its region (production-mode
    /// fallbacks): where none does, an address outside the region is not
    /// this pool's, known without the lock.
    pub fn has_fallbacks(&self) -> bool {
        self.inner.fallbacks.load(Ordering::Acquire) > 0
    }

    /// Whether `addr` lies inside the region.
    pub fn contains(&self, addr: usize) -> bool {
        addr >= self.inner.base && ((addr - self.inner.base) as u64) < self.capacity()
    }

    /// The requested size of the live allocation at `addr`, if it is one.
    pub fn requested_size(&self, addr: usize) -> Option<u64> {
        let inner = &*self.inner;
        let core = self.core();
        if self.contains(addr) {
            let offset = (addr - inner.base) as u64;
            let idx = core.live.get(&(offset >> inner.shift))?;
            let b = &core.slab[*idx as usize];
            (b.offset == offset).then_some(b.requested)
        } else {
            core.fallback.get(&(addr as u64)).map(|f| f.requested)
        }
    }

    /// Resets the peaks to the current values.
    pub fn reset_peak(&self) {
        let mut core = self.core();
        let cap = self.capacity();
        let c = &mut core.c;
        c.allocated_peak = c.allocated;
        c.in_use_peak = c.allocated + c.fallback_bytes;
        c.live_peak = c.live;
        c.reserved_peak = cap + c.fallback_bytes;
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ActivationStats {
        let core = self.core();
        let c = core.c;
        let (mut free_bytes, mut free_blocks, mut largest, mut streams) = (0, 0, 0, 0);
        for lane in &core.lanes {
            free_bytes += lane.bytes;
            free_blocks += u64::from(lane.blocks);
            if lane.blocks > 0 {
                streams += 1;
                largest = largest.max(lane.largest(&core.slab));
            }
        }
        ActivationStats {
            capacity: self.capacity(),
            measuring: core.measuring,
            high_water: core.extent_peak,
            frozen: core.frozen,
            align: self.inner.align,
            allocated: c.allocated,
            allocated_peak: c.allocated_peak,
            in_use: c.allocated + c.fallback_bytes,
            in_use_peak: c.in_use_peak,
            requested: c.requested,
            live: c.live,
            live_peak: c.live_peak,
            allocs_total: c.allocs_total,
            frees_total: c.frees_total,
            allocated_bytes_total: c.allocated_bytes_total,
            freed_bytes_total: c.freed_bytes_total,
            fallbacks_total: c.fallbacks_total,
            fallback_bytes_total: c.fallback_bytes_total,
            fallback_live: core.fallback.len() as u64,
            fallback_bytes: c.fallback_bytes,
            reserved_peak: c.reserved_peak,
            ooms: c.ooms,
            refused_frees: c.refused_frees,
            free_bytes,
            free_blocks,
            largest_free: largest,
            cross_stream_reuses: c.cross_stream_reuses,
            reclaims: c.reclaims,
            streams,
            parked_blocks: c.parked_blocks,
        }
    }

    /// Where the memory lives (the backend's kind and device).
    pub fn placement(&self) -> crate::source::Placement {
        crate::arena::placement_of(&self.region())
    }

    /// A short description of the pool's size, for messages.
    pub fn describe(&self) -> String {
        format!(
            "activation pool of {} (align {} B, {})",
            human_bytes(self.capacity()),
            self.inner.align,
            if self.inner.strict {
                "strict"
            } else {
                "production"
            }
        )
    }
}

pub(super) fn parked_bytes(core: &Core) -> u64 {
    core.slab
        .iter()
        .filter(|b| b.state == BlockState::Parked)
        .map(|b| b.size)
        .sum()
}

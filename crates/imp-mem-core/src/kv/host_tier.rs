//! The host tier of the prefix cache (T5b): pinned host blocks behind the
//! device pool, so that an evicted prefix block is copied out instead of
//! dropped and a later hit brings it back instead of recomputing it.
//!
//! # Algorithm
//!
//! A block hash lives in one tier at a time: a device cache entry, or a
//! resident host slot. Evicting a device entry starts a device → host copy
//! of its block into a free host slot (the host tier's own LRU head makes
//! room when there is none: its slot is reused and its hash dropped). The
//! entry leaves the device cache at once, but its block's ref stays with
//! the copy ([`Offload`]) until the copy has completed — the fence: only
//! then does the block return to the free list (or to the allocation that
//! waited for it), and only then is the hash resident on the host. An
//! admission whose prefix continues past its device hits into resident
//! host blocks takes those slots, allocates device blocks for them (they
//! count as blocks the admission needs) and starts host → device copies
//! into them; the new device entries are the sequence's hits at once,
//! their bytes pending until the copies complete ([`Onboard`]; the engine
//! waits for them before the sequence's first step, and the host slots are
//! free again only then). The device LRU evicts into the host tier's most
//! recent end, so the two lists are one LRU order: host oldest first, then
//! the device's evictable entries.
//!
//! A hash cached on the device while a host copy of it exists (recomputed
//! past an earlier miss) drops the host copy; a completed offload whose
//! hash is back on the device, already resident, or claimed frees its
//! slot. A hash is claimed from the moment an admission takes its slot (or
//! stages it from disk) until its device entry exists: the admission may
//! wait for offloads in between (making room), and one of them can be an
//! older copy of the same hash, evicted again after a miss recomputed it
//! while its first offload was in flight; made resident, it would be a
//! second copy next to the onboarded one.
//!
//! Copies go through [`TierIo`], the engine the pool's source gives
//! ([`host_tier_io`] asks it): host memory copies on the fake
//! ([`FakeTierIo`], which runs its queue only when told, so tests can hold
//! copies in flight), `cuMemcpy*Async` on a copy stream with an event per
//! copy on a GPU.
//!
//! Thread safety: part of the manager, under its `&mut self`.

use std::collections::{BTreeMap, VecDeque};

use crate::backend::Backend;
use crate::block_pool::{BlockId, BlockToken};
use crate::error::{try_reserve, MemError};
use crate::kv::disk_tier::DiskTier;
use crate::kv::events::{EventLog, Medium};
use crate::kv::hash::BlockHash;
use crate::kv::prefix::FastMap;

// The engine's trait is the source's (`MemorySource::host_tier_io`), the
// fake's engine is the fake's; their old paths stay.
pub use crate::fake::FakeTierIo;
pub use crate::source::{CopyTicket, TierIo};

/// The copy engine of a host tier of `host_blocks` blocks of `block_bytes`
/// for a KV pool on `backend`, from its source
/// ([`MemorySource::host_tier_io`](crate::source::MemorySource::host_tier_io)).
/// Refused (`InvalidArgument`) without a backend, with no block bytes, or
/// over a source that has no host tier.
pub fn host_tier_io(
    backend: Option<&Backend>,
    block_bytes: usize,
    host_blocks: u32,
) -> Result<Box<dyn TierIo>, MemError> {
    let unsupported = || {
        MemError::invalid(format!(
            "host_blocks={host_blocks} needs a manager over a backend (FakeBackend, \
             CudaBackend or VmmBackend) with block_bytes > 0; pass both, or host_blocks=0"
        ))
    };
    let backend = backend
        .filter(|_| block_bytes > 0)
        .ok_or_else(unsupported)?;
    backend
        .host_tier_io(block_bytes, host_blocks)?
        .ok_or_else(unsupported)
}

/// A device → host copy in flight: the device block's ref waits for it.
#[derive(Debug)]
pub(crate) struct Offload {
    pub ticket: CopyTicket,
    pub hash: BlockHash,
    pub token: BlockToken,
    pub slot: u32,
}

/// A host → device copy in flight: the host slot waits for it.
#[derive(Debug)]
pub(crate) struct Onboard {
    pub ticket: CopyTicket,
    pub slot: u32,
    pub block: BlockId,
}

/// Counters of the host tier, merged into [`KvStats`](crate::kv::KvStats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct HostCounters {
    pub offloads: u64,
    pub offload_bytes: u64,
    pub onboards: u64,
    pub onboard_bytes: u64,
    pub evictions: u64,
    pub hit_blocks: u64,
    pub dropped: u64,
}

/// The host tier's state. See the module docs.
#[derive(Debug)]
pub(crate) struct HostTier {
    pub io: Box<dyn TierIo>,
    capacity: u32,
    free: Vec<u32>,
    /// Resident hash → (slot, LRU stamp).
    resident: FastMap<BlockHash, (u32, u64)>,
    /// LRU stamp → hash, oldest first.
    lru: BTreeMap<u64, BlockHash>,
    next_stamp: u64,
    pub offloading: VecDeque<Offload>,
    pub onboarding: VecDeque<Onboard>,
    /// Hashes an admission took (or staged) for onboarding whose device
    /// entries do not exist yet; empty between calls.
    claimed: FastMap<BlockHash, ()>,
    pub counters: HostCounters,
    /// Where evicted host blocks go, when a disk budget was given.
    pub disk: Option<DiskTier>,
}

/// What [`HostTier::reap`] finished.
#[derive(Debug, Default)]
pub(crate) struct Reaped {
    /// Device blocks whose offload completed: theirs to release or reuse.
    pub tokens: Vec<BlockToken>,
}

impl HostTier {
    /// The tier over `io`'s slots; its free list is reserved fallibly.
    pub fn new(io: Box<dyn TierIo>) -> Result<Self, MemError> {
        let capacity = io.slots();
        let mut free = Vec::new();
        try_reserve(
            &mut free,
            capacity as usize,
            &format!("a host tier of {capacity} blocks"),
        )?;
        free.extend((0..capacity).rev());
        Ok(Self {
            io,
            capacity,
            free,
            resident: FastMap::default(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            offloading: VecDeque::new(),
            onboarding: VecDeque::new(),
            claimed: FastMap::default(),
            counters: HostCounters::default(),
            disk: None,
        })
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    pub fn resident_len(&self) -> u32 {
        self.resident.len() as u32
    }

    pub fn free_len(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.resident.contains_key(hash)
    }

    /// Resident hashes, least recently used first.
    pub fn resident_in_order(&self) -> Vec<BlockHash> {
        self.lru.values().copied().collect()
    }

    fn bytes(&self) -> u64 {
        self.io.block_bytes() as u64
    }

    /// A slot for an offload: a free one, else the LRU resident's (its hash
    /// is dropped). `None` when every slot is in flight.
    fn slot_for_offload(&mut self, events: &mut EventLog) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let (&stamp, &hash) = self.lru.iter().next()?;
        self.lru.remove(&stamp);
        let (slot, _) = self.resident.remove(&hash)?;
        self.counters.evictions += 1;
        events.removed(hash, Medium::Host);
        if let Some(disk) = self.disk.as_mut() {
            let io = &mut self.io;
            disk.spill(hash, |buf| io.read_slot(slot, buf).is_ok(), events);
        }
        Some(slot)
    }

    /// Host slots a disk hit can be staged in now: free ones and those of
    /// residents (whose eviction makes room).
    pub fn stageable(&self) -> u32 {
        (self.free.len() + self.resident.len()) as u32
    }

    /// Reads disk blocks `hashes` back into host slots, in order, stopping
    /// at the first that cannot be (a bad file, or no slot): their slots
    /// and stamps, as [`Self::take`] gives them, for onboarding.
    pub fn stage_from_disk(
        &mut self,
        hashes: &[BlockHash],
        events: &mut EventLog,
    ) -> Vec<(u32, u64)> {
        let Some(disk) = self.disk.as_mut() else {
            return Vec::new();
        };
        // Spills still being written are files to read: finished first.
        disk.flush(events);
        let (files, format) = disk.reader(hashes);
        if files.len() < 2 {
            let mut buf = disk.take_buffer();
            let mut out = Vec::new();
            if let Some((h, _)) = files.first() {
                let taken = disk.take_into(h, &mut buf, events);
                if taken {
                    out.extend(self.stage_one(*h, &buf, events));
                }
            }
            if let Some(disk) = self.disk.as_mut() {
                disk.put_buffer(buf);
            }
            return out;
        }
        // Several: the files are read and checked on up to four threads,
        // two blocks ahead of this one each, which stages them in order.
        // Each file is deleted (here) before its slot is taken, so the
        // spill that may make room adds a file where one just went and
        // never evicts the next from the disk. A reader keeps its file open
        // and the process's releaser closes it after the deletion
        // (`DiskTier::taken`, `persist::release_later`): the close frees
        // the file's storage (page by page on a tmpfs), which the deletion
        // would otherwise do on this thread. Files read ahead past where
        // the prefix stops are closed as they are, still indexed.
        let workers = files
            .len()
            .min(4)
            .min(std::thread::available_parallelism().map_or(1, |n| n.get()));
        let mut bufs: Vec<Vec<u8>> = (0..files.len().min(2 * workers))
            .map(|_| disk.take_buffer())
            .collect();
        type Read = (usize, Vec<u8>, bool, Option<std::fs::File>);
        let (job_tx, job_rx) = std::sync::mpsc::channel::<(usize, Vec<u8>)>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<Read>();
        let job_rx = std::sync::Mutex::new(job_rx);
        let mut out = Vec::new();
        let mut back = Vec::new();
        std::thread::scope(|s| {
            // Owned by this closure: dropped when it returns, which ends
            // the workers' loops before the scope joins them.
            let job_tx = job_tx;
            for _ in 0..workers {
                let (files, format, job_rx, done_tx) = (&files, &format, &job_rx, done_tx.clone());
                s.spawn(move || loop {
                    let job = job_rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    let Ok((i, mut buf)) = job else {
                        break;
                    };
                    let (hash, path) = &files[i];
                    let (read, file) = format.read_open(path, *hash, &mut buf);
                    if done_tx.send((i, buf, read.is_ok(), file)).is_err() {
                        break;
                    }
                });
            }
            drop(done_tx);
            let mut next = 0;
            for buf in bufs.drain(..) {
                let _ = job_tx.send((next, buf));
                next += 1;
            }
            let mut ready: FastMap<usize, (Vec<u8>, bool, Option<std::fs::File>)> =
                FastMap::default();
            for (i, (h, _)) in files.iter().enumerate() {
                let (buf, read, file) = loop {
                    if let Some(r) = ready.remove(&i) {
                        break r;
                    }
                    match done_rx.recv() {
                        Ok((j, buf, read, file)) => {
                            ready.insert(j, (buf, read, file));
                        }
                        Err(_) => return,
                    }
                };
                // The reader's handle goes with the file: closed off this
                // thread once the deletion leaves it the last.
                let taken = self
                    .disk
                    .as_mut()
                    .is_some_and(|d| d.taken(h, read, file, events));
                if !taken {
                    back.push(buf);
                    return;
                }
                match self.stage_one(*h, &buf, events) {
                    Some(staged) => out.push(staged),
                    None => {
                        back.push(buf);
                        return;
                    }
                }
                if next < files.len() {
                    let _ = job_tx.send((next, buf));
                    next += 1;
                } else {
                    back.push(buf);
                }
            }
        });
        if let Some(disk) = self.disk.as_mut() {
            back.into_iter().for_each(|buf| disk.put_buffer(buf));
        }
        out
    }

    /// Takes a host slot for disk block `hash` and copies `bytes` in: its
    /// slot and stamp, or `None` when there is no slot or the copy failed.
    fn stage_one(
        &mut self,
        hash: BlockHash,
        bytes: &[u8],
        events: &mut EventLog,
    ) -> Option<(u32, u64)> {
        let slot = self.slot_for_offload(events)?;
        if self.io.write_slot(slot, bytes).is_err() {
            self.free.push(slot);
            return None;
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        // On the host now, on its way to the device.
        self.claimed.insert(hash, ());
        events.stored_alone(hash, Medium::Host);
        Some((slot, stamp))
    }

    /// Starts copying an evicted device block out. Hands the token back
    /// when it cannot (no slot, or the copy was refused): the caller then
    /// drops the block as if there were no host tier.
    pub fn begin_offload(
        &mut self,
        hash: BlockHash,
        token: BlockToken,
        dev_addr: usize,
        events: &mut EventLog,
    ) -> Result<(), BlockToken> {
        let Some(slot) = self.slot_for_offload(events) else {
            self.counters.dropped += 1;
            return Err(token);
        };
        match self.io.offload(dev_addr, slot) {
            Ok(ticket) => {
                self.offloading.push_back(Offload {
                    ticket,
                    hash,
                    token,
                    slot,
                });
                Ok(())
            }
            Err(_) => {
                self.free.push(slot);
                self.counters.dropped += 1;
                Err(token)
            }
        }
    }

    /// Takes resident `hash`'s slot for an onboarding (with its LRU stamp,
    /// for [`Self::restore`]) and claims the hash until
    /// [`Self::onboarded`] or [`Self::restore`].
    pub fn take(&mut self, hash: &BlockHash) -> Option<(u32, u64)> {
        let taken = self.take_resident(hash)?;
        self.claimed.insert(*hash, ());
        Some(taken)
    }

    fn take_resident(&mut self, hash: &BlockHash) -> Option<(u32, u64)> {
        let (slot, stamp) = self.resident.remove(hash)?;
        self.lru.remove(&stamp);
        Some((slot, stamp))
    }

    /// Puts back what [`Self::take`] (or a staging) took: an admission
    /// that failed.
    pub fn restore(&mut self, hash: BlockHash, slot: u32, stamp: u64) {
        self.claimed.remove(&hash);
        self.resident.insert(hash, (slot, stamp));
        self.lru.insert(stamp, hash);
    }

    /// Claimed `hash` has its device entry now (or was computed instead).
    pub fn onboarded(&mut self, hash: &BlockHash) {
        self.claimed.remove(hash);
    }

    /// Starts copying each `(slot, block, dev_addr)`: host `slot` into
    /// device block `block` at `dev_addr`. All or nothing: on an error no
    /// copy is in flight and the slots are still the caller's.
    pub fn begin_onboard(&mut self, copies: &[(u32, BlockId, usize)]) -> Result<(), MemError> {
        let pairs: Vec<(u32, usize)> = copies.iter().map(|&(s, _, a)| (s, a)).collect();
        let tickets = self.io.onboard_many(&pairs)?;
        if tickets.len() != copies.len() {
            return Err(MemError::Invariant(format!(
                "{} onboarding copies got {} tickets",
                copies.len(),
                tickets.len()
            )));
        }
        for (&(slot, block, _), ticket) in copies.iter().zip(tickets) {
            self.onboarding.push_back(Onboard {
                ticket,
                slot,
                block,
            });
        }
        self.counters.onboards += copies.len() as u64;
        self.counters.onboard_bytes += copies.len() as u64 * self.bytes();
        Ok(())
    }

    /// Drops the host copy of `hash`, which is now cached on the device.
    pub fn discard(&mut self, hash: &BlockHash, events: &mut EventLog) {
        if let Some((slot, _)) = self.take_resident(hash) {
            self.free.push(slot);
            events.removed(*hash, Medium::Host);
        }
        if let Some(disk) = self.disk.as_mut() {
            disk.discard(hash, events);
        }
    }

    fn make_resident(&mut self, hash: BlockHash, slot: u32, events: &mut EventLog) {
        if let Some(disk) = self.disk.as_mut() {
            disk.discard(&hash, events);
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.resident.insert(hash, (slot, stamp));
        self.lru.insert(stamp, hash);
        events.stored_alone(hash, Medium::Host);
    }

    /// Finishes the copies that have completed (all of them, waiting, with
    /// `wait`). `on_device` says whether a hash is cached on the device
    /// again, in which case its finished offload frees its slot, as one of
    /// a resident or claimed hash does.
    pub fn reap(
        &mut self,
        wait: bool,
        on_device: impl Fn(&BlockHash) -> bool,
        events: &mut EventLog,
    ) -> Result<Reaped, MemError> {
        let mut out = Reaped::default();
        // The disk tier's spill writes in flight finish too: after a poll
        // every indexed block has its file.
        if let Some(disk) = self.disk.as_mut() {
            disk.flush(events);
        }
        while let Some(o) = self.offloading.front() {
            if wait {
                self.io.wait(o.ticket)?;
            } else if !self.io.is_done(o.ticket)? {
                break;
            }
            let Some(o) = self.offloading.pop_front() else {
                break;
            };
            self.counters.offloads += 1;
            self.counters.offload_bytes += self.bytes();
            if on_device(&o.hash)
                || self.resident.contains_key(&o.hash)
                || self.claimed.contains_key(&o.hash)
            {
                self.free.push(o.slot);
            } else {
                self.make_resident(o.hash, o.slot, events);
            }
            out.tokens.push(o.token);
        }
        while let Some(o) = self.onboarding.front() {
            if wait {
                self.io.wait(o.ticket)?;
            } else if !self.io.is_done(o.ticket)? {
                break;
            }
            if let Some(o) = self.onboarding.pop_front() {
                self.free.push(o.slot);
            }
        }
        Ok(out)
    }

    /// The pending onboard into device block `block`, if any.
    pub fn pending_onboard(&self, block: BlockId) -> Option<CopyTicket> {
        self.onboarding
            .iter()
            .find(|o| o.block == block)
            .map(|o| o.ticket)
    }

    /// Waits for the pending onboard into device block `block`, if any,
    /// and frees its host slot: the block is about to leave the cache.
    pub fn settle_onboard(&mut self, block: BlockId) -> Result<(), MemError> {
        let Some(at) = self.onboarding.iter().position(|o| o.block == block) else {
            return Ok(());
        };
        self.io.wait(self.onboarding[at].ticket)?;
        if let Some(o) = self.onboarding.remove(at) {
            self.free.push(o.slot);
        }
        Ok(())
    }

    /// Forgets every resident block (a reset); copies in flight stay.
    pub fn clear_resident(&mut self) -> u32 {
        if let Some(disk) = self.disk.as_mut() {
            disk.clear();
        }
        let n = self.resident.len() as u32;
        for (_, (slot, _)) in self.resident.drain() {
            self.free.push(slot);
        }
        self.lru.clear();
        n
    }

    /// Takes every in-flight offload's device token after waiting for all
    /// copies (the manager's drop: the memory must not be freed under a
    /// copy).
    pub fn wait_and_take_all(&mut self) -> Vec<BlockToken> {
        let tickets = self.offloading.iter().map(|o| o.ticket);
        let last = tickets
            .chain(self.onboarding.iter().map(|o| o.ticket))
            .max();
        if let Some(t) = last {
            // Copies complete in ticket order: the last one fences them all.
            let _ = self.io.wait(t);
        }
        self.onboarding.clear();
        self.offloading.drain(..).map(|o| o.token).collect()
    }

    /// Checks the slot partition: every slot exactly once over free,
    /// resident, offloading and onboarding; the LRU matches the residents.
    pub fn check(&self) -> Result<(), MemError> {
        let broken = |what: String| Err(MemError::Invariant(format!("host tier: {what}")));
        let mut seen = vec![false; self.capacity as usize];
        let slots = self
            .free
            .iter()
            .copied()
            .chain(self.resident.values().map(|&(s, _)| s))
            .chain(self.offloading.iter().map(|o| o.slot))
            .chain(self.onboarding.iter().map(|o| o.slot));
        let mut n = 0u32;
        for s in slots {
            match seen.get_mut(s as usize) {
                Some(v) if !*v => *v = true,
                _ => return broken(format!("slot {s} is out of range or in two places")),
            }
            n += 1;
        }
        if n != self.capacity {
            return broken(format!("{n} slots accounted of {}", self.capacity));
        }
        if self.lru.len() != self.resident.len()
            || self
                .lru
                .iter()
                .any(|(stamp, h)| self.resident.get(h).map(|r| r.1) != Some(*stamp))
        {
            return broken("the LRU and the residents disagree".into());
        }
        if let Some(h) = self.claimed.keys().next() {
            return broken(format!(
                "block hash {h:x} is still claimed after its admission"
            ));
        }
        Ok(())
    }
}

//! A sleep that keeps the live blocks' bytes (issue 24: `imp_mem.torch`
//! regions, the trainer's side of RL colocation).
//!
//! [`ActivationPool::sleep`] drops every byte: an engine's activations are
//! rewritten before they are read. A trainer's allocations (its weights,
//! gradients, optimizer state, inside torch's segments) must survive, so
//! [`ActivationPool::sleep_keeping`] first copies each live block (merged
//! with its live neighbours, in address order) into one pinned host buffer,
//! then decommits the whole region; [`ActivationPool::wake`] recommits it at
//! the same base and copies the blocks back. Free blocks are not copied. The
//! buffer is kept after the wake, so the next sleep copies at once instead
//! of pinning again; [`ActivationPool::release_host_copy`] frees it.
//! [`ActivationPool::pin_host_copy`] pins that buffer ahead of the first
//! sleep (so that one copies at the line rate too), and
//! [`ActivationPool::host_copy_of`] finds a live block's bytes in the copy
//! (while asleep, or in the kept buffer after a wake until the next sleep):
//! torch_memory_saver's `get_cpu_backup` (issue 51).
//!
//! Locks: the pool's state, then its region, then the backup (the order of
//! every other path that takes more than one).

use std::sync::MutexGuard;

use crate::backend::Region;
use crate::error::MemError;
use crate::pinned::{PinnedBuffer, PinnedHost};

use super::blocks::Core;
use super::tlsf::BlockState;
use super::ActivationPool;

/// The host copy of a sleeping pool's live blocks, and the buffer kept for
/// the next sleep.
#[derive(Debug, Default)]
pub(super) struct Backup {
    /// `(offset in the region, length)` of each range copied, in address
    /// order; the copy holds them back to back.
    ranges: Vec<(usize, usize)>,
    copy: Option<PinnedBuffer>,
    spare: Option<PinnedBuffer>,
    /// The ranges `spare` still holds after a wake (the copy of the last
    /// sleep, laid out as `ranges` was); empty once it is pinned afresh,
    /// reused or freed.
    kept: Vec<(usize, usize)>,
}

impl Backup {
    /// Copies the ranges back into `region` (committed again) and keeps the
    /// buffer as the spare. On failure the copy stays for a retry.
    pub(super) fn restore(&mut self, region: &mut Region) -> Result<(), MemError> {
        let Some(copy) = self.copy.as_ref() else {
            return Ok(());
        };
        let mut at = 0;
        for &(offset, len) in &self.ranges {
            region.copy_from_host(offset, &copy.as_slice()[at..at + len])?;
            at += len;
        }
        self.kept = std::mem::take(&mut self.ranges);
        self.spare = self.copy.take();
        Ok(())
    }
}

/// Where `[offset, offset + len)` lies in `buffer`, whose bytes are
/// `ranges` back to back; None unless one range holds all of it.
fn find_in(
    ranges: &[(usize, usize)],
    buffer: &PinnedBuffer,
    offset: usize,
    len: usize,
) -> Option<usize> {
    let mut at = 0;
    for &(start, n) in ranges {
        if offset >= start && offset.checked_add(len)? <= start + n {
            return Some(buffer.addr() + at + (offset - start));
        }
        at += n;
    }
    None
}

/// Live blocks as ranges of the region, neighbours merged, in address order.
fn live_ranges(core: &Core) -> Vec<(usize, usize)> {
    let mut blocks: Vec<(usize, usize)> = core
        .slab
        .iter()
        .filter(|b| matches!(b.state, BlockState::Live) && b.size > 0)
        .map(|b| (b.offset as usize, b.size as usize))
        .collect();
    blocks.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(blocks.len());
    for (offset, len) in blocks {
        match merged.last_mut() {
            Some(last) if last.0 + last.1 == offset => last.1 += len,
            _ => merged.push((offset, len)),
        }
    }
    merged
}

impl ActivationPool {
    pub(super) fn backup(&self) -> MutexGuard<'_, Backup> {
        self.inner
            .backup
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sleeps at level 1 keeping the live blocks' bytes: each is copied to
    /// pinned memory from `host` (the buffer kept from the last sleep when
    /// it is large enough), then the region is decommitted; its addresses
    /// stay, allocations are refused ([`MemError::Asleep`]) until
    /// [`ActivationPool::wake`] recommits it and copies the bytes back. The
    /// caller makes sure no work still uses the memory (on a GPU: it has
    /// synchronised). All or nothing: on failure the pool is awake and
    /// unchanged. Returns the bytes copied.
    pub fn sleep_keeping(&self, host: &PinnedHost) -> Result<u64, MemError> {
        // The state lock stays held: no block changes until the sleep is
        // done.
        let mut core = self.core();
        if let Some((level, _)) = core.asleep {
            return Err(MemError::invalid(format!(
                "the activation pool already sleeps (level {level}); call wake() first"
            )));
        }
        let ranges = live_ranges(&core);
        let mut region = self.region();
        if !region.is_growable() {
            return Err(MemError::BackendUnavailable(
                "the activation pool cannot sleep: its region is fixed; open it growable \
                 (growable=True) on a VMM backend"
                    .into(),
            ));
        }
        let total: usize = ranges.iter().map(|r| r.1).sum();
        let mut backup = self.backup();
        // The kept buffer is about to be overwritten (or dropped).
        backup.kept.clear();
        let mut buffer = match backup.spare.take() {
            Some(b) if b.len() >= total => Some(b),
            old => {
                drop(old);
                if total == 0 {
                    None
                } else {
                    Some(host.allocate(total)?)
                }
            }
        };
        if let Some(buf) = buffer.as_mut() {
            let mut at = 0;
            for &(offset, len) in &ranges {
                if let Err(err) = region.copy_to_host(offset, &mut buf.as_mut_slice()[at..at + len])
                {
                    backup.spare = buffer;
                    return Err(err);
                }
                at += len;
            }
        }
        let committed = region.len();
        if let Err(err) = region.decommit(0) {
            backup.spare = buffer;
            return Err(err);
        }
        core.asleep = Some((1, committed));
        backup.ranges = ranges;
        backup.copy = buffer;
        Ok(total as u64)
    }

    /// Pinned host bytes the pool holds for sleeping: the copy of a sleeping
    /// pool and the buffer kept for the next sleep.
    pub fn host_bytes(&self) -> u64 {
        let backup = self.backup();
        let len = |b: &Option<PinnedBuffer>| b.as_ref().map_or(0, PinnedBuffer::len) as u64;
        len(&backup.copy) + len(&backup.spare)
    }

    /// Frees the pinned buffer kept after a wake (a sleeping pool's copy is
    /// not freed); returns the bytes freed.
    pub fn release_host_copy(&self) -> u64 {
        let mut backup = self.backup();
        backup.kept.clear();
        backup.spare.take().map_or(0, |b| b.len() as u64)
    }

    /// Pins the buffer the next sleep copies into ahead of it: at least
    /// `bytes` from `host`, kept as the spare (a smaller spare is freed
    /// first; a large enough one is kept as it is). A sleeping pool's copy
    /// is not touched (returns 0). Returns the spare's size. Only the
    /// backup's lock is held while pinning, so a concurrent sleep waits for
    /// this buffer rather than pinning a second one.
    pub fn pin_host_copy(&self, bytes: usize, host: &PinnedHost) -> Result<u64, MemError> {
        let mut backup = self.backup();
        if backup.copy.is_some() {
            return Ok(0);
        }
        if let Some(spare) = backup.spare.as_ref() {
            if spare.len() >= bytes {
                return Ok(spare.len() as u64);
            }
        }
        backup.kept.clear();
        backup.spare = None;
        if bytes == 0 {
            return Ok(0);
        }
        let buffer = host.allocate(bytes)?;
        let len = buffer.len() as u64;
        backup.spare = Some(buffer);
        Ok(len)
    }

    /// The host address holding the `len` bytes at `offset` of the region
    /// in the copy: while asleep after [`ActivationPool::sleep_keeping`],
    /// or after the wake in the kept buffer (until it is reused, re-pinned
    /// or freed). None where no copied range holds all of them.
    pub fn host_copy_of(&self, offset: usize, len: usize) -> Option<usize> {
        let backup = self.backup();
        if let Some(copy) = backup.copy.as_ref() {
            return find_in(&backup.ranges, copy, offset, len);
        }
        let spare = backup.spare.as_ref()?;
        find_in(&backup.kept, spare, offset, len)
    }
}

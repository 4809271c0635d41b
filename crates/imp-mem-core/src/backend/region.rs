//! [`Region`]: memory acquired from a [`Backend`](super::Backend).
//!
//! Move-only, the only type that holds an address obtained from a source,
//! and released exactly once — when it is dropped, or explicitly with
//! [`Backend::release`](super::Backend::release). Growable regions reserve
//! address space for their maximum and commit physical memory in granules;
//! their base never moves (V9). A region's bytes are read and written
//! through its backend's source (the copies below).

use std::sync::Arc;

use super::Backend;
use crate::accounting::JournalOp;
use crate::error::{try_reserve, MemError};
use crate::source::{FromHost, ToHost};
use crate::tag::Tag;
use crate::units::round_up;

/// Bytes [`Region::commit_and_fill`] commits ahead of its copy at a time:
/// two 64 MiB VMM chunks, a DMA of ~2.4 ms at an H200's pinned bandwidth
/// against ~0.3 ms of driver work to commit them.
pub const FILL_PIECE_BYTES: usize = 128 << 20;

/// Memory acquired from a backend. Move-only; released exactly once, when
/// dropped.
pub struct Region {
    pub(super) base: usize,
    pub(super) reserved: usize,
    pub(super) committed: usize,
    pub(super) align: usize,
    pub(super) tag: Tag,
    pub(super) growable: bool,
    pub(super) backend: Backend,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("base", &format_args!("{:#x}", self.base))
            .field("committed", &self.committed)
            .field("reserved", &self.reserved)
            .field("tag", &self.tag)
            .field("growable", &self.growable)
            .finish()
    }
}

impl Region {
    /// The first address. Never changes, growable or not (V9).
    pub fn base(&self) -> usize {
        self.base
    }

    /// Bytes usable now (committed).
    pub fn len(&self) -> usize {
        self.committed
    }

    /// True when nothing is committed (a growable region before its first
    /// commit).
    pub fn is_empty(&self) -> bool {
        self.committed == 0
    }

    /// Address space held: the maximum a growable region can commit.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// The alignment of `base`.
    pub fn align(&self) -> usize {
        self.align
    }

    /// What the region is for.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// Whether it can commit and decommit.
    pub fn is_growable(&self) -> bool {
        self.growable
    }

    /// The backend it came from.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    fn check_growable(&self, what: &str) -> Result<usize, MemError> {
        if !self.growable {
            return Err(MemError::invalid(format!(
                "cannot {what} a fixed region; acquire it with acquire_growable() to grow it"
            )));
        }
        Ok(self.backend.shared.info.granularity.max(1))
    }

    /// Grows the committed part to at least `new_len` bytes (rounded up to the
    /// granularity). A no-op if it is already that large. The base does not
    /// move.
    pub fn commit(&mut self, new_len: u64) -> Result<(), MemError> {
        let granule = self.check_growable("commit")?;
        if new_len > self.reserved as u64 {
            return Err(MemError::invalid(format!(
                "commit to {new_len} B is past the reservation of {} B; reserve more when \
                 acquiring",
                self.reserved
            )));
        }
        let target = round_up(new_len as usize, granule)
            .ok_or_else(|| MemError::invalid("commit size overflows"))?
            .min(self.reserved);
        if target <= self.committed {
            return Ok(());
        }
        let delta = (target - self.committed) as u64;
        let shared = &self.backend.shared;
        let mut state = shared.state();
        state.check_budget(delta, self.tag, shared.info.capacity)?;
        if let Err(e) = shared.source.commit(self.base, self.committed, target) {
            state.refund(delta);
            return Err(shared.map_source_error(&state, e, delta, self.tag));
        }
        state.ledger.on_commit(self.tag, delta);
        state.record(self.tag, delta, JournalOp::Commit);
        self.committed = target;
        Ok(())
    }

    /// Shrinks the committed part to `new_len` bytes (rounded up to the
    /// granularity), returning the rest of the physical memory. A no-op if it
    /// is already that small. The caller guarantees nothing in flight still
    /// uses the decommitted tail (on a GPU: the fence has completed).
    pub fn decommit(&mut self, new_len: u64) -> Result<(), MemError> {
        let granule = self.check_growable("decommit")?;
        let target = round_up(new_len.min(self.reserved as u64) as usize, granule)
            .ok_or_else(|| MemError::invalid("decommit size overflows"))?
            .min(self.reserved);
        if target >= self.committed {
            return Ok(());
        }
        let delta = (self.committed - target) as u64;
        let shared = &self.backend.shared;
        let mut state = shared.state();
        // SAFETY: `[target, committed)` is committed in this region's live
        // reservation, and `&mut self` means no span of this crate borrows it.
        unsafe { shared.source.decommit(self.base, target, self.committed) }
            .map_err(|e| shared.map_source_error(&state, e, delta, self.tag))?;
        state.ledger.on_decommit(self.tag, delta);
        state.refund(delta);
        state.record(self.tag, delta, JournalOp::Decommit);
        self.committed = target;
        Ok(())
    }
}

impl Region {
    fn check_copy(&self, offset: usize, len: usize) -> Result<(), MemError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.committed => Ok(()),
            _ => Err(MemError::invalid(format!(
                "copy of {len} B at offset {offset} runs past the {} B committed in this region",
                self.committed
            ))),
        }
    }

    /// Copies `dst.len()` bytes at `offset` of this region to `dst`,
    /// through the source ([`MemorySource::copy_to_host`]); pinned host
    /// memory makes it a DMA at full speed on a device.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemError> {
        self.check_copy(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let shared = &self.backend.shared;
        // SAFETY: `[base + offset, + len)` is inside this live region's
        // committed part (checked just above); `dst` is a host slice we hold
        // exclusively for the call.
        unsafe {
            shared
                .source
                .copy_to_host(self.base + offset, dst.as_mut_ptr(), dst.len())
        }
        .map_err(|e| shared.map_source_error(&shared.state(), e, 0, self.tag))
    }

    /// Reads `len` bytes at `offset` of this region into a new host buffer
    /// ([`Region::copy_to_host`]): the range is checked before the buffer is
    /// reserved, and the reservation fails as `HostOutOfMemory` rather than
    /// aborting.
    pub fn read_to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, MemError> {
        self.check_copy(offset, len)?;
        let mut out = Vec::new();
        try_reserve(&mut out, len, "a region read")?;
        out.resize(len, 0);
        self.copy_to_host(offset, &mut out)?;
        Ok(out)
    }

    /// Copies `src` into this region at `offset`, through the source
    /// ([`MemorySource::copy_from_host`]). `&mut self`: nothing of this
    /// crate borrows the range meanwhile.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), MemError> {
        self.check_copy(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let shared = &self.backend.shared;
        // SAFETY: as in `copy_to_host`, the range is committed in this live
        // region, and `src` is a host slice borrowed for the call.
        unsafe {
            shared
                .source
                .copy_from_host(self.base + offset, src.as_ptr(), src.len())
        }
        .map_err(|e| shared.map_source_error(&shared.state(), e, 0, self.tag))
    }

    /// [`Region::copy_to_host`] of every `(offset, dst)` of `copies`, through
    /// one call to the source ([`MemorySource::copy_to_host_many`]): on a
    /// device every copy is enqueued and the host waits once. Every range is
    /// checked before any copy starts, so a batch with one range past the
    /// committed part copies nothing. On the source's failure the copies
    /// before the failing one may have landed.
    pub fn copy_to_host_many(&self, copies: &mut [(usize, &mut [u8])]) -> Result<(), MemError> {
        let mut batch: Vec<ToHost> = Vec::new();
        try_reserve(&mut batch, copies.len(), "a batch of region copies")?;
        for (offset, dst) in copies.iter_mut() {
            self.check_copy(*offset, dst.len())?;
            if !dst.is_empty() {
                batch.push((self.base + *offset, dst.as_mut_ptr(), dst.len()));
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let shared = &self.backend.shared;
        // SAFETY: every source range is inside this live region's committed
        // part (checked above); every `dst` is a host slice borrowed
        // mutably from `copies` for the call, so no two overlap.
        unsafe { shared.source.copy_to_host_many(&batch) }
            .map_err(|e| shared.map_source_error(&shared.state(), e, 0, self.tag))
    }

    /// [`Region::copy_from_host`] of every `(offset, src)` of `copies`,
    /// through one call to the source
    /// ([`MemorySource::copy_from_host_many`]), in order (a later copy to the
    /// same bytes wins). Checked as [`Region::copy_to_host_many`]: a batch
    /// with one bad range copies nothing.
    pub fn copy_from_host_many(&mut self, copies: &[(usize, &[u8])]) -> Result<(), MemError> {
        let mut batch: Vec<FromHost> = Vec::new();
        try_reserve(&mut batch, copies.len(), "a batch of region copies")?;
        for &(offset, src) in copies {
            self.check_copy(offset, src.len())?;
            if !src.is_empty() {
                batch.push((self.base + offset, src.as_ptr(), src.len()));
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let shared = &self.backend.shared;
        // SAFETY: as in `copy_to_host_many`, the ranges are committed in this
        // live region, which `&mut self` keeps from every span of this crate;
        // every `src` is a host slice borrowed for the call.
        unsafe { shared.source.copy_from_host_many(&batch) }
            .map_err(|e| shared.map_source_error(&shared.state(), e, 0, self.tag))
    }

    /// Commits the region to `new_len` bytes (as [`Region::commit`]) and
    /// copies `src` to its start, the two overlapped: a scoped worker thread
    /// commits piece after piece (whole granules, about [`FILL_PIECE_BYTES`])
    /// while this thread copies each piece once it is committed. On a device
    /// a commit is the driver creating and mapping handles, the copy a DMA
    /// from pinned memory; in sequence a wake pays both (the commit measured
    /// at ~11 % of the copy of the same bytes on an H200), overlapped about
    /// the copy alone. On failure the region keeps what it committed (the
    /// caller decommits) and the first error is returned.
    pub fn commit_and_fill(&mut self, new_len: u64, src: &[u8]) -> Result<(), MemError> {
        self.commit_and_fill_by(new_len, src, FILL_PIECE_BYTES)
    }

    /// [`Region::commit_and_fill`] with pieces of about `piece_bytes`.
    pub(crate) fn commit_and_fill_by(
        &mut self,
        new_len: u64,
        src: &[u8],
        piece_bytes: usize,
    ) -> Result<(), MemError> {
        let granule = self.check_growable("commit")?;
        if src.len() as u64 > new_len {
            return Err(MemError::invalid(format!(
                "fill of {} B is larger than the commit to {new_len} B",
                src.len()
            )));
        }
        let piece = piece_bytes.div_ceil(granule).max(1) * granule;
        if src.len() <= piece {
            self.commit(new_len)?;
            return self.copy_from_host(0, src);
        }
        let (base, tag, start) = (self.base, self.tag, self.committed);
        let shared = Arc::clone(&self.backend.shared);
        let (tx, rx) = std::sync::mpsc::channel::<usize>();
        let region = &mut *self;
        std::thread::scope(|scope| {
            let worker = scope.spawn(move || -> Result<(), MemError> {
                while (region.committed as u64) < new_len {
                    let next = (region.committed as u64).saturating_add(piece as u64);
                    region.commit(next.min(new_len))?;
                    if tx.send(region.committed).is_err() {
                        break; // the copy failed: nothing more to fill
                    }
                }
                Ok(())
            });
            let mut copied = 0usize;
            let mut copy_error = None;
            for committed in std::iter::once(start).chain(rx.iter()) {
                let upto = committed.min(src.len());
                if upto <= copied {
                    continue;
                }
                // SAFETY: `[base + copied, base + upto)` lies in the part of
                // this live region the worker has committed (it sent
                // `committed` after the commit returned); the region is
                // borrowed mutably for the whole scope, so no span of this
                // crate refers to it, and `src[copied..upto]` is a host slice
                // we borrow for the call.
                let result = unsafe {
                    shared.source.copy_from_host(
                        base + copied,
                        src[copied..].as_ptr(),
                        upto - copied,
                    )
                };
                if let Err(e) = result {
                    copy_error = Some(shared.map_source_error(&shared.state(), e, 0, tag));
                    break;
                }
                copied = upto;
            }
            drop(rx);
            let committed = worker.join().unwrap_or_else(|_| {
                Err(MemError::Invariant(
                    "the commit worker of a fill panicked".to_string(),
                ))
            });
            match (committed, copy_error) {
                (Err(e), _) | (Ok(()), Some(e)) => Err(e),
                (Ok(()), None) if copied == src.len() => Ok(()),
                (Ok(()), None) => Err(MemError::Invariant(format!(
                    "fill copied {copied} of {} B",
                    src.len()
                ))),
            }
        })
    }

    /// Tells the source that `[offset, offset + len)` of this region was
    /// released by the tier allocator that owns it (see
    /// [`MemorySource::scrub`]). Ranges past the committed part are clipped.
    ///
    /// # Safety
    /// No live handle refers to the range.
    pub(crate) unsafe fn scrub(&self, offset: usize, len: usize) {
        let end = offset.saturating_add(len).min(self.committed);
        if offset < end {
            // SAFETY: `[base + offset, base + end)` is inside this live region's
            // committed part (clipped just above); the caller promises no live
            // handle refers to it.
            unsafe {
                self.backend
                    .shared
                    .source
                    .scrub(self.base + offset, end - offset)
            };
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let shared = Arc::clone(&self.backend.shared);
        shared.release(self);
    }
}

#[cfg(test)]
mod fill_tests {
    use super::*;
    use crate::fake::{FakeBackend, FakeConfig};

    fn fake() -> FakeBackend {
        FakeBackend::new(FakeConfig {
            capacity: 64 << 20,
            granularity: 4096,
            ..FakeConfig::default()
        })
        .unwrap()
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

    #[test]
    fn a_fill_in_pieces_commits_the_length_and_copies_every_byte() {
        let fb = fake();
        // Pieces of 4 granules, a fill of 10.5 granules into a commit of 13,
        // and one that starts from a region already partly committed.
        for (start, new_len, fill) in [(0, 13 * 4096, 43_008), (8192, 13 * 4096, 43_008)] {
            let mut region = fb.acquire_growable(1 << 20, start, Tag::Weights).unwrap();
            let src = pattern(fill);
            region
                .commit_and_fill_by(new_len as u64, &src, 3 * 4096 + 1)
                .unwrap();
            assert_eq!(region.len(), new_len);
            let mut back = vec![0u8; fill];
            region.copy_to_host(0, &mut back).unwrap();
            assert_eq!(back, src);
            assert_eq!(fb.stats().total.committed, new_len as u64);
        }
    }

    #[test]
    fn a_refused_commit_is_the_fills_error_and_a_bad_fill_changes_nothing() {
        let fb = fake();
        let mut region = fb.acquire_growable(1 << 20, 0, Tag::Weights).unwrap();
        fb.fail_commits(1);
        let src = pattern(40_000);
        assert!(region.commit_and_fill_by(65_536, &src, 8192).is_err());
        assert_eq!(region.len(), 0);
        let err = region.commit_and_fill_by(1024, &src, 8192).unwrap_err();
        assert!(err.to_string().contains("larger than the commit"), "{err}");
        assert_eq!(region.len(), 0);
        let mut fixed = fb.acquire(4096, 4096, Tag::Workspace).unwrap();
        assert!(fixed.commit_and_fill(4096, &src[..16]).is_err());
    }
}

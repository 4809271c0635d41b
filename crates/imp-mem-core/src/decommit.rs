//! When to give a growable region's memory back: the hysteretic decommit
//! policy and the fenced, deferred decommit.
//!
//! Algorithm. Decommit is the expensive direction (an H200 unmap+release of
//! 1 GiB takes 311 µs against 72 µs to commit it), and a pool that shrinks the
//! moment its load dips pays it again on the next burst. So:
//!
//! * [`DecommitTracker::observe`] is called once per engine step with the
//!   chunks the pool *needs* (the highest chunk holding a live block, plus
//!   one: only a free tail can be unmapped) and the chunks committed. A step
//!   is *idle* when more than `keep_chunks` chunks above the need are
//!   committed. After `min_idle_steps` consecutive idle steps it decides to
//!   shrink to the highest need seen during that idle window plus
//!   `keep_chunks` — never below the need now. Any step that is not idle, or
//!   any growth, restarts the count. The decision is pure and deterministic.
//! * [`DeferredDecommit`] carries a decision out safely: the caller records a
//!   fence (a CUDA event: `imp_mem_cuda::Fence`) after the last work that may touch
//!   the tail, schedules the decommit with it, and polls; the tail is
//!   unmapped only once the fence has completed. Growing again before that
//!   cancels it.
//!
//! It lives in the core (no CUDA here) so that a growable `BlockPool` can use
//! it on any backend; `imp-mem-cuda` implements [`FenceLike`] for its CUDA
//! event fence, and tests use a stand-in.
//!
//! Contract for the caller (a growable `BlockPool`): between `schedule` and
//! the decommit, no block in the tail past the target is handed out; if one
//! must be, call [`DeferredDecommit::cancel`] first.
//!
//! Thread safety: both types are plain values with `&mut self` methods; the
//! pool that owns them serialises access.

use crate::backend::Region;
use crate::error::MemError;

/// How eagerly a growable pool returns memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecommitPolicy {
    /// Consecutive idle steps before a shrink is decided.
    pub min_idle_steps: u32,
    /// Spare chunks kept committed above the need.
    pub keep_chunks: usize,
}

impl Default for DecommitPolicy {
    fn default() -> Self {
        Self {
            min_idle_steps: 256,
            keep_chunks: 1,
        }
    }
}

/// What the tracker decided this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Leave the region as it is.
    Keep,
    /// Shrink the committed part to this many chunks.
    Decommit {
        /// Chunks to keep committed.
        to_chunks: usize,
    },
}

/// The per-pool state of the policy.
#[derive(Debug, Clone)]
pub struct DecommitTracker {
    policy: DecommitPolicy,
    idle_steps: u32,
    /// The highest need seen during the current idle window.
    window_peak: usize,
    last_committed: usize,
}

impl DecommitTracker {
    /// A tracker with `policy`.
    pub fn new(policy: DecommitPolicy) -> Self {
        Self {
            policy,
            idle_steps: 0,
            window_peak: 0,
            last_committed: 0,
        }
    }

    /// The policy.
    pub fn policy(&self) -> DecommitPolicy {
        self.policy
    }

    /// Consecutive idle steps so far.
    pub fn idle_steps(&self) -> u32 {
        self.idle_steps
    }

    fn restart(&mut self) {
        self.idle_steps = 0;
        self.window_peak = 0;
    }

    /// One engine step: `needed` leading chunks must stay, `committed` are.
    pub fn observe(&mut self, needed: usize, committed: usize) -> Decision {
        let grew = committed > self.last_committed;
        self.last_committed = committed;
        if grew || committed <= needed.saturating_add(self.policy.keep_chunks) {
            self.restart();
            return Decision::Keep;
        }
        self.idle_steps = self.idle_steps.saturating_add(1);
        self.window_peak = self.window_peak.max(needed);
        if self.idle_steps < self.policy.min_idle_steps.max(1) {
            return Decision::Keep;
        }
        let target = self
            .window_peak
            .saturating_add(self.policy.keep_chunks)
            .max(needed)
            .min(committed);
        self.restart();
        if target < committed {
            Decision::Decommit { to_chunks: target }
        } else {
            Decision::Keep
        }
    }
}

/// Something that completes when queued work has finished: a CUDA event,
/// or a stand-in in tests.
pub trait FenceLike {
    /// Complete now? Never blocks.
    fn is_complete(&self) -> Result<bool, MemError>;
    /// Blocks until complete.
    fn wait(&self) -> Result<(), MemError>;
}

/// A decommit waiting for its fence.
#[derive(Debug)]
pub struct DeferredDecommit<F: FenceLike> {
    pending: Option<(F, u64)>,
}

impl<F: FenceLike> Default for DeferredDecommit<F> {
    fn default() -> Self {
        Self { pending: None }
    }
}

impl<F: FenceLike> DeferredDecommit<F> {
    /// Nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Schedules shrinking to `target_len` bytes once `fence` completes. A
    /// decommit already pending is replaced: the newer fence was recorded
    /// later, so it covers the older one's work too.
    pub fn schedule(&mut self, fence: F, target_len: u64) {
        self.pending = Some((fence, target_len));
    }

    /// The pending target, if any.
    pub fn pending_target(&self) -> Option<u64> {
        self.pending.as_ref().map(|(_, t)| *t)
    }

    /// Drops the pending decommit (the pool needs its tail again).
    pub fn cancel(&mut self) {
        self.pending = None;
    }

    /// Decommits if the fence has completed; returns the bytes returned, or
    /// `None` when nothing happened (nothing pending, or still in flight).
    pub fn poll(&mut self, region: &mut Region) -> Result<Option<u64>, MemError> {
        let ready = match &self.pending {
            None => return Ok(None),
            Some((fence, _)) => fence.is_complete()?,
        };
        if !ready {
            return Ok(None);
        }
        self.finish(region)
    }

    /// Waits for the fence and decommits.
    pub fn flush(&mut self, region: &mut Region) -> Result<Option<u64>, MemError> {
        if let Some((fence, _)) = &self.pending {
            fence.wait()?;
        }
        self.finish(region)
    }

    fn finish(&mut self, region: &mut Region) -> Result<Option<u64>, MemError> {
        let Some((fence, target)) = self.pending.take() else {
            return Ok(None);
        };
        let before = region.len() as u64;
        if let Err(e) = region.decommit(target) {
            // Keep it pending: the caller may retry or cancel.
            self.pending = Some((fence, target));
            return Err(e);
        }
        Ok(Some(before.saturating_sub(region.len() as u64)))
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use crate::{FakeBackend, FakeConfig, Tag};

    use super::*;

    #[test]
    fn a_busy_pool_never_shrinks() {
        let mut t = DecommitTracker::new(DecommitPolicy {
            min_idle_steps: 3,
            keep_chunks: 1,
        });
        for _ in 0..100 {
            assert_eq!(t.observe(9, 10), Decision::Keep);
        }
    }

    #[test]
    fn shrinks_after_the_idle_window_to_its_peak_plus_the_margin() {
        let mut t = DecommitTracker::new(DecommitPolicy {
            min_idle_steps: 4,
            keep_chunks: 1,
        });
        assert_eq!(t.observe(10, 10), Decision::Keep);
        assert_eq!(t.observe(2, 10), Decision::Keep);
        assert_eq!(t.observe(5, 10), Decision::Keep);
        assert_eq!(t.observe(3, 10), Decision::Keep);
        assert_eq!(t.observe(1, 10), Decision::Decommit { to_chunks: 6 });
        // The window restarts after a decision.
        assert_eq!(t.idle_steps(), 0);
    }

    #[test]
    fn a_burst_restarts_the_count() {
        let mut t = DecommitTracker::new(DecommitPolicy {
            min_idle_steps: 3,
            keep_chunks: 0,
        });
        t.observe(10, 10);
        assert_eq!(t.observe(1, 10), Decision::Keep);
        assert_eq!(t.observe(1, 10), Decision::Keep);
        assert_eq!(t.observe(10, 10), Decision::Keep);
        assert_eq!(t.observe(1, 10), Decision::Keep);
        assert_eq!(t.observe(1, 10), Decision::Keep);
        assert_eq!(t.observe(1, 10), Decision::Decommit { to_chunks: 1 });
    }

    #[test]
    fn growth_restarts_the_count() {
        let mut t = DecommitTracker::new(DecommitPolicy {
            min_idle_steps: 2,
            keep_chunks: 0,
        });
        t.observe(4, 8);
        assert_eq!(t.observe(1, 8), Decision::Keep);
        assert_eq!(t.observe(1, 12), Decision::Keep, "grew: restart");
        assert_eq!(t.observe(1, 12), Decision::Keep);
        assert_eq!(t.observe(1, 12), Decision::Decommit { to_chunks: 1 });
    }

    #[test]
    fn never_below_the_need_and_never_above_committed() {
        // Deterministic sweep over small inputs: the target respects both
        // bounds, whatever the history.
        for keep in 0..3 {
            for idle in 1..4 {
                let mut t = DecommitTracker::new(DecommitPolicy {
                    min_idle_steps: idle,
                    keep_chunks: keep,
                });
                let mut committed = 12usize;
                for step in 0..500usize {
                    let needed = (step * 7 + step / 3) % 13;
                    let needed = needed.min(committed);
                    match t.observe(needed, committed) {
                        Decision::Keep => {}
                        Decision::Decommit { to_chunks } => {
                            assert!(to_chunks >= needed, "below the need");
                            assert!(to_chunks < committed, "not a shrink");
                            committed = to_chunks;
                            t.observe(needed, committed);
                        }
                    }
                    if needed == committed && committed < 12 {
                        committed += 1;
                    }
                }
            }
        }
    }

    #[test]
    fn zero_idle_steps_means_one() {
        let mut t = DecommitTracker::new(DecommitPolicy {
            min_idle_steps: 0,
            keep_chunks: 0,
        });
        t.observe(4, 4);
        assert_eq!(t.observe(1, 4), Decision::Decommit { to_chunks: 1 });
    }

    struct TestFence<'a> {
        done: &'a Cell<bool>,
        waited: &'a Cell<u32>,
    }

    impl FenceLike for TestFence<'_> {
        fn is_complete(&self) -> Result<bool, MemError> {
            Ok(self.done.get())
        }

        fn wait(&self) -> Result<(), MemError> {
            self.waited.set(self.waited.get() + 1);
            self.done.set(true);
            Ok(())
        }
    }

    #[test]
    fn the_tail_goes_only_after_the_fence() {
        let fake = FakeBackend::new(FakeConfig {
            granularity: 4096,
            ..FakeConfig::default()
        })
        .unwrap();
        let mut region = fake
            .acquire_growable(1 << 20, 64 << 10, Tag::KvCache)
            .unwrap();
        let (done, waited) = (Cell::new(false), Cell::new(0));
        let mut deferred = DeferredDecommit::new();
        assert_eq!(deferred.poll(&mut region).unwrap(), None);
        deferred.schedule(
            TestFence {
                done: &done,
                waited: &waited,
            },
            16 << 10,
        );
        assert_eq!(deferred.poll(&mut region).unwrap(), None);
        assert_eq!(region.len(), 64 << 10, "not before the fence");
        done.set(true);
        assert_eq!(deferred.poll(&mut region).unwrap(), Some(48 << 10));
        assert_eq!(region.len(), 16 << 10);
        assert_eq!(deferred.pending_target(), None);
    }

    #[test]
    fn flush_waits_and_cancel_forgets() {
        let fake = FakeBackend::new(FakeConfig {
            granularity: 4096,
            ..FakeConfig::default()
        })
        .unwrap();
        let mut region = fake
            .acquire_growable(1 << 20, 64 << 10, Tag::KvCache)
            .unwrap();
        let (done, waited) = (Cell::new(false), Cell::new(0));
        let mut deferred = DeferredDecommit::new();
        deferred.schedule(
            TestFence {
                done: &done,
                waited: &waited,
            },
            0,
        );
        deferred.cancel();
        assert_eq!(deferred.flush(&mut region).unwrap(), None);
        assert_eq!(region.len(), 64 << 10);
        deferred.schedule(
            TestFence {
                done: &done,
                waited: &waited,
            },
            0,
        );
        assert_eq!(deferred.flush(&mut region).unwrap(), Some(64 << 10));
        assert_eq!(waited.get(), 1);
    }

    #[test]
    fn a_failed_decommit_stays_pending() {
        let fake = FakeBackend::new(FakeConfig {
            granularity: 4096,
            ..FakeConfig::default()
        })
        .unwrap();
        let mut region = fake
            .acquire_growable(1 << 20, 64 << 10, Tag::KvCache)
            .unwrap();
        let (done, waited) = (Cell::new(true), Cell::new(0));
        let mut deferred = DeferredDecommit::new();
        deferred.schedule(
            TestFence {
                done: &done,
                waited: &waited,
            },
            0,
        );
        fake.fail_decommits(1);
        assert!(deferred.poll(&mut region).is_err());
        assert_eq!(deferred.pending_target(), Some(0));
        assert_eq!(deferred.poll(&mut region).unwrap(), Some(64 << 10));
    }
}

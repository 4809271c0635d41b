//! The stream-order contract of the activation pool.
//!
//! A block carries the stream it was freed on. Work queued on that stream
//! before the free may still be reading or writing the block, so:
//!
//! * reusing it on the *same* stream needs nothing: the stream runs in order,
//!   so the new owner's work queues behind the old owner's;
//! * reusing it on *another* stream first orders the new stream after the old
//!   one, through [`StreamOrder::order_after`]. On CUDA that is an event
//!   recorded on the producer at that moment and a wait for it on the waiter.
//!   Recording at reuse time (rather than at the free) is conservative and
//!   correct: everything the old owner queued came before the free, which
//!   came before the record.
//!
//! The pool calls `order_after` only while no other caller can observe the
//! block on the waiter's stream, and treats a failure as "not reusable": the
//! block stays the producer's.
//!
//! [`NoStreams`] is for callers with one stream (or none: host memory);
//! [`FakeStreamOrder`] records every call so tests can check the rule.

use std::sync::{Arc, Mutex};

use crate::error::MemError;

// The trait is what a source gives its pools (`MemorySource::stream_order`),
// so it sits on the floor with it; its old path stays.
pub use crate::source::{NoStreams, StreamOrder};

/// A recording [`StreamOrder`] for tests: every call is kept, in order, and
/// the next `n` calls can be told to fail.
#[derive(Debug, Clone, Default)]
pub struct FakeStreamOrder {
    state: Arc<Mutex<FakeOrderState>>,
}

#[derive(Debug, Default)]
struct FakeOrderState {
    calls: Vec<(u64, u64)>,
    fail_next: u32,
    waits: Vec<u64>,
    fail_waits: u32,
}

impl FakeStreamOrder {
    /// A recorder with no calls yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FakeOrderState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every successful `(waiter, producer)` call so far, oldest first.
    pub fn calls(&self) -> Vec<(u64, u64)> {
        self.state().calls.clone()
    }

    /// How many successful calls were made.
    pub fn len(&self) -> usize {
        self.state().calls.len()
    }

    /// True when no call succeeded yet.
    pub fn is_empty(&self) -> bool {
        self.state().calls.is_empty()
    }

    /// Makes the next `n` calls fail with a driver error.
    pub fn fail_next(&self, n: u32) {
        self.state().fail_next = n;
    }

    /// Every successful [`StreamOrder::wait`]'s stream so far, oldest first.
    pub fn waits(&self) -> Vec<u64> {
        self.state().waits.clone()
    }

    /// Makes the next `n` waits fail with a driver error.
    pub fn fail_waits(&self, n: u32) {
        self.state().fail_waits = n;
    }
}

impl StreamOrder for FakeStreamOrder {
    fn order_after(&self, waiter: u64, producer: u64) -> Result<(), MemError> {
        let mut state = self.state();
        if state.fail_next > 0 {
            state.fail_next -= 1;
            return Err(MemError::Driver(
                "order_after failed on command (FakeStreamOrder)".into(),
            ));
        }
        state.calls.push((waiter, producer));
        Ok(())
    }

    fn wait(&self, stream: u64) -> Result<(), MemError> {
        let mut state = self.state();
        if state.fail_waits > 0 {
            state.fail_waits -= 1;
            return Err(MemError::Driver(
                "wait failed on command (FakeStreamOrder)".into(),
            ));
        }
        state.waits.push(stream);
        Ok(())
    }
}

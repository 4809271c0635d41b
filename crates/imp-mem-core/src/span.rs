//! L3 — spans: non-owning views of tier memory (seed A3.4, D5).
//!
//! * [`DeviceSpan`] may point at anything: an address, a length and where the
//!   memory lives. Anyone can make one (unsafely, from raw parts).
//! * [`StableSpan`] additionally promises that its address stays valid and
//!   unmoved for as long as the span exists. Only the tier allocators can make
//!   that promise, so only they can mint one: the constructor takes a
//!   [`MintKey`], a passkey that only this crate can construct (D5: one
//!   greppable grant instead of a friend list).
//!
//! A `StableSpan` widens to a `DeviceSpan` (`From`); there is deliberately no
//! conversion back, no public constructor from an address, and no
//! `as_stable()` escape hatch. Both carry a lifetime: a span borrowed from an
//! arena cannot outlive the arena or survive its `reset(&mut self)`, and a
//! widened span keeps the borrow.
//!
//! Spans never dereference the memory (it is usually device memory); they
//! are what kernel launches, DLPack exports and tests read addresses from.

use std::marker::PhantomData;

use crate::error::MemError;

// Where memory lives is the source's kind; its old path stays.
pub use crate::source::Placement;

/// The passkey that lets a tier allocator mint a [`StableSpan`]. Only this
/// crate can construct one; granting another type the right to promise
/// stability is a call to [`MintKey::new`] inside the crate.
#[derive(Debug, Clone, Copy)]
pub struct MintKey {
    _private: (),
}

impl MintKey {
    /// The key. Crate-private on purpose.
    pub(crate) const fn new() -> Self {
        Self { _private: () }
    }
}

/// A non-owning view of memory whose address is stable for `'a`. Minted only
/// by the tier allocators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StableSpan<'a> {
    addr: usize,
    len: usize,
    placement: Placement,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> StableSpan<'a> {
    /// Mints a span. Only a holder of a [`MintKey`] (a tier allocator) can
    /// call this; it promises that `[addr, addr + len)` stays valid and
    /// unmoved for `'a`.
    pub fn new(_key: MintKey, addr: usize, len: usize, placement: Placement) -> Self {
        Self {
            addr,
            len,
            placement,
            _borrow: PhantomData,
        }
    }

    /// Widens to a [`DeviceSpan`] with the same borrow.
    pub fn as_device(&self) -> DeviceSpan<'a> {
        DeviceSpan {
            addr: self.addr,
            len: self.len,
            placement: self.placement,
            _borrow: PhantomData,
        }
    }
}

impl<'a> From<StableSpan<'a>> for DeviceSpan<'a> {
    fn from(span: StableSpan<'a>) -> Self {
        span.as_device()
    }
}

/// A non-owning view of memory that promises nothing about stability: what a
/// relocatable buffer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceSpan<'a> {
    addr: usize,
    len: usize,
    placement: Placement,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> DeviceSpan<'a> {
    /// A span over raw parts.
    ///
    /// # Safety
    /// `[addr, addr + len)` is memory of `placement` that stays allocated for
    /// `'a` (whoever consumes the span may hand it to a kernel).
    pub unsafe fn from_raw_parts(addr: usize, len: usize, placement: Placement) -> Self {
        Self {
            addr,
            len,
            placement,
            _borrow: PhantomData,
        }
    }
}

/// What both kinds of span answer in the same way: their parts, and a
/// sub-range of the same kind (as stable as the span it comes from).
macro_rules! span_parts {
    ($span:ident) => {
        impl<'a> $span<'a> {
            /// The first address.
            pub fn addr(&self) -> usize {
                self.addr
            }

            /// Bytes in the span.
            pub fn len(&self) -> usize {
                self.len
            }

            /// True for a zero-length span.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// Where the memory lives.
            pub fn placement(&self) -> Placement {
                self.placement
            }

            /// A sub-range of `nbytes` at `offset`, of the same kind as this
            /// span; non-empty and inside it ([`subrange`]).
            pub fn subspan(&self, offset: usize, nbytes: usize) -> Result<$span<'a>, MemError> {
                let range = subrange(self.len, offset, Some(nbytes))?;
                Ok(Self {
                    addr: self.addr + range.start,
                    len: range.len(),
                    placement: self.placement,
                    _borrow: PhantomData,
                })
            }
        }
    };
}

span_parts!(StableSpan);
span_parts!(DeviceSpan);

/// The one rule for a sub-range of a span of `total` bytes, which the
/// core's [`StableSpan::subspan`] / [`DeviceSpan::subspan`] and the
/// binding's `subspan(offset, nbytes=None)` share: `nbytes` bytes at
/// `offset` (`None`: the rest of the span from `offset`), not empty — an
/// empty view has no address that means anything — and inside the span.
/// Returns the range, relative to the span's start.
pub fn subrange(
    total: usize,
    offset: usize,
    nbytes: Option<usize>,
) -> Result<std::ops::Range<usize>, MemError> {
    let nbytes = nbytes.unwrap_or(total.saturating_sub(offset));
    match offset.checked_add(nbytes) {
        Some(end) if end <= total && nbytes > 0 => Ok(offset..end),
        _ => Err(MemError::invalid(format!(
            "subspan [{offset}, {offset} + {nbytes}) is outside a span of {total} B or empty; \
             keep 0 < nbytes and offset + nbytes <= {total}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_widens_and_subspans_stay_inside() {
        let s = StableSpan::new(MintKey::new(), 0x1000, 256, Placement::HOST);
        let d: DeviceSpan<'_> = s.into();
        assert_eq!((d.addr(), d.len()), (0x1000, 256));
        let sub = s.subspan(16, 32).unwrap();
        assert_eq!((sub.addr(), sub.len()), (0x1010, 32));
        assert!(s.subspan(250, 7).is_err());
        assert!(s.subspan(usize::MAX, 2).is_err());
        assert!(s.subspan(16, 0).is_err(), "an empty subspan is refused");
        assert_eq!(d.subspan(255, 1).unwrap().addr(), 0x10ff);
        assert_eq!(s.placement().dlpack_device(), (1, 0));
    }

    #[test]
    fn a_subrange_is_non_empty_and_inside_and_the_rest_by_default() {
        assert_eq!(subrange(64, 16, Some(8)).unwrap(), 16..24);
        assert_eq!(
            subrange(64, 16, None).unwrap(),
            16..64,
            "the rest of the span"
        );
        assert_eq!(subrange(64, 0, Some(64)).unwrap(), 0..64);
        for (offset, nbytes) in [
            (60, Some(8)),
            (16, Some(0)),
            (64, None),
            (65, None),
            (usize::MAX, Some(1)),
            (1, Some(usize::MAX)),
        ] {
            let err = subrange(64, offset, nbytes).unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(err, MemError::InvalidArgument(_))
                    && msg.contains("0 < nbytes and offset + nbytes <= 64"),
                "{offset} {nbytes:?}: {msg}"
            );
        }
        let msg = subrange(64, 60, Some(8)).unwrap_err().to_string();
        assert!(msg.contains("[60, 60 + 8)"), "{msg}");
    }
}

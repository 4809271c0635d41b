//! The KV manager's refs: [`BlockToken`]s, minted and released in batches
//! by a [`SharedBlockPool`] without touching its `Arc`.

use crate::error::MemError;
use crate::span::StableSpan;

use super::shared::{SharedBlockPool, SharedBlockRef, RELEASED};
use super::BlockId;

/// One reference to a live block of a [`SharedBlockPool`] that does not hold
/// the pool: the KV manager's ref (seed A5.1's `BlockRef`, minus the `Arc`).
///
/// A [`SharedBlockRef`] pays an atomic increment and decrement of its pool's
/// `Arc` per ref, which was half of a KV request's cost (K16). The manager
/// owns its pools' handles for as long as it holds any token, so its tokens
/// need not keep the pool alive. What a token keeps from a ref is the
/// discipline: it is move-only (no `Clone`), minted only by the pool, and
/// consumed only by
/// [`SharedBlockPool::release_tokens`], which decrements exactly once per
/// token. What it gives up is release-on-drop: dropping a token would leak
/// its ref, so in debug builds (every Rust test) a token dropped without
/// being released panics, and the manager's `check_invariants` counts the
/// pool's refs against the tokens it holds in every build.
#[derive(Debug)]
#[must_use = "a BlockToken must be released into its pool, or its block leaks"]
pub(crate) struct BlockToken {
    id: BlockId,
    /// The low bits of the minting pool's id, checked on release.
    pool: u32,
}

impl BlockToken {
    /// The block's id.
    pub(crate) fn id(&self) -> BlockId {
        self.id
    }

    /// The low bits of the minting pool's id.
    pub(crate) fn pool_tag(&self) -> u32 {
        self.pool
    }

    /// Consumes the token without touching the pool (its ref was released
    /// or handed over by the caller).
    fn consume(self) {
        std::mem::forget(self);
    }
}

impl Drop for BlockToken {
    fn drop(&mut self) {
        // Only reached for a token nobody released: a leaked ref.
        if cfg!(debug_assertions) && !std::thread::panicking() {
            panic!(
                "a BlockToken of block {} (pool tag {}) was dropped without being released",
                self.id, self.pool
            );
        }
    }
}

impl SharedBlockPool {
    /// The low bits of the id, which this pool's tokens carry.
    pub(crate) fn tag(&self) -> u32 {
        self.inner.id as u32
    }

    fn token(&self, id: BlockId) -> BlockToken {
        BlockToken {
            id,
            pool: self.tag(),
        }
    }

    fn check_tag(&self, token: &BlockToken) -> Result<(), MemError> {
        if token.pool != self.tag() {
            return Err(MemError::Invariant(format!(
                "a block token of pool tag {} was handed to pool #{}",
                token.pool,
                self.id()
            )));
        }
        Ok(())
    }

    /// `n` blocks, one token each, handed to `push` in allocation order, or
    /// none (the pool is unchanged on failure). One lock.
    pub(crate) fn allocate_tokens(
        &self,
        n: u32,
        mut push: impl FnMut(BlockToken),
    ) -> Result<(), MemError> {
        self.core().allocate_many(n, |id| push(self.token(id)))
    }

    /// Releases every token, exactly once each, under one lock. A token of
    /// another pool is consumed without a release and reported (its ref
    /// leaks: the manager never mixes its pools, so this is a bug report).
    pub(crate) fn release_tokens(
        &self,
        tokens: impl IntoIterator<Item = BlockToken>,
    ) -> Result<(), MemError> {
        let mut tokens = tokens.into_iter().peekable();
        if tokens.peek().is_none() {
            return Ok(());
        }
        let mut core = self.core();
        let mut first_err = None;
        for t in tokens {
            let outcome = self.check_tag(&t).and_then(|()| core.release(t.id));
            t.consume();
            if let Err(e) = outcome {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Turns a ref of this pool into a token, keeping its count.
    pub(crate) fn token_from_ref(&self, mut block: SharedBlockRef) -> Result<BlockToken, MemError> {
        self.check_owner(&block)?;
        let id = block.id;
        // Handed over: its drop only lets go of the pool.
        block.id = RELEASED;
        Ok(self.token(id))
    }

    /// A ref (with its own count) to the block of `token`, for code that
    /// takes refs ([`BlockIo`](crate::kv::BlockIo)); off the hot paths.
    pub(crate) fn ref_of_token(&self, token: &BlockToken) -> Result<SharedBlockRef, MemError> {
        self.check_tag(token)?;
        self.core().share(token.id)?;
        Ok(SharedBlockRef {
            pool: self.clone(),
            id: token.id,
        })
    }

    /// The bytes of the block of `token`.
    pub(crate) fn token_span(&self, token: &BlockToken) -> Result<StableSpan<'_>, MemError> {
        self.check_tag(token)?;
        self.span_of(token.id)
    }
}

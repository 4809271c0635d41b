//! Chained, content-addressed block hashes.
//!
//! A full block's hash is `H(parent ‖ extras of this block ‖ tokens)`, where
//! `parent` is the previous block's hash and, for block 0, a root hash of the
//! sequence-wide extra keys (LoRA id, cache salt). Chaining makes a hash name
//! the whole prefix up to and including its block, so two requests share a
//! cached block only when every token before it (and every extra key) agrees.
//! Multimodal items are mixed into the blocks whose token range they overlap,
//! with their position relative to the block: the placeholder tokens of two
//! different images are equal, their content hashes are not.
//!
//! `H` is XXH3-128 with a 64-bit seed ([`HASH_ALGORITHM`]). Why: the chain is
//! computed for every block of every request, so speed matters (about 6 ns
//! for a 16-token block against ~1.4 µs for vLLM's SHA-256 over pickle), and
//! 128 bits make an accidental collision negligible (a birthday bound of
//! ~2^-64 after 2^32 distinct blocks). XXH3 is not a cryptographic hash: a
//! deployment whose tenants do not trust each other must give each tenant its
//! own `cache_salt` (blocks of different salts can never share), which is
//! what isolates them, not the hash. The seed is part of the persisted file's
//! identity, so a cache saved under one seed is refused under another.
//!
//! Blocks of 8 to 55 tokens without multimodal items are hashed by
//! `xxh3_block.rs`, which computes the same XXH3-128 value from the parent
//! and the token slice without laying out the bytes: 5.8–5.9 ns per 16-token
//! block against 11.6–11.7 ns through the library on a stack buffer
//! (`--example kv_churn`, back to back). Every other block goes through
//! `xxh3_128_with_seed`.

use xxhash_rust::xxh3::xxh3_128_with_seed;

use super::xxh3_block::{self, SeededSecret};
use crate::error::MemError;

/// A block's chained hash.
pub type BlockHash = u128;

/// The name recorded in persisted files.
pub const HASH_ALGORITHM: &str = "xxh3-128";

/// The default seed (the bytes of "imp-mem"); persisted caches only match a
/// manager with the same seed.
pub const DEFAULT_HASH_SEED: u64 = 0x696d_702d_6d65_6d00;

/// A multimodal item inside the token sequence: the tokens `[start, end)` are
/// its placeholders and `hash` names its content (e.g. the image's hash).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MmSpan {
    /// First placeholder token.
    pub start: usize,
    /// One past the last placeholder token.
    pub end: usize,
    /// The content hash of the item.
    pub hash: u128,
}

impl MmSpan {
    /// The item over tokens `[start, end)`; an empty span is refused.
    pub fn new(start: usize, end: usize, hash: u128) -> Result<Self, MemError> {
        if start >= end {
            return Err(MemError::invalid(format!(
                "mm span [{start}, {end}) is empty"
            )));
        }
        Ok(Self { start, end, hash })
    }
}

/// Keys beyond the tokens that decide whether two blocks hold the same KV.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ExtraKeys {
    /// The LoRA adapter the KV was computed with.
    pub lora_id: Option<u64>,
    /// A salt that isolates tenants: blocks of different salts never match.
    pub cache_salt: Option<Vec<u8>>,
    /// Multimodal items, sorted by `start`.
    pub mm: Vec<MmSpan>,
}

impl ExtraKeys {
    /// The keys of a request whose multimodal items come in any order:
    /// sorted here by `start` (stably: items that start together keep
    /// their order).
    pub fn new(lora_id: Option<u64>, cache_salt: Option<Vec<u8>>, mut mm: Vec<MmSpan>) -> Self {
        mm.sort_by_key(|s| s.start);
        Self {
            lora_id,
            cache_salt,
            mm,
        }
    }

    /// True when there are no extra keys.
    pub fn is_empty(&self) -> bool {
        self.lora_id.is_none() && self.cache_salt.is_none() && self.mm.is_empty()
    }
}

/// Blocks of up to this many tokens that [`xxh3_block`] does not cover are
/// hashed from a stack buffer.
const INLINE_TOKENS: usize = 64;

/// Computes chained block hashes for one block size and seed.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
    /// The root of a sequence without LoRA id or salt, computed once.
    plain_root: BlockHash,
    /// The seed folded into XXH3's secret, for [`xxh3_block`].
    secret: SeededSecret,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens.
    pub fn new(block_size: usize, seed: u64) -> Self {
        let mut hasher = Self {
            block_size,
            seed,
            plain_root: 0,
            secret: SeededSecret::new(seed),
        };
        hasher.plain_root = hasher.hash_root(None, None);
        hasher
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The parent of block 0: a hash of the sequence-wide extra keys.
    pub fn root(&self, extras: &ExtraKeys) -> BlockHash {
        match (extras.lora_id, &extras.cache_salt) {
            (None, None) => self.plain_root,
            (lora_id, salt) => self.hash_root(lora_id, salt.as_deref()),
        }
    }

    fn hash_root(&self, lora_id: Option<u64>, cache_salt: Option<&[u8]>) -> BlockHash {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(b"imp-mem/kv/root/v1\0");
        match lora_id {
            Some(id) => {
                buf.push(1);
                buf.extend_from_slice(&id.to_le_bytes());
            }
            None => buf.push(0),
        }
        match cache_salt {
            Some(salt) => {
                buf.push(1);
                buf.extend_from_slice(&(salt.len() as u64).to_le_bytes());
                buf.extend_from_slice(salt);
            }
            None => buf.push(0),
        }
        xxh3_128_with_seed(&buf, self.seed)
    }

    /// Appends to `out` the hashes of the full blocks of `tokens`, the first
    /// of which is block `first_block` of its sequence and has parent
    /// `parent`. A trailing partial block is not hashed.
    pub fn extend_chain(
        &self,
        mut parent: BlockHash,
        tokens: &[u32],
        first_block: usize,
        extras: &ExtraKeys,
        out: &mut Vec<BlockHash>,
    ) {
        let bs = self.block_size;
        if bs == 0 {
            return;
        }
        let full = tokens.len() / bs;
        out.reserve(full);
        if extras.mm.is_empty() && xxh3_block::COVERED.contains(&bs) {
            // The common case, the same bytes hashed without laying them out.
            xxh3_block::extend_chain(&self.secret, parent, tokens, bs, out);
            return;
        }
        if extras.mm.is_empty() && bs <= INLINE_TOKENS {
            // Other small blocks, on a stack buffer: `parent ‖ 0u32 ‖ tokens`,
            // the bytes `mix_mm` lays out when no item touches the block.
            let mut buf = [0u8; 20 + 4 * INLINE_TOKENS];
            let len = 20 + 4 * bs;
            for block in tokens.chunks_exact(bs) {
                buf[..16].copy_from_slice(&parent.to_le_bytes());
                for (dst, t) in buf[20..len].chunks_exact_mut(4).zip(block) {
                    dst.copy_from_slice(&t.to_le_bytes());
                }
                parent = xxh3_128_with_seed(&buf[..len], self.seed);
                out.push(parent);
            }
            return;
        }
        let mut buf = Vec::with_capacity(16 + 4 + 4 * bs + 40 * extras.mm.len().min(4));
        for (k, block) in tokens.chunks_exact(bs).enumerate() {
            let start = (first_block + k) * bs;
            buf.clear();
            buf.extend_from_slice(&parent.to_le_bytes());
            self.mix_mm(start, extras, &mut buf);
            let at = buf.len();
            buf.resize(at + 4 * bs, 0);
            for (dst, t) in buf[at..].chunks_exact_mut(4).zip(block) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            parent = xxh3_128_with_seed(&buf, self.seed);
            out.push(parent);
        }
    }

    /// The hashes of every full block of a sequence's `tokens`.
    pub fn chain(&self, tokens: &[u32], extras: &ExtraKeys) -> Vec<BlockHash> {
        let mut out = Vec::new();
        self.extend_chain(self.root(extras), tokens, 0, extras, &mut out);
        out
    }

    /// Multimodal items overlapping the block at token `start`, with their
    /// offsets relative to it; a count first, so the layout is unambiguous.
    fn mix_mm(&self, start: usize, extras: &ExtraKeys, buf: &mut Vec<u8>) {
        let end = start + self.block_size;
        let count_at = buf.len();
        buf.extend_from_slice(&0u32.to_le_bytes());
        if extras.mm.is_empty() {
            return;
        }
        let mut count = 0u32;
        for item in &extras.mm {
            if item.start < end && item.end > start {
                count += 1;
                buf.extend_from_slice(&(item.start as i64 - start as i64).to_le_bytes());
                buf.extend_from_slice(&(item.end as i64 - start as i64).to_le_bytes());
                buf.extend_from_slice(&item.hash.to_le_bytes());
            }
        }
        buf[count_at..count_at + 4].copy_from_slice(&count.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The chain as defined: the library over `parent ‖ 0u32 ‖ tokens`.
    fn reference_chain(bs: usize, seed: u64, mut parent: u128, tokens: &[u32]) -> Vec<u128> {
        let mut out = vec![];
        for block in tokens.chunks_exact(bs) {
            let mut bytes = parent.to_le_bytes().to_vec();
            bytes.extend_from_slice(&0u32.to_le_bytes());
            bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
            parent = xxh3_128_with_seed(&bytes, seed);
            out.push(parent);
        }
        out
    }

    #[test]
    fn an_empty_mm_span_is_refused() {
        for (start, end) in [(5, 5), (6, 5), (0, 0)] {
            let e = MmSpan::new(start, end, 1).unwrap_err();
            assert!(matches!(e, MemError::InvalidArgument(_)));
            assert_eq!(e.to_string(), format!("mm span [{start}, {end}) is empty"));
        }
        assert_eq!(
            MmSpan::new(3, 4, 9).unwrap(),
            MmSpan {
                start: 3,
                end: 4,
                hash: 9
            }
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// The items come out sorted by start, every one kept, those that
        /// start together in their given order; and the chain does not
        /// depend on the order they were given in (distinct starts).
        #[test]
        fn mm_spans_are_sorted_stably(
            items in proptest::collection::vec((0usize..40, 1usize..8, 0u128..4), 0..8),
            rotate in 0usize..8,
        ) {
            let spans: Vec<MmSpan> = items
                .iter()
                .map(|&(start, len, hash)| MmSpan::new(start, start + len, hash).unwrap())
                .collect();
            let keys = ExtraKeys::new(Some(7), None, spans.clone());
            prop_assert_eq!(keys.lora_id, Some(7));
            prop_assert!(keys.mm.windows(2).all(|w| w[0].start <= w[1].start));
            // A stable sort by hand: each item inserted after the last
            // one that starts no later.
            let mut expected: Vec<MmSpan> = Vec::new();
            for s in &spans {
                let at = expected.iter().rposition(|e: &MmSpan| e.start <= s.start);
                expected.insert(at.map_or(0, |i| i + 1), *s);
            }
            prop_assert_eq!(&keys.mm, &expected);

            let mut distinct = spans.clone();
            distinct.sort_by_key(|s| s.start);
            distinct.dedup_by_key(|s| s.start);
            let mut turned = distinct.clone();
            if !turned.is_empty() {
                let k = rotate % turned.len();
                turned.rotate_left(k);
            }
            let h = BlockHasher::new(4, 1);
            let tokens: Vec<u32> = (0..48).collect();
            prop_assert_eq!(
                h.chain(&tokens, &ExtraKeys::new(None, None, distinct)),
                h.chain(&tokens, &ExtraKeys::new(None, None, turned))
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Every block size's fast path (specialised XXH3 or stack buffer)
        /// hashes exactly the bytes the library would.
        #[test]
        fn the_fast_path_equals_the_library(
            bs in 1usize..=64,
            blocks in 1usize..=12,
            tail in 0usize..64,
            seed in any::<u64>(),
            parent in any::<u128>(),
            words in proptest::collection::vec(any::<u32>(), 64 * 12 + 64),
        ) {
            let tokens = &words[..blocks * bs + tail % bs];
            let h = BlockHasher::new(bs, seed);
            let mut got = vec![];
            h.extend_chain(parent, tokens, 0, &ExtraKeys::default(), &mut got);
            prop_assert_eq!(got, reference_chain(bs, seed, parent, tokens));
        }
    }

    /// Prompts longer than one prefetch window (256 ids) are hashed window
    /// by window: the chain runs on across them unchanged.
    #[test]
    fn long_prompts_hash_across_prefetch_windows() {
        let words: Vec<u32> = (0..5000u32)
            .map(|t| t.wrapping_mul(2_654_435_761))
            .collect();
        for bs in [8, 16, 27, 28, 41, 55] {
            for len in [255, 256, 257, 1024 + bs, 5000] {
                let h = BlockHasher::new(bs, 11);
                let mut got = vec![];
                h.extend_chain(5, &words[..len], 0, &ExtraKeys::default(), &mut got);
                assert_eq!(
                    got,
                    reference_chain(bs, 11, 5, &words[..len]),
                    "block size {bs}, {len} ids"
                );
            }
        }
    }

    #[test]
    fn known_answers_of_the_specialised_path() {
        // Computed by the library (xxhash-rust 0.8.21) before the
        // specialised path existed: 16 and 27 tokens take XXH3's 17–128
        // path, 32 and 55 its 129–240 path.
        let want = [
            (
                16,
                [
                    0x166e83063b096b84681b0b379bd3ca6f_u128,
                    0x23a63120039887210477fe488a74ac69,
                ],
            ),
            (
                27,
                [
                    0x1a2e9ac2fa946b8ec99c05b244574ebd,
                    0x80e210378186239f8bf009c9465a5303,
                ],
            ),
            (
                32,
                [
                    0xd5c5ad72d6c7339ee9af29434a22b7cf,
                    0xef02015254fd1e774c53f8d761a243bf,
                ],
            ),
            (
                55,
                [
                    0xb30a86e82d607599a992c05303fe670f,
                    0xa71602265aa0f6528bf19dfdf1edeb19,
                ],
            ),
        ];
        for (bs, want) in want {
            let h = BlockHasher::new(bs, DEFAULT_HASH_SEED);
            let toks: Vec<u32> = (0..2 * bs as u32)
                .map(|t| t.wrapping_mul(2_654_435_761))
                .collect();
            assert_eq!(
                h.chain(&toks, &ExtraKeys::default()),
                want,
                "block size {bs}"
            );
        }
    }

    #[test]
    fn the_chain_names_the_whole_prefix() {
        let h = BlockHasher::new(4, 7);
        let none = ExtraKeys::default();
        let a = h.chain(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &none);
        assert_eq!(a.len(), 2, "the partial block is not hashed");
        let b = h.chain(&[1, 2, 3, 4, 5, 6, 7, 8], &none);
        assert_eq!(a, b);
        // Same second block, different first block: the second hash differs.
        let c = h.chain(&[0, 2, 3, 4, 5, 6, 7, 8], &none);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
        // Extending a chain equals hashing it whole.
        let mut d = vec![];
        h.extend_chain(h.root(&none), &[1, 2, 3, 4], 0, &none, &mut d);
        h.extend_chain(d[0], &[5, 6, 7, 8], 1, &none, &mut d);
        assert_eq!(d, a);
    }

    #[test]
    fn the_bytes_hashed_do_not_change() {
        // Persisted caches are keyed by these values: a faster path must
        // hash the same bytes. (Values from the layout as first shipped.)
        let h = BlockHasher::new(4, DEFAULT_HASH_SEED);
        let toks: Vec<u32> = (1..=12).collect();
        let want = [
            0x5edf9a5b7a32d0aab0221f467eb038ad_u128,
            0x64ed11be5e5627ff391f604d3fe2b3ef,
            0x613dc7f64a6b74ddfb864fe2d60ccd93,
        ];
        assert_eq!(h.chain(&toks, &ExtraKeys::default()), want);
        // An image that touches no block takes the general path and mixes
        // in a count of 0: the same bytes, the same hashes.
        let far = ExtraKeys {
            mm: vec![MmSpan {
                start: 1_000_000,
                end: 1_000_004,
                hash: 9,
            }],
            ..ExtraKeys::default()
        };
        assert_eq!(h.chain(&toks, &far), want);
        // Every block size the stack buffer covers, and one past it.
        for bs in [1, 2, 16, 63, 64, 65, 100] {
            let h = BlockHasher::new(bs, 3);
            let toks: Vec<u32> = (0..(3 * bs as u32 + 1))
                .map(|t| t.wrapping_mul(2_654_435_761))
                .collect();
            assert_eq!(
                h.chain(&toks, &ExtraKeys::default()),
                h.chain(&toks, &far),
                "block size {bs}"
            );
        }
    }

    #[test]
    fn extra_keys_and_seed_separate_chains() {
        let h = BlockHasher::new(2, 1);
        let toks = [5, 6, 7, 8];
        let base = h.chain(&toks, &ExtraKeys::default());
        let lora = h.chain(
            &toks,
            &ExtraKeys {
                lora_id: Some(3),
                ..Default::default()
            },
        );
        let salt = h.chain(
            &toks,
            &ExtraKeys {
                cache_salt: Some(b"tenant-a".to_vec()),
                ..Default::default()
            },
        );
        let seed = BlockHasher::new(2, 2).chain(&toks, &ExtraKeys::default());
        for other in [&lora, &salt, &seed] {
            assert_ne!(base[0], other[0]);
            assert_ne!(base[1], other[1]);
        }
    }

    #[test]
    fn a_multimodal_item_changes_only_the_blocks_it_touches_and_after() {
        let h = BlockHasher::new(2, 1);
        let toks = [9, 9, 9, 9, 9, 9];
        let img = |hash| ExtraKeys {
            mm: vec![MmSpan {
                start: 2,
                end: 4,
                hash,
            }],
            ..Default::default()
        };
        let a = h.chain(&toks, &img(1));
        let b = h.chain(&toks, &img(2));
        assert_eq!(a[0], b[0], "block 0 is before the image");
        assert_ne!(a[1], b[1]);
        assert_ne!(a[2], b[2], "the chain carries the difference on");
    }
}

//! XXH3-128 of one chained block, computed without laying out its bytes.
//!
//! A block without multimodal items hashes the bytes
//! `parent (16, LE) ‖ 0u32 ‖ tokens (u32 LE each)` with the library's
//! `xxh3_128_with_seed`. For 8 to 55 tokens (28 to 240 bytes) this module
//! computes the same value straight from the parent and the `&[u32]` slice:
//! XXH3 reads its input as 16-byte lanes at byte offsets that are all
//! multiples of 4 here, so every lane is either the parent, the lane at byte
//! 16 (`0u32`, then tokens 0..3), or four whole tokens. Block sizes below 8
//! have trailing lanes that overlap the parent, and above 55 XXH3 takes its
//! long-input path; those go through the library.
//!
//! Why: the chain is latency-bound (block *i + 1* needs block *i*'s hash).
//! Through a buffer the parent is stored and reloaded every block; here it
//! stays in registers, the token-only mixes (most of the work) do not
//! depend on it and run ahead, and the seeded secret is computed once per
//! hasher. The algorithm is XXH3's (spec v0.8 `XXH3_len_17to128_128b` and
//! `XXH3_len_129to240_128b`, default secret, 64-bit seed), so the values are
//! bit-identical; a proptest against the library covers every block size.

/// The first 136 bytes of XXH3's default secret (`kSecret`): all an input of
/// at most 240 bytes reads.
const SECRET: [u8; 136] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3,
];

const PRIME64_1: u64 = 0x9e37_79b1_85eb_ca87;
const PRIME64_2: u64 = 0xc2b2_ae3d_27d4_eb4f;
const PRIME64_4: u64 = 0x85eb_ca77_c2b2_ae63;

/// Block sizes (tokens) this module hashes.
pub(super) const COVERED: std::ops::RangeInclusive<usize> = 8..=55;

/// Up to this many tokens (128 bytes) XXH3 uses its 17–128-byte path.
const SHORT_MAX: usize = 27;

/// The 16-byte secret pieces with the seed folded in, as XXH3's `mix16B`
/// uses them: `(secret_lo + seed, secret_hi - seed)`.
#[derive(Debug, Clone)]
pub(super) struct SeededSecret {
    seed: u64,
    /// Byte offsets 0, 16, …, 112: the 17–128 path and the first four
    /// rounds of the 129–240 path.
    head: [(u64, u64); 8],
    /// Byte offsets 3, 19, …, 83: rounds 4 to 6 of the 129–240 path.
    tail: [(u64, u64); 6],
    /// Byte offsets 103 and 119, with the seed negated: the 129–240 path's
    /// last mix.
    last: [(u64, u64); 2],
}

const fn secret_u64(at: usize) -> u64 {
    let b = &SECRET;
    u64::from_le_bytes([
        b[at],
        b[at + 1],
        b[at + 2],
        b[at + 3],
        b[at + 4],
        b[at + 5],
        b[at + 6],
        b[at + 7],
    ])
}

fn seeded(at: usize, seed: u64) -> (u64, u64) {
    (
        secret_u64(at).wrapping_add(seed),
        secret_u64(at + 8).wrapping_sub(seed),
    )
}

impl SeededSecret {
    pub(super) fn new(seed: u64) -> Self {
        Self {
            seed,
            head: std::array::from_fn(|i| seeded(16 * i, seed)),
            tail: std::array::from_fn(|i| seeded(3 + 16 * i, seed)),
            last: std::array::from_fn(|i| seeded(103 + 16 * i, seed.wrapping_neg())),
        }
    }
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9e37_79f9);
    h ^ (h >> 32)
}

/// XXH3's `mix16B`: a 64×64→128 multiply of the keyed lane, folded.
#[inline(always)]
fn mix16(lane: (u64, u64), key: (u64, u64)) -> u64 {
    let p = u128::from(lane.0 ^ key.0) * u128::from(lane.1 ^ key.1);
    (p as u64) ^ ((p >> 64) as u64)
}

/// XXH3's `mix32B` on the 128-bit accumulator `acc`.
#[inline(always)]
fn mix32(acc: &mut (u64, u64), a: (u64, u64), b: (u64, u64), ka: (u64, u64), kb: (u64, u64)) {
    acc.0 = acc.0.wrapping_add(mix16(a, ka)) ^ b.0.wrapping_add(b.1);
    acc.1 = acc.1.wrapping_add(mix16(b, kb)) ^ a.0.wrapping_add(a.1);
}

/// The 16 bytes of tokens `at..at + 4`, as two little-endian u64s.
#[inline(always)]
fn lane(tokens: &[u32], at: usize) -> (u64, u64) {
    let t = &tokens[at..at + 4];
    (
        u64::from(t[0]) | u64::from(t[1]) << 32,
        u64::from(t[2]) | u64::from(t[3]) << 32,
    )
}

/// Bytes 16..32 of the input: `0u32`, then tokens 0..3.
#[inline(always)]
fn head_lane(tokens: &[u32]) -> (u64, u64) {
    let t = &tokens[..3];
    (
        u64::from(t[0]) << 32,
        u64::from(t[1]) | u64::from(t[2]) << 32,
    )
}

fn finish(acc: (u64, u64), len: u64, seed: u64) -> u128 {
    let lo = avalanche(acc.0.wrapping_add(acc.1));
    let hi = avalanche(
        acc.0
            .wrapping_mul(PRIME64_1)
            .wrapping_add(acc.1.wrapping_mul(PRIME64_4))
            .wrapping_add(len.wrapping_sub(seed).wrapping_mul(PRIME64_2)),
    )
    .wrapping_neg();
    u128::from(lo) | u128::from(hi) << 64
}

/// XXH3-128 of `parent ‖ 0u32 ‖ tokens`, 8 to 27 tokens (52–128 bytes).
#[inline(always)]
fn hash_short(key: &SeededSecret, parent: (u64, u64), t: &[u32]) -> u128 {
    let n = t.len();
    let len = 20 + 4 * n as u64;
    let mut acc = (len.wrapping_mul(PRIME64_1), 0);
    // Lanes from both ends towards the middle; byte `len - 16k` is token
    // `n - 4k`, and the parent's lane comes last.
    if n >= 20 {
        mix32(
            &mut acc,
            lane(t, 7),
            lane(t, n - 16),
            key.head[6],
            key.head[7],
        );
    }
    if n >= 12 {
        mix32(
            &mut acc,
            lane(t, 3),
            lane(t, n - 12),
            key.head[4],
            key.head[5],
        );
    }
    mix32(
        &mut acc,
        head_lane(t),
        lane(t, n - 8),
        key.head[2],
        key.head[3],
    );
    mix32(&mut acc, parent, lane(t, n - 4), key.head[0], key.head[1]);
    finish(acc, len, key.seed)
}

/// XXH3-128 of `parent ‖ 0u32 ‖ tokens`, 28 to 55 tokens (132–240 bytes).
#[inline(always)]
fn hash_mid(key: &SeededSecret, parent: (u64, u64), t: &[u32]) -> u128 {
    let n = t.len();
    let len = 20 + 4 * n;
    let mut acc = ((len as u64).wrapping_mul(PRIME64_1), 0);
    // Round r mixes bytes 32r..32r + 32; from r = 1 on, byte 32r is token
    // 8r - 5.
    mix32(&mut acc, parent, head_lane(t), key.head[0], key.head[1]);
    for r in 1..4 {
        let (a, b) = (lane(t, 8 * r - 5), lane(t, 8 * r - 1));
        mix32(&mut acc, a, b, key.head[2 * r], key.head[2 * r + 1]);
    }
    acc = (avalanche(acc.0), avalanche(acc.1));
    for r in 4..len / 32 {
        let (a, b) = (lane(t, 8 * r - 5), lane(t, 8 * r - 1));
        let k = 2 * (r - 4);
        mix32(&mut acc, a, b, key.tail[k], key.tail[k + 1]);
    }
    mix32(
        &mut acc,
        lane(t, n - 4),
        lane(t, n - 8),
        key.last[0],
        key.last[1],
    );
    finish(acc, len as u64, key.seed)
}

/// How much of the prompt is requested from memory ahead of the hash, in
/// ids (1 KiB). A prompt tokenized long before its admission is read from
/// DRAM: asking for a window's lines at once, a window ahead of the blocks
/// being hashed, keeps them arriving while the chain computes, instead of
/// each block waiting for its own line. Measured against 512, 1024 and 128
/// ids: a burst larger than the core's outstanding misses waits for lines
/// instead of overlapping with the hash, a smaller one runs dry.
const PREFETCH_IDS: usize = 256;

/// Asks for the cache lines holding `ids`. A hint only.
#[inline(always)]
fn prefetch(ids: &[u32]) {
    #[cfg(target_arch = "x86_64")]
    for at in (0..ids.len()).step_by(16) {
        // SAFETY: a prefetch is a hint that cannot fault and reads nothing
        // into the program; the address is inside `ids`.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                ids.as_ptr().wrapping_add(at).cast(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ids;
}

/// Appends the chained hashes of the full `block_size`-token blocks of
/// `tokens`, starting from `parent`. `block_size` must be in [`COVERED`].
pub(super) fn extend_chain(
    key: &SeededSecret,
    parent: u128,
    tokens: &[u32],
    block_size: usize,
    out: &mut Vec<u128>,
) {
    debug_assert!(COVERED.contains(&block_size));
    let full = &tokens[..tokens.len() / block_size * block_size];
    // Windows of whole blocks; each is requested while the one before it
    // is hashed.
    let mut windows = full
        .chunks(PREFETCH_IDS / block_size * block_size)
        .peekable();
    if let Some(first) = windows.peek() {
        prefetch(first);
    }
    let mut p = (parent as u64, (parent >> 64) as u64);
    while let Some(window) = windows.next() {
        if let Some(next) = windows.peek() {
            prefetch(next);
        }
        let blocks = window.chunks_exact(block_size);
        // One loop per path, so the choice is not made per block.
        if block_size <= SHORT_MAX {
            for t in blocks {
                let h = hash_short(key, p, t);
                out.push(h);
                p = (h as u64, (h >> 64) as u64);
            }
        } else {
            for t in blocks {
                let h = hash_mid(key, p, t);
                out.push(h);
                p = (h as u64, (h >> 64) as u64);
            }
        }
    }
}

//! One conformance suite, run against every tier allocator (RMM's
//! `mr_ref_test` is the model): each tier is wrapped in a small adapter that
//! says how to allocate, free and read back, and every check below runs
//! against every adapter.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test harness code: a failed unwrap is a failed test

use std::collections::HashMap;
use std::sync::Arc;

use imp_mem_core::{
    FakeBackend, FakeConfig, FakePinnedHost, MemError, PinnedBuffer, PinnedHost, PoolConfig,
    ScratchSpan, SharedArena, SharedBlockPool, SharedBlockRef, SharedMark, SharedScratchStack,
    Tier,
};

const CAPACITY: usize = 64 << 10;

/// What the suite knows of one allocation.
#[derive(Debug, Clone, Copy)]
struct Handle {
    key: u64,
    addr: usize,
    len: usize,
}

/// A tier allocator as the suite drives it.
trait UnderTest {
    fn name(&self) -> &'static str;
    /// The largest single request that can succeed on an empty tier.
    fn unit(&self) -> usize;
    /// Whether `free` must be called innermost-first (scratch).
    fn lifo(&self) -> bool {
        false
    }
    /// Whether `free` returns memory by itself (an arena frees only at reset).
    fn frees_individually(&self) -> bool {
        true
    }
    fn alloc(&mut self, bytes: usize, align: usize) -> Result<Handle, MemError>;
    fn free(&mut self, h: Handle);
    fn free_all(&mut self);
    fn in_use(&self) -> usize;
    fn write(&mut self, h: &Handle, data: &[u8]);
    fn read(&self, h: &Handle) -> Vec<u8>;
    /// Whether released bytes read as the fake's poison.
    fn poisoned(&self, h: &Handle) -> Option<bool>;
    /// Backend journal length: takes must not reach the backend.
    fn backend_ops(&self) -> usize;
}

struct ArenaTier {
    fb: FakeBackend,
    arena: SharedArena,
    next: u64,
}

impl UnderTest for ArenaTier {
    fn name(&self) -> &'static str {
        "arena"
    }
    fn unit(&self) -> usize {
        CAPACITY
    }
    fn frees_individually(&self) -> bool {
        false
    }
    fn alloc(&mut self, bytes: usize, align: usize) -> Result<Handle, MemError> {
        let t = self.arena.take(bytes, align)?;
        let s = self.arena.span(&t)?;
        self.next += 1;
        Ok(Handle {
            key: self.next,
            addr: s.addr(),
            len: s.len(),
        })
    }
    fn free(&mut self, _h: Handle) {}
    fn free_all(&mut self) {
        self.arena.reset();
    }
    fn in_use(&self) -> usize {
        self.arena.stats().used
    }
    fn write(&mut self, h: &Handle, data: &[u8]) {
        self.fb.write(h.addr, data).unwrap();
    }
    fn read(&self, h: &Handle) -> Vec<u8> {
        self.fb.read(h.addr, h.len).unwrap()
    }
    fn poisoned(&self, h: &Handle) -> Option<bool> {
        Some(self.fb.is_poisoned(h.addr, h.len).unwrap())
    }
    fn backend_ops(&self) -> usize {
        self.fb.journal().unwrap().len()
    }
}

struct PoolTier {
    fb: FakeBackend,
    pool: SharedBlockPool,
    refs: HashMap<u64, SharedBlockRef>,
    next: u64,
}

const BLOCK: usize = 1024;

impl UnderTest for PoolTier {
    fn name(&self) -> &'static str {
        "block_pool"
    }
    fn unit(&self) -> usize {
        BLOCK
    }
    fn alloc(&mut self, bytes: usize, align: usize) -> Result<Handle, MemError> {
        if bytes == 0 || bytes > BLOCK || !align.is_power_of_two() || align > BLOCK {
            return Err(MemError::invalid("a block pool serves one block size"));
        }
        let r = self.pool.allocate()?;
        let s = r.span()?;
        let h = Handle {
            key: self.next,
            addr: s.addr(),
            len: BLOCK,
        };
        self.refs.insert(self.next, r);
        self.next += 1;
        Ok(h)
    }
    fn free(&mut self, h: Handle) {
        self.refs.remove(&h.key);
    }
    fn free_all(&mut self) {
        self.refs.clear();
    }
    fn in_use(&self) -> usize {
        self.pool.stats().live as usize * BLOCK
    }
    fn write(&mut self, h: &Handle, data: &[u8]) {
        self.fb.write(h.addr, data).unwrap();
    }
    fn read(&self, h: &Handle) -> Vec<u8> {
        self.fb.read(h.addr, h.len).unwrap()
    }
    fn poisoned(&self, h: &Handle) -> Option<bool> {
        Some(self.fb.is_poisoned(h.addr, h.len).unwrap())
    }
    fn backend_ops(&self) -> usize {
        self.fb.journal().unwrap().len()
    }
}

struct ScratchTier {
    fb: FakeBackend,
    stack: SharedScratchStack,
    marks: Vec<(u64, SharedMark, ScratchSpan)>,
    next: u64,
}

impl UnderTest for ScratchTier {
    fn name(&self) -> &'static str {
        "scratch"
    }
    fn unit(&self) -> usize {
        CAPACITY
    }
    fn lifo(&self) -> bool {
        true
    }
    fn alloc(&mut self, bytes: usize, align: usize) -> Result<Handle, MemError> {
        let mark = self.stack.mark()?;
        let t = mark.take(bytes, align)?;
        let s = self.stack.span(&t)?;
        let h = Handle {
            key: self.next,
            addr: s.addr(),
            len: s.len(),
        };
        self.marks.push((self.next, mark, t));
        self.next += 1;
        Ok(h)
    }
    fn free(&mut self, h: Handle) {
        let (key, mark, _) = self.marks.pop().unwrap();
        assert_eq!(key, h.key, "the suite frees scratch innermost-first");
        mark.rewind().unwrap();
    }
    fn free_all(&mut self) {
        while let Some((_, mark, _)) = self.marks.pop() {
            mark.rewind().unwrap();
        }
    }
    fn in_use(&self) -> usize {
        self.stack.stats().used
    }
    fn write(&mut self, h: &Handle, data: &[u8]) {
        self.fb.write(h.addr, data).unwrap();
    }
    fn read(&self, h: &Handle) -> Vec<u8> {
        self.fb.read(h.addr, h.len).unwrap()
    }
    fn poisoned(&self, h: &Handle) -> Option<bool> {
        Some(self.fb.is_poisoned(h.addr, h.len).unwrap())
    }
    fn backend_ops(&self) -> usize {
        self.fb.journal().unwrap().len()
    }
}

struct PinnedTier {
    host: PinnedHost,
    buffers: HashMap<u64, PinnedBuffer>,
    next: u64,
}

impl UnderTest for PinnedTier {
    fn name(&self) -> &'static str {
        "pinned"
    }
    fn unit(&self) -> usize {
        CAPACITY
    }
    fn alloc(&mut self, bytes: usize, align: usize) -> Result<Handle, MemError> {
        if align > imp_mem_core::pinned::PINNED_ALIGNMENT || !align.is_power_of_two() {
            return Err(MemError::invalid("pinned memory is page-aligned"));
        }
        let b = self.host.allocate(bytes)?;
        let h = Handle {
            key: self.next,
            addr: b.addr(),
            len: b.len(),
        };
        self.buffers.insert(self.next, b);
        self.next += 1;
        Ok(h)
    }
    fn free(&mut self, h: Handle) {
        self.buffers.remove(&h.key);
    }
    fn free_all(&mut self) {
        self.buffers.clear();
    }
    fn in_use(&self) -> usize {
        self.host.stats().live_bytes as usize
    }
    fn write(&mut self, h: &Handle, data: &[u8]) {
        self.buffers.get_mut(&h.key).unwrap().as_mut_slice()[..data.len()].copy_from_slice(data);
    }
    fn read(&self, h: &Handle) -> Vec<u8> {
        self.buffers[&h.key].as_slice().to_vec()
    }
    fn poisoned(&self, _h: &Handle) -> Option<bool> {
        None // freed, not quarantined: reading it would be a use after free
    }
    fn backend_ops(&self) -> usize {
        0
    }
}

fn every_tier() -> Vec<Box<dyn UnderTest>> {
    let fake = || FakeBackend::new(FakeConfig::default()).unwrap();
    let fb = fake();
    let arena = SharedArena::new(&fb, Tier::ModelResident, CAPACITY as u64, None).unwrap();
    let fb2 = fake();
    let pool =
        SharedBlockPool::new(&fb2, &PoolConfig::fixed(BLOCK, (CAPACITY / BLOCK) as u32)).unwrap();
    let fb3 = fake();
    let stack = SharedScratchStack::new(&fb3, CAPACITY as u64, None).unwrap();
    let host = PinnedHost::new(Arc::new(FakePinnedHost::new(CAPACITY as u64)));
    vec![
        Box::new(ArenaTier { fb, arena, next: 0 }),
        Box::new(PoolTier {
            fb: fb2,
            pool,
            refs: HashMap::new(),
            next: 0,
        }),
        Box::new(ScratchTier {
            fb: fb3,
            stack,
            marks: Vec::new(),
            next: 0,
        }),
        Box::new(PinnedTier {
            host,
            buffers: HashMap::new(),
            next: 0,
        }),
    ]
}

fn pattern(h: &Handle) -> Vec<u8> {
    (0..h.len)
        .map(|i| (h.key as usize * 31 + i) as u8)
        .collect()
}

/// Deterministic sizes in `1..=unit`.
fn sizes(unit: usize, n: usize) -> Vec<usize> {
    let mut x = 0x9E37_79B9u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1 + (x as usize % unit.min(3000))
        })
        .collect()
}

#[test]
fn allocate_and_free_return_to_empty() {
    for mut t in every_tier() {
        let h = t.alloc(t.unit().min(512), 8).unwrap();
        assert!(t.in_use() >= h.len.min(512), "{}", t.name());
        t.free(h);
        t.free_all();
        assert_eq!(t.in_use(), 0, "{}", t.name());
    }
}

#[test]
fn allocations_are_aligned_and_disjoint() {
    for mut t in every_tier() {
        let mut live = Vec::new();
        for (i, bytes) in sizes(t.unit(), 24).into_iter().enumerate() {
            let align = 1usize << (i % 9);
            match t.alloc(bytes, align) {
                Ok(h) => {
                    assert_eq!(h.addr % align, 0, "{} align {align}", t.name());
                    assert!(h.len >= bytes, "{}", t.name());
                    live.push(h);
                }
                Err(MemError::Capacity(_) | MemError::OutOfMemory(_)) => break,
                Err(e) => panic!("{}: {e}", t.name()),
            }
        }
        assert!(live.len() >= 4, "{} held only {}", t.name(), live.len());
        let mut ranges: Vec<_> = live.iter().map(|h| (h.addr, h.addr + h.len)).collect();
        ranges.sort_unstable();
        assert!(
            ranges.windows(2).all(|w| w[0].1 <= w[1].0),
            "{} overlaps",
            t.name()
        );
    }
}

#[test]
fn contents_survive_other_allocations() {
    for mut t in every_tier() {
        let mut live = Vec::new();
        for bytes in sizes(t.unit(), 10) {
            let h = t.alloc(bytes, 16).unwrap();
            let data = pattern(&h);
            t.write(&h, &data);
            live.push(h);
        }
        for h in &live {
            assert_eq!(t.read(h), pattern(h), "{}", t.name());
        }
    }
}

#[test]
fn exhaustion_fails_cleanly_and_recovers() {
    for mut t in every_tier() {
        let unit = t.unit().min(4096);
        let mut held = Vec::new();
        let err = loop {
            match t.alloc(unit, 8) {
                Ok(h) => held.push(h),
                Err(e) => break e,
            }
            assert!(
                held.len() <= CAPACITY / unit + 1,
                "{} never ran out",
                t.name()
            );
        };
        assert!(
            matches!(err, MemError::Capacity(_) | MemError::OutOfMemory(_)),
            "{}: {err}",
            t.name()
        );
        let before = t.in_use();
        assert!(t.alloc(unit, 8).is_err());
        assert_eq!(
            t.in_use(),
            before,
            "{}: a failed allocation changed the state",
            t.name()
        );
        t.free_all();
        assert_eq!(t.in_use(), 0);
        assert!(t.alloc(unit, 8).is_ok(), "{} did not recover", t.name());
    }
}

#[test]
fn zero_size_and_bad_alignment_are_invalid_arguments() {
    for mut t in every_tier() {
        assert!(
            matches!(t.alloc(0, 8), Err(MemError::InvalidArgument(_))),
            "{}",
            t.name()
        );
        assert!(
            matches!(t.alloc(8, 3), Err(MemError::InvalidArgument(_))),
            "{}",
            t.name()
        );
        assert_eq!(t.in_use(), 0, "{}", t.name());
    }
}

#[test]
fn mixed_allocate_and_free_keeps_accounting() {
    for mut t in every_tier() {
        let mut live: Vec<Handle> = Vec::new();
        let mut seed = 7usize;
        for bytes in sizes(t.unit().min(2048), 200) {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if seed % 3 == 0 && !live.is_empty() {
                let i = if t.lifo() {
                    live.len() - 1
                } else {
                    (seed >> 8) % live.len()
                };
                let h = live.remove(i);
                t.free(h);
            } else if let Ok(h) = t.alloc(bytes, 64) {
                live.push(h);
            }
            if t.frees_individually() {
                let held: usize = live.iter().map(|h| h.len).sum();
                assert!(
                    t.in_use() >= held,
                    "{}: in use {} < held {held}",
                    t.name(),
                    t.in_use()
                );
            }
        }
        t.free_all();
        assert_eq!(t.in_use(), 0, "{}", t.name());
    }
}

#[test]
fn released_memory_reads_as_poison_on_the_fake() {
    for mut t in every_tier() {
        let h = t.alloc(t.unit().min(256), 8).unwrap();
        t.write(&h, &vec![0x11; h.len]);
        t.free(h);
        t.free_all();
        if let Some(poisoned) = t.poisoned(&h) {
            assert!(poisoned, "{}", t.name());
        }
    }
}

#[test]
fn takes_never_reach_the_backend() {
    for mut t in every_tier() {
        let before = t.backend_ops();
        for bytes in sizes(t.unit().min(1024), 20) {
            if let Ok(h) = t.alloc(bytes, 8) {
                if !t.lifo() {
                    t.free(h);
                }
            }
        }
        t.free_all();
        assert_eq!(t.backend_ops(), before, "{}", t.name());
    }
}

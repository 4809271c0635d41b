//! Prefix-cache persistence: save and load round trips, refused and
//! corrupted files (every truncation, bit flip, crafted header and
//! reordered entry), faults injected through a `BlockIo`, the atomic
//! replace, the chunk buffers and the releaser thread's queue.

use super::*;

/// Writes a pattern derived from the block's hash into every full block of
/// sequence `id` (what an engine's forward pass would put there).
fn fill(m: &KVCacheManager, fake: &FakeBackend, id: SeqId) {
    let hashes = m.sequence_hashes(id).unwrap().to_vec();
    for (i, h) in hashes.iter().enumerate() {
        if let Some((addr, len)) = m.block_span(id, i).unwrap() {
            let bytes: Vec<u8> = (0..len)
                .map(|k| (h.wrapping_shr(k as u32 % 128) as u8) ^ k as u8)
                .collect();
            fake.write(addr, &bytes).unwrap();
        }
    }
}

fn pattern(h: BlockHash, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (h.wrapping_shr(k as u32 % 128) as u8) ^ k as u8)
        .collect()
}

#[test]
fn save_and_load_restore_hashes_and_bytes() {
    let (mut m, fake) = backed(16, 64);
    m.admit(1, &toks(0..13), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (_dir, path) = tmp("cache.bin");
    assert_eq!(m.save_prefix_cache(&path).unwrap(), 3);
    let saved: Vec<_> = m.cached_blocks().iter().map(|c| c.0).collect();
    assert_eq!(m.evict(100), 3);
    assert_eq!(m.load_prefix_cache(&path).unwrap(), 3);
    assert_eq!(m.load_prefix_cache(&path).unwrap(), 0, "already cached");
    let loaded = m.cached_blocks();
    assert_eq!(loaded.iter().map(|c| c.0).collect::<Vec<_>>(), saved);
    for (h, _, addr) in &loaded {
        assert_eq!(fake.read(addr.unwrap(), 64).unwrap(), pattern(*h, 64));
    }
    assert_eq!(m.admit(2, &toks(0..13), none()).unwrap().cached_tokens, 12);
    m.check_invariants().unwrap();

    // A fresh manager of the same configuration loads it too.
    let (mut other, _f) = backed(16, 64);
    assert_eq!(other.load_prefix_cache(&path).unwrap(), 3);
    other.check_invariants().unwrap();
}

#[test]
fn bad_files_are_refused_and_nothing_is_loaded() {
    let (mut m, fake) = backed(16, 32);
    m.admit(1, &toks(0..9), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (dir, path) = tmp("cache.bin");
    m.save_prefix_cache(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    m.evict(100);
    let before = m.stats();

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", good[..good.len() - 7].to_vec()),
        ("checksum", {
            let mut b = good.clone();
            let at = b.len() - 30;
            b[at] ^= 1;
            b
        }),
        ("magic", {
            let mut b = good.clone();
            b[0] = b'X';
            b
        }),
        ("version", {
            let mut b = good.clone();
            b[8] = 9;
            b
        }),
        ("empty", vec![]),
    ];
    for (what, bytes) in cases {
        let p = dir.path().join(what);
        std::fs::write(&p, bytes).unwrap();
        let err = m.load_prefix_cache(&p).unwrap_err();
        assert!(
            err.to_string().contains("nothing was loaded"),
            "{what}: {err}"
        );
        assert_eq!(m.stats(), before, "{what}");
    }
    // Another model's manager refuses it, naming the field.
    let fake2 = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut cfg = m.config().clone();
    cfg.model_fingerprint = "another-model".into();
    let mut other = KVCacheManager::new(cfg, Some(fake2.backend())).unwrap();
    let err = other.load_prefix_cache(&path).unwrap_err();
    assert!(err.to_string().contains("model_fingerprint"), "{err}");
    assert_eq!(other.stats().cached, 0);
    // A file that does not fit is refused whole.
    let (mut small, _f) = backed(1, 32);
    assert!(matches!(
        small.load_prefix_cache(&path),
        Err(MemError::KvCapacity(_))
    ));
    assert_eq!(small.stats().cached, 0);
    small.check_invariants().unwrap();
}

#[derive(Debug)]
struct FailingIo {
    inner: PoolBlockIo,
    fail_at: std::sync::atomic::AtomicU32,
}

impl BlockIo for FailingIo {
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    fn read_block(&self, b: &crate::SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError> {
        self.inner.read_block(b, dst)
    }
    fn write_block(&self, b: &crate::SharedBlockRef, src: &[u8]) -> Result<(), MemError> {
        use std::sync::atomic::Ordering;
        if self.fail_at.fetch_sub(1, Ordering::SeqCst) == 1 {
            return Err(MemError::Driver("injected copy failure".into()));
        }
        self.inner.write_block(b, src)
    }
}

#[test]
fn a_copy_failure_during_load_unwinds_every_ref() {
    let (mut m, fake) = backed(16, 32);
    m.admit(1, &toks(0..17), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (_dir, path) = tmp("c.bin");
    m.save_prefix_cache(&path).unwrap();
    m.evict(100);
    m.set_block_io(Box::new(FailingIo {
        inner: PoolBlockIo::new(32),
        fail_at: 3.into(),
    }))
    .unwrap();
    let before = m.stats();
    assert!(matches!(
        m.load_prefix_cache(&path),
        Err(MemError::Driver(_))
    ));
    assert_eq!(m.stats(), before);
    m.check_invariants().unwrap();
}

#[derive(Debug)]
struct FailingRead(PoolBlockIo);

impl BlockIo for FailingRead {
    fn block_bytes(&self) -> usize {
        self.0.block_bytes()
    }
    fn read_block(&self, _: &crate::SharedBlockRef, _: &mut [u8]) -> Result<(), MemError> {
        Err(MemError::Driver("injected read failure".into()))
    }
    fn write_block(&self, b: &crate::SharedBlockRef, src: &[u8]) -> Result<(), MemError> {
        self.0.write_block(b, src)
    }
}

#[test]
fn a_failed_save_leaves_the_previous_file_and_no_temporary() {
    let (mut m, fake) = backed(16, 32);
    m.admit(1, &toks(0..9), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (dir, path) = tmp("cache.bin");
    m.save_prefix_cache(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    m.admit(2, &toks(50..59), none()).unwrap();
    m.free(2, None).unwrap();
    m.set_block_io(Box::new(FailingRead(PoolBlockIo::new(32))))
        .unwrap();
    assert!(matches!(
        m.save_prefix_cache(&path),
        Err(MemError::Driver(_))
    ));
    assert_eq!(
        std::fs::read(&path).unwrap(),
        good,
        "the old file is intact"
    );
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(names.len(), 1, "no temporary left behind");
}

#[test]
fn a_save_over_a_file_replaces_it_whole_and_a_reader_of_the_old_keeps_it() {
    // The replaced file is held open across the rename and closed on the
    // releaser thread: a reader that had it open still reads the old
    // bytes, the path holds the new file, and no temporary is left.
    let (mut m, fake) = backed(16, 64);
    m.admit(1, &toks(0..9), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (dir, path) = tmp("cache.bin");
    assert_eq!(m.save_prefix_cache(&path).unwrap(), 2);
    let old = std::fs::read(&path).unwrap();
    let mut reader = std::fs::File::open(&path).unwrap();
    m.admit(2, &toks(50..63), none()).unwrap();
    fill(&m, &fake, 2);
    m.free(2, None).unwrap();
    for round in 0..3 {
        assert_eq!(m.save_prefix_cache(&path).unwrap(), 5, "round {round}");
    }
    let mut held = Vec::new();
    std::io::Read::read_to_end(&mut reader, &mut held).unwrap();
    assert_eq!(held, old, "the old file, whole, for its reader");
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(names.len(), 1, "no temporary left behind");
    let (mut other, _f) = backed(16, 64);
    assert_eq!(other.load_prefix_cache(&path).unwrap(), 5);
    assert_eq!(other.probe(&toks(50..63), &none()), 3);
    other.check_invariants().unwrap();
}

#[test]
fn a_save_over_a_symlink_replaces_the_link_and_leaves_its_target() {
    let (mut m, fake) = backed(16, 32);
    m.admit(1, &toks(0..9), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (dir, path) = tmp("cache.bin");
    let target = dir.path().join("target.bin");
    std::fs::write(&target, b"not a cache").unwrap();
    std::os::unix::fs::symlink(&target, &path).unwrap();
    m.save_prefix_cache(&path).unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), b"not a cache");
    assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
    let (mut other, _f) = backed(16, 32);
    assert_eq!(other.load_prefix_cache(&path).unwrap(), 2);
}

#[test]
fn the_chunk_buffers_are_kept_between_calls() {
    let (m, _fake) = backed(16, 32);
    let block = m.pool().allocate_many_unchecked(1).unwrap().into_refs();
    let io = PoolBlockIo::new(32);
    // Each buffer marked: a fresh one is zeroed. A save's set and a load's
    // (of another size) are both kept: 2 * BUFFERS.
    let kept = 2 * BUFFERS;
    let fresh: Vec<HostBuf> = (0..kept + 1)
        .map(|_| io.host_buffer(&block[0], 4096))
        .collect();
    for (mark, mut buf) in (1..).zip(fresh) {
        assert_eq!(buf.as_slice()[0], 0, "a fresh buffer");
        buf.as_mut_slice()[0] = mark;
        io.keep_buffer(buf);
    }
    // `kept` of them come back, each once; then fresh ones.
    let again: Vec<HostBuf> = (0..kept + 1)
        .map(|_| io.host_buffer(&block[0], 4096))
        .collect();
    let mut marks: Vec<u8> = again.iter().map(|b| b.as_slice()[0]).collect();
    marks.sort_unstable();
    let mut want = vec![0];
    want.extend(1..=kept as u8);
    assert_eq!(marks, want);
    assert!(again.iter().all(|b| b.as_slice().len() == 4096));
    // A buffer of another length is not handed out for this one.
    io.keep_buffer(HostBuf::heap(100));
    assert_eq!(io.host_buffer(&block[0], 4096).as_slice().len(), 4096);
}

#[test]
fn released_files_are_all_closed_past_a_full_queue() {
    // A burst of deleted files, more than the releaser's queue holds: the
    // overflow is closed by the caller, the rest by the thread, and soon no
    // handle of any is left open.
    use crate::kv::persist::{release_later, RELEASE_QUEUE};
    let dir = tempfile::tempdir().unwrap();
    for i in 0..3 * RELEASE_QUEUE {
        let path = dir.path().join(format!("f-{i}"));
        std::fs::write(&path, vec![7u8; 8192]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        release_later(file);
    }
    let ours = || {
        std::fs::read_dir("/proc/self/fd")
            .map(|fds| {
                fds.flatten()
                    .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                    .filter(|target| target.starts_with(dir.path()))
                    .count()
            })
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while ours() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(ours(), 0, "every released file closed");
}

#[test]
fn a_file_saved_under_another_hash_seed_is_refused() {
    let (mut m, fake) = backed(16, 32);
    m.admit(1, &toks(0..9), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (_dir, path) = tmp("cache.bin");
    m.save_prefix_cache(&path).unwrap();
    let fake2 = FakeBackend::new(FakeConfig::default()).unwrap();
    let mut cfg = m.config().clone();
    cfg.hash_seed ^= 1;
    cfg.block_size = 8;
    let mut other = KVCacheManager::new(cfg, Some(fake2.backend())).unwrap();
    let err = other.load_prefix_cache(&path).unwrap_err().to_string();
    assert!(
        err.contains("hash_seed") && err.contains("block_size"),
        "{err}"
    );
    assert_eq!(other.stats().cached, 0);
}

/// A `BlockIo` that rewrites a byte of the file's last block the first time
/// a block is copied in: the file changing between the load's two passes.
/// Every copy waits for the rewrite (the load's workers copy at once).
#[derive(Debug)]
struct FileChangesMidLoad {
    inner: PoolBlockIo,
    path: PathBuf,
    done: std::sync::Mutex<bool>,
}

impl BlockIo for FileChangesMidLoad {
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    fn read_block(&self, b: &crate::SharedBlockRef, dst: &mut [u8]) -> Result<(), MemError> {
        self.inner.read_block(b, dst)
    }
    fn write_block(&self, b: &crate::SharedBlockRef, src: &[u8]) -> Result<(), MemError> {
        let mut done = self.done.lock().unwrap();
        if !*done {
            // One byte, in place: never shorter while the other workers
            // read (a rewrite through a truncation would be, for a moment).
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&self.path)
                .unwrap();
            let at = file.metadata().unwrap().len() - 16 - 3; // the last block's bytes
            let mut byte = [0u8];
            file.read_exact_at(&mut byte, at).unwrap();
            file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
            *done = true;
        }
        drop(done);
        self.inner.write_block(b, src)
    }
}

#[test]
fn a_file_that_changes_between_the_passes_loads_nothing() {
    // Blocks larger than half a chunk: four chunks of one block, for three
    // workers. The last is claimed only after a worker's first copy, which
    // waited for the rewrite, so it is read changed.
    const BB: usize = 600 << 10;
    let (mut m, fake) = backed(16, BB);
    m.admit(1, &toks(0..17), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (_dir, path) = tmp("c.bin");
    assert_eq!(m.save_prefix_cache(&path).unwrap(), 4);
    m.evict(100);
    m.set_block_io(Box::new(FileChangesMidLoad {
        inner: PoolBlockIo::new(BB),
        path: path.clone(),
        done: false.into(),
    }))
    .unwrap();
    let before = m.stats();
    let err = m.load_prefix_cache(&path).unwrap_err().to_string();
    assert!(err.contains("changed while it was being loaded"), "{err}");
    assert_eq!(m.stats(), before, "nothing loaded, every fresh block back");
    m.check_invariants().unwrap();
}

/// The trailer of version `version` for `rest` (a file without its
/// trailer, entries of `bb` bytes): version 1 hashes every byte, version 2
/// the head and each entry's 24-byte record.
fn trailer_of(version: u32, rest: &[u8], bb: usize) -> u128 {
    if version == 1 {
        return xxhash_rust::xxh3::xxh3_128(rest);
    }
    let header_len = u32::from_le_bytes(rest[12..16].try_into().unwrap()) as usize;
    let (head, entries) = rest.split_at(16 + header_len);
    let mut hashed = head.to_vec();
    for entry in entries.chunks(24 + bb) {
        hashed.extend_from_slice(&entry[..24.min(entry.len())]);
    }
    xxhash_rust::xxh3::xxh3_128(&hashed)
}

/// `rest` (a file without its trailer) with its version's trailer.
fn with_trailer(mut rest: Vec<u8>, bb: usize) -> Vec<u8> {
    let version = u32::from_le_bytes(rest[8..12].try_into().unwrap());
    let trailer = trailer_of(version, &rest, bb);
    rest.extend_from_slice(&trailer.to_le_bytes());
    rest
}

#[test]
fn the_streamed_file_keeps_the_format() {
    // Version 2: the streaming writer's trailer is the one-shot XXH3-128 of
    // the head and the entries' records, and every entry's checksum the
    // XXH3-64 of its bytes.
    let (mut m, fake) = backed(16, 32);
    m.admit(1, &toks(0..17), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (_dir, path) = tmp("c.bin");
    let n = m.save_prefix_cache(&path).unwrap() as usize;
    let data = std::fs::read(&path).unwrap();
    assert_eq!(u32::from_le_bytes(data[8..12].try_into().unwrap()), 2);
    let (rest, trailer) = data.split_at(data.len() - 16);
    assert_eq!(
        trailer_of(2, rest, 32),
        u128::from_le_bytes(trailer.try_into().unwrap())
    );
    let header_len = u32::from_le_bytes(data[12..16].try_into().unwrap()) as usize;
    let body = 16 + header_len;
    assert_eq!(rest.len(), body + n * (24 + 32));
    for k in 0..n {
        let at = body + k * (24 + 32);
        let sum = u64::from_le_bytes(rest[at + 16..at + 24].try_into().unwrap());
        assert_eq!(sum, xxhash_rust::xxh3::xxh3_64(&rest[at + 24..at + 56]));
    }
}
// ------------------------------------------ issue 31 (the single-pass load)

/// A manager with 5 cached blocks of `bb` bytes saved to a file, then
/// evicted; the file's bytes.
fn saved_five(
    bb: usize,
) -> (
    KVCacheManager,
    FakeBackend,
    tempfile::TempDir,
    PathBuf,
    Vec<u8>,
) {
    let (mut m, fake) = backed(16, bb);
    m.admit(1, &toks(0..21), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (dir, path) = tmp("c.bin");
    assert_eq!(m.save_prefix_cache(&path).unwrap(), 5);
    let good = std::fs::read(&path).unwrap();
    assert_eq!(m.evict(100), 5);
    (m, fake, dir, path, good)
}

fn refused_unchanged(m: &mut KVCacheManager, path: &Path, what: &str) {
    let before = m.stats();
    let err = m.load_prefix_cache(path).unwrap_err().to_string();
    assert!(err.contains("nothing was loaded"), "{what}: {err}");
    assert_eq!(m.stats(), before, "{what}");
    assert!(m.cached_blocks().is_empty(), "{what}");
}

#[test]
fn every_truncation_and_every_bit_flip_is_refused_and_loads_nothing() {
    let (mut m, fake, dir, path, good) = saved_five(48);
    let bad = dir.path().join("bad.bin");
    for cut in 0..good.len() {
        std::fs::write(&bad, &good[..cut]).unwrap();
        refused_unchanged(&mut m, &bad, &format!("cut at {cut}"));
    }
    // One bit of every byte (a different bit from byte to byte): magic,
    // version, header, the index, the block bytes and the trailer.
    for at in 0..good.len() {
        let mut b = good.clone();
        b[at] ^= 1 << (at % 8);
        std::fs::write(&bad, &b).unwrap();
        refused_unchanged(&mut m, &bad, &format!("bit {} of byte {at}", at % 8));
    }
    m.check_invariants().unwrap();
    assert_eq!(
        m.load_prefix_cache(&path).unwrap(),
        5,
        "the good file loads"
    );
    for (h, _, addr) in m.cached_blocks() {
        assert_eq!(fake.read(addr.unwrap(), 48).unwrap(), pattern(h, 48));
    }
    m.check_invariants().unwrap();
}

/// `good` with its entry count replaced by `entries` (the header is JSON),
/// its length fixed to match when `fit`, and a correct trailer.
fn crafted(good: &[u8], entries: u64, fit: bool, bb: usize) -> Vec<u8> {
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&good[16..16 + header_len]).unwrap();
    header["entries"] = entries.into();
    let header = serde_json::to_vec(&header).unwrap();
    let mut out = good[..12].to_vec();
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    let body = &good[16 + header_len..good.len() - 16];
    let want = (24 + bb) * entries.min(1 << 20) as usize;
    if fit && want <= body.len() {
        out.extend_from_slice(&body[..want]);
    } else {
        out.extend_from_slice(body);
    }
    with_trailer(out, bb)
}

#[test]
fn crafted_headers_and_entries_are_refused_and_a_consistent_subset_loads() {
    let (mut m, _fake, dir, _path, good) = saved_five(48);
    let bad = dir.path().join("bad.bin");
    for (what, bytes) in [
        ("entries past the file", crafted(&good, 6, false, 48)),
        ("absurd entries", crafted(&good, u64::MAX / 2, false, 48)),
        ("fewer entries, long file", crafted(&good, 3, false, 48)),
        ("header length past the end", {
            let mut b = good.clone();
            b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
            b
        }),
        ("a block's checksum, trailer recomputed", {
            let mut b = good.clone();
            let header_len = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
            b[16 + header_len + 2 * 72 + 16] ^= 4;
            b.truncate(b.len() - 16);
            with_trailer(b, 48)
        }),
    ] {
        std::fs::write(&bad, &bytes).unwrap();
        refused_unchanged(&mut m, &bad, what);
    }
    // A header that promises 3 entries over 3 entries, trailer correct: a
    // consistent file of its own, which loads.
    std::fs::write(&bad, crafted(&good, 3, true, 48)).unwrap();
    assert_eq!(m.load_prefix_cache(&bad).unwrap(), 3);
    m.check_invariants().unwrap();
}

/// `good` (a saved file of five entries of `bb` bytes, version 2) with
/// its entries in the order `order` (entry `k` of the result is entry
/// `order[k]` of `good`, record and bytes), its trailer kept.
fn reordered(good: &[u8], order: &[usize], bb: usize) -> Vec<u8> {
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let body = 16 + header_len;
    let stride = 24 + bb;
    let mut out = good[..body].to_vec();
    for &k in order {
        out.extend_from_slice(&good[body + k * stride..body + (k + 1) * stride]);
    }
    out.extend_from_slice(&good[good.len() - 16..]);
    out
}

#[test]
fn the_trailer_of_the_records_refuses_moved_and_repeated_entries() {
    // Version 2 hashes each entry's record, not its bytes, into the
    // trailer: whole entries (record and bytes, every checksum right)
    // swapped, rotated or repeated must still be refused by it.
    let (mut m, _fake, dir, _path, good) = saved_five(48);
    let bad = dir.path().join("bad.bin");
    for (what, order) in [
        ("two entries swapped", [0, 3, 2, 1, 4]),
        ("the last two swapped", [0, 1, 2, 4, 3]),
        ("rotated", [1, 2, 3, 4, 0]),
        ("one entry twice, one gone", [0, 1, 1, 3, 4]),
    ] {
        std::fs::write(&bad, reordered(&good, &order, 48)).unwrap();
        refused_unchanged(&mut m, &bad, what);
        let err = m.load_prefix_cache(&bad).unwrap_err().to_string();
        assert!(
            err.contains("file checksum does not match"),
            "{what}: {err}"
        );
    }
    // A block's bytes moved under another entry's record: its checksum.
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let (a, b) = (16 + header_len + 24, 16 + header_len + 72 + 24);
    let mut moved = good.clone();
    moved.copy_within(a..a + 48, b);
    std::fs::write(&bad, &moved).unwrap();
    refused_unchanged(&mut m, &bad, "bytes under another record");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

    /// Any order of the entries but the saved one is refused under the
    /// saved trailer, and loads whole under its own (a consistent file).
    #[test]
    fn entries_load_only_in_the_order_their_trailer_names(
        order in proptest::strategy::Strategy::prop_shuffle(
            proptest::sample::subsequence(vec![0usize, 1, 2, 3, 4], 5)
        )
    ) {
        let (mut m, fake, dir, _path, good) = saved_five(48);
        let bad = dir.path().join("bad.bin");
        let file = reordered(&good, &order, 48);
        std::fs::write(&bad, &file).unwrap();
        if order == [0, 1, 2, 3, 4] {
            proptest::prop_assert_eq!(m.load_prefix_cache(&bad).unwrap(), 5);
        } else {
            refused_unchanged(&mut m, &bad, &format!("{order:?}"));
            let rest = file[..file.len() - 16].to_vec();
            std::fs::write(&bad, with_trailer(rest, 48)).unwrap();
            proptest::prop_assert_eq!(m.load_prefix_cache(&bad).unwrap(), 5);
        }
        for (h, _, addr) in m.cached_blocks() {
            proptest::prop_assert_eq!(fake.read(addr.unwrap(), 48).unwrap(), pattern(h, 48));
        }
        m.check_invariants().unwrap();
    }
}

#[test]
fn a_version_1_file_loads_and_is_checked_by_its_own_trailer() {
    // The builds before wrote version 1: the trailer over every byte.
    let (mut m, fake, dir, _path, good) = saved_five(48);
    let as_version = |version: u32, trailer_version: u32| {
        let mut rest = good[..good.len() - 16].to_vec();
        rest[8..12].copy_from_slice(&version.to_le_bytes());
        let trailer = trailer_of(trailer_version, &rest, 48);
        rest.extend_from_slice(&trailer.to_le_bytes());
        rest
    };
    let bad = dir.path().join("bad.bin");
    for (what, bytes) in [
        ("version 1 under a version-2 trailer", as_version(1, 2)),
        ("version 2 under a version-1 trailer", as_version(2, 1)),
        ("version 3", as_version(3, 2)),
        ("version 1, a block byte flipped, trailer recomputed", {
            let mut b = as_version(1, 1);
            let at = b.len() - 16 - 5;
            b[at] ^= 0x20;
            b.truncate(b.len() - 16);
            with_trailer(b, 48)
        }),
        ("version 1, a block byte flipped", {
            let mut b = as_version(1, 1);
            let at = b.len() - 16 - 5;
            b[at] ^= 0x20;
            b
        }),
    ] {
        std::fs::write(&bad, &bytes).unwrap();
        refused_unchanged(&mut m, &bad, what);
    }
    std::fs::write(&bad, as_version(3, 2)).unwrap();
    let err = m.load_prefix_cache(&bad).unwrap_err().to_string();
    assert!(err.contains("format version 3"), "{err}");
    std::fs::write(&bad, as_version(1, 1)).unwrap();
    assert_eq!(m.load_prefix_cache(&bad).unwrap(), 5);
    for (h, _, addr) in m.cached_blocks() {
        assert_eq!(fake.read(addr.unwrap(), 48).unwrap(), pattern(h, 48));
    }
    m.check_invariants().unwrap();
}

#[test]
fn a_file_rewritten_between_the_index_and_the_copies_loads_nothing() {
    // Another save of the same hashes, other bytes: the same length.
    let (mut m, fake, dir, path, good) = saved_five(48);
    let other_path = dir.path().join("other.bin");
    let (mut o, ofake) = backed(16, 48);
    o.admit(1, &toks(0..21), none()).unwrap();
    for i in 0..5 {
        let (addr, len) = o.block_span(1, i).unwrap().unwrap();
        ofake.write(addr, &vec![0xA5 ^ i as u8; len]).unwrap();
    }
    o.free(1, None).unwrap();
    o.save_prefix_cache(&other_path).unwrap();
    let other = std::fs::read(&other_path).unwrap();
    assert_eq!(other.len(), good.len());
    let before = m.stats();
    // In place (the same inode, as a writer that truncates and rewrites).
    let file = m.load_target().unwrap().verify(&path).unwrap();
    let mut pending = m.reserve_load(file).unwrap();
    std::fs::write(&path, &other).unwrap();
    let err = pending.copy_in().unwrap_err().to_string();
    assert!(err.contains("changed while it was being loaded"), "{err}");
    drop(pending);
    assert_eq!(m.stats(), before);
    m.check_invariants().unwrap();
    // Replaced by a rename: the open file is the one read, whole.
    std::fs::write(&path, &good).unwrap();
    let file = m.load_target().unwrap().verify(&path).unwrap();
    let mut pending = m.reserve_load(file).unwrap();
    std::fs::rename(&other_path, &path).unwrap();
    pending.copy_in().unwrap();
    assert_eq!(m.finish_load(pending).unwrap(), 5);
    for (h, _, addr) in m.cached_blocks() {
        assert_eq!(fake.read(addr.unwrap(), 48).unwrap(), pattern(h, 48));
    }
    m.check_invariants().unwrap();
}

#[test]
fn a_load_and_a_save_of_many_chunks_keep_every_byte() {
    // 2 000 blocks of 1 000 bytes: a little under two megabytes, two chunks
    // and more, the last one short.
    const BB: usize = 1000;
    let (mut m, fake) = backed(2048, BB);
    m.admit(1, &toks(0..8000), none()).unwrap();
    fill(&m, &fake, 1);
    m.free(1, None).unwrap();
    let (_dir, path) = tmp("c.bin");
    assert_eq!(m.save_prefix_cache(&path).unwrap(), 2000);
    let data = std::fs::read(&path).unwrap();
    let (rest, trailer) = data.split_at(data.len() - 16);
    assert_eq!(
        trailer_of(2, rest, BB),
        u128::from_le_bytes(trailer.try_into().unwrap())
    );
    let saved = m.cached_blocks();
    assert_eq!(m.evict(u32::MAX), 2000);
    assert_eq!(m.load_prefix_cache(&path).unwrap(), 2000);
    let loaded = m.cached_blocks();
    assert_eq!(
        loaded.iter().map(|c| c.0).collect::<Vec<_>>(),
        saved.iter().map(|c| c.0).collect::<Vec<_>>()
    );
    for (h, _, addr) in loaded {
        assert_eq!(fake.read(addr.unwrap(), BB).unwrap(), pattern(h, BB));
    }
    m.check_invariants().unwrap();
}

#[test]
fn a_save_and_a_load_copy_each_chunk_of_blocks_as_one_batch() {
    // 2 000 blocks of 1 000 bytes: entries of 1 024 bytes; a save's chunks
    // of 8 MiB hold them all, a load's of 1 MiB 1 024 entries, the last
    // one short.
    const BB: usize = 1000;
    let fb = FakeBackend::new(FakeConfig::default()).unwrap();
    let source = Arc::new(crate::test_source::TestSource::over(fb.source().clone()));
    let backend = crate::Backend::new(source.clone(), crate::PhaseMode::Strict, None).unwrap();
    let mut cfg = KvConfig::new(4, 2048);
    cfg.block_bytes = BB;
    cfg.model_fingerprint = "test-model".into();
    let mut m = KVCacheManager::new(cfg, Some(&backend)).unwrap();
    m.admit(1, &toks(0..8000), none()).unwrap();
    fill(&m, &fb, 1);
    m.free(1, None).unwrap();
    let batches = || std::mem::take(&mut *source.batches.lock().unwrap());
    let hosts = || std::mem::take(&mut *source.hosts.lock().unwrap());
    batches();
    hosts();

    let (_dir, path) = tmp("batched.bin");
    assert_eq!(m.save_prefix_cache(&path).unwrap(), 2000);
    assert_eq!(batches(), [2000], "one batch a chunk");
    // Each block's copy lands in its entry of the chunk: an entry apart.
    let out = hosts();
    assert_eq!(out.len(), 2000, "no copy outside the batches");
    assert!(
        out.windows(2).all(|w| w[1] - w[0] == 1024),
        "{:?}",
        &out[..4]
    );

    let saved = m.cached_blocks();
    assert_eq!(m.evict(u32::MAX), 2000);
    assert_eq!(m.load_prefix_cache(&path).unwrap(), 2000);
    // The load's workers take the two chunks at once: in either order.
    let mut loaded = batches();
    loaded.sort_unstable();
    assert_eq!(loaded, [976, 1024]);
    assert_eq!(hosts().len(), 2000);
    for (h, _, addr) in m.cached_blocks() {
        assert_eq!(fb.read(addr.unwrap(), BB).unwrap(), pattern(h, BB));
    }
    // Nothing new: nothing copied.
    assert_eq!(m.load_prefix_cache(&path).unwrap(), 0);
    assert!(batches().is_empty());

    // Only the entries evicted are copied back, still a batch a chunk.
    assert_eq!(m.evict(100), 100);
    assert_eq!(m.load_prefix_cache(&path).unwrap(), 100);
    let loaded = batches();
    assert!(loaded.len() <= 2, "{loaded:?}");
    assert_eq!(loaded.iter().sum::<usize>(), 100);
    assert_eq!(
        m.cached_blocks()
            .iter()
            .map(|c| c.0)
            .collect::<Vec<_>>()
            .len(),
        saved.len()
    );
    m.check_invariants().unwrap();
}

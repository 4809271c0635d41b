//! The streamed load: a file verified against its target
//! ([`LoadTarget::verify`]), then its entries read, checked and copied
//! into fresh blocks ([`PendingLoad::copy_in`]).
//!
//! Loading reads the file once. [`LoadTarget::verify`] checks its size,
//! magic, version and header fields against this manager and reads its
//! index (each entry's hash and checksum: 24 bytes of each); the manager
//! notes the new entries, checks capacity and allocates fresh blocks (refs
//! — never raw ids, and not in the cache: nothing sees them);
//! [`PendingLoad::copy_in`] then reads every entry, checking each byte as
//! above while the new blocks are filled. Only when every check and copy
//! has passed are the entries inserted. Any failure — a corrupted file, or
//! one changed or truncated while it is read (its bytes then disagree with
//! the index, a checksum or the trailer) — drops the fresh refs and leaves
//! the manager as it was. Only regular files are read or replaced (a FIFO
//! would block the open forever). A manager with prefix caching off
//! refuses a load (`InvalidArgument`): it would hold the blocks and never
//! hit them.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use xxhash_rust::xxh3::Xxh3;

use super::block_io::{BlockIo, HostBuf};
use super::format::{check_header, io_err, refuse, Header, TrailerOver, FILE_MAGIC, FILE_VERSION};
use super::lent::LentRefs;
use super::save::refuse_irregular;
use super::{chunk_buffers, entries_per_chunk, joined, CHUNK_BYTES};
use crate::block_pool::SharedBlockRef;
use crate::error::MemError;
use crate::kv::hash::BlockHash;

/// What a file must match to load into a manager
/// ([`KVCacheManager::load_target`](crate::kv::KVCacheManager::load_target)).
#[derive(Debug)]
pub struct LoadTarget {
    pub(crate) want: Header,
    pub(crate) io: Arc<dyn BlockIo>,
}

/// A file whose size, magic, version and header fields were checked, and
/// whose entries were indexed; the checksums are checked as the blocks are
/// read in ([`PendingLoad::copy_in`]).
#[derive(Debug)]
pub struct VerifiedFile {
    pub(crate) path: PathBuf,
    file: File,
    io: Arc<dyn BlockIo>,
    /// Magic, version, header length and header: the trailer's first bytes.
    head: Vec<u8>,
    /// What the trailer hashes after `head` (the file's version).
    trailer_over: TrailerOver,
    stride: u64,
    /// `(hash, index in the file, block checksum)` of every entry, in order.
    pub(crate) entries: Vec<(BlockHash, u64, u64)>,
}

/// Fresh blocks allocated for a load, to be filled and inserted.
#[derive(Debug)]
pub struct PendingLoad {
    pub(crate) refs: LentRefs,
    pub(crate) fresh: Vec<(BlockHash, u64, u64)>,
    pub(crate) file: VerifiedFile,
    /// The main pool's capacity before the reservation grew it: what
    /// [`KVCacheManager::abandon_load`](crate::kv::KVCacheManager::abandon_load)
    /// shrinks back to.
    pub(crate) capacity_before: u32,
}

impl LoadTarget {
    /// Opens `path`, checks its size, magic, version and header against
    /// this manager, and reads the entries' index (each entry's hash and
    /// checksum, 24 bytes of each): what the manager needs to choose the
    /// entries it lacks and allocate their blocks. The block bytes and every
    /// checksum are read and checked once, by [`PendingLoad::copy_in`].
    pub fn verify(self, path: &Path) -> Result<VerifiedFile, MemError> {
        let bb = self.io.block_bytes();
        let read_err = |e| io_err("cannot read the prefix cache", path, e);
        refuse_irregular(path, "read the prefix cache")?;
        let file = File::open(path).map_err(read_err)?;
        let meta = file.metadata().map_err(read_err)?;
        refuse_irregular(path, "read the prefix cache")?;
        let len = meta.len();
        let mut prefix = [0u8; 16];
        if len < 16 + 16
            || file.read_exact_at(&mut prefix, 0).is_err()
            || &prefix[..8] != FILE_MAGIC
        {
            return Err(refuse(
                path,
                "it is not an imp-mem prefix cache (bad magic or too short)",
            ));
        }
        let word = |at: usize| {
            u32::from_le_bytes([prefix[at], prefix[at + 1], prefix[at + 2], prefix[at + 3]])
        };
        let version = word(8);
        let Some(trailer_over) = TrailerOver::of_version(version) else {
            return Err(refuse(
                path,
                format!("format version {version}; this build reads versions 1 to {FILE_VERSION}"),
            ));
        };
        let header_len = word(12) as u64;
        let body = 16 + header_len;
        if body + 16 > len {
            return Err(refuse(path, "truncated inside the header"));
        }
        let mut head = vec![0u8; body as usize];
        file.read_exact_at(&mut head, 0).map_err(read_err)?;
        if head[..16] != prefix {
            return Err(refuse(path, "it changed while it was being loaded"));
        }
        let header: Header = serde_json::from_slice(&head[16..])
            .map_err(|e| refuse(path, format!("unreadable header ({e})")))?;
        check_header(path, &header, &self.want)?;
        let n = header.entries;
        let stride = 24 + bb as u64;
        let expected = n
            .checked_mul(stride)
            .and_then(|e| e.checked_add(body + 16))
            .ok_or_else(|| refuse(path, "absurd entry count"))?;
        if len != expected {
            return Err(refuse(
                path,
                format!(
                    "it is {len} bytes but its header promises {expected} ({n} entries of {bb} \
                     bytes): {}",
                    if len < expected {
                        "truncated"
                    } else {
                        "trailing garbage"
                    }
                ),
            ));
        }
        // The index: each entry's hash and checksum. What they claim is
        // checked against the bytes (and the trailer) by `copy_in`.
        let mut entries = Vec::with_capacity(n as usize);
        let mut at = [0u8; 24];
        for k in 0..n {
            file.read_exact_at(&mut at, body + k * stride)
                .map_err(|_| refuse(path, "it changed while it was being loaded"))?;
            let hash = u128::from_le_bytes(at[..16].try_into().unwrap_or_default());
            let sum = u64::from_le_bytes(at[16..].try_into().unwrap_or_default());
            entries.push((hash, k, sum));
        }
        Ok(VerifiedFile {
            path: path.to_path_buf(),
            file,
            io: self.io,
            head,
            trailer_over,
            stride,
            entries,
        })
    }
}

/// Bytes a load reads at once and hashes right after, on the same core:
/// small enough to be still in its L2 cache for the hash (an entry larger
/// than this is read in equal parts).
const PIECE_BYTES: usize = 512 << 10;

/// Why a chunk of a load failed.
enum ChunkFailed {
    /// An entry disagrees with the index or its checksum.
    Refused(MemError),
    /// The read (short: truncated meanwhile).
    Io(std::io::Error),
    /// A block's copy.
    Copy(MemError),
}

/// What every worker of a load shares ([`PendingLoad::copy_in`]).
struct LoadPass<'a> {
    file: &'a File,
    path: &'a Path,
    io: &'a dyn BlockIo,
    /// The first entry's offset in the file.
    body: u64,
    stride: usize,
    /// Entries a chunk.
    per: usize,
    chunks: usize,
    /// `(hash, index, checksum)` of every entry, from the index.
    entries: &'a [(BlockHash, u64, u64)],
    /// For each entry, its fresh block among `refs` (`None`: not loaded).
    target: &'a [Option<usize>],
    refs: &'a [SharedBlockRef],
    /// The next chunk to claim.
    next: AtomicUsize,
    /// Set by the first failure: the workers stop claiming.
    stop: AtomicBool,
    /// The failure of the earliest chunk, by chunk.
    failed: Mutex<Option<(usize, ChunkFailed)>>,
}

impl LoadPass<'_> {
    /// Claims chunks until none is left or a worker failed: each read into
    /// `buf` (its bytes hashed piece by piece as they arrive), checked and
    /// its new entries copied into their blocks. `trailer`, where given,
    /// takes every chunk whole (version 1; there is one worker then, so in
    /// file order).
    fn work(&self, buf: &mut HostBuf, mut trailer: Option<&mut Xxh3>) {
        while !self.stop.load(Ordering::Relaxed) {
            let c = self.next.fetch_add(1, Ordering::Relaxed);
            if c >= self.chunks {
                break;
            }
            let first = c * self.per;
            let count = self.per.min(self.entries.len() - first);
            let chunk = &mut buf.as_mut_slice()[..count * self.stride];
            if let Err(e) = self.chunk(first, chunk) {
                self.stop.store(true, Ordering::Relaxed);
                let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
                if failed.as_ref().is_none_or(|(at, _)| c < *at) {
                    *failed = Some((c, e));
                }
                break;
            }
            if let Some(t) = trailer.as_deref_mut() {
                t.update(chunk);
            }
        }
    }

    /// Reads, checks and copies the `chunk.len() / stride` entries from
    /// entry `first`.
    fn chunk(&self, first: usize, chunk: &mut [u8]) -> Result<(), ChunkFailed> {
        let stride = self.stride;
        let parts = stride.div_ceil(PIECE_BYTES);
        let piece = stride.div_ceil(parts);
        for (j, entry) in chunk.chunks_exact_mut(stride).enumerate() {
            let k = first + j;
            let at = self.body + (k * stride) as u64;
            let mut sum = Xxh3::new();
            let mut done = 0;
            while done < stride {
                let end = (done + piece).min(stride);
                self.file
                    .read_exact_at(&mut entry[done..end], at + done as u64)
                    .map_err(ChunkFailed::Io)?;
                sum.update(&entry[done.max(24)..end]);
                done = end;
            }
            let hash = u128::from_le_bytes(entry[..16].try_into().unwrap_or_default());
            let stored = u64::from_le_bytes(entry[16..24].try_into().unwrap_or_default());
            let (want_hash, _, want_sum) = self.entries[k];
            let why = if (hash, stored) != (want_hash, want_sum) {
                format!("block {k} changed while it was being loaded")
            } else if sum.digest() != stored {
                format!(
                    "block {k}'s checksum does not match (corrupted, or changed while it was \
                     being loaded)"
                )
            } else {
                continue;
            };
            return Err(ChunkFailed::Refused(refuse(self.path, why)));
        }
        // The chunk's new entries, as one batch.
        let bb = stride - 24;
        let copies: Vec<_> = chunk
            .chunks_exact(stride)
            .zip(&self.target[first..])
            .filter_map(|(entry, &i)| Some((&self.refs[i?], &entry[24..24 + bb])))
            .collect();
        if copies.is_empty() {
            return Ok(());
        }
        self.io
            .write_blocks_staged(&copies)
            .map_err(ChunkFailed::Copy)
    }
}

impl PendingLoad {
    /// Reads the file's entries once, in chunks of whole entries, and
    /// checks every byte while the new blocks' bytes are copied into their
    /// fresh (not yet visible) blocks: each entry against the index and its
    /// checksum, and the whole file against the trailer. Any mismatch fails
    /// it (the caller then drops the fresh blocks: nothing was loaded).
    ///
    /// [`BUFFERS`] workers (this thread and two more), each with a host
    /// buffer of its own (pinned where the pool has pinned memory), claim
    /// chunks in turn and take each through every step on one core: read
    /// in pieces of at most [`PIECE_BYTES`], each hashed right after its
    /// read (while it is in the core's cache), the entries checked against
    /// the index, the new ones copied into their blocks as one batch. The
    /// reads of one worker overlap the hashes and the copies of the others,
    /// and together they read faster than one reader could. A version-2
    /// trailer is the hash of the index the entries were checked against;
    /// a version-1 file, whose trailer hashes every byte in order, is read
    /// by this thread alone.
    pub fn copy_in(&mut self) -> Result<(), MemError> {
        let f = &self.file;
        let path = f.path.as_path();
        let io = &*f.io;
        let stride = f.stride as usize;
        let n = f.entries.len();
        let per = entries_per_chunk(CHUNK_BYTES, stride);
        let refs = &self.refs.refs;
        let mut target: Vec<Option<usize>> = vec![None; n];
        for (i, &(_, k, _)) in self.fresh.iter().enumerate() {
            if let Some(t) = target.get_mut(k as usize) {
                *t = Some(i);
            }
        }
        let pass = LoadPass {
            file: &f.file,
            path,
            io,
            body: f.head.len() as u64,
            stride,
            per,
            chunks: n.div_ceil(per),
            entries: &f.entries,
            target: &target,
            refs,
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        };
        let mut buffers = chunk_buffers(io, refs.first(), per.min(n.max(1)) * stride);
        let mut whole = (f.trailer_over == TrailerOver::Entries).then(|| {
            let mut t = Xxh3::new();
            t.update(&f.head);
            t
        });
        let workers = if whole.is_some() {
            1
        } else {
            pass.chunks.clamp(1, buffers.len())
        };
        std::thread::scope(|s| {
            let (mine, others) = buffers.split_at_mut(1);
            let pass = &pass;
            let helpers: Vec<_> = others[..workers - 1]
                .iter_mut()
                .map(|buf| s.spawn(move || pass.work(buf, None)))
                .collect();
            pass.work(&mut mine[0], whole.as_mut());
            helpers.into_iter().for_each(joined);
        });
        for buf in buffers {
            io.keep_buffer(buf);
        }
        if let Some((_, failed)) = pass.failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(match failed {
                ChunkFailed::Refused(e) | ChunkFailed::Copy(e) => e,
                ChunkFailed::Io(e) => read_failed(path, e),
            });
        }
        let trailer = match whole {
            Some(t) => t.digest128(),
            None => {
                let mut t = Xxh3::new();
                t.update(&f.head);
                for &(hash, _, sum) in &f.entries {
                    t.update(&hash.to_le_bytes());
                    t.update(&sum.to_le_bytes());
                }
                t.digest128()
            }
        };
        let mut stored = [0u8; 16];
        f.file
            .read_exact_at(&mut stored, pass.body + (n * stride) as u64)
            .map_err(|e| read_failed(path, e))?;
        if trailer != u128::from_le_bytes(stored) {
            return Err(refuse(path, "the file checksum does not match (corrupted)"));
        }
        Ok(())
    }
}

/// A load's read error: a short read is the file truncated meanwhile.
fn read_failed(path: &Path, e: std::io::Error) -> MemError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            refuse(path, "it was truncated while it was being loaded")
        }
        _ => io_err("cannot read the prefix cache", path, e),
    }
}

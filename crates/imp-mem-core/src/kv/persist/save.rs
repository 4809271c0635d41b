//! The streamed save ([`PrefixSnapshot::write`]): a snapshot's entries
//! written to a temporary file, synced and renamed over the old one.
//!
//! Saving streams `<path>.tmp-<pid>-<n>`, syncs it and renames it over
//! `path`, so a reader sees the old file or the new one, never half of one.
//! The old file is opened before the rename and that handle closed on the
//! process's releaser thread (`release_later`): the close that frees its
//! storage (page by page on a tmpfs, a third of the write's time) runs off
//! the save's time instead of inside the rename.
//! A save first removes the temps of earlier saves to the same path whose
//! process is gone (a killed save; Linux, where `/proc` tells), so they do
//! not pile up.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::block_io::{BlockIo, HostBuf};
use super::format::{io_err, FILE_MAGIC, FILE_VERSION};
use super::lent::LentRefs;
use super::release::{open_to_release, release_later};
use super::{chunk_buffers, entries_per_chunk, joined, BUFFERS, SAVE_CHUNK_BYTES};
use crate::error::MemError;
use crate::kv::hash::BlockHash;

/// What a save writes
/// ([`KVCacheManager::snapshot_prefix_cache`](crate::kv::KVCacheManager::snapshot_prefix_cache)).
#[derive(Debug)]
pub struct PrefixSnapshot {
    pub(crate) io: Arc<dyn BlockIo>,
    pub(crate) header: Vec<u8>,
    pub(crate) hashes: Vec<BlockHash>,
    pub(crate) refs: LentRefs,
}

/// Temps of one save: a counter keeps two saves of one process apart.
static SAVES: AtomicU64 = AtomicU64::new(0);

impl PrefixSnapshot {
    /// Writes the file atomically; returns the entries written.
    ///
    /// Streamed in chunks of whole entries through [`BUFFERS`] host
    /// buffers (pinned where the pool has pinned memory) passed along three
    /// stages at once: this thread copies blocks out of the pool into a
    /// chunk laid out as the file is, a second computes the blocks'
    /// checksums into it and feeds the entries' records to the trailer's
    /// hash, and a third writes it to the file.
    pub fn write(self, path: &Path) -> Result<u64, MemError> {
        refuse_irregular(path, "write the prefix cache to")?;
        let file_name = path
            .file_name()
            .ok_or_else(|| MemError::invalid(format!("{} names no file", path.display())))?;
        remove_dead_temps(path);
        let mut tmp_name = file_name.to_os_string();
        tmp_name.push(format!(
            ".tmp-{}-{}",
            std::process::id(),
            SAVES.fetch_add(1, Ordering::Relaxed)
        ));
        let tmp = path.with_file_name(tmp_name);
        let failed = |e| io_err("cannot write the prefix cache to", path, e);
        let written = (|| -> Result<Option<File>, MemError> {
            let file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(failed)?;
            let file = self.stream(file).map_err(|e| match e {
                Streamed::Io(e) => failed(e),
                Streamed::Mem(e) => e,
            })?;
            file.sync_all().map_err(failed)?;
            drop(file);
            let replaced = open_to_release(path);
            fs::rename(&tmp, path).map_err(failed)?;
            Ok(replaced)
        })();
        let replaced = match written {
            Ok(replaced) => replaced,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        if let Some(old) = replaced {
            release_later(old);
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Makes the rename durable; best effort where directories cannot
            // be opened.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(self.hashes.len() as u64)
    }

    /// Writes magic, version, header, entries and trailer to `file` (the
    /// three-stage pipeline of [`Self::write`]); returns the file, unsynced.
    fn stream(&self, mut file: File) -> Result<File, Streamed> {
        let io = &*self.io;
        let bb = io.block_bytes();
        let stride = 24 + bb;
        let per = entries_per_chunk(SAVE_CHUNK_BYTES, stride);
        let mut head = Vec::with_capacity(16 + self.header.len());
        head.extend_from_slice(FILE_MAGIC);
        head.extend_from_slice(&FILE_VERSION.to_le_bytes());
        head.extend_from_slice(&(self.header.len() as u32).to_le_bytes());
        head.extend_from_slice(&self.header);
        file.write_all(&head).map_err(Streamed::Io)?;
        let refs = &self.refs.refs;
        let n = refs.len();
        let stop = AtomicBool::new(false);
        let (free_tx, free_rx) = sync_channel::<HostBuf>(BUFFERS);
        for buf in chunk_buffers(io, refs.first(), per.min(n.max(1)) * stride) {
            let _ = free_tx.send(buf);
        }
        let (hash_tx, hash_rx) = sync_channel::<(usize, HostBuf)>(BUFFERS);
        let (write_tx, write_rx) = sync_channel::<(usize, HostBuf)>(BUFFERS);
        std::thread::scope(|s| {
            let stop = &stop;
            let hasher = s.spawn(move || {
                let mut trailer = Xxh3::new();
                trailer.update(&head);
                for (len, mut buf) in hash_rx {
                    let chunk = &mut buf.as_mut_slice()[..len];
                    for entry in chunk.chunks_exact_mut(stride) {
                        let sum = xxh3_64(&entry[24..]);
                        entry[16..24].copy_from_slice(&sum.to_le_bytes());
                        trailer.update(&entry[..24]);
                    }
                    if write_tx.send((len, buf)).is_err() {
                        break;
                    }
                }
                trailer.digest128()
            });
            let writer = s.spawn(move || {
                let mut failed = None;
                for (len, buf) in write_rx {
                    if failed.is_none() {
                        if let Err(e) = file.write_all(&buf.as_slice()[..len]) {
                            failed = Some(e);
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                    let _ = free_tx.send(buf);
                }
                failed.map_or(Ok(file), Err)
            });
            // This thread: the blocks out of the pool, chunk by chunk.
            let mut copy_failed = None;
            let mut k = 0;
            while k < n && !stop.load(Ordering::Relaxed) {
                let Ok(mut buf) = free_rx.recv() else {
                    break;
                };
                let count = per.min(n - k);
                let chunk = &mut buf.as_mut_slice()[..count * stride];
                let mut copies = Vec::with_capacity(count);
                for (j, entry) in chunk.chunks_exact_mut(stride).enumerate() {
                    let (head, bytes) = entry.split_at_mut(24);
                    head[..16].copy_from_slice(&self.hashes[k + j].to_le_bytes());
                    copies.push((&refs[k + j], bytes));
                }
                if let Err(e) = io.read_blocks_staged(&mut copies) {
                    copy_failed = Some(e);
                    break;
                }
                drop(copies);
                if hash_tx.send((count * stride, buf)).is_err() {
                    break;
                }
                k += count;
            }
            drop(hash_tx);
            let trailer = joined(hasher);
            let file = joined(writer);
            for buf in free_rx.try_iter() {
                io.keep_buffer(buf);
            }
            if let Some(e) = copy_failed {
                return Err(Streamed::Mem(e));
            }
            let mut file = file.map_err(Streamed::Io)?;
            file.write_all(&trailer.to_le_bytes())
                .map_err(Streamed::Io)?;
            Ok(file)
        })
    }
}

/// A streamed save's failure: of the file, or of a block's copy.
enum Streamed {
    Io(std::io::Error),
    Mem(MemError),
}

/// Refuses `path` when it exists and is not a regular file: opening a FIFO
/// blocks until a writer comes, and a device or a directory is no cache.
pub(super) fn refuse_irregular(path: &Path, what: &str) -> Result<(), MemError> {
    match fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(MemError::invalid(format!(
            "cannot {what} {}: it is not a regular file (a directory, FIFO, socket or device); \
             pass the path of a regular file",
            path.display()
        ))),
        _ => Ok(()),
    }
}

/// Removes `<path>.tmp-<pid>[-<n>]` files whose process is gone (killed
/// saves). Only where `/proc` lists processes (Linux); best effort.
fn remove_dead_temps(path: &Path) {
    let proc = Path::new("/proc/self");
    let (Some(name), Some(dir)) = (path.file_name(), path.parent()) else {
        return;
    };
    if !proc.exists() {
        return;
    }
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(listing) = fs::read_dir(dir) else {
        return;
    };
    let mut prefix = name.to_os_string();
    prefix.push(".tmp-");
    let prefix = prefix.to_string_lossy().into_owned();
    for entry in listing.flatten() {
        let file = entry.file_name();
        let Some(rest) = file.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or_default();
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        let regular = entry.file_type().is_ok_and(|t| t.is_file());
        if !alive && regular {
            let _ = fs::remove_file(entry.path());
        }
    }
}

//! Closing the last handle of a replaced or deleted file on a thread of
//! the process's ([`release_later`]), so that freeing its storage runs off
//! the caller's time.

use std::fs::{self, File};
use std::path::Path;
use std::sync::mpsc::sync_channel;

/// The regular file at `path`, opened to be held across the rename that
/// replaces it or the deletion that removes it (then closed by
/// [`release_later`]), or `None` (no file, not a regular one, a symlink,
/// or not readable). Non-blocking, so a FIFO put there meanwhile cannot
/// hang it.
pub(crate) fn open_to_release(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOFOLLOW;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits() as i32)
        .open(path)
        .ok()?;
    file.metadata().ok()?.is_file().then_some(file)
}

/// Closes `file`, the last handle of a deleted or replaced file, on a
/// thread of the process's (started at the first call, then waiting for
/// the next): the close frees the file's storage — on a tmpfs every page
/// of it, as long as a third of writing it — which the rename over its
/// last link (a save) or its deletion (the disk tier's) would otherwise do
/// in the caller's time. The storage is freed a moment after the call
/// returns. Closed here instead when the thread's queue is full (at most
/// [`RELEASE_QUEUE`] files wait, so that waiting handles cannot use up the
/// process's descriptors, and a caller faster than the frees takes its
/// share of them), when the thread cannot start, and in a child forked
/// after it started (which has no such thread).
pub(crate) fn release_later(file: File) {
    type Releaser = Option<(u32, std::sync::mpsc::SyncSender<File>)>;
    static RELEASER: std::sync::OnceLock<Releaser> = std::sync::OnceLock::new();
    let releaser = RELEASER.get_or_init(|| {
        let (tx, rx) = sync_channel::<File>(RELEASE_QUEUE);
        std::thread::Builder::new()
            .name("imp-mem-release".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .ok()
            .map(|_| (std::process::id(), tx))
    });
    match releaser {
        Some((pid, tx)) if *pid == std::process::id() => {
            // Full or gone: the file comes back in the error, closed here.
            drop(tx.try_send(file));
        }
        _ => drop(file),
    }
}

/// Files at most waiting for the releaser thread ([`release_later`]).
pub(crate) const RELEASE_QUEUE: usize = 64;

//! The device ledger (issue 27): one small table per device, shared by
//! every imp-mem process on it, of the tenants that commit its memory.
//!
//! Where it lives: a file `<dir>/<key>.ledger`, where `dir` is
//! `$IMP_MEM_LEDGER_DIR` or `/dev/shm/imp-mem-ledger` and `key` names the
//! device (its UUID; a fake backend's name). Beside it, one liveness file
//! `<key>.<slot>.live` per slot.
//!
//! Protocol. Every read-modify-write of the table happens under an
//! exclusive `flock` on the table file (and, within a process, a mutex: a
//! flock belongs to an open file, which threads share). A tenant holds an
//! exclusive `flock` on its slot's liveness file for as long as it lives;
//! the kernel drops it when the process dies, however it dies (SIGKILL
//! included), so a survivor that takes a slot's liveness lock finds the
//! tenant dead, frees the slot and so returns its commitment to the others
//! ("reaping"). Nothing waits on a pid or a heartbeat.
//!
//! The rule that grants memory: each live tenant *reserves* the larger of
//! its commitment and its floor, and the reservations never sum past the
//! device budget. A tenant may grow by `d` when its commitment plus `d`
//! stays within its cap and within the budget less the others'
//! reservations. So a tenant's growth up to its floor always succeeds (its
//! floor was reserved when it was admitted), the total committed never
//! passes the budget, and whatever is above the floors is elastic: first
//! come, first served, and handed back under pressure.
//!
//! Admission: a tenant is admitted when its floor fits beside the others'
//! reservations. When it does not fit beside their *floors* the join is
//! refused at once ([`MemError::LedgerFull`], naming every tenant and its
//! floor). When the floors fit but the others hold elastic memory, the
//! joiner waits in a pending slot whose `want` asks them to give back;
//! meanwhile its floor counts against the others' elastic growth (not
//! their growth within their own floors), so what they give back is not
//! taken again before the joiner is admitted.
//!
//! Pressure: a refused grow, or a pending join, records a `want` (fresh
//! for [`WANT_TTL_MS`]). [`Tenant::pressure`] tells a tenant how much of
//! the shortfall it should give back: the fresh wants less the free room,
//! shared among the tenants above their floors in proportion to their
//! excess. A tenant answers by evicting and decommitting
//! (`SharedBlockPool::give_back`).
//!
//! Thread safety: [`DeviceLedger`] and [`Tenant`] are `Send + Sync`; each
//! call takes the locks it needs and holds none between calls.
//!
//! Files: `table.rs` (the record format and why a record is never torn),
//! `tests.rs`; the cross-process property test is
//! `tests/ledger_processes.rs`.

mod table;
#[cfg(test)]
mod tests;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rustix::fs::{flock, FlockOperation};

use crate::error::MemError;
use crate::units::human_bytes;

use table::{decode_header, decode_slot, encode_header, encode_slot, Header, RECORD, TABLE_BYTES};
pub use table::{Slot, SlotState, NAME_BYTES, SLOTS};

/// The environment variable that moves the ledger's directory.
pub const DIR_ENV: &str = "IMP_MEM_LEDGER_DIR";
/// The directory when the variable is unset.
pub const DEFAULT_DIR: &str = "/dev/shm/imp-mem-ledger";
/// How long a refused request keeps pressing on the other tenants.
pub const WANT_TTL_MS: u64 = 1000;
const TABLE_SUFFIX: &str = ".ledger";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn io_error(what: &str, path: &Path, err: impl std::fmt::Display) -> MemError {
    MemError::BackendUnavailable(format!(
        "device ledger: cannot {what} {}: {err}; set {DIR_ENV} to a writable directory",
        path.display()
    ))
}

/// The ledger's directory: `$IMP_MEM_LEDGER_DIR`, else [`DEFAULT_DIR`].
pub fn default_dir() -> PathBuf {
    std::env::var_os(DIR_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from)
}

fn check_key(key: &str) -> Result<(), MemError> {
    let ok = !key.is_empty()
        && key.len() <= 128
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !key.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(MemError::invalid(format!(
            "ledger key {key:?} must be 1-128 characters of letters, digits, '-', '_' or '.' \
             (not starting with '.'); use the device's UUID or a plain name"
        )))
    }
}

/// The device keys with a table in `dir` (for `imp-mem top`), sorted.
pub fn list_devices(dir: &Path) -> Result<Vec<String>, MemError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_error("read", dir, e)),
    };
    let mut keys: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(TABLE_SUFFIX))
                .map(str::to_string)
        })
        .filter(|k| check_key(k).is_ok())
        .collect();
    keys.sort();
    Ok(keys)
}

/// One tenant as a snapshot shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantView {
    /// Its slot.
    pub slot: usize,
    /// Its record.
    pub record: Slot,
}

/// The device's table at one moment (dead tenants already reaped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerSnapshot {
    /// The device key.
    pub key: String,
    /// The budget all tenants share.
    pub budget: u64,
    /// The pending and live tenants.
    pub tenants: Vec<TenantView>,
    /// Tenants found dead and reaped while taking it.
    pub reaped: usize,
}

impl LedgerSnapshot {
    /// Bytes committed by all tenants.
    pub fn committed(&self) -> u64 {
        self.tenants.iter().map(|t| t.record.committed).sum()
    }

    /// Bytes reserved (each live tenant's larger of commitment and floor).
    pub fn reserved(&self) -> u64 {
        self.tenants.iter().map(|t| t.record.reserved()).sum()
    }
}

/// The refusal's data lives beside the error that carries it
/// ([`MemError::LedgerFull`]), so that the error type does not depend on
/// the ledger.
pub use crate::error::LedgerRefusal;

struct Table {
    file: File,
    path: PathBuf,
    dir: PathBuf,
    key: String,
    header: Header,
}

/// A device's ledger: the table, opened. Cheap to clone.
#[derive(Clone)]
pub struct DeviceLedger {
    inner: Arc<Mutex<Table>>,
    key: String,
    budget: u64,
}

impl std::fmt::Debug for DeviceLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLedger")
            .field("key", &self.key)
            .field("budget", &self.budget)
            .finish()
    }
}

/// The table, locked: the in-process mutex and the file's flock, released
/// in that order's reverse when dropped.
struct Locked<'a> {
    table: MutexGuard<'a, Table>,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // Unlocking cannot fail on a valid descriptor; the close would drop
        // the lock anyway.
        let _ = flock(&self.table.file, FlockOperation::Unlock);
    }
}

impl Locked<'_> {
    fn read_slot(&self, i: usize) -> Result<Slot, MemError> {
        let mut rec = [0u8; RECORD];
        self.table
            .file
            .read_exact_at(&mut rec, ((i + 1) * RECORD) as u64)
            .map_err(|e| io_error("read", &self.table.path, e))?;
        decode_slot(&rec, i)
    }

    fn read_all(&self) -> Result<Vec<Slot>, MemError> {
        let mut buf = vec![0u8; TABLE_BYTES];
        self.table
            .file
            .read_exact_at(&mut buf, 0)
            .map_err(|e| io_error("read", &self.table.path, e))?;
        (0..SLOTS)
            .map(|i| decode_slot(&buf[(i + 1) * RECORD..(i + 2) * RECORD], i))
            .collect()
    }

    fn write_slot(&self, i: usize, slot: &Slot) -> Result<(), MemError> {
        // One record, one pwrite, 128-aligned: never torn (table.rs).
        let rec = encode_slot(slot);
        self.table
            .file
            .write_all_at(&rec, ((i + 1) * RECORD) as u64)
            .map_err(|e| io_error("write", &self.table.path, e))
    }

    fn live_path(&self, i: usize) -> PathBuf {
        self.table.dir.join(format!("{}.{i}.live", self.table.key))
    }

    /// Frees the slots whose tenant died (its liveness lock is free).
    /// Returns the slots read after reaping.
    fn reap(&self) -> Result<(Vec<Slot>, usize), MemError> {
        let mut slots = self.read_all()?;
        let mut reaped = 0;
        for (i, slot) in slots.iter_mut().enumerate() {
            if slot.state == SlotState::Free {
                continue;
            }
            let path = self.live_path(i);
            let dead = match OpenOptions::new().read(true).open(&path) {
                Ok(f) => match flock(&f, FlockOperation::NonBlockingLockExclusive) {
                    // We hold it now: nobody did. Closing `f` lets it go.
                    Ok(()) => true,
                    Err(e) if e == rustix::io::Errno::WOULDBLOCK => false,
                    Err(e) => return Err(io_error("lock", &path, e)),
                },
                // No liveness file at all: its tenant never finished joining.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
                Err(e) => return Err(io_error("open", &path, e)),
            };
            if dead {
                let next = Slot {
                    generation: slot.generation,
                    ..Slot::default()
                };
                self.write_slot(i, &next)?;
                *slot = next;
                reaped += 1;
            }
        }
        Ok((slots, reaped))
    }
}

fn fresh_want(s: &Slot, now: u64) -> u64 {
    if s.state != SlotState::Free && s.want > 0 && now.saturating_sub(s.want_ms) <= WANT_TTL_MS {
        s.want
    } else {
        0
    }
}

/// What every tenant but `i` holds back from it: a live one its larger of
/// commitment and floor, a pending joiner its floor.
fn others_reserved(slots: &[Slot], i: usize) -> u64 {
    slots
        .iter()
        .enumerate()
        .filter(|&(j, _)| j != i)
        .map(|(_, s)| match s.state {
            SlotState::Pending => s.floor,
            _ => s.reserved(),
        })
        .sum()
}

/// How much tenant `i` may grow now: up to its floor always (that is
/// reserved for it), and beyond it into what the others' reservations and
/// the floors of pending joiners leave (so elastic growth never takes the
/// room a joiner waits for).
fn headroom(slots: &[Slot], i: usize, budget: u64) -> u64 {
    let me = &slots[i];
    let others = others_reserved(slots, i);
    let within_floor = me.floor.saturating_sub(me.committed);
    let by_budget = budget
        .saturating_sub(others)
        .saturating_sub(me.committed)
        .max(within_floor);
    let by_cap = me.cap.saturating_sub(me.committed);
    by_budget.min(by_cap)
}

/// What tenant `i` is asked to give back: the fresh wants of the others
/// less the free room, shared by excess over floor.
fn pressure_on(slots: &[Slot], i: usize, budget: u64, now: u64) -> u64 {
    let me = &slots[i];
    let excess = |s: &Slot| match s.state {
        SlotState::Live => s.committed.saturating_sub(s.floor),
        _ => 0,
    };
    let mine = excess(me);
    if mine == 0 || fresh_want(me, now) > 0 {
        return 0;
    }
    let wants: u64 = slots.iter().map(|s| fresh_want(s, now)).sum();
    let reserved: u64 = slots.iter().map(Slot::reserved).sum();
    let deficit = wants.saturating_sub(budget.saturating_sub(reserved));
    if deficit == 0 {
        return 0;
    }
    let total_excess: u64 = slots
        .iter()
        .filter(|s| fresh_want(s, now) == 0)
        .map(excess)
        .sum();
    let share = (deficit as u128 * mine as u128).div_ceil(total_excess.max(1) as u128) as u64;
    share.min(mine)
}

impl DeviceLedger {
    /// Opens (creating if needed) the table of device `key` in `dir`. The
    /// first opener sets the `budget` all tenants share; a later opener
    /// passing another budget is refused, naming the table's (open it with
    /// [`DeviceLedger::open_existing`] to take whatever the table says).
    pub fn open(dir: &Path, key: &str, budget: u64) -> Result<Self, MemError> {
        if budget == 0 {
            return Err(MemError::invalid(
                "ledger budget must be positive; pass the device's capacity or a cap in bytes",
            ));
        }
        Self::open_with(dir, key, Some(budget))
    }

    /// Opens the existing table of device `key` in `dir` with the budget
    /// its first opener set; refused where there is none (nothing is
    /// created: a table's budget comes from a first opener that knows it).
    pub fn open_existing(dir: &Path, key: &str) -> Result<Self, MemError> {
        Self::open_with(dir, key, None)
    }

    fn open_with(dir: &Path, key: &str, budget: Option<u64>) -> Result<Self, MemError> {
        check_key(key)?;
        let path = dir.join(format!("{key}{TABLE_SUFFIX}"));
        if budget.is_some() {
            std::fs::create_dir_all(dir).map_err(|e| io_error("create", dir, e))?;
        } else if !path.is_file() {
            return Err(MemError::invalid(format!(
                "budget: no ledger for device {key:?} in {} yet; the first opener passes the \
                 device's budget (e.g. \"80GiB\")",
                dir.display()
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(budget.is_some())
            .truncate(false)
            .open(&path)
            .map_err(|e| io_error("open", &path, e))?;
        flock(&file, FlockOperation::LockExclusive).map_err(|e| io_error("lock", &path, e))?;
        // An existing table's header wins; `budget` only writes a new one.
        let header = Self::init(&file, &path, budget.unwrap_or(0));
        // Unlocking cannot fail on a valid descriptor.
        let _ = flock(&file, FlockOperation::Unlock);
        let header = header?;
        if let Some(asked) = budget.filter(|&b| b != header.budget) {
            return Err(MemError::invalid(format!(
                "budget: the ledger of device {key:?} already shares {} ({} B, set by its first \
                 opener), not {} ({asked} B); pass that budget, or budget=None to take the \
                 table's",
                human_bytes(header.budget),
                header.budget,
                human_bytes(asked)
            )));
        }
        Ok(Self {
            inner: Arc::new(Mutex::new(Table {
                file,
                path,
                dir: dir.to_path_buf(),
                key: key.to_string(),
                header,
            })),
            key: key.to_string(),
            budget: header.budget,
        })
    }

    /// Under the flock: the table's header, writing a fresh table where
    /// there is none (slots first, header last, so a valid header means a
    /// whole table).
    fn init(file: &File, path: &Path, budget: u64) -> Result<Header, MemError> {
        let len = file
            .metadata()
            .map_err(|e| io_error("stat", path, e))?
            .len();
        if len >= TABLE_BYTES as u64 {
            let mut rec = [0u8; RECORD];
            file.read_exact_at(&mut rec, 0)
                .map_err(|e| io_error("read", path, e))?;
            if let Some(h) = decode_header(&rec) {
                return Ok(h);
            }
            if rec.iter().any(|&b| b != 0) {
                return Err(MemError::BackendUnavailable(format!(
                    "device ledger: {} is not a ledger table of this version; remove it when no \
                     imp-mem process uses the device",
                    path.display()
                )));
            }
        }
        if budget == 0 {
            // `open_existing` found no table: write none.
            return Err(MemError::invalid(format!(
                "budget: the ledger {} has no table yet; the first opener passes the device's \
                 budget",
                path.display()
            )));
        }
        file.set_len(0).map_err(|e| io_error("truncate", path, e))?;
        file.write_all_at(&vec![0u8; TABLE_BYTES], 0)
            .map_err(|e| io_error("write", path, e))?;
        let header = Header {
            budget,
            created_ms: now_ms(),
        };
        file.write_all_at(&encode_header(&header), 0)
            .map_err(|e| io_error("write", path, e))?;
        Ok(header)
    }

    /// Opens device `key`'s table in [`default_dir`].
    pub fn open_default(key: &str, budget: u64) -> Result<Self, MemError> {
        Self::open(&default_dir(), key, budget)
    }

    /// The device key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The budget all tenants share.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    fn lock(&self) -> Result<Locked<'_>, MemError> {
        let table = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        flock(&table.file, FlockOperation::LockExclusive)
            .map_err(|e| io_error("lock", &table.path, e))?;
        Ok(Locked { table })
    }

    /// The table now, dead tenants reaped.
    pub fn snapshot(&self) -> Result<LedgerSnapshot, MemError> {
        let locked = self.lock()?;
        let (slots, reaped) = locked.reap()?;
        Ok(LedgerSnapshot {
            key: self.key.clone(),
            budget: locked.table.header.budget,
            tenants: slots
                .into_iter()
                .enumerate()
                .filter(|(_, s)| s.state != SlotState::Free)
                .map(|(slot, record)| TenantView { slot, record })
                .collect(),
            reaped,
        })
    }

    /// Admits a tenant `name` with `floor` and `cap` bytes, committing
    /// nothing yet. Refused at once with [`MemError::LedgerFull`] when its
    /// floor does not fit beside the admitted tenants' floors; when it does
    /// but the others hold elastic memory, it presses on them and waits up
    /// to `wait` for them to give it back ([`MemError::Capacity`] after).
    pub fn join(
        &self,
        name: &str,
        floor: u64,
        cap: u64,
        wait: Duration,
    ) -> Result<Tenant, MemError> {
        if cap < floor {
            return Err(MemError::invalid(format!(
                "tenant cap {} is below its floor {}; give a cap of at least {floor} B",
                human_bytes(cap),
                human_bytes(floor)
            )));
        }
        let cap = cap.min(self.budget);
        let deadline = Instant::now() + wait;
        let (slot, generation, live_file) = {
            let locked = self.lock()?;
            let (slots, _) = locked.reap()?;
            self.check_floors(&slots, name, floor)?;
            let mut chosen = None;
            for (i, s) in slots.iter().enumerate() {
                if s.state != SlotState::Free {
                    continue;
                }
                let path = locked.live_path(i);
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)
                    .map_err(|e| io_error("create", &path, e))?;
                match flock(&f, FlockOperation::NonBlockingLockExclusive) {
                    Ok(()) => {
                        chosen = Some((i, s.generation.wrapping_add(1), f));
                        break;
                    }
                    // A tenant that freed its slot and is closing its file.
                    Err(e) if e == rustix::io::Errno::WOULDBLOCK => continue,
                    Err(e) => return Err(io_error("lock", &path, e)),
                }
            }
            let Some((i, generation, f)) = chosen else {
                return Err(MemError::Capacity(format!(
                    "device ledger {}: all {SLOTS} tenant slots are taken",
                    self.key
                )));
            };
            let record = Slot {
                state: SlotState::Pending,
                pid: std::process::id(),
                generation,
                floor,
                cap,
                name: table::truncate_name(name).to_string(),
                updated_ms: now_ms(),
                ..Slot::default()
            };
            locked.write_slot(i, &record)?;
            (i, generation, f)
        };
        let tenant = Tenant {
            ledger: self.clone(),
            slot,
            generation,
            _live: live_file,
        };
        loop {
            {
                let locked = self.lock()?;
                let (slots, _) = locked.reap()?;
                let mut me = tenant.mine(&slots)?;
                let reserved: u64 = slots.iter().map(Slot::reserved).sum();
                let now = now_ms();
                if reserved.saturating_add(floor) <= self.budget {
                    me.state = SlotState::Live;
                    me.want = 0;
                    me.updated_ms = now;
                    locked.write_slot(slot, &me)?;
                    return Ok(tenant);
                }
                self.check_floors(&slots, name, floor)?;
                me.want = floor;
                me.want_ms = now;
                locked.write_slot(slot, &me)?;
                if Instant::now() >= deadline {
                    return Err(MemError::Capacity(format!(
                        "device ledger {}: tenant '{name}' needs a floor of {}; the floors fit, \
                         but the other tenants hold {} above theirs and did not give {} back \
                         within {:?}; wait longer, or have them shrink (give_back)",
                        self.key,
                        human_bytes(floor),
                        human_bytes(
                            slots
                                .iter()
                                .filter(|s| s.state == SlotState::Live)
                                .map(|s| s.committed.saturating_sub(s.floor))
                                .sum()
                        ),
                        human_bytes(floor - self.budget.saturating_sub(reserved)),
                        wait
                    )));
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn check_floors(&self, slots: &[Slot], name: &str, floor: u64) -> Result<(), MemError> {
        let floors: u64 = slots
            .iter()
            .filter(|s| s.state == SlotState::Live)
            .map(|s| s.floor)
            .sum();
        if floors.saturating_add(floor) <= self.budget {
            return Ok(());
        }
        Err(MemError::LedgerFull(Box::new(LedgerRefusal {
            key: self.key.clone(),
            budget: self.budget,
            name: name.to_string(),
            floor,
            tenants: slots
                .iter()
                .filter(|s| s.state == SlotState::Live)
                .map(|s| (s.name.clone(), s.pid, s.floor, s.committed))
                .collect(),
        })))
    }
}

/// A refused grow: what was asked and what the ledger could grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Bytes asked.
    pub asked: u64,
    /// Bytes the ledger could have granted.
    pub headroom: u64,
    /// What the tenant had committed.
    pub committed: u64,
    /// The tenant's cap.
    pub cap: u64,
}

impl Refused {
    /// The tenant's share for an [`crate::error::OomReport`]; `for_tag`:
    /// asked through a backend, for the report's tag.
    pub fn share(&self, for_tag: bool) -> crate::error::TenantShare {
        crate::error::TenantShare {
            committed: self.committed,
            cap: self.cap,
            for_tag,
        }
    }
}

/// One admitted tenant: the right to commit on the device up to what the
/// ledger grants. Dropping it leaves the ledger (its commitment returns).
pub struct Tenant {
    ledger: DeviceLedger,
    slot: usize,
    generation: u32,
    // Held for life: its flock is the liveness mark.
    _live: File,
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("ledger", &self.ledger.key)
            .field("slot", &self.slot)
            .finish()
    }
}

impl Tenant {
    /// The ledger it belongs to.
    pub fn ledger(&self) -> &DeviceLedger {
        &self.ledger
    }

    /// Its slot in the table.
    pub fn slot(&self) -> usize {
        self.slot
    }

    fn mine(&self, slots: &[Slot]) -> Result<Slot, MemError> {
        self.check_mine(&slots[self.slot])
    }

    fn check_mine(&self, me: &Slot) -> Result<Slot, MemError> {
        if me.state == SlotState::Free || me.generation != self.generation {
            return Err(MemError::Invariant(format!(
                "device ledger {}: slot {} no longer belongs to this tenant (reaped while it \
                 lived?)",
                self.ledger.key, self.slot
            )));
        }
        Ok(me.clone())
    }

    fn update<T>(&self, f: impl FnOnce(&[Slot], &mut Slot) -> T) -> Result<T, MemError> {
        let locked = self.ledger.lock()?;
        let slots = locked.read_all()?;
        let mut me = self.mine(&slots)?;
        let out = f(&slots, &mut me);
        me.updated_ms = now_ms();
        locked.write_slot(self.slot, &me)?;
        Ok(out)
    }

    /// Its record now.
    pub fn record(&self) -> Result<Slot, MemError> {
        let locked = self.ledger.lock()?;
        self.check_mine(&locked.read_slot(self.slot)?)
    }

    /// Asks for `bytes` more. Granted (and recorded as committed) when it
    /// fits its cap and the room beside the others' reservations; refused
    /// otherwise, recording a want that presses on the others. A refusal
    /// first reaps dead tenants, so a share freed by a death is found here.
    pub fn grow(&self, bytes: u64) -> Result<Result<(), Refused>, MemError> {
        match self.try_grow(bytes, false)? {
            Ok(()) => Ok(Ok(())),
            Err(_) => self.try_grow(bytes, true),
        }
    }

    fn try_grow(&self, bytes: u64, reap: bool) -> Result<Result<(), Refused>, MemError> {
        let locked = self.ledger.lock()?;
        let slots = if reap {
            locked.reap()?.0
        } else {
            locked.read_all()?
        };
        let mut me = self.mine(&slots)?;
        let room = headroom(&slots, self.slot, self.ledger.budget);
        let now = now_ms();
        let result = if bytes <= room {
            me.committed += bytes;
            me.want = 0;
            Ok(())
        } else {
            // Only what the cap allows presses on the others.
            me.want = bytes.min(me.cap.saturating_sub(me.committed));
            me.want_ms = now;
            Err(Refused {
                asked: bytes,
                headroom: room,
                committed: me.committed,
                cap: me.cap,
            })
        };
        me.updated_ms = now;
        locked.write_slot(self.slot, &me)?;
        Ok(result)
    }

    /// Raises its floor by `bytes`: memory it learned it must always hold
    /// (a warm-up measured past its plan's line, whose bytes torch keeps).
    /// Granted when every tenant's reservation, its own at the new floor,
    /// still fits the budget (always, for bytes it already holds beyond its
    /// floor); refused otherwise, nothing changed. Its cap rises with it.
    pub fn raise_floor(&self, bytes: u64) -> Result<Result<(), Refused>, MemError> {
        let locked = self.ledger.lock()?;
        let slots = locked.reap()?.0;
        let mut me = self.mine(&slots)?;
        let floor = me.floor.saturating_add(bytes);
        let room = self
            .ledger
            .budget
            .saturating_sub(others_reserved(&slots, self.slot));
        if me.committed.max(floor) > room {
            return Ok(Err(Refused {
                asked: bytes,
                headroom: room.saturating_sub(me.reserved()),
                committed: me.committed,
                // Raising the floor raises the cap: the others refused.
                cap: u64::MAX,
            }));
        }
        me.floor = floor;
        me.cap = me.cap.max(floor);
        me.updated_ms = now_ms();
        locked.write_slot(self.slot, &me)?;
        Ok(Ok(()))
    }

    /// Lowers its floor by `bytes` (to zero at most): a join's floor is
    /// planned with room for rounding, and once its tiers are open the
    /// tenant knows what it holds at rest. Always granted (a lower floor
    /// only frees room for the others); its cap stays.
    pub fn lower_floor(&self, bytes: u64) -> Result<(), MemError> {
        self.update(|_, me| me.floor = me.floor.saturating_sub(bytes))
    }

    /// Returns `bytes` of its commitment (a decommit or a release).
    pub fn shrink(&self, bytes: u64) -> Result<(), MemError> {
        self.update(|_, me| me.committed = me.committed.saturating_sub(bytes))
    }

    /// How much it may grow now (cap and the others' reservations).
    pub fn headroom(&self) -> Result<u64, MemError> {
        let locked = self.ledger.lock()?;
        let slots = locked.read_all()?;
        self.mine(&slots)?;
        Ok(headroom(&slots, self.slot, self.ledger.budget))
    }

    /// Bytes the ledger asks it to give back now (0: none).
    pub fn pressure(&self) -> Result<u64, MemError> {
        let locked = self.ledger.lock()?;
        let slots = locked.read_all()?;
        self.mine(&slots)?;
        Ok(pressure_on(&slots, self.slot, self.ledger.budget, now_ms()))
    }

    /// Records the bytes of its KV blocks live now (for operators).
    pub fn set_kv_live(&self, bytes: u64) -> Result<(), MemError> {
        self.update(|_, me| me.kv_live = bytes)
    }

    /// Records its sleep level (0: awake).
    pub fn set_asleep(&self, level: u8) -> Result<(), MemError> {
        self.update(|_, me| me.asleep = level)
    }

    /// Records a want of `bytes` (fresh for [`WANT_TTL_MS`]) without
    /// growing: the other tenants are asked to give it back
    /// ([`Tenant::pressure`]) so that a later [`Tenant::grow`] finds room.
    pub fn want(&self, bytes: u64) -> Result<(), MemError> {
        self.update(|_, me| {
            me.want = bytes.min(me.cap.saturating_sub(me.committed));
            me.want_ms = now_ms();
        })
    }

    /// Withdraws its want (it stopped asking).
    pub fn clear_want(&self) -> Result<(), MemError> {
        self.update(|_, me| me.want = 0)
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        // Free the slot, then (the field's drop) the liveness lock. If this
        // fails the next reaper frees it: the lock goes with the file.
        if let Ok(locked) = self.ledger.lock() {
            if let Ok(me) = locked.read_slot(self.slot) {
                if me.generation == self.generation && me.state != SlotState::Free {
                    let _ = locked.write_slot(
                        self.slot,
                        &Slot {
                            generation: self.generation,
                            ..Slot::default()
                        },
                    );
                }
            }
        }
    }
}

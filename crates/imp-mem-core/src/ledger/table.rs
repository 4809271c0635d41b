//! The ledger's file format: a header record and [`SLOTS`] tenant records,
//! each [`RECORD`] bytes, little-endian, each closed by an xxh3 checksum of
//! its first 120 bytes.
//!
//! Why records of 128 bytes: every change the protocol makes touches one
//! record, written with one `pwrite` at a 128-byte-aligned offset, so it
//! never straddles a page. The kernel copies a page of a write before it
//! looks at a fatal signal again, so a writer killed by SIGKILL leaves a
//! record either old or new, never torn (the checksum would say so, as a
//! typed error, if a foreign file or a bug ever broke this).

use crate::error::MemError;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes per record (the header and every slot).
pub const RECORD: usize = 128;
/// Tenant slots per device.
pub const SLOTS: usize = 63;
/// Bytes of the whole table file.
pub const TABLE_BYTES: usize = RECORD * (SLOTS + 1);
/// Bytes of a tenant's name kept in its slot.
pub const NAME_BYTES: usize = 48;

const MAGIC: &[u8; 8] = b"IMPLEDG1";
const VERSION: u32 = 1;
const SUM_AT: usize = RECORD - 8;

/// The header: what every tenant of this device shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The bytes all tenants together may commit.
    pub budget: u64,
    /// When the table was made (Unix ms).
    pub created_ms: u64,
}

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SlotState {
    /// Nobody.
    #[default]
    Free,
    /// A tenant waiting to be admitted: its floor fits beside the others'
    /// floors, but the others hold more than their floors; its `want` asks
    /// them to give back.
    Pending,
    /// An admitted tenant.
    Live,
}

/// One tenant's record.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Slot {
    /// Free, pending or live.
    pub state: SlotState,
    /// The process.
    pub pid: u32,
    /// Bumped at every join of this slot, so a handle never writes over a
    /// successor's record.
    pub generation: u32,
    /// Bytes its plan must always have.
    pub floor: u64,
    /// The most it may commit.
    pub cap: u64,
    /// Bytes committed now.
    pub committed: u64,
    /// Bytes of KV blocks live now (reported by the tenant, for operators).
    pub kv_live: u64,
    /// Bytes it asked for and was refused, fresh until `want_ms` + TTL.
    pub want: u64,
    /// When `want` was last asserted (Unix ms).
    pub want_ms: u64,
    /// Sleep level (0: awake).
    pub asleep: u8,
    /// Its name (truncated to [`NAME_BYTES`]).
    pub name: String,
    /// Last update (Unix ms).
    pub updated_ms: u64,
}

impl Slot {
    /// What this tenant holds against the budget: its commitment, or its
    /// floor where that is larger (a floor is reserved whether committed or
    /// not). A pending tenant holds nothing yet.
    pub fn reserved(&self) -> u64 {
        match self.state {
            SlotState::Live => self.committed.max(self.floor),
            _ => 0,
        }
    }
}

fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u32(buf: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(b)
}

fn get_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}

fn seal(rec: &mut [u8; RECORD]) {
    let sum = xxh3_64(&rec[..SUM_AT]);
    put_u64(rec, SUM_AT, sum);
}

fn sealed(rec: &[u8]) -> bool {
    get_u64(rec, SUM_AT) == xxh3_64(&rec[..SUM_AT])
}

/// The header's bytes.
pub fn encode_header(h: &Header) -> [u8; RECORD] {
    let mut rec = [0u8; RECORD];
    rec[..8].copy_from_slice(MAGIC);
    put_u32(&mut rec, 8, VERSION);
    put_u32(&mut rec, 12, SLOTS as u32);
    put_u64(&mut rec, 16, h.budget);
    put_u64(&mut rec, 24, h.created_ms);
    seal(&mut rec);
    rec
}

/// The header, or `None` where the record is not one (a table never
/// finished, a foreign file).
pub fn decode_header(rec: &[u8]) -> Option<Header> {
    if rec.len() < RECORD
        || &rec[..8] != MAGIC
        || get_u32(rec, 8) != VERSION
        || get_u32(rec, 12) != SLOTS as u32
        || !sealed(rec)
    {
        return None;
    }
    Some(Header {
        budget: get_u64(rec, 16),
        created_ms: get_u64(rec, 24),
    })
}

/// A slot's bytes.
pub fn encode_slot(s: &Slot) -> [u8; RECORD] {
    let mut rec = [0u8; RECORD];
    let state = match s.state {
        SlotState::Free => 0u8,
        SlotState::Pending => 1,
        SlotState::Live => 2,
    };
    rec[0] = state;
    rec[1] = s.asleep;
    put_u32(&mut rec, 4, s.pid);
    put_u64(&mut rec, 8, s.floor);
    put_u64(&mut rec, 16, s.cap);
    put_u64(&mut rec, 24, s.committed);
    put_u64(&mut rec, 32, s.kv_live);
    put_u64(&mut rec, 40, s.want);
    put_u64(&mut rec, 48, s.want_ms);
    put_u32(&mut rec, 56, s.generation);
    put_u64(&mut rec, 60, s.updated_ms);
    let name = truncate_name(&s.name);
    rec[68..68 + name.len()].copy_from_slice(name.as_bytes());
    seal(&mut rec);
    rec
}

/// `name` cut to at most [`NAME_BYTES`] bytes at a character boundary.
pub fn truncate_name(name: &str) -> &str {
    let mut end = name.len().min(NAME_BYTES);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// A slot from its bytes; an all-zero record is a free slot (a fresh
/// table).
pub fn decode_slot(rec: &[u8], index: usize) -> Result<Slot, MemError> {
    if rec.iter().all(|&b| b == 0) {
        return Ok(Slot::default());
    }
    if !sealed(rec) {
        return Err(MemError::Invariant(format!(
            "device ledger: slot {index} fails its checksum (a torn or foreign write)"
        )));
    }
    let state = match rec[0] {
        0 => SlotState::Free,
        1 => SlotState::Pending,
        2 => SlotState::Live,
        other => {
            return Err(MemError::Invariant(format!(
                "device ledger: slot {index} has state {other}"
            )))
        }
    };
    let name_bytes = &rec[68..68 + NAME_BYTES];
    let len = name_bytes
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(NAME_BYTES);
    Ok(Slot {
        state,
        asleep: rec[1],
        pid: get_u32(rec, 4),
        floor: get_u64(rec, 8),
        cap: get_u64(rec, 16),
        committed: get_u64(rec, 24),
        kv_live: get_u64(rec, 32),
        want: get_u64(rec, 40),
        want_ms: get_u64(rec, 48),
        generation: get_u32(rec, 56),
        updated_ms: get_u64(rec, 60),
        name: String::from_utf8_lossy(&name_bytes[..len]).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_a_flipped_byte_is_caught() {
        let slot = Slot {
            state: SlotState::Live,
            pid: 4242,
            generation: 7,
            floor: 3 << 30,
            cap: 40 << 30,
            committed: 5 << 30,
            kv_live: 1 << 30,
            want: 64 << 20,
            want_ms: 99,
            asleep: 1,
            name: "qwen3-8b ✓".to_string(),
            updated_ms: 123,
        };
        let mut rec = encode_slot(&slot);
        assert_eq!(decode_slot(&rec, 0).unwrap(), slot);
        rec[9] ^= 1;
        assert!(decode_slot(&rec, 0).is_err());
        let h = Header {
            budget: 1 << 40,
            created_ms: 5,
        };
        let mut rec = encode_header(&h);
        assert_eq!(decode_header(&rec), Some(h));
        rec[17] ^= 1;
        assert_eq!(decode_header(&rec), None);
        assert_eq!(decode_slot(&[0u8; RECORD], 3).unwrap(), Slot::default());
    }

    #[test]
    fn a_long_name_is_cut_at_a_character_boundary() {
        let name = "é".repeat(40);
        let cut = truncate_name(&name);
        assert!(cut.len() <= NAME_BYTES && cut.len() % 2 == 0);
    }
}

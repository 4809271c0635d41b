//! Token ids from the forms callers hold them in: the decoding rule behind
//! every reader of the Python binding, kept here so that `cargo test`
//! proves it.
//!
//! A token id is an integer in `0..=u32::MAX`, whatever it arrives as.
//! Two shapes of input reach the rule:
//!
//! * raw integers of one layout ([`IntLayout`]: 1, 2, 4 or 8 bytes, signed
//!   or not, either byte order), as a buffer or a NumPy array holds them:
//!   [`ids_from_bytes`] converts them in one vectorised pass and looks for
//!   the id to name only when the pass saw one out of range;
//! * items, one at a time, as a list or tuple of Python ints holds them:
//!   [`item_id`] is the rule for one ([`TokenItem`] says what the binding
//!   found), [`IdNarrower`] the fast loop for many plain ints, which defers
//!   the range check to one test at the end.
//!
//! Both name the first bad id with the same message
//! (`token id V is outside 0..=4294967295`), so a list and an array of the
//! same ids are refused alike; an item that is not an integer at all is
//! named by its position and type. Pure functions, no shared state.

use crate::MemError;

/// The message for an id outside `0..=u32::MAX` (`v` as Python prints it).
pub fn out_of_range(v: impl std::fmt::Display) -> MemError {
    MemError::invalid(format!("token id {v} is outside 0..=4294967295"))
}

/// Refuses 4-byte signed ids read as `u32` (an `int32` array read in
/// place) when one was negative, naming the first. The check is one
/// branch-free pass (it vectorises); only a bad id is looked for.
pub fn check_int32(ids: &[u32]) -> Result<(), MemError> {
    if ids.iter().fold(0u32, |acc, &v| acc | v) > i32::MAX as u32 {
        if let Some(&v) = ids.iter().find(|&&v| v > i32::MAX as u32) {
            return Err(out_of_range(v as i32));
        }
    }
    Ok(())
}

/// How a buffer's integers are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntLayout {
    /// Bytes an integer: 1, 2, 4 or 8.
    pub size: usize,
    /// Two's complement or unsigned.
    pub signed: bool,
    /// Most significant byte first.
    pub big_endian: bool,
}

impl IntLayout {
    /// The layout of integers of `size` bytes in this machine's byte order.
    pub fn native(size: usize, signed: bool) -> Self {
        Self {
            size,
            signed,
            big_endian: cfg!(target_endian = "big"),
        }
    }

    /// A buffer's layout from its struct-module `format` and `itemsize`,
    /// or the refusal of a buffer that does not hold integers.
    pub fn from_format(format: &str, itemsize: usize) -> Result<Self, MemError> {
        let (big_endian, code) = match format.as_bytes() {
            [b'>' | b'!', c] => (true, *c),
            [b'<', c] => (false, *c),
            [b'=' | b'@', c] | [c] => (cfg!(target_endian = "big"), *c),
            _ => (false, b'?'),
        };
        let signed = match code {
            b'b' | b'h' | b'i' | b'l' | b'q' | b'n' => true,
            b'B' | b'H' | b'I' | b'L' | b'Q' | b'N' => false,
            _ => {
                return Err(MemError::invalid(format!(
                    "tokens must be integers; the buffer's format is {format:?}"
                )))
            }
        };
        if !matches!(itemsize, 1 | 2 | 4 | 8) {
            return Err(MemError::invalid(format!(
                "unsupported integer size {itemsize}"
            )));
        }
        Ok(Self {
            size: itemsize,
            signed,
            big_endian,
        })
    }
}

/// Refuses a buffer of more than one dimension.
pub fn one_dimensional(ndim: usize) -> Result<(), MemError> {
    if ndim > 1 {
        return Err(MemError::invalid(format!(
            "tokens must be one-dimensional, got {ndim} dimensions"
        )));
    }
    Ok(())
}

/// Converts integers laid out as `layout` (a trailing partial integer is
/// ignored) to token ids, refusing any outside `0..=u32::MAX` and naming
/// the first.
pub fn ids_from_bytes(bytes: &[u8], layout: IntLayout) -> Result<Vec<u32>, MemError> {
    let IntLayout {
        size,
        signed,
        big_endian: big,
    } = layout;
    // Little-endian integers of every size. Each is a loop over a zeroed
    // vector (it vectorises; a collect over the chunks did not) and a
    // branch-free check; only a bad id is looked for. (Signed 1- and 2-byte
    // ids are sign-extended, so the int32 check finds a negative one.)
    if !big {
        match size {
            4 => {
                let mut out = vec![0u32; bytes.len() / 4];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes(c.try_into().unwrap_or([0; 4]));
                }
                if signed {
                    check_int32(&out)?;
                }
                return Ok(out);
            }
            1 => {
                let mut out = vec![0u32; bytes.len()];
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = if signed { b as i8 as u32 } else { u32::from(b) };
                }
                if signed {
                    check_int32(&out)?;
                }
                return Ok(out);
            }
            2 => {
                let mut out = vec![0u32; bytes.len() / 2];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    let v = u16::from_le_bytes(c.try_into().unwrap_or([0; 2]));
                    *o = if signed {
                        v as i16 as u32
                    } else {
                        u32::from(v)
                    };
                }
                if signed {
                    check_int32(&out)?;
                }
                return Ok(out);
            }
            8 => {
                // One pass: narrow each id and gather its high halves.
                let mut out = vec![0u32; bytes.len() / 8];
                let mut high = 0u64;
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                    let v = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
                    high |= v >> 32;
                    *o = v as u32;
                }
                if high != 0 {
                    let v = bytes
                        .chunks_exact(8)
                        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                        .map(|v| if signed { v as i64 as i128 } else { v as i128 })
                        .find(|&v| !(0..=u32::MAX as i128).contains(&v))
                        .unwrap_or(-1);
                    return Err(out_of_range(v));
                }
                return Ok(out);
            }
            _ => {}
        }
    }
    if !matches!(size, 1 | 2 | 4 | 8) {
        return Err(MemError::invalid(format!(
            "unsupported integer size {size}"
        )));
    }
    let mut out = Vec::with_capacity(bytes.len() / size);
    for chunk in bytes.chunks_exact(size) {
        let mut word = [0u8; 8];
        let u = if big {
            word[8 - size..].copy_from_slice(chunk);
            u64::from_be_bytes(word)
        } else {
            word[..size].copy_from_slice(chunk);
            u64::from_le_bytes(word)
        };
        let shift = 64 - 8 * size as u32;
        let v: i128 = if signed {
            ((u << shift) as i64 >> shift) as i128
        } else {
            u as i128
        };
        out.push(u32::try_from(v).map_err(|_| out_of_range(v))?);
    }
    Ok(out)
}

/// One item of a sequence of token ids, as the binding found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenItem<'a> {
    /// An integer that fits an `i64`.
    Int(i64),
    /// An integer beyond `i64`, in decimal (or however it can be named).
    Huge(&'a str),
    /// `True` or `False`: refused as a NumPy bool array is, since a bool
    /// where an id belongs is a mistake, not id 0 or 1.
    Bool,
    /// Anything else that is not an integer, by its type's name.
    NotInteger(&'a str),
}

/// The rule for item `index` of a sequence of token ids.
pub fn item_id(index: usize, item: TokenItem<'_>) -> Result<u32, MemError> {
    match item {
        TokenItem::Int(v) => u32::try_from(v).map_err(|_| out_of_range(v)),
        TokenItem::Huge(v) => Err(out_of_range(v)),
        TokenItem::Bool => Err(MemError::invalid(format!(
            "tokens must be integers; item {index} is a bool"
        ))),
        TokenItem::NotInteger(type_name) => Err(MemError::invalid(format!(
            "tokens must be integers; item {index} is a {type_name}"
        ))),
    }
}

/// Narrows `i64` ids to `u32` as they are read, gathering the bits that
/// say whether one was out of range instead of testing each: one `or` an
/// item, one test at the end ([`IdNarrower::in_range`]). A reader that
/// finds them out of range (or meets an item that is not a plain integer)
/// starts again with [`item_id`] on every item, which names the first bad
/// one.
#[derive(Debug, Default)]
pub struct IdNarrower {
    high: u64,
}

impl IdNarrower {
    /// Notes `v` and returns its low 32 bits (the id, if all are in range).
    #[inline(always)]
    pub fn narrow(&mut self, v: i64) -> u32 {
        self.high |= (v as u64) >> 32;
        v as u32
    }

    /// True when every id noted was in `0..=u32::MAX`.
    #[inline(always)]
    pub fn in_range(&self) -> bool {
        self.high == 0
    }
}

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
//! (`tokens: token id V is outside 0 to 4294967295 (ids are unsigned 32-bit)`), so a list and an array of the
//! same ids are refused alike; an item that is not an integer at all is
//! named by its position and type. Pure functions, no shared state.

use crate::MemError;

/// The message for an id outside `0..=u32::MAX` (`v` as Python prints it).
pub fn out_of_range(v: impl std::fmt::Display) -> MemError {
    MemError::invalid(format!(
        "tokens: token id {v} is outside 0 to 4294967295 (ids are unsigned 32-bit)"
    ))
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SIZES: [usize; 4] = [1, 2, 4, 8];

    /// The rule written the slow way: each integer decoded into an `i128`
    /// and tested on its own, the first one outside `0..=u32::MAX` named.
    fn model(bytes: &[u8], layout: IntLayout) -> Result<Vec<u32>, String> {
        bytes
            .chunks_exact(layout.size)
            .map(|chunk| {
                let mut ordered = chunk.to_vec();
                if layout.big_endian {
                    ordered.reverse();
                }
                let mut v: i128 = 0;
                for (k, &b) in ordered.iter().enumerate() {
                    v |= i128::from(b) << (8 * k);
                }
                let top = 8 * layout.size as u32;
                if layout.signed && v >> (top - 1) == 1 {
                    v -= 1i128 << top;
                }
                u32::try_from(v).map_err(|_| {
                    format!(
                        "tokens: token id {v} is outside 0 to 4294967295 (ids are unsigned 32-bit)"
                    )
                })
            })
            .collect()
    }

    /// The list reader's two loops: the fast one (every item narrowed, one
    /// range test) and, when it gives up, the careful one (`item_id` on
    /// each, the first error kept).
    fn read_items(items: &[TokenItem<'_>]) -> Result<Vec<u32>, String> {
        let mut narrow = IdNarrower::default();
        let mut fast = Vec::new();
        for item in items {
            match item {
                TokenItem::Int(v) => fast.push(narrow.narrow(*v)),
                _ => break,
            }
        }
        if fast.len() == items.len() && narrow.in_range() {
            return Ok(fast);
        }
        items
            .iter()
            .enumerate()
            .map(|(i, &item)| item_id(i, item))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())
    }

    fn layouts() -> impl Strategy<Value = IntLayout> {
        (
            prop::sample::select(&SIZES[..]),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(size, signed, big_endian)| IntLayout {
                size,
                signed,
                big_endian,
            })
    }

    /// Ids near the edges of every width, so that both sides of each range
    /// test are drawn often.
    fn edgy_i64() -> impl Strategy<Value = i64> {
        prop_oneof![
            0i64..70_000,
            (-3i64..3).prop_map(|d| i64::from(u32::MAX) + d),
            (-3i64..3).prop_map(|d| i64::from(i32::MAX) + d),
            (-3i64..3).prop_map(|d| (1i64 << 30) + d),
            -70_000i64..0,
            any::<i64>(),
            Just(i64::MIN),
            Just(i64::MAX),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Every layout's conversion (the vectorised loops and the general
        /// one) reads what the slow rule reads, and refuses with its message.
        #[test]
        fn bytes_convert_as_the_slow_rule_says(
            layout in layouts(),
            bytes in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            let got = ids_from_bytes(&bytes, layout).map_err(|e| e.to_string());
            prop_assert_eq!(got, model(&bytes, layout));
        }

        /// The same ids as a list of ints and as an int64 array (what NumPy
        /// makes of that list): the same ids, or the same refusal naming
        /// the same first id.
        #[test]
        fn a_list_reads_as_its_int64_array(values in prop::collection::vec(edgy_i64(), 0..300)) {
            let items: Vec<_> = values.iter().map(|&v| TokenItem::Int(v)).collect();
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let array = ids_from_bytes(&bytes, IntLayout::native(8, true));
            prop_assert_eq!(read_items(&items), array.map_err(|e| e.to_string()));
        }

        /// And as an int32 array read in place (`check_int32` on the raw
        /// words), for the ids that fit one.
        #[test]
        fn a_list_reads_as_its_int32_array(values in prop::collection::vec(any::<i32>(), 0..300)) {
            let items: Vec<_> = values.iter().map(|&v| TokenItem::Int(i64::from(v))).collect();
            let words: Vec<u32> = values.iter().map(|&v| v as u32).collect();
            let in_place = check_int32(&words).map(|()| words).map_err(|e| e.to_string());
            prop_assert_eq!(read_items(&items), in_place);
        }

        /// An item that is not an integer is refused by position wherever
        /// it is, unless an id before it is already out of range.
        #[test]
        fn the_first_bad_item_is_named(
            values in prop::collection::vec(0i64..100, 1..50),
            at in any::<prop::sample::Index>(),
            kind in 0..4u8,
            earlier_bad in any::<bool>(),
        ) {
            let at = at.index(values.len());
            let mut items: Vec<_> = values.iter().map(|&v| TokenItem::Int(v)).collect();
            items[at] = match kind {
                0 => TokenItem::Bool,
                1 => TokenItem::NotInteger("float"),
                2 => TokenItem::Huge("18446744073709551616"),
                _ => TokenItem::Int(-1),
            };
            let expected = match kind {
                0 => format!("tokens must be integers; item {at} is a bool"),
                1 => format!("tokens must be integers; item {at} is a float"),
                2 => "tokens: token id 18446744073709551616 is outside 0 to 4294967295 (ids are unsigned 32-bit)".to_string(),
                _ => "tokens: token id -1 is outside 0 to 4294967295 (ids are unsigned 32-bit)".to_string(),
            };
            if earlier_bad && at > 0 {
                items[0] = TokenItem::Int(1 << 33);
                prop_assert_eq!(
                    read_items(&items),
                    Err("tokens: token id 8589934592 is outside 0 to 4294967295 (ids are unsigned 32-bit)".to_string())
                );
            } else {
                prop_assert_eq!(read_items(&items), Err(expected));
            }
        }

        /// Any format string and item size is read or refused, never a panic.
        #[test]
        fn any_format_is_read_or_refused(format in ".{0,3}", itemsize in 0usize..20) {
            if let Ok(layout) = IntLayout::from_format(&format, itemsize) {
                prop_assert!(SIZES.contains(&layout.size));
                prop_assert_eq!(layout.size, itemsize);
            }
        }
    }

    #[test]
    fn struct_formats_name_their_layouts() {
        let le = cfg!(target_endian = "little");
        for (format, signed, big) in [
            ("i", true, !le),
            ("<i", true, false),
            (">I", false, true),
            ("!q", true, true),
            ("=H", false, !le),
            ("@B", false, !le),
            ("n", true, !le),
        ] {
            let layout = IntLayout::from_format(format, 4);
            assert_eq!(
                layout.map(|l| (l.signed, l.big_endian)),
                Ok((signed, big)),
                "{format}"
            );
        }
        for refused in ["d", "f", "?", "e", "<d", "xi", "", "ii", "O"] {
            let err = IntLayout::from_format(refused, 8).map_err(|e| e.to_string());
            assert_eq!(
                err,
                Err(format!(
                    "tokens must be integers; the buffer's format is {refused:?}"
                ))
            );
        }
        assert_eq!(
            IntLayout::from_format("i", 3).map_err(|e| e.to_string()),
            Err("unsupported integer size 3".to_string())
        );
        assert!(ids_from_bytes(&[0; 6], IntLayout::native(3, false)).is_err());
        assert!(one_dimensional(1).is_ok() && one_dimensional(0).is_ok());
        assert_eq!(
            one_dimensional(2).map_err(|e| e.to_string()),
            Err("tokens must be one-dimensional, got 2 dimensions".to_string())
        );
    }

    #[test]
    fn an_int32_read_in_place_names_its_first_negative_id() {
        let words = [5, i32::MAX as u32, (-7i32) as u32, (-9i32) as u32];
        assert_eq!(
            check_int32(&words).map_err(|e| e.to_string()),
            Err(
                "tokens: token id -7 is outside 0 to 4294967295 (ids are unsigned 32-bit)"
                    .to_string()
            )
        );
        assert_eq!(check_int32(&words[..2]), Ok(()));
    }
}

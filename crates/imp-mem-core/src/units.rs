//! Byte-size helpers shared by messages and reports.

/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// Renders a byte count for a human: `512 B`, `4.0 KiB`, `1.50 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value >= 100.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else if value >= 10.0 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two), or `None` on
/// overflow.
pub fn align_up(value: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    value.checked_add(align - 1).map(|v| v & !(align - 1))
}

/// Rounds `value` up to a multiple of `granule` (any positive number), or
/// `None` on overflow.
pub fn round_up(value: usize, granule: usize) -> Option<usize> {
    if granule <= 1 {
        return Some(value);
    }
    value.div_ceil(granule).checked_mul(granule)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_picks_a_unit() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(4096), "4.00 KiB");
        assert_eq!(human_bytes(3 * GIB / 2), "1.50 GiB");
        assert_eq!(human_bytes(200 * MIB), "200 MiB");
    }

    #[test]
    fn rounding() {
        assert_eq!(align_up(1, 256), Some(256));
        assert_eq!(align_up(256, 256), Some(256));
        assert_eq!(align_up(usize::MAX, 2), None);
        assert_eq!(round_up(5, 3), Some(6));
        assert_eq!(round_up(0, 3), Some(0));
    }
}

/// Parses a byte count written for a human: `80GiB`, `80 GB`, `81920MiB`,
/// `1.5GiB`, `4096`, `512k`. Binary and decimal suffixes are both honoured
/// (`GiB` = 2^30, `GB` = 10^9); a bare `G`/`M`/`K` is binary.
pub fn parse_bytes(text: &str) -> Result<u64, crate::error::MemError> {
    let bad = || {
        crate::error::MemError::invalid(format!(
            "cannot read {text:?} as a byte count; write e.g. 80GiB, 80 GB, 81920MiB or 4096"
        ))
    };
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number = number.replace('_', "");
    if number.is_empty() {
        return Err(bad());
    }
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(scale).ok_or_else(bad);
    }
    let value: f64 = number.parse().map_err(|_| bad())?;
    let bytes = value * scale as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    #[test]
    fn parses_the_usual_spellings() {
        assert_eq!(parse_bytes("80GiB").unwrap(), 80 * GIB);
        assert_eq!(parse_bytes("80 GB").unwrap(), 80_000_000_000);
        assert_eq!(parse_bytes("81920MiB").unwrap(), 80 * GIB);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("512k").unwrap(), 512 * 1024);
        for bad in [
            "",
            "GiB",
            "80 parsecs",
            "-1GiB",
            "1e999",
            "99999999999999999999TiB",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}

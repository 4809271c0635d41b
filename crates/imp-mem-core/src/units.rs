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

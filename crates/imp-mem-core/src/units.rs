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

/// The most a size may say: 256 PiB, past any device or host memory.
pub const MAX_SIZE: u64 = 1 << 58;

/// Parses a size written for a human, the one rule every size argument
/// follows (Python and the CLI alike): a number and a unit, `80GiB`,
/// `80 GB`, `81920MiB`, `1.5GiB`, `512k`, `4096B`. The units are binary
/// and case-blind: `K`/`KB`/`KiB` = 2^10, `M`/`MB`/`MiB` = 2^20,
/// `G`/`GB`/`GiB` = 2^30, `T`/`TB`/`TiB` = 2^40, `P`/`PB`/`PiB` = 2^50 (a
/// GPU sold as "80GB" holds 80 GiB, so `80GB` means what its owner
/// means); `B` is bytes and must be whole. A bare number is refused: no
/// size is read as bytes by default (Python passes an `int` for bytes).
/// A negative size, or one past [`MAX_SIZE`], is refused as such.
/// Errors say the text and what to write; the caller prefixes the name of
/// the argument.
pub fn parse_bytes(text: &str) -> Result<u64, crate::error::MemError> {
    let err = |why: String| crate::error::MemError::invalid(why);
    let bad = || {
        err(format!(
            "cannot read {text:?} as a byte count; write a number and a unit, e.g. 80GiB, \
             512MiB or 4096B"
        ))
    };
    let s = text.trim();
    if let Some(rest) = s.strip_prefix('-') {
        if rest
            .trim_start()
            .starts_with(|c: char| c.is_ascii_digit() || c == '.')
        {
            return Err(err(format!(
                "{text:?} is negative; a size must be positive"
            )));
        }
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number = number.replace('_', "");
    if number.is_empty() || number == "." {
        return Err(bad());
    }
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" => {
            return Err(err(format!(
                "{text:?} has no unit; write \"{number}{}\" (a size takes a unit: B, KiB, MiB, \
                 GiB or TiB)",
                suggested_unit(&number)
            )))
        }
        "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => return Err(bad()),
    };
    let too_large = || {
        err(format!(
            "{text:?} is too large; a size is at most {}",
            human_bytes(MAX_SIZE)
        ))
    };
    let bytes = if let Ok(whole) = number.parse::<u64>() {
        whole.checked_mul(1 << shift).ok_or_else(too_large)?
    } else {
        let value: f64 = number.parse().map_err(|_| bad())?;
        let bytes = value * (1u64 << shift) as f64;
        if !bytes.is_finite() || bytes >= MAX_SIZE as f64 * 2.0 {
            return Err(too_large());
        }
        if shift == 0 && bytes.fract() != 0.0 {
            return Err(err(format!(
                "{text:?} is not a whole number of bytes; write bytes as a whole number \
                 (\"{}B\") or use a larger unit (\"{number}KiB\")",
                bytes.round()
            )));
        }
        bytes.round() as u64
    };
    if bytes > MAX_SIZE {
        return Err(too_large());
    }
    Ok(bytes)
}

/// The unit that makes a bare `number` a plausible memory size, for the
/// suggestion when it came without one: GiB up to 512 (a device or a
/// host's share of one), MiB up to 512 Ki (so `527` means the CUDA
/// context's 527 MiB, not 527 GiB), else bytes.
fn suggested_unit(number: &str) -> &'static str {
    match number.parse::<f64>() {
        Ok(n) if n <= 512.0 => "GiB",
        Ok(n) if n <= 512.0 * 1024.0 => "MiB",
        _ => "B",
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    #[test]
    fn parses_the_usual_spellings() {
        assert_eq!(parse_bytes("80GiB").unwrap(), 80 * GIB);
        assert_eq!(parse_bytes("80 GB").unwrap(), 80 * GIB);
        assert_eq!(parse_bytes("80g").unwrap(), 80 * GIB);
        assert_eq!(parse_bytes("81920MiB").unwrap(), 80 * GIB);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_bytes("4096B").unwrap(), 4096);
        assert_eq!(parse_bytes("512k").unwrap(), 512 * 1024);
        assert_eq!(parse_bytes("256PiB").unwrap(), MAX_SIZE);
        for bad in ["", "GiB", "80 parsecs", "1e999", "."] {
            let e = parse_bytes(bad).unwrap_err().to_string();
            assert!(e.contains("cannot read"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_bare_number_is_refused_with_a_plausible_unit() {
        let e = parse_bytes("80").unwrap_err().to_string();
        assert!(e.contains("no unit") && e.contains("\"80GiB\""), "{e}");
        let e = parse_bytes("527").unwrap_err().to_string();
        assert!(e.contains("\"527MiB\"") && !e.contains("527GiB"), "{e}");
        let e = parse_bytes("1.5").unwrap_err().to_string();
        assert!(e.contains("\"1.5GiB\"") && !e.contains("1.5B"), "{e}");
        let e = parse_bytes("99999999").unwrap_err().to_string();
        assert!(e.contains("\"99999999B\""), "{e}");
    }

    #[test]
    fn negative_fractional_bytes_and_too_large_say_so() {
        for neg in ["-1GiB", " -1 GiB", "-0.5MiB"] {
            let e = parse_bytes(neg).unwrap_err().to_string();
            assert!(e.contains("negative"), "{neg}: {e}");
        }
        for big in ["99999999TiB", "257PiB", "99999999999999999999TiB", "1e3000"] {
            let e = parse_bytes(big).unwrap_err().to_string();
            assert!(
                e.contains("too large") || e.contains("cannot read"),
                "{big}: {e}"
            );
        }
        assert!(parse_bytes("99999999TiB")
            .unwrap_err()
            .to_string()
            .contains("too large"));
        let e = parse_bytes("1.5B").unwrap_err().to_string();
        assert!(e.contains("whole number of bytes"), "{e}");
        assert_eq!(parse_bytes("0.5KiB").unwrap(), 512);
    }
}

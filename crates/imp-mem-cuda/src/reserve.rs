//! The measured charges: the CUDA context's cost and the library reserve
//! (seed A1.5, A5.3, open question "LibraryReserve calibration"), remembered
//! across starts in a small JSON file keyed by a fingerprint.
//!
//! The library reserve is memory the CUDA libraries (cuBLAS, cuBLASLt,
//! CUTLASS) claim on their first dispatch, outside any allocator; the
//! context cost is what the driver takes for a context before anything is
//! allocated. Neither is visible to an allocator, both are invariant to batch
//! and context length, and both change with the GPU, the driver and the
//! library versions — so they are measured once per *fingerprint* (GPU name,
//! driver version, CUDA version, library versions as the caller names them)
//! and charged by the planner as named line items.
//!
//! Procedure (driven from Python; `tools/measure_reserve.py`):
//!
//! 1. A parent process with its own context reads the device's free memory,
//!    starts a child, and reads it again once the child has created its
//!    context and allocated nothing: the difference is `context_bytes`.
//! 2. The child reads device used memory and its allocator's reserved bytes,
//!    runs the first bf16 matmul through torch (cuBLAS), synchronises, and
//!    reads both again. `library_reserve_bytes` = Δ device used − Δ reserved
//!    by the allocator ([`Readings`] → [`measurement_from`]).
//! 3. The result is stored under the fingerprint ([`ReserveCache::insert`],
//!    [`ReserveCache::store`]: write to a temporary file in the same
//!    directory, flush, rename — a reader sees the old file or the new one,
//!    never half of one).
//! 4. On later starts the engine measures step 2 again after its first
//!    forward and calls [`self_check`]: a divergence over 10 % (of either
//!    charge) is reported, with both numbers and the fingerprint; re-measure
//!    after a driver, CUDA or library upgrade (a new fingerprint does so by
//!    itself).
//!
//! Everything here is pure (no driver) and tested on the CPU.
//!
//! Thread safety: plain values. Concurrent `store`s of the same file are
//! atomic each (last rename wins); a load never sees a partial file. A
//! load, insert and store is not: `imp_mem.reserve.store` holds the file's
//! `flock` around the three, so processes storing at once keep each
//! other's entries.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use imp_mem_core::units::{human_bytes, MIB};
use imp_mem_core::MemError;
use serde::{Deserialize, Serialize};

/// The divergence over which the self-check reports (10 %).
pub const DEFAULT_TOLERANCE: f64 = 0.10;
/// The file's format marker.
pub const FORMAT: &str = "imp-mem-reserve-cache";
/// The file's format version.
pub const VERSION: u32 = 1;
/// Divergences are relative to at least this many bytes, so a charge
/// remembered as 0 does not make every later reading infinitely divergent.
pub const DIVERGENCE_FLOOR: u64 = MIB;

/// What the measured charges depend on.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Fingerprint {
    /// `cuDeviceGetName`, e.g. `NVIDIA H200`.
    pub gpu_name: String,
    /// The driver version string (e.g. `580.95.05`), or the driver's CUDA
    /// version number where that is all there is.
    pub driver_version: String,
    /// The CUDA version the libraries use (e.g. `13.0`).
    pub cuda_version: String,
    /// Library name → version (`torch`, `cublas`, ...), as the caller names
    /// them.
    #[serde(default)]
    pub libraries: BTreeMap<String, String>,
}

impl Fingerprint {
    /// The cache key: every field, in a stable order.
    pub fn key(&self) -> String {
        let mut key = format!(
            "gpu={};driver={};cuda={}",
            self.gpu_name, self.driver_version, self.cuda_version
        );
        for (name, version) in &self.libraries {
            key.push_str(&format!(";{name}={version}"));
        }
        key
    }
}

/// The two measured charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReserveMeasurement {
    /// Device memory a CUDA context costs before any allocation.
    pub context_bytes: u64,
    /// Device memory the libraries claim on first use, outside any allocator.
    pub library_reserve_bytes: u64,
}

/// The device readings of one measurement (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Readings {
    /// Device free memory seen by another process before the measured
    /// process created its context.
    pub free_before_context: u64,
    /// The same reading once it has (and has allocated nothing).
    pub free_after_context: u64,
    /// Device used memory (total − free) before the first library call.
    pub used_before_library: u64,
    /// The allocator's reserved bytes at that point.
    pub allocator_before_library: u64,
    /// Device used memory after the first library call, synchronised.
    pub used_after_library: u64,
    /// The allocator's reserved bytes then.
    pub allocator_after_library: u64,
}

/// The charges a set of readings implies. Pure.
pub fn measurement_from(r: &Readings) -> ReserveMeasurement {
    let device_growth = r.used_after_library.saturating_sub(r.used_before_library);
    let allocator_growth = r
        .allocator_after_library
        .saturating_sub(r.allocator_before_library);
    ReserveMeasurement {
        context_bytes: r.free_before_context.saturating_sub(r.free_after_context),
        library_reserve_bytes: device_growth.saturating_sub(allocator_growth),
    }
}

/// One remembered measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// What it was measured on.
    pub fingerprint: Fingerprint,
    /// The charges.
    pub measurement: ReserveMeasurement,
    /// When (seconds since the Unix epoch).
    pub measured_unix_s: u64,
    /// How many runs the charges summarise (the median of them).
    #[serde(default = "one")]
    pub samples: u32,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Serialize, Deserialize)]
struct CacheFile {
    format: String,
    version: u32,
    entries: BTreeMap<String, CacheEntry>,
}

/// The cache: fingerprint key → measurement.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReserveCache {
    entries: BTreeMap<String, CacheEntry>,
}

impl ReserveCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `path`; a missing file is an empty cache. A file that is not a
    /// cache (or of a newer version) is an error that names the path.
    pub fn load(path: &Path) -> Result<Self, MemError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::new()),
            Err(e) => {
                return Err(MemError::invalid(format!(
                    "cannot read the reserve cache {}: {e}",
                    path.display()
                )))
            }
        };
        Self::from_json(&text).map_err(|msg| {
            MemError::invalid(format!(
                "{} is not a usable reserve cache ({msg}); delete it to re-measure",
                path.display()
            ))
        })
    }

    /// Parses the file format.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let file: CacheFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if file.format != FORMAT {
            return Err(format!("format is '{}', expected '{FORMAT}'", file.format));
        }
        if file.version > VERSION {
            return Err(format!(
                "version {} is newer than this imp-mem understands ({VERSION})",
                file.version
            ));
        }
        Ok(Self {
            entries: file.entries,
        })
    }

    /// The file format.
    pub fn to_json(&self) -> Result<String, MemError> {
        let file = CacheFile {
            format: FORMAT.into(),
            version: VERSION,
            entries: self.entries.clone(),
        };
        serde_json::to_string_pretty(&file)
            .map_err(|e| MemError::invalid(format!("cannot encode the reserve cache: {e}")))
    }

    /// Writes the cache to `path` atomically: a temporary file in the same
    /// directory, flushed to disk, then renamed over `path`.
    pub fn store(&self, path: &Path) -> Result<(), MemError> {
        let text = self.to_json()?;
        let io = |what: &str, e: std::io::Error| {
            MemError::invalid(format!(
                "cannot {what} the reserve cache at {}: {e}",
                path.display()
            ))
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir).map_err(|e| io("create the directory of", e))?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "reserve".into());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = dir.join(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
        let written = (|| {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(text.as_bytes())?;
            file.write_all(b"\n")?;
            file.sync_all()
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(io("write", e));
        }
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io("replace", e));
        }
        Ok(())
    }

    /// The measurement remembered for `fingerprint`.
    pub fn get(&self, fingerprint: &Fingerprint) -> Option<&CacheEntry> {
        self.entries.get(&fingerprint.key())
    }

    /// Remembers `measurement` for `fingerprint` (replacing an older one).
    pub fn insert(
        &mut self,
        fingerprint: Fingerprint,
        measurement: ReserveMeasurement,
        measured_unix_s: u64,
        samples: u32,
    ) {
        let key = fingerprint.key();
        self.entries.insert(
            key,
            CacheEntry {
                fingerprint,
                measurement,
                measured_unix_s,
                samples: samples.max(1),
            },
        );
    }

    /// Every entry, by key.
    pub fn entries(&self) -> impl Iterator<Item = &CacheEntry> {
        self.entries.values()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The result of comparing a fresh reading against the remembered one.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfCheck {
    /// What the cache says.
    pub expected: ReserveMeasurement,
    /// What was measured now.
    pub observed: ReserveMeasurement,
    /// |observed − expected| / max(expected, 1 MiB), for the context.
    pub context_divergence: f64,
    /// The same, for the library reserve.
    pub library_divergence: f64,
    /// The tolerance applied.
    pub tolerance: f64,
    /// True when either divergence is over the tolerance.
    pub diverged: bool,
}

/// Relative divergence of `observed` from `expected`. Pure.
pub fn divergence(expected: u64, observed: u64) -> f64 {
    let diff = expected.abs_diff(observed) as f64;
    diff / expected.max(DIVERGENCE_FLOOR) as f64
}

/// Compares `observed` against `expected`; `diverged` when either charge is
/// more than `tolerance` (e.g. 0.10) away. Pure.
pub fn self_check(
    expected: ReserveMeasurement,
    observed: ReserveMeasurement,
    tolerance: f64,
) -> SelfCheck {
    let context_divergence = divergence(expected.context_bytes, observed.context_bytes);
    let library_divergence = divergence(
        expected.library_reserve_bytes,
        observed.library_reserve_bytes,
    );
    SelfCheck {
        expected,
        observed,
        context_divergence,
        library_divergence,
        tolerance,
        diverged: context_divergence > tolerance || library_divergence > tolerance,
    }
}

impl SelfCheck {
    /// A one-line report: both charges, remembered against measured.
    pub fn message(&self, fingerprint: &Fingerprint) -> String {
        let line = |what: &str, e: u64, o: u64, d: f64| {
            format!(
                "{what} measured {} against {} remembered ({:+.1} %)",
                human_bytes(o),
                human_bytes(e),
                signed_pct(e, o, d)
            )
        };
        let body = format!(
            "{}; {}",
            line(
                "context",
                self.expected.context_bytes,
                self.observed.context_bytes,
                self.context_divergence
            ),
            line(
                "library reserve",
                self.expected.library_reserve_bytes,
                self.observed.library_reserve_bytes,
                self.library_divergence
            ),
        );
        if self.diverged {
            format!(
                "the measured charges diverge by more than {:.0} % on {}: {body}; re-measure \
                 (tools/measure_reserve.py) and store the result",
                self.tolerance * 100.0,
                fingerprint.key()
            )
        } else {
            format!("the measured charges hold on {}: {body}", fingerprint.key())
        }
    }
}

fn signed_pct(expected: u64, observed: u64, divergence: f64) -> f64 {
    if observed >= expected {
        divergence * 100.0
    } else {
        -divergence * 100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> Fingerprint {
        Fingerprint {
            gpu_name: "NVIDIA H200".into(),
            driver_version: "580.95.05".into(),
            cuda_version: "13.0".into(),
            libraries: [
                ("torch".to_string(), "2.9.0".to_string()),
                ("cublas".to_string(), "13.0.0".to_string()),
            ]
            .into_iter()
            .collect(),
        }
    }

    const MEASURED: ReserveMeasurement = ReserveMeasurement {
        context_bytes: 527 * MIB,
        library_reserve_bytes: 66 * MIB,
    };

    fn tmp_path(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "imp-mem-reserve-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir.join("sub").join("reserve.json")
    }

    #[test]
    fn the_key_names_every_field_in_a_stable_order() {
        let key = h200().key();
        assert_eq!(
            key,
            "gpu=NVIDIA H200;driver=580.95.05;cuda=13.0;cublas=13.0.0;torch=2.9.0"
        );
        let mut other = h200();
        other.libraries.insert("torch".into(), "2.10.0".into());
        assert_ne!(other.key(), key);
    }

    #[test]
    fn store_then_load_round_trips_atomically() {
        let path = tmp_path("roundtrip");
        assert!(
            ReserveCache::load(&path).unwrap().is_empty(),
            "a missing file is an empty cache"
        );
        let mut cache = ReserveCache::new();
        cache.insert(h200(), MEASURED, 1_790_000_000, 5);
        cache.store(&path).unwrap();
        let loaded = ReserveCache::load(&path).unwrap();
        assert_eq!(loaded, cache);
        assert_eq!(loaded.get(&h200()).unwrap().measurement, MEASURED);
        // No temporary file is left beside it.
        let dir = path.parent().unwrap();
        let names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // Storing again replaces.
        let mut cache = loaded;
        cache.insert(
            h200(),
            ReserveMeasurement {
                context_bytes: 1,
                library_reserve_bytes: 2,
            },
            1,
            1,
        );
        cache.store(&path).unwrap();
        assert_eq!(ReserveCache::load(&path).unwrap().len(), 1);
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    }

    #[test]
    fn a_corrupt_or_foreign_file_is_an_error_naming_it() {
        let path = tmp_path("corrupt");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "{not json").unwrap();
        let err = ReserveCache::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("reserve.json") && err.contains("delete it"),
            "{err}"
        );
        std::fs::write(&path, r#"{"format": "other", "version": 1, "entries": {}}"#).unwrap();
        assert!(ReserveCache::load(&path).is_err());
        std::fs::write(
            &path,
            r#"{"format": "imp-mem-reserve-cache", "version": 99, "entries": {}}"#,
        )
        .unwrap();
        assert!(ReserveCache::load(&path)
            .unwrap_err()
            .to_string()
            .contains("newer"));
        let _ = std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap());
    }

    #[test]
    fn self_check_reports_over_ten_percent() {
        let same = self_check(MEASURED, MEASURED, DEFAULT_TOLERANCE);
        assert!(!same.diverged);
        assert_eq!(same.library_divergence, 0.0);
        // 66 → 72 MiB is +9.1 %: holds.
        let close = ReserveMeasurement {
            library_reserve_bytes: 72 * MIB,
            ..MEASURED
        };
        assert!(!self_check(MEASURED, close, DEFAULT_TOLERANCE).diverged);
        // 66 → 74 MiB is +12.1 %: reported.
        let far = ReserveMeasurement {
            library_reserve_bytes: 74 * MIB,
            ..MEASURED
        };
        let check = self_check(MEASURED, far, DEFAULT_TOLERANCE);
        assert!(check.diverged);
        let msg = check.message(&h200());
        assert!(
            msg.contains("+12.1 %") && msg.contains("NVIDIA H200") && msg.contains("re-measure"),
            "{msg}"
        );
        // A shrinking context is a divergence too.
        let less = ReserveMeasurement {
            context_bytes: 400 * MIB,
            ..MEASURED
        };
        let check = self_check(MEASURED, less, DEFAULT_TOLERANCE);
        assert!(check.diverged);
        assert!(
            check.message(&h200()).contains("-24.1 %"),
            "{}",
            check.message(&h200())
        );
    }

    #[test]
    fn a_zero_charge_is_measured_against_a_floor() {
        let zero = ReserveMeasurement {
            context_bytes: 0,
            library_reserve_bytes: 0,
        };
        let tiny = ReserveMeasurement {
            context_bytes: 0,
            library_reserve_bytes: 64 << 10,
        };
        assert!(!self_check(zero, tiny, DEFAULT_TOLERANCE).diverged);
        let big = ReserveMeasurement {
            context_bytes: 0,
            library_reserve_bytes: 2 * MIB,
        };
        assert!(self_check(zero, big, DEFAULT_TOLERANCE).diverged);
        assert!(divergence(0, 0).abs() < f64::EPSILON);
    }

    #[test]
    fn readings_give_the_charges() {
        let r = Readings {
            free_before_context: 140_000 * MIB,
            free_after_context: 140_000 * MIB - 527 * MIB,
            used_before_library: 1000 * MIB,
            allocator_before_library: 200 * MIB,
            used_after_library: 1000 * MIB + 66 * MIB + 20 * MIB,
            allocator_after_library: 220 * MIB,
        };
        assert_eq!(measurement_from(&r), MEASURED);
        // Readings that went the wrong way clamp to zero instead of wrapping.
        let backwards = Readings {
            free_after_context: 150_000 * MIB,
            used_after_library: 0,
            ..r
        };
        assert_eq!(
            measurement_from(&backwards),
            ReserveMeasurement {
                context_bytes: 0,
                library_reserve_bytes: 0
            }
        );
    }
}

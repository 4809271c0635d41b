//! Builds the LD_PRELOAD interposer (`crates/imp-mem-preload`) beside the
//! extension, into `python/imp_mem/libimp_mem_preload.so`, so that the
//! wheel maturin packs from `python/` carries it (maturin builds one
//! cdylib per wheel; this is the second).
//!
//! The interposer is one crate without dependencies, so it is compiled by a
//! plain `rustc` call (the toolchain cargo runs this script with), not a
//! nested cargo: no build lock, no registry, a second or two. Linux only
//! (LD_PRELOAD is the dynamic linker's of Linux); elsewhere nothing is
//! built. The file is replaced by a rename, so two builds at once (clippy
//! beside a release build) never leave half a library.

use std::env;
use std::error::Error;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

const LIBRARY: &str = "libimp_mem_preload.so";

fn main() -> Result<(), Box<dyn Error>> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let crates = manifest
        .parent()
        .ok_or("imp-mem-py's manifest lies in crates/")?;
    let source = crates.join("imp-mem-preload").join("src");
    println!("cargo:rerun-if-changed={}", source.display());
    println!("cargo:rerun-if-changed=build.rs");
    if env::var("CARGO_CFG_TARGET_OS")? != "linux" {
        return Ok(());
    }
    let out = PathBuf::from(env::var("OUT_DIR")?).join(LIBRARY);
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let status = Command::new(rustc)
        .args(["--edition", "2021", "--crate-type", "cdylib"])
        .args(["--crate-name", "imp_mem_preload"])
        .args(["--target", &env::var("TARGET")?])
        .args(["-C", "opt-level=3", "-C", "codegen-units=1"])
        .args(["-C", "panic=unwind", "-C", "strip=debuginfo"])
        .arg("-o")
        .arg(&out)
        .arg(source.join("lib.rs"))
        .status()?;
    if !status.success() {
        return Err(format!("rustc could not build {LIBRARY} ({status})").into());
    }
    let package = crates
        .parent()
        .ok_or("crates/ lies in the repository")?
        .join("python")
        .join("imp_mem");
    let dest = package.join(LIBRARY);
    let built = fs::read(&out)?;
    if fs::read(&dest).ok().as_deref() != Some(built.as_slice()) {
        let staged = package.join(format!(".{LIBRARY}.{}", std::process::id()));
        fs::write(&staged, &built)?;
        fs::rename(&staged, &dest)?;
    }
    Ok(())
}

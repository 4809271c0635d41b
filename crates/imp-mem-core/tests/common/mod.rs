//! Helpers the integration tests share (each test file is a crate of its
//! own; `mod common;` brings these in).

#![allow(dead_code, clippy::unwrap_used)] // test harness code: a failed unwrap is a failed test

pub mod hooks;

use imp_mem_core::{FakeBackend, FakeConfig, PhaseMode};

/// A strict fake backend the size of a large GPU (64 GiB of synthetic
/// addresses, nothing backed) committing in 2 MiB granules: room for a
/// measured tier at a real model's size.
pub fn fake_gpu_sized() -> FakeBackend {
    FakeBackend::new(FakeConfig {
        capacity: 64 << 30,
        granularity: 2 << 20,
        backed: false,
        mode: PhaseMode::Strict,
        ..FakeConfig::default()
    })
    .unwrap()
}

//! The type rules of seed I3 and I5, pinned as compile-fail tests so that a
//! refactor cannot reopen them: a span cannot outlive its arena or survive a
//! reset, a scratch take cannot outlive its mark, a block ref cannot outlive
//! its pool, `BlockRef` is not `Clone`, a `DeviceSpan` never becomes a
//! `StableSpan`, and only the tier allocators can mint one.

#[test]
fn type_rules_hold_at_compile_time() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}

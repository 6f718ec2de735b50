//! The `predicate` target: `fuzz_support::targets::predicate` (what it asserts is
//! said there; the same code replays the regressions as ordinary tests).
#![no_main]

use fuzz_support::targets::predicate::{Input, fuzz};

libfuzzer_sys::fuzz_target!(|input: Input| fuzz(input));

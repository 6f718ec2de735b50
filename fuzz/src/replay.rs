//! The fuzz targets as ordinary tests: each target's committed regression
//! inputs (`fuzz/regressions/<target>/`), then `RANDOM_INPUTS` inputs of
//! random bytes from a fixed seed, run through the same `fuzz` function
//! libFuzzer calls. No coverage guidance and no instrumented build: the
//! search itself is `scripts/fuzz.sh`'s (the test command runs it when
//! `FUZZ_SECONDS` is set).

use std::path::Path;

use arbitrary::{Arbitrary, Unstructured};
use broker_tools::seeded::SplitMix64;

use crate::targets;

/// Random inputs per target: a few seconds of the debug build for all six.
const RANDOM_INPUTS: usize = 2_000;
/// Longest random input: past what most `Input`s draw from.
const MAX_RANDOM_INPUT_BYTES: usize = 4_096;

/// A random input of at most `MAX_RANDOM_INPUT_BYTES`.
fn input(bytes: &mut SplitMix64) -> Vec<u8> {
    let len = (bytes.next_u64() % (MAX_RANDOM_INPUT_BYTES as u64 + 1)) as usize;
    let mut input = vec![0; len];
    bytes.fill(&mut input);
    input
}

/// Every input of `target`, each decoded as libFuzzer's typed entry does
/// (`arbitrary_take_rest`; bytes that do not decode are skipped there
/// too) and run.
fn replay<T: for<'a> Arbitrary<'a>>(target: &str, fuzz: fn(T)) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("regressions")
        .join(target);
    let mut inputs = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries {
            let path = entry.expect("a regressions entry").path();
            inputs.push(std::fs::read(&path).expect("a regression input"));
        }
    }
    let mut bytes = SplitMix64(target.len() as u64);
    inputs.extend((0..RANDOM_INPUTS).map(|_| input(&mut bytes)));
    let mut decoded = 0;
    for input in &inputs {
        if let Ok(value) = T::arbitrary_take_rest(Unstructured::new(input)) {
            fuzz(value);
            decoded += 1;
        }
    }
    // Inputs that never decode would test nothing.
    assert!(
        decoded > RANDOM_INPUTS / 2,
        "{target}: {decoded} inputs decoded"
    );
}

/// One test per target, named as the target, replaying its inputs.
macro_rules! replay_tests {
    ($($target:ident),* $(,)?) => {
        $(
            #[test]
            fn $target() {
                replay(stringify!($target), targets::$target::fuzz);
            }
        )*
    };
}

replay_tests!(chain, decode_convert, invariants, predicate, schema, scope);

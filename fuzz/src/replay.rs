//! The fuzz targets as ordinary tests: each target's committed regression
//! inputs (`fuzz/regressions/<target>/`), then `RANDOM_INPUTS` inputs of
//! random bytes from a fixed seed, run through the same `fuzz` function
//! libFuzzer calls. No coverage guidance and no instrumented build: the
//! search itself is `scripts/fuzz.sh`'s (the test command runs it when
//! `FUZZ_SECONDS` is set).

use std::path::Path;

use arbitrary::{Arbitrary, Unstructured};

use crate::targets;

/// Random inputs per target: a few seconds of the debug build for all six.
const RANDOM_INPUTS: usize = 2_000;
/// Longest random input: past what most `Input`s draw from.
const MAX_RANDOM_INPUT_BYTES: usize = 4_096;

/// splitmix64: a fixed, dependency-free stream of bytes.
struct Bytes(u64);

impl Bytes {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn input(&mut self) -> Vec<u8> {
        let len = (self.next() % (MAX_RANDOM_INPUT_BYTES as u64 + 1)) as usize;
        (0..len).map(|_| self.next() as u8).collect()
    }
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
    let mut bytes = Bytes(target.len() as u64);
    inputs.extend((0..RANDOM_INPUTS).map(|_| bytes.input()));
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

//! The fuzz targets' code, one module each: `Input` (drawn from the
//! fuzzer's bytes by `arbitrary`) and `fuzz`, which asserts what the
//! module's own doc says. The binaries in `fuzz_targets/` hand libFuzzer's
//! inputs to `fuzz`; `crate::replay` runs the same code as ordinary tests.

pub mod chain;
pub mod decode_convert;
pub mod invariants;
pub mod predicate;
pub mod schema;
pub mod scope;

//! Thin entry point: parse the command line, call the library.

fn main() -> std::process::ExitCode {
    delegation_broker::cli::main()
}

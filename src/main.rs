//! The `inflight` binary: a thin shell over [`inflight_cli::cli`].

use std::process::ExitCode;

fn main() -> ExitCode {
    inflight_cli::cli::run(inflight_cli::cli::parse())
}

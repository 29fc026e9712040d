//! The `inflight` binary: a thin shell over [`inflight_cli::cli`].

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    inflight_cli::cli::run(inflight_cli::cli::Cli::parse())
}

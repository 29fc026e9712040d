//! The `inflight` binary: a thin shell over [`inflight::cli`].

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    inflight::cli::run(inflight::cli::Cli::parse())
}

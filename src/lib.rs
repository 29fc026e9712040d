//! The `inflight` command line, as a library so that its tests can reach
//! it: `serve`, `snapshot`, `show`, `cancel`, `release`, `reap`,
//! `check-config` and `demo` ([`cli`]),
//! and the incident the demo replays ([`demo`]). The ledger itself is the
//! [`inflight`] crate; the HTTP service is [`inflight_server`].

pub mod cli;
pub mod demo;

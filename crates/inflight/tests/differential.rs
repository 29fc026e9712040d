//! Differential test: random sequences of operations run against a plain
//! reference model written in this file and against every store (through the
//! public [`Store`] seam, with one shared [`FakeClock`]). After every step
//! every store must give the same reply, and that reply must equal the
//! model's: the reply kind (a record, counts, a snapshot, an owner, or an
//! error and its kind), every field of every record and owner, and every
//! snapshot row in its order. "Every field" includes those the wire leaves
//! out but `/metrics` reads (a lane's `next_waiting_reap_in_ms`, an
//! aggregate's whole `totals`), and the snapshot's `warnings` and
//! `unknown_classes`, which the ledger notes (not a store), so a store
//! leaves them empty.
//!
//! The model follows `docs/semantics.md` plus the rules decided on top of it:
//!
//! 1. In-flight rows are ordered by `(enqueuedAt, activityId)` ascending,
//!    recent completions by `(completedAt, activityId)` descending, reaped
//!    rows by `(reapedAt, activityId)` descending; a snapshot lists the live
//!    owners and those that ended at or after `since`, by
//!    `(registeredAt, ownerId)` ascending; lanes by lane.
//! 2. A timestamp the caller does not give is "now, but never earlier than
//!    the record's latest timestamp": `startedAt = max(now, enqueuedAt)`,
//!    `completedAt = max(now, startedAt or enqueuedAt)`, and a reap's
//!    `reapedAt` likewise. A caller-given
//!    timestamp earlier than the one before it is still `invalid`.
//! 3. A begin that gives `startedAt` but no `enqueuedAt` gets
//!    `enqueuedAt = min(now, startedAt)`.
//! 4. Every command is all or nothing: a refusal leaves the store as it found
//!    it, apart from the reaps that time forced first.
//! 5. Releasing an owner cancels all its in-flight records, or none.
//!
//! Refusal check (rule 4): before a command the model predicts is refused,
//! every store (and the model) reaps at the same instant, so that the reap
//! the command may force first is a no-op; the store is dumped (a full
//! snapshot, a `get` of every id ever used, its record count), the command
//! runs, and the store is dumped again: both dumps must be equal.
//!
//! Aggregates are listed in `AggregateKey` order (the engine sorts them),
//! and a prune deletes at most [`PRUNE_LIMIT`] records, oldest end (then
//! id) first, so that its order is checked too.
//!
//! Adding a store is one line in [`STORES`].
//!
//! Shrunk failures are persisted by proptest in
//! `proptest-regressions/differential.txt` (see [`REGRESSIONS`]) and
//! replayed first on every run: check that file in once a failure is fixed.
//! Record ids are chosen here, so a run is deterministic, except that each
//! store draws its own owner ids (the public API takes none): a failure that
//! depends on the order of owner ids may not replay from its seed, and
//! shrinks poorly.
//!
//! The SQLite store syncs every commit; its files go to `/dev/shm` when there
//! is one, which keeps a run (256 cases) well under a minute in a debug build.
//!
//! Restricting the generator: `INFLIGHT_DIFF_RESTRICT` takes a
//! comma-separated list of switches, for checking the harness against a
//! checkout that does not implement every rule above yet:
//!
//! - `no-future`: no timestamp a store accepts lies in the future (a future
//!   timestamp within the 5-minute allowance is replaced by *now*), so
//!   rule 2 makes no difference;
//! - `enqueued-with-started`: a begin that gives `startedAt` also gives
//!   `enqueuedAt` (the value rule 3 would pick), so rule 3 makes no
//!   difference;
//! - `any-owner-order`: the owners of a snapshot are compared as a set
//!   (rule 1 for owners is not checked);
//! - `all`: all of the above.
//!
//! Without the variable the full rules are checked.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use inflight::domain::idempotency::{Fingerprint, Idempotency};
use inflight::domain::labels::{ActivityLabels, Label, RawLabels};
use inflight::domain::transition::{BeginExtras, NewActivity, Transition};
use inflight::domain::{ClassBounds, ReapPolicy, TraceParent};
use inflight::store::{self, Command, Reply, Store};
use inflight::{
    ActivityId, ActivityRecord, Admission, Disposition, ErrorKind, FailureStage, FakeClock, LedgerConfig,
    Owner, OwnerId, OwnerState, Priority, ReapReason, Since, Snapshot, SnapshotOptions, State, Timestamp,
    Usage,
};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// The URL [`store::open`] opens a store from, given a fresh directory of
/// its own, and what must live as long as the store (a test database).
type StoreUrl = fn(&Path) -> (String, Box<dyn std::any::Any>);

/// Every store under test, by name. One line per store.
const STORES: &[(&str, StoreUrl)] = &[
    ("memory", |_| ("memory:".to_owned(), Box::new(()))),
    ("sqlite", |dir| {
        (
            format!("sqlite://{}", dir.join("ledger.db").display()),
            Box::new(()),
        )
    }),
    // Under `normal` a lone caller runs its own commands (the store's
    // `handoff.rs`), where under `full` the writer thread runs them.
    ("sqlite-normal", |dir| {
        (
            format!("sqlite://{}?synchronous=normal", dir.join("ledger.db").display()),
            Box::new(()),
        )
    }),
    // A fresh schema on the test server, as deployed: the default pool and
    // the listener. Several writers still land one process's commands in
    // the order sent, which a dump (sent all at once) checks too.
    #[cfg(feature = "postgres")]
    ("postgres", |_| {
        let database = inflight_pg_testing::TestDatabase::new();
        (database.store_url(""), Box::new(database))
    }),
];

/// Where proptest keeps the seeds of shrunk failures, replayed first.
const REGRESSIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/proptest-regressions/differential.txt"
);

// ---------------------------------------------------------------------------
// The configuration the stores and the model share.

/// Where the clock starts. Every time below is relative to it.
const T0: Timestamp = Timestamp::from_millis(1_786_000_000_000);
const SEC: i64 = 1_000;
const MINUTE: i64 = 60 * SEC;
/// How far ahead of *now* a caller's timestamp may be.
const SKEW: i64 = 5 * MINUTE;
/// The reap factor (an integer, so that `ceil(factor x ms)` is exact).
const FACTOR: i64 = 3;
/// How long settled and reaped records are kept.
/// The most records one prune deletes: small, so that batches are cut.
const PRUNE_LIMIT: usize = 3;

const RETENTION: i64 = MINUTE;
/// Configured classes: name, execution deadline, queue wait (ms). Short, so
/// that a few clock advances cross their bounds.
const CLASSES: [(&str, i64, i64); 2] = [("embedding", 20 * SEC, 20 * SEC), ("chat", 30 * SEC, 5 * SEC)];
/// The classes records are begun with: two configured, one unconfigured,
/// and none (`unknown`).
/// The `chat` class's token estimate (`[classes.chat] tokens`).
const CHAT_TOKENS: i64 = 300;
const CLASS_CHOICES: [Option<&str>; 4] = [Some("embedding"), Some("chat"), Some("rerank"), None];
/// The lanes; the first one is capped.
const LANES: [(&str, &str); 3] = [("kb", "ollama"), ("kb", "openai"), ("mc", "ollama")];
const CAPPED_LANE: &str = "kb::ollama";
const CAP: i64 = 2;
/// The ranked lane (`docs/semantics.md` §6, "Ranked lanes"): two slots,
/// one of them batch work's at most, and one overtake.
const RANKED_LANE: &str = "kb::openai";
const RANKED_CAP: usize = 2;
const RANKED_BATCH_CAP: usize = 1;
const MAX_OVERTAKES: u32 = 1;
/// The ranked lane is adaptive too, with a short `max_cooldown`; the plain
/// capped lane keeps the default of a minute.
const RANKED_MAX_COOLDOWN: i64 = 10 * SEC;
/// The plain capped lane's token budget, and the `openai` provider's,
/// which holds for the ranked lane (`docs/semantics.md` §8, "Budgets").
const LANE_BUDGET: i64 = 1_500;
const BUDGETED_PROVIDER: &str = "openai";
const PROVIDER_BUDGET: i64 = 1_200;
const MAX_COOLDOWN: i64 = 60 * SEC;
/// The priorities begins carry; `unknown` ranks as batch.
const PRIORITIES: [Priority; 3] = [Priority::Interactive, Priority::Batch, Priority::Unknown];
const STAGE: &str = "diff-stage";
const MODEL: &str = "nomic-embed-text";
const OWNER_NAMES: [&str; 3] = ["worker-a", "worker-b", "worker-c"];
/// Lease TTLs; the first is below the 100 ms minimum, so refused.
const TTLS: [i64; 4] = [50, 2 * SEC, 10 * SEC, 30 * SEC];
/// A well-formed owner id nobody registered.
const UNKNOWN_OWNER: &str = "00000000-0000-4000-8000-000000000000";
const MALFORMED_OWNER: &str = "not-an-owner";
/// Cancel reasons: kept, and one redacted (a credential).
const REASONS: [(&str, &str); 2] = [
    ("client went away", "client went away"),
    ("sk-live-abc", "redacted"),
];
const RELEASE_REASON: &str = "owner released";
/// Idempotency keys begins carry: few, so that repeats and conflicts are
/// common.
const KEYS: [&str; 2] = ["key-a", "key-b"];
/// Models a refinement names, as sent and as recorded: the begin's, another,
/// one redacted (a credential), and an empty one (refused).
const REFINED_MODELS: [(&str, Option<&str>); 4] = [
    (MODEL, Some(MODEL)),
    ("bge-m3", Some("bge-m3")),
    ("sk-live-abc", Some("redacted")),
    ("", None),
];

fn millis(ms: i64) -> Duration {
    Duration::from_millis(ms as u64)
}

fn config() -> LedgerConfig {
    let classes = CLASSES
        .iter()
        .map(|(name, deadline, wait)| {
            let bounds = ClassBounds::new(millis(*deadline), Some(millis(*wait))).unwrap();
            let bounds = match class_tokens(name) {
                Some(tokens) => bounds.with_tokens(tokens).unwrap(),
                None => bounds,
            };
            (name.to_string(), bounds)
        })
        .collect();
    LedgerConfig::new(ReapPolicy::new(classes, FACTOR as f64).unwrap())
        .with_lane_cap(CAPPED_LANE, CAP as u32)
        .unwrap()
        .with_lane_cap(RANKED_LANE, RANKED_CAP as u32)
        .unwrap()
        .with_lane_ranking(RANKED_LANE, Some(RANKED_BATCH_CAP as u32), Some(MAX_OVERTAKES))
        .unwrap()
        .with_lane_cooldown(RANKED_LANE, Some(millis(RANKED_MAX_COOLDOWN)), true)
        .unwrap()
        .with_lane_budget(CAPPED_LANE, LANE_BUDGET)
        .unwrap()
        .with_provider_budget(BUDGETED_PROVIDER, PROVIDER_BUDGET)
        .unwrap()
        .with_retention(millis(RETENTION))
        .unwrap()
}

/// The widest raw deadline or queue wait of any class.
fn widest_raw() -> i64 {
    CLASSES.iter().map(|(_, d, w)| *d.max(w)).max().unwrap()
}

/// The token estimate of a call of `class` that declares none.
fn class_tokens(class: &str) -> Option<i64> {
    (class == "chat").then_some(CHAT_TOKENS)
}

fn class_bounds(class: &str) -> Option<(i64, i64)> {
    CLASSES
        .iter()
        .find(|(name, _, _)| *name == class)
        .map(|(_, d, w)| (*d, *w))
}

// ---------------------------------------------------------------------------
// Restrictions (see the module documentation).

#[derive(Debug, Clone, Copy, Default)]
struct Restrict {
    no_future: bool,
    enqueued_with_started: bool,
    any_owner_order: bool,
}

fn restrictions() -> Restrict {
    let mut restrict = Restrict::default();
    let spec = std::env::var("INFLIGHT_DIFF_RESTRICT").unwrap_or_default();
    for switch in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match switch {
            "no-future" => restrict.no_future = true,
            "enqueued-with-started" => restrict.enqueued_with_started = true,
            "any-owner-order" => restrict.any_owner_order = true,
            "all" => {
                restrict = Restrict {
                    no_future: true,
                    enqueued_with_started: true,
                    any_owner_order: true,
                }
            }
            other => panic!("INFLIGHT_DIFF_RESTRICT: unknown switch {other:?}"),
        }
    }
    restrict
}

// ---------------------------------------------------------------------------
// Operations, as generated: abstract, resolved against the model's state.

/// A record: the `k`-th most recent one in flight, or stored, the `k`-th
/// most recent id used (refused, pruned or never begun ones included), or an
/// id never used.
#[derive(Debug, Clone, Copy)]
enum Pick {
    InFlight(usize),
    Stored(usize),
    Any(usize),
    Missing,
}

/// An owner: the `k`-th most recently registered one, or one nobody
/// registered.
#[derive(Debug, Clone, Copy)]
enum OwnerPick {
    Nobody,
    Recent(usize),
    Unknown,
    Malformed,
}

/// A caller-given timestamp of a start, settle or cancel.
#[derive(Debug, Clone, Copy)]
enum Ts {
    /// Not given.
    Default,
    /// Now plus this offset.
    Now(i64),
    /// The record's latest timestamp plus this (non-negative) offset.
    AfterLatest(i64),
    /// The record's latest timestamp minus this (positive) offset.
    BeforeLatest(i64),
}

#[derive(Debug, Clone)]
struct BeginOp {
    lane: usize,
    class: usize,
    /// 0 queued, 1 direct, 2 external.
    admission: usize,
    priority: usize,
    /// `enqueuedAt` as an offset from now.
    enqueued: Option<i64>,
    /// `startedAt` as an offset from `enqueuedAt` (or now).
    started: Option<i64>,
    deadline: Option<i64>,
    /// A declared estimate (`maxTokens`).
    max_tokens: Option<u32>,
    owner: OwnerPick,
    /// Orders the new id among the others (ties are broken by id).
    id_key: u8,
    /// Reuse the id of this record instead of a fresh one.
    duplicate: Option<usize>,
    /// The idempotency key it carries, if any.
    key: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
enum SinceOp {
    Ago(i64),
    /// The instant the run started.
    Start,
    /// Five minutes after the run started.
    Later,
}

#[derive(Debug, Clone)]
enum Op {
    Begin(BeginOp),
    Start(Pick, Ts),
    /// A refusing provider's `Retry-After`, in ms, then the usage it
    /// reports.
    Settle(Pick, bool, Option<FailureStage>, Ts, Option<i64>, Usage),
    Cancel(Pick, Option<usize>, Ts),
    Refine(Pick, usize),
    /// A retry of the `k`-th most recent begin with a key: the same
    /// request, a new id.
    Repeat(usize),
    Get(Pick),
    Register(usize, usize),
    Renew(OwnerPick),
    Release(OwnerPick),
    Advance(i64),
    Reap,
    Snapshot(SinceOp, usize),
    Prune,
}

fn recent() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 0..3usize, 1 => 0..40usize]
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        8 => recent().prop_map(Pick::InFlight),
        6 => recent().prop_map(Pick::Stored),
        2 => recent().prop_map(Pick::Any),
        1 => Just(Pick::Missing),
    ]
}

fn owner_pick() -> impl Strategy<Value = OwnerPick> {
    prop_oneof![
        6 => Just(OwnerPick::Nobody),
        8 => recent().prop_map(OwnerPick::Recent),
        1 => Just(OwnerPick::Unknown),
        1 => Just(OwnerPick::Malformed),
    ]
}

/// An offset from now for `enqueuedAt`.
fn enqueued_offset() -> impl Strategy<Value = i64> {
    prop_oneof![
        3 => Just(0i64),
        4 => -60 * SEC..=0i64,
        3 => 1..=60 * SEC,
        1 => -12 * MINUTE..-60 * SEC,
        1 => Just(SKEW + 1),
    ]
}

fn ts() -> impl Strategy<Value = Ts> {
    prop_oneof![
        8 => Just(Ts::Default),
        2 => (-60 * SEC..=60 * SEC).prop_map(Ts::Now),
        2 => (0..=10 * SEC).prop_map(Ts::AfterLatest),
        1 => (1..=5 * SEC).prop_map(Ts::BeforeLatest),
    ]
}

fn begin_op() -> impl Strategy<Value = BeginOp> {
    (
        (
            prop_oneof![3 => Just(0usize), 5 => Just(1usize), 1 => Just(2usize)],
            0..CLASS_CHOICES.len(),
            prop_oneof![14 => Just(0usize), 3 => Just(1usize), 3 => Just(2usize)],
            0..PRIORITIES.len(),
            prop::option::weighted(0.25, 0..KEYS.len()),
        ),
        prop::option::weighted(0.4, enqueued_offset()),
        prop::option::weighted(0.35, prop_oneof![3 => 0..=20 * SEC, 1 => -10 * SEC..0i64]),
        prop_oneof![12 => Just(None), 4 => (SEC..=8 * SEC).prop_map(Some), 1 => Just(Some(0i64))],
        owner_pick(),
        any::<u8>(),
        prop::option::weighted(0.03, recent()),
        prop::option::weighted(0.3, 0..2_000u32),
    )
        .prop_map(
            |(
                (lane, class, admission, priority, key),
                enqueued,
                started,
                deadline,
                owner,
                id_key,
                duplicate,
                max_tokens,
            )| {
                BeginOp {
                    lane,
                    key,
                    class,
                    admission,
                    priority,
                    enqueued,
                    started,
                    deadline,
                    max_tokens,
                    owner,
                    id_key,
                    duplicate,
                }
            },
        )
}

/// A refusing provider's `Retry-After`: mostly valid, some out of range.
fn retry_after() -> impl Strategy<Value = i64> {
    prop_oneof![
        1 => Just(0i64),
        8 => 1..=20 * SEC,
        1 => Just(90 * SEC),
        1 => Just(3_600_001i64),
    ]
}

/// A settle's usage: mostly none, some valid, a few out of range.
fn usage() -> impl Strategy<Value = Usage> {
    let count = prop_oneof![3 => Just(None), 6 => (0..5_000i64).prop_map(Some), 1 => Just(Some(-1i64)), 1 => Just(Some(1_000_000_001i64))];
    prop_oneof![
        3 => Just(Usage::default()),
        2 => (count.clone(), count).prop_map(|(input_tokens, output_tokens)| Usage { input_tokens, output_tokens }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let stage = prop_oneof![
        Just(None),
        Just(Some(FailureStage::Provider)),
        Just(Some(FailureStage::Queue))
    ];
    prop_oneof![
        8 => begin_op().prop_map(Op::Begin),
        6 => (pick(), ts()).prop_map(|(p, t)| Op::Start(p, t)),
        2 => (pick(), ts(), prop::option::weighted(0.03, Just(SEC)), usage()).prop_map(|(p, t, retry, u)| Op::Settle(p, true, None, t, retry, u)),
        1 => (pick(), stage, ts(), prop::option::weighted(0.4, retry_after()), usage()).prop_map(|(p, s, t, retry, u)| Op::Settle(p, false, s, t, retry, u)),
        1 => (pick(), prop::option::of(0..REASONS.len()), ts()).prop_map(|(p, r, t)| Op::Cancel(p, r, t)),
        2 => (pick(), 0..REFINED_MODELS.len()).prop_map(|(p, m)| Op::Refine(p, m)),
        2 => recent().prop_map(Op::Repeat),
        1 => pick().prop_map(Op::Get),
        2 => (0..OWNER_NAMES.len(), prop_oneof![1 => Just(0usize), 8 => 1..TTLS.len()])
            .prop_map(|(n, t)| Op::Register(n, t)),
        1 => owner_pick().prop_map(Op::Renew),
        1 => owner_pick().prop_map(Op::Release),
        5 => prop_oneof![
            2 => 0..=2i64,
            5 => 1..=5 * SEC,
            3 => 5 * SEC..=40 * SEC,
            2 => 40 * SEC..=4 * MINUTE,
            // Exactly a bound or the retention, or one millisecond past it.
            2 => prop::sample::select(vec![
                15 * SEC,
                15 * SEC + 1,
                MINUTE,
                MINUTE + 1,
                90 * SEC,
                90 * SEC + 1,
            ]),
        ]
        .prop_map(Op::Advance),
        1 => Just(Op::Reap),
        2 => (
            prop_oneof![
                3 => prop_oneof![Just(30 * SEC), Just(3 * MINUTE), Just(24 * 60 * MINUTE)]
                    .prop_map(SinceOp::Ago),
                1 => Just(SinceOp::Start),
                1 => Just(SinceOp::Later),
            ],
            prop_oneof![Just(1usize), Just(2), Just(3), Just(100)],
        )
            .prop_map(|(s, l)| Op::Snapshot(s, l)),
        2 => Just(Op::Prune),
    ]
}

// ---------------------------------------------------------------------------
// Steps: concrete commands, the same for the model and every store. Times
// are relative to T0.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnerRef {
    Nobody,
    Known(usize),
    Unknown,
    Malformed,
}

#[derive(Debug, Clone, PartialEq)]
struct BeginSpec {
    lane: usize,
    class: Option<&'static str>,
    admission: Admission,
    priority: Priority,
    enqueued: Option<i64>,
    started: Option<i64>,
    deadline: Option<i64>,
    /// A declared estimate (`maxTokens`).
    max_tokens: Option<u32>,
    owner: OwnerRef,
    key: Option<&'static str>,
}

#[derive(Debug, Clone)]
enum Step {
    Begin(usize, BeginSpec),
    Start(usize, Option<i64>),
    Settle(usize, bool, Option<FailureStage>, Option<i64>, Option<i64>, Usage),
    Cancel(usize, Option<&'static str>, Option<i64>),
    Refine(usize, usize),
    Get(usize),
    Register(&'static str, i64),
    Renew(OwnerRef),
    Release(OwnerRef),
    Advance(i64),
    Reap,
    Snapshot(Since, usize),
    Prune,
    Stats,
}

// ---------------------------------------------------------------------------
// Observations: what a reply says, in a form the model produces too. Record
// ids are shown as the index `r` of the id in the run, owners as the index
// `o` of their registration, times relative to T0.

// One observation per step, compared and dropped: its size costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
enum Obs {
    Refused(ErrorKind),
    Record(Rec),
    Reaped { abandoned: i64, unsettled: i64 },
    Snapshot(Box<Snap>),
    Owner(Own),
    Pruned(usize),
    Stored(i64),
    Nothing,
}

#[derive(Debug, Clone, PartialEq)]
struct Rec {
    r: usize,
    service: String,
    provider: String,
    class: String,
    stage: String,
    model: String,
    priority: Priority,
    admission: Admission,
    state: State,
    disposition: Option<Disposition>,
    reap_reason: Option<ReapReason>,
    owner: Option<usize>,
    enqueued_at: i64,
    started_at: Option<i64>,
    completed_at: Option<i64>,
    reaped_at: Option<i64>,
    declared_deadline_ms: Option<i64>,
    deadline_ms: i64,
    reapable_at: Option<i64>,
    queue_wait_ms: Option<i64>,
    execution_ms: Option<i64>,
    success: Option<bool>,
    failure_stage: Option<FailureStage>,
    late_settle: bool,
    cancel_reason: Option<String>,
    refined: bool,
    usage: Usage,
    max_tokens: Option<i64>,
    trace_parent: Option<String>,
}

/// The trace context record `r`'s begin carries: every other record has
/// one, so that the stores keep it beside records without.
fn trace_parent_of(r: usize) -> Option<String> {
    (r % 2 == 0).then(|| format!("00-{:032x}-{:016x}-0{}", r + 1, r + 7, r % 4 / 2))
}

impl Rec {
    fn in_flight(&self) -> bool {
        self.state.is_in_flight()
    }

    /// The instant a default timestamp may not precede (rule 2).
    fn latest(&self) -> i64 {
        self.started_at.unwrap_or(self.enqueued_at)
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Own {
    o: usize,
    name: String,
    ttl_ms: i64,
    registered_at: i64,
    renewed_at: i64,
    expires_at: i64,
    state: OwnerState,
    ended_at: Option<i64>,
    reaped_records: i64,
    cancelled_records: i64,
}

#[derive(Debug, Clone, PartialEq)]
struct LaneObs {
    service: String,
    provider: String,
    cap: Option<u32>,
    executing: i64,
    waiting: i64,
    abandoned: i64,
    unsettled: i64,
    owner_lost: i64,
    late_settles: i64,
    resurrections: i64,
    longest_wait_ms: i64,
    next_waiting_reap_in_ms: Option<i64>,
    effective_cap: Option<u32>,
    cooling_until: Option<i64>,
    cooldowns: i64,
    /// Executing and waiting, by interactive, batch, unknown.
    by_priority: [(i64, i64); 3],
    tokens_last_minute: i64,
    tokens_reserved: i64,
}

type AggKey = (String, String, String, String, String, Priority, Admission);

#[derive(Debug, Clone, PartialEq)]
struct AggObs {
    key: AggKey,
    calls: i64,
    successes: i64,
    failures: i64,
    cancelled: i64,
    abandoned: i64,
    unsettled: i64,
    late_settles: i64,
    in_flight: i64,
    avg_queue_wait_ms: Option<i64>,
    max_queue_wait_ms: Option<i64>,
    avg_execution_ms: Option<i64>,
    max_execution_ms: Option<i64>,
    last_seen_at: Option<i64>,
    // The counters the view leaves out (its `totals`, which `/metrics`
    // reads); `(count, sum, max)` for the durations.
    owner_lost: i64,
    owner_lost_abandoned: i64,
    resurrections: i64,
    succeeded_unstarted: i64,
    queue_waits: (i64, i64, i64),
    executions: (i64, i64, i64),
    /// Input and output tokens.
    tokens: (i64, i64),
}

#[derive(Debug, Clone, PartialEq)]
struct Snap {
    status: String,
    at: i64,
    since: i64,
    lanes: Vec<(String, LaneObs)>,
    total_activities: i64,
    total_succeeded: i64,
    total_failed: i64,
    total_cancelled: i64,
    total_in_flight: i64,
    total_recent_completions: i64,
    total_reaped: i64,
    total_reaped_owner_lost: i64,
    total_late_settles: i64,
    total_resurrections: i64,
    reaped_this_read: (i64, i64),
    /// `(elapsedMs, record)`, in order.
    in_flight: Vec<(i64, Rec)>,
    recent_completions: Vec<Rec>,
    /// `(ageMs, record)`, in order.
    reaped: Vec<(i64, Rec)>,
    truncated: (bool, bool, bool),
    /// Sorted by key: no rule orders them, and the stores do not agree.
    aggregates: Vec<AggObs>,
    owners: Vec<Own>,
    /// `(code, message)`.
    warnings: Vec<(String, String)>,
    unknown_classes: Vec<(String, i64)>,
}

// ---------------------------------------------------------------------------
// The reference model.

#[derive(Debug, Clone, Copy, Default)]
struct Tot {
    calls: i64,
    succeeded: i64,
    failed: i64,
    cancelled: i64,
    abandoned: i64,
    unsettled: i64,
    owner_lost: i64,
    /// Owner-lost reaps of records not started, ever (a resurrection does
    /// not take one back).
    owner_lost_abandoned: i64,
    late_settles: i64,
    resurrections: i64,
    /// Successes of records that never started.
    succeeded_unstarted: i64,
    /// Tokens reported by the calls that ended here, late settles included.
    input_tokens: i64,
    output_tokens: i64,
    in_flight: i64,
    qw_count: i64,
    qw_sum: i64,
    qw_max: i64,
    ex_count: i64,
    ex_sum: i64,
    ex_max: i64,
    last_seen: Option<i64>,
}

impl Tot {
    fn spent(&mut self, usage: Usage) {
        self.input_tokens += usage.input_tokens.unwrap_or(0);
        self.output_tokens += usage.output_tokens.unwrap_or(0);
    }

    /// A call counts its queue wait when it ends, under its final model.
    fn queue_wait(&mut self, wait: Option<i64>) {
        if let Some(wait) = wait {
            self.qw_count += 1;
            self.qw_sum += wait;
            self.qw_max = self.qw_max.max(wait);
        }
    }

    fn seen(&mut self, at: i64) {
        self.last_seen = Some(self.last_seen.map_or(at, |seen| seen.max(at)));
    }
}

type Refusal = ErrorKind;

#[derive(Debug, Clone, Default)]
struct Model {
    now: i64,
    /// Every id used, by `r`.
    ids: Vec<ActivityId>,
    /// The stored record of each id, `None` when never created or pruned.
    recs: Vec<Option<Rec>>,
    /// Every owner registered, by `o`; `None` once pruned.
    owners: Vec<Option<Own>>,
    totals: BTreeMap<AggKey, Tot>,
    /// Each idempotency key held: the record its first begin made, and
    /// that begin's request.
    keys: BTreeMap<&'static str, (usize, BeginSpec)>,
    /// Every begin with a key, as sent, for repeats.
    keyed_begins: Vec<BeginSpec>,
    /// Completions per minute of `completedAt` (absolute minutes).
    minutes: BTreeMap<i64, i64>,
    /// Tokens charged to each lane's window (section 8), by absolute second
    /// and lane; a running call's estimate in the second `RESERVED`. Kept
    /// apart from the records, which a short retention prunes while their
    /// second is still in the window, and moved by how each step changes
    /// each record's charge (`charge_of`).
    token_seconds: BTreeMap<(i64, String), i64>,
    /// What each record charged when last synced (`sync_tokens`).
    charged: Vec<Option<(i64, i64)>>,
    /// The ranked lane's interactive grants in a row while batch work
    /// waited.
    overtakes: u32,
    /// Each capped lane's cooldown and adaptive cap.
    lanes: BTreeMap<&'static str, LaneModel>,
}

/// A capped lane's cooldown, and (the ranked lane's) adaptive cap.
#[derive(Debug, Clone, Default)]
struct LaneModel {
    cooling_until: Option<i64>,
    cooldowns: i64,
    effective_cap: Option<usize>,
    successes: usize,
}

fn key_of(rec: &Rec) -> AggKey {
    (
        rec.service.clone(),
        rec.stage.clone(),
        rec.class.clone(),
        rec.provider.clone(),
        rec.model.clone(),
        rec.priority,
        rec.admission,
    )
}

fn minute_of(rel: i64) -> i64 {
    (T0 + rel).as_millis().div_euclid(MINUTE)
}

/// The second a charge at `rel` (relative ms) counts in.
fn second_of(rel: i64) -> i64 {
    (T0 + rel).as_millis().div_euclid(1_000)
}

/// The second of a running call's reservation: in every window.
const RESERVED: i64 = i64::MAX;

/// What `rec` charges to its lane's token window (section 8), written
/// from the rule's words: running, its estimate, reserved; ended after it
/// ran (started, or settled with an outcome), its reported tokens, else
/// its estimate, at its end (`completedAt`, else `reapedAt`); a late
/// settle's usage counts even for a record that never ran.
fn charge_of(rec: &Rec) -> Option<(i64, i64)> {
    let estimate = rec.max_tokens.unwrap_or(0);
    let reported = (rec.usage.input_tokens.is_some() || rec.usage.output_tokens.is_some())
        .then(|| rec.usage.input_tokens.unwrap_or(0) + rec.usage.output_tokens.unwrap_or(0));
    let (second, tokens) = match rec.state {
        State::Waiting => return None,
        State::Executing => (RESERVED, estimate),
        _ => {
            let ran = rec.started_at.is_some() || rec.success.is_some();
            let tokens = reported.unwrap_or(if ran { estimate } else { 0 });
            (second_of(rec.completed_at.or(rec.reaped_at)?), tokens)
        }
    };
    (tokens > 0).then_some((second, tokens))
}

fn lane_key(rec: &Rec) -> String {
    format!("{}::{}", rec.service, rec.provider)
}

fn bound_of(rec: &Rec) -> Option<i64> {
    match rec.state {
        State::Executing => Some(rec.started_at.unwrap() + FACTOR * rec.deadline_ms),
        State::Waiting => {
            let wait = class_bounds(&rec.class).map_or(widest_raw(), |(_, wait)| wait);
            Some(rec.enqueued_at + FACTOR * wait)
        }
        _ => None,
    }
}

impl Model {
    fn rec(&self, r: usize) -> Option<&Rec> {
        self.recs.get(r).and_then(Option::as_ref)
    }

    fn rec_mut(&mut self, r: usize) -> &mut Rec {
        self.recs[r].as_mut().expect("a stored record")
    }

    fn tot(&mut self, r: usize) -> &mut Tot {
        let key = key_of(self.rec(r).expect("a stored record"));
        self.totals.entry(key).or_default()
    }

    fn owner(&self, o: usize) -> Option<&Own> {
        self.owners.get(o).and_then(Option::as_ref)
    }

    fn owner_mut(&mut self, o: usize) -> &mut Own {
        self.owners[o].as_mut().expect("a stored owner")
    }

    fn in_flight(&self) -> Vec<usize> {
        (0..self.recs.len())
            .filter(|&r| self.rec(r).is_some_and(Rec::in_flight))
            .collect()
    }

    fn is_due(&self, r: usize) -> bool {
        let rec = self.rec(r).unwrap();
        rec.in_flight() && rec.reapable_at.is_some_and(|at| self.now > at)
    }

    /// Marks the in-flight record `r` reaped; returns its disposition.
    fn reap(&mut self, r: usize, reason: ReapReason) -> Disposition {
        let now = self.now;
        let rec = self.rec_mut(r);
        let disposition = if rec.state == State::Waiting {
            Disposition::Abandoned
        } else {
            Disposition::Unsettled
        };
        rec.state = State::Reaped;
        rec.disposition = Some(disposition);
        rec.reap_reason = Some(reason);
        // Like every instant the ledger stamps: never before the record's latest.
        rec.reaped_at = Some(now.max(rec.latest()));
        rec.reapable_at = None;
        let wait = rec.queue_wait_ms;
        let tot = self.tot(r);
        tot.in_flight -= 1;
        tot.queue_wait(wait);
        match disposition {
            Disposition::Abandoned => tot.abandoned += 1,
            Disposition::Unsettled => tot.unsettled += 1,
        }
        if reason == ReapReason::OwnerLost {
            tot.owner_lost += 1;
            if disposition == Disposition::Abandoned {
                tot.owner_lost_abandoned += 1;
            }
        }
        disposition
    }

    fn reap_if_due(&mut self, r: usize) -> Option<Disposition> {
        self.is_due(r).then(|| self.reap(r, ReapReason::Deadline))
    }

    /// Marks the owner `o` lost and reaps its in-flight records.
    fn lose(&mut self, o: usize, counts: &mut (i64, i64)) {
        let now = self.now;
        let owner = self.owner_mut(o);
        owner.state = OwnerState::Lost;
        owner.ended_at = Some(now);
        for r in self.in_flight() {
            if self.rec(r).unwrap().owner != Some(o) {
                continue;
            }
            let reason = if self.is_due(r) {
                ReapReason::Deadline
            } else {
                ReapReason::OwnerLost
            };
            count(counts, self.reap(r, reason));
            self.owner_mut(o).reaped_records += 1;
        }
    }

    fn expired(&self, o: usize) -> bool {
        self.owner(o)
            .is_some_and(|owner| owner.state == OwnerState::Live && self.now > owner.expires_at)
    }

    fn lose_if_expired(&mut self, o: usize) {
        if self.expired(o) {
            self.lose(o, &mut (0, 0));
        }
    }

    fn reap_all(&mut self) -> (i64, i64) {
        let mut counts = (0, 0);
        for o in 0..self.owners.len() {
            if self.expired(o) {
                self.lose(o, &mut counts);
            }
        }
        for r in self.in_flight() {
            if let Some(disposition) = self.reap_if_due(r) {
                count(&mut counts, disposition);
            }
        }
        counts
    }

    /// A settle of `r` landed: a `Retry-After` cools its capped lane down
    /// (at most its `max_cooldown`); the ranked lane's cap adapts.
    fn lane_settled(&mut self, r: usize, success: bool, retry: Option<i64>) {
        let rec = self.rec(r).unwrap();
        let completed_at = rec.completed_at.unwrap();
        let lane: &'static str = match lane_key(rec).as_str() {
            CAPPED_LANE => CAPPED_LANE,
            RANKED_LANE => RANKED_LANE,
            _ => return,
        };
        let state = self.lanes.entry(lane).or_default();
        if let Some(ms) = retry {
            let max = if lane == RANKED_LANE {
                RANKED_MAX_COOLDOWN
            } else {
                MAX_COOLDOWN
            };
            let until = completed_at + ms.min(max);
            state.cooling_until = Some(state.cooling_until.map_or(until, |running| running.max(until)));
            state.cooldowns += 1;
        }
        if lane == RANKED_LANE {
            let cap = state.effective_cap.unwrap_or(RANKED_CAP);
            if retry.is_some() {
                state.effective_cap = Some((cap / 2).max(1));
                state.successes = 0;
            } else if success && cap < RANKED_CAP {
                state.successes += 1;
                if state.successes >= RANKED_CAP {
                    state.successes = 0;
                    state.effective_cap = (cap + 1 < RANKED_CAP).then_some(cap + 1);
                }
            }
        }
    }

    fn capped(rec: &Rec) -> bool {
        rec.admission == Admission::Queued && (lane_key(rec) == CAPPED_LANE || lane_key(rec) == RANKED_LANE)
    }

    /// Whether `rec` holds a slot of `lane`, or a place in its line: an
    /// `external` record only while it executes.
    fn in_lane(rec: &Rec, lane: &str) -> bool {
        lane_key(rec) == lane
            && match rec.admission {
                Admission::Queued => true,
                Admission::External => rec.state == State::Executing,
                _ => false,
            }
    }

    /// The admission decision for `rec` asking to start now: reap what is
    /// due, then count the lane; on the ranked lane, hand out its free
    /// slots in its order and see whether `rec` is served. Returns the
    /// ranked lane's run of overtakes once `rec` starts.
    fn admit(&mut self, rec: &Rec, id: ActivityId, newcomer: bool) -> Result<Option<u32>, Refusal> {
        if !Self::capped(rec) {
            return Ok(None);
        }
        self.reap_all();
        // A reap charges its estimate at once: the window below reads it.
        self.sync_tokens();
        let lane = lane_key(rec);
        let me = (rec.enqueued_at, id);
        let batch = |p: Priority| p != Priority::Interactive;
        let (mut executing, mut executing_batch) = (0, 0);
        // The line, `rec` in its place: (place, batch?, is it `rec`).
        let mut line = vec![(
            (me.0, if newcomer { 1 } else { 0 }, id),
            batch(rec.priority),
            true,
            0,
        )];
        for r in self.in_flight() {
            let other = self.rec(r).unwrap();
            if !Self::in_lane(other, &lane) || self.ids[r] == id {
                continue;
            }
            match other.state {
                State::Executing => {
                    executing += 1;
                    executing_batch += usize::from(batch(other.priority));
                }
                State::Waiting => line.push((
                    (other.enqueued_at, 0, self.ids[r]),
                    batch(other.priority),
                    false,
                    other.max_tokens.unwrap_or(0),
                )),
                _ => {}
            }
        }
        line.sort();
        let state = self.lanes.get(lane.as_str()).cloned().unwrap_or_default();
        if state.cooling_until.is_some_and(|until| self.now < until) {
            return Err(ErrorKind::LaneCooling);
        }
        let own = rec.max_tokens.unwrap_or(0);
        // The estimates waiting ahead that the lane serves first: on the
        // ranked lane, an interactive record waits for interactive ones
        // only.
        let at = line.iter().position(|(_, _, me, _)| *me).unwrap();
        let tokens_ahead = |only_interactive: bool| -> i64 {
            line[..at]
                .iter()
                .filter(|(_, b, _, _)| !(only_interactive && *b))
                .map(|(_, _, _, tokens)| tokens)
                .sum()
        };
        if lane == CAPPED_LANE {
            if executing + at >= CAP as usize {
                return Err(ErrorKind::LaneFull);
            }
            if self.window_holds(|key| key == CAPPED_LANE) + tokens_ahead(false) + own > LANE_BUDGET {
                return Err(ErrorKind::BudgetExhausted);
            }
            return Ok(None);
        }
        let provider_tokens_ahead = tokens_ahead(!batch(rec.priority));
        // The ranked lane's order, one free slot at a time.
        let mut interactive: Vec<bool> = line
            .iter()
            .filter(|(_, b, _, _)| !b)
            .map(|(_, _, me, _)| *me)
            .collect();
        let mut batches: Vec<bool> = line
            .iter()
            .filter(|(_, b, _, _)| *b)
            .map(|(_, _, me, _)| *me)
            .collect();
        let others_batch = batches.iter().filter(|me| !**me).count();
        let mut run = self.overtakes;
        let cap = state.effective_cap.unwrap_or(RANKED_CAP);
        let mut free = cap.saturating_sub(executing);
        while free > 0 {
            let batch_may = !batches.is_empty() && executing_batch < RANKED_BATCH_CAP;
            let served = if batch_may && (interactive.is_empty() || run >= MAX_OVERTAKES) {
                executing_batch += 1;
                run = 0;
                batches.remove(0)
            } else if !interactive.is_empty() {
                run = if batches.is_empty() { 0 } else { run + 1 };
                interactive.remove(0)
            } else {
                break;
            };
            if served {
                let provider = format!("::{BUDGETED_PROVIDER}");
                if self.window_holds(|key| key.ends_with(&provider)) + provider_tokens_ahead + own
                    > PROVIDER_BUDGET
                {
                    return Err(ErrorKind::BudgetExhausted);
                }
                let after = if batch(rec.priority) || others_batch == 0 {
                    0
                } else {
                    self.overtakes + 1
                };
                return Ok(Some(after));
            }
            free -= 1;
        }
        Err(ErrorKind::LaneFull)
    }

    /// What the token windows of the lanes `of` hold now: charged in the
    /// last minute, and reserved.
    fn window_holds(&self, of: impl Fn(&str) -> bool) -> i64 {
        let first_second = second_of(self.now - MINUTE);
        self.token_seconds
            .iter()
            .filter(|((second, key), _)| *second >= first_second && of(key))
            .map(|(_, tokens)| tokens)
            .sum()
    }

    /// `step` applied, with its moves in the token windows.
    fn apply(&mut self, step: &Step) -> Obs {
        let obs = self.apply_step(step);
        self.sync_tokens();
        obs
    }

    /// Moves each record's charge in the token windows from what it
    /// charged when last seen to what it charges now (a record a prune
    /// removed leaves its seconds as they were).
    fn sync_tokens(&mut self) {
        self.charged.resize(self.recs.len(), None);
        for r in 0..self.recs.len() {
            let Some(rec) = self.rec(r) else { continue };
            let (lane, is) = (lane_key(rec), charge_of(rec));
            let was = std::mem::replace(&mut self.charged[r], is);
            if was == is {
                continue;
            }
            if let Some((second, tokens)) = was {
                *self.token_seconds.entry((second, lane.clone())).or_default() -= tokens;
            }
            if let Some((second, tokens)) = is {
                *self.token_seconds.entry((second, lane)).or_default() += tokens;
            }
        }
    }

    fn apply_step(&mut self, step: &Step) -> Obs {
        let result = match step {
            Step::Begin(r, spec) => self.begin(*r, spec),
            Step::Start(r, at) => self.transition(*r, true, |m, r| m.start(r, *at)),
            Step::Settle(r, success, stage, at, retry, usage) => self.transition(*r, false, |m, r| {
                // Checked before anything else is: a refusal changes nothing.
                if retry.is_some_and(|ms| *success || !(1..=3_600_000).contains(&ms)) {
                    return Err(ErrorKind::InvalidInput);
                }
                let in_range = |count: Option<i64>| count.is_none_or(|n| (0..=1_000_000_000).contains(&n));
                if !in_range(usage.input_tokens) || !in_range(usage.output_tokens) {
                    return Err(ErrorKind::InvalidInput);
                }
                let (outcome, stage) = if *success {
                    (State::Succeeded, None)
                } else {
                    (State::Failed, Some(stage.unwrap_or(FailureStage::Unknown)))
                };
                let was_in_flight = m.rec(r).unwrap().in_flight();
                m.settle(r, outcome, stage, None, *at, *usage)?;
                if was_in_flight {
                    m.lane_settled(r, *success, *retry);
                }
                Ok(())
            }),
            Step::Cancel(r, reason, at) => self.transition(*r, false, |m, r| {
                m.settle(
                    r,
                    State::Cancelled,
                    None,
                    sanitized(*reason),
                    *at,
                    Usage::default(),
                )
            }),
            Step::Refine(r, m) => self.refine(*r, *m),
            Step::Get(r) => self.get(*r),
            Step::Register(name, ttl) => self.register(name, *ttl),
            Step::Renew(owner) => self.renew(*owner),
            Step::Release(owner) => self.release(*owner),
            Step::Advance(ms) => {
                self.now += ms;
                Ok(Obs::Nothing)
            }
            Step::Reap => {
                let (abandoned, unsettled) = self.reap_all();
                Ok(Obs::Reaped { abandoned, unsettled })
            }
            Step::Snapshot(since, limit) => Ok(Obs::Snapshot(Box::new(self.snapshot(*since, *limit)))),
            Step::Prune => Ok(Obs::Pruned(self.prune())),
            Step::Stats => Ok(Obs::Stored(self.recs.iter().flatten().count() as i64)),
        };
        result.unwrap_or_else(Obs::Refused)
    }

    fn begin(&mut self, r: usize, spec: &BeginSpec) -> Result<Obs, Refusal> {
        if let Some(key) = spec.key {
            self.keyed_begins.push(spec.clone());
            // A repeat: looked up before anything else is checked.
            if let Some((first, sent)) = self.keys.get(key).cloned() {
                if sent != *spec {
                    return Err(ErrorKind::IdempotencyConflict);
                }
                if let Some(o) = self.rec(first).unwrap().owner {
                    self.lose_if_expired(o);
                }
                self.reap_if_due(first);
                return Ok(Obs::Record(self.rec(first).unwrap().clone()));
            }
        }
        let now = self.now;
        let owner = match spec.owner {
            OwnerRef::Nobody => None,
            OwnerRef::Malformed | OwnerRef::Unknown => return Err(ErrorKind::InvalidInput),
            OwnerRef::Known(o) => {
                if self.owner(o).is_none() {
                    return Err(ErrorKind::InvalidInput);
                }
                self.lose_if_expired(o);
                if self.owner(o).unwrap().state != OwnerState::Live {
                    return Err(ErrorKind::Conflict);
                }
                Some(o)
            }
        };
        // Rule 3: started but not enqueued is enqueued at min(now, started).
        let enqueued = spec
            .enqueued
            .unwrap_or_else(|| spec.started.map_or(now, |started| started.min(now)));
        if enqueued > now + SKEW {
            return Err(ErrorKind::InvalidInput);
        }
        if let Some(started) = spec.started {
            if started > now + SKEW || started < enqueued {
                return Err(ErrorKind::InvalidInput);
            }
        }
        if spec.deadline.is_some_and(|d| d <= 0) {
            return Err(ErrorKind::InvalidInput);
        }
        let (service, provider) = LANES[spec.lane];
        let class = spec.class.unwrap_or("unknown");
        let deadline_ms = spec
            .deadline
            .unwrap_or_else(|| class_bounds(class).map_or(widest_raw(), |(deadline, _)| deadline));
        let mut rec = Rec {
            r,
            service: service.to_owned(),
            provider: provider.to_owned(),
            class: class.to_owned(),
            stage: STAGE.to_owned(),
            model: MODEL.to_owned(),
            priority: spec.priority,
            admission: spec.admission,
            state: if spec.started.is_some() {
                State::Executing
            } else {
                State::Waiting
            },
            disposition: None,
            reap_reason: None,
            owner,
            enqueued_at: enqueued,
            started_at: spec.started,
            completed_at: None,
            reaped_at: None,
            declared_deadline_ms: spec.deadline,
            deadline_ms,
            reapable_at: None,
            queue_wait_ms: spec.started.map(|started| started - enqueued),
            execution_ms: None,
            success: None,
            failure_stage: None,
            late_settle: false,
            cancel_reason: None,
            refined: false,
            usage: Usage::default(),
            max_tokens: spec.max_tokens.map(i64::from).or_else(|| class_tokens(class)),
            trace_parent: trace_parent_of(r),
        };
        rec.reapable_at = bound_of(&rec);
        let budget = match lane_key(&rec).as_str() {
            CAPPED_LANE => Some(LANE_BUDGET),
            RANKED_LANE => Some(PROVIDER_BUDGET),
            _ => None,
        };
        if rec.admission == Admission::Queued
            && budget.is_some_and(|budget| rec.max_tokens.is_some_and(|estimate| estimate > budget))
        {
            return Err(ErrorKind::InvalidInput);
        }
        let granted = if rec.state == State::Executing {
            self.admit(&rec, self.ids[r], true)?
        } else {
            None
        };
        if self.rec(r).is_some() {
            return Err(ErrorKind::Conflict);
        }
        self.recs[r] = Some(rec);
        if let Some(run) = granted {
            self.overtakes = run;
        }
        if let Some(key) = spec.key {
            self.keys.insert(key, (r, spec.clone()));
        }
        let tot = self.tot(r);
        tot.calls += 1;
        tot.in_flight += 1;
        tot.seen(enqueued);
        if let Some(started) = spec.started {
            tot.seen(started);
        }
        // Begun with old timestamps: past its bound at once.
        self.reap_if_due(r);
        Ok(Obs::Record(self.rec(r).unwrap().clone()))
    }

    fn needs_admission(rec: &Rec) -> bool {
        let would_start = rec.state == State::Waiting
            || (rec.state == State::Reaped && rec.disposition == Some(Disposition::Abandoned));
        would_start && Self::capped(rec)
    }

    fn transition(
        &mut self,
        r: usize,
        start: bool,
        apply: impl FnOnce(&mut Self, usize) -> Result<(), Refusal>,
    ) -> Result<Obs, Refusal> {
        let Some(rec) = self.rec(r) else {
            return Err(ErrorKind::NotFound);
        };
        let mut granted = None;
        if rec.owner.is_some() || (start && Self::needs_admission(rec)) {
            if let Some(o) = rec.owner {
                self.lose_if_expired(o);
            }
            let rec = self.rec(r).unwrap().clone();
            if start && Self::needs_admission(&rec) {
                granted = self.admit(&rec, self.ids[r], false)?;
            }
        }
        self.reap_if_due(r);
        apply(self, r)?;
        // The run changes only once the start landed.
        if let Some(run) = granted {
            self.overtakes = run;
        }
        self.reap_if_due(r);
        Ok(Obs::Record(self.rec(r).unwrap().clone()))
    }

    fn start(&mut self, r: usize, at: Option<i64>) -> Result<(), Refusal> {
        let now = self.now;
        let rec = self.rec(r).unwrap();
        let resurrects = match (rec.state, rec.disposition) {
            (State::Executing, _) => return Ok(()),
            (State::Waiting, _) => false,
            (State::Reaped, Some(Disposition::Abandoned)) => true,
            _ => return Err(ErrorKind::Conflict),
        };
        // Rule 2: never before the record's enqueuedAt.
        let at = at.unwrap_or(now.max(rec.enqueued_at));
        if at > now + SKEW || at < rec.enqueued_at {
            return Err(ErrorKind::InvalidInput);
        }
        if resurrects {
            let rec = self.rec_mut(r);
            rec.disposition = None;
            rec.reap_reason = None;
            rec.reaped_at = None;
            let tot = self.tot(r);
            tot.in_flight += 1;
            tot.abandoned -= 1;
            tot.resurrections += 1;
        }
        let rec = self.rec_mut(r);
        rec.state = State::Executing;
        rec.started_at = Some(at);
        let wait = at - rec.enqueued_at;
        rec.queue_wait_ms = Some(wait);
        rec.reapable_at = bound_of(rec);
        self.tot(r).seen(at);
        Ok(())
    }

    fn settle(
        &mut self,
        r: usize,
        outcome: State,
        stage: Option<FailureStage>,
        reason: Option<String>,
        at: Option<i64>,
        usage: Usage,
    ) -> Result<(), Refusal> {
        let now = self.now;
        let rec = self.rec(r).unwrap();
        // Rule 2: never before the record's latest timestamp.
        let at = at.unwrap_or(now.max(rec.latest()));
        match rec.state {
            State::Reaped => {
                if !rec.late_settle {
                    let seen = now.min(at.max(rec.enqueued_at));
                    let rec = self.rec_mut(r);
                    rec.late_settle = true;
                    // The call ran: what it reports was spent (section 8).
                    if usage.input_tokens.is_some() || usage.output_tokens.is_some() {
                        rec.usage = usage;
                    }
                    let tot = self.tot(r);
                    tot.late_settles += 1;
                    tot.spent(usage);
                    tot.seen(seen);
                }
                return Ok(());
            }
            settled if settled.is_settled() => {
                return if settled == outcome {
                    Ok(())
                } else {
                    Err(ErrorKind::Conflict)
                };
            }
            _ => {}
        }
        if at > now + SKEW || at < rec.latest() {
            return Err(ErrorKind::InvalidInput);
        }
        let rec = self.rec_mut(r);
        rec.state = outcome;
        rec.completed_at = Some(at);
        rec.reapable_at = None;
        rec.execution_ms = rec.started_at.map(|started| at - started);
        rec.success = match outcome {
            State::Succeeded => Some(true),
            State::Failed => Some(false),
            _ => None,
        };
        rec.failure_stage = stage;
        rec.cancel_reason = reason;
        rec.usage = usage;
        let execution = rec.execution_ms;
        let wait = rec.queue_wait_ms;
        let tot = self.tot(r);
        tot.in_flight -= 1;
        tot.spent(usage);
        tot.queue_wait(wait);
        match outcome {
            State::Succeeded => {
                tot.succeeded += 1;
                tot.succeeded_unstarted += i64::from(wait.is_none());
            }
            State::Failed => tot.failed += 1,
            _ => tot.cancelled += 1,
        }
        if let Some(ms) = execution {
            tot.ex_count += 1;
            tot.ex_sum += ms;
            tot.ex_max = tot.ex_max.max(ms);
        }
        tot.seen(at);
        *self.minutes.entry(minute_of(at)).or_default() += 1;
        Ok(())
    }

    /// Refinement (semantics, section 2): the first one sets the model, the same one again
    /// keeps it, a different one folds it to `unknown`; only in flight.
    /// The call's count in flight moves with it.
    fn refine(&mut self, r: usize, m: usize) -> Result<Obs, Refusal> {
        let Some(asked) = REFINED_MODELS[m].1 else {
            return Err(ErrorKind::InvalidInput);
        };
        let Some(rec) = self.rec(r) else {
            return Err(ErrorKind::NotFound);
        };
        if let Some(o) = rec.owner {
            self.lose_if_expired(o);
        }
        self.reap_if_due(r);
        let now = self.now;
        let rec = self.rec(r).unwrap();
        if !rec.in_flight() {
            return Err(ErrorKind::Conflict);
        }
        let model = if !rec.refined || rec.model == asked {
            asked
        } else {
            "unknown"
        };
        if rec.model != model {
            let at = now.max(rec.latest());
            self.tot(r).in_flight -= 1;
            self.tot(r).calls -= 1;
            self.rec_mut(r).model = model.to_owned();
            let tot = self.tot(r);
            tot.in_flight += 1;
            tot.calls += 1;
            tot.seen(at);
        }
        self.rec_mut(r).refined = true;
        Ok(Obs::Record(self.rec(r).unwrap().clone()))
    }

    fn get(&mut self, r: usize) -> Result<Obs, Refusal> {
        let Some(rec) = self.rec(r) else {
            return Err(ErrorKind::NotFound);
        };
        if let Some(o) = rec.owner {
            self.lose_if_expired(o);
        }
        self.reap_if_due(r);
        Ok(Obs::Record(self.rec(r).unwrap().clone()))
    }

    fn register(&mut self, name: &str, ttl_ms: i64) -> Result<Obs, Refusal> {
        if !(100..=3_600_000).contains(&ttl_ms) {
            return Err(ErrorKind::InvalidInput);
        }
        let owner = Own {
            o: self.owners.len(),
            name: name.to_owned(),
            ttl_ms,
            registered_at: self.now,
            renewed_at: self.now,
            expires_at: self.now + ttl_ms,
            state: OwnerState::Live,
            ended_at: None,
            reaped_records: 0,
            cancelled_records: 0,
        };
        self.owners.push(Some(owner.clone()));
        Ok(Obs::Owner(owner))
    }

    fn known_owner(&mut self, owner: OwnerRef) -> Result<usize, Refusal> {
        match owner {
            OwnerRef::Known(o) if self.owner(o).is_some() => {
                self.lose_if_expired(o);
                Ok(o)
            }
            _ => Err(ErrorKind::NotFound),
        }
    }

    fn renew(&mut self, owner: OwnerRef) -> Result<Obs, Refusal> {
        let o = self.known_owner(owner)?;
        let now = self.now;
        let owner = self.owner_mut(o);
        if owner.state != OwnerState::Live {
            return Err(ErrorKind::Conflict);
        }
        owner.renewed_at = now;
        owner.expires_at = now + owner.ttl_ms;
        Ok(Obs::Owner(owner.clone()))
    }

    fn release(&mut self, owner: OwnerRef) -> Result<Obs, Refusal> {
        let o = self.known_owner(owner)?;
        let now = self.now;
        match self.owner(o).unwrap().state {
            OwnerState::Released => return Ok(Obs::Owner(self.owner(o).unwrap().clone())),
            OwnerState::Lost => return Err(ErrorKind::Conflict),
            OwnerState::Live => {}
        }
        let owner = self.owner_mut(o);
        owner.state = OwnerState::Released;
        owner.ended_at = Some(now);
        // Rule 5: every in-flight record of the owner is cancelled (or, when
        // past its bound, reaped and then late-settled).
        for r in self.in_flight() {
            if self.rec(r).unwrap().owner != Some(o) {
                continue;
            }
            self.reap_if_due(r);
            let cancelled = self.rec(r).unwrap().state != State::Reaped;
            self.settle(
                r,
                State::Cancelled,
                None,
                Some(RELEASE_REASON.to_owned()),
                None,
                Usage::default(),
            )
            .expect("rule 2: a release's cancel is never refused");
            if cancelled {
                self.owner_mut(o).cancelled_records += 1;
            }
        }
        Ok(Obs::Owner(self.owner(o).unwrap().clone()))
    }

    fn prune(&mut self) -> usize {
        let before = self.now - RETENTION;
        let mut old: Vec<(i64, ActivityId, usize)> = Vec::new();
        for (r, slot) in self.recs.iter().enumerate() {
            let Some(rec) = slot else { continue };
            let ended = if rec.state.is_settled() {
                rec.completed_at
            } else if rec.state == State::Reaped {
                rec.reaped_at
            } else {
                None
            };
            if let Some(ended) = ended.filter(|&at| at < before) {
                old.push((ended, self.ids[r], r));
            }
        }
        // The oldest first, a batch at a time.
        old.sort_unstable();
        let pruned = old.len().min(PRUNE_LIMIT);
        for &(_, _, r) in &old[..pruned] {
            self.recs[r] = None;
        }
        // A key is kept as long as its record.
        let recs = &self.recs;
        self.keys.retain(|_, (r, _)| recs[*r].is_some());
        for slot in &mut self.owners {
            if slot
                .as_ref()
                .is_some_and(|owner| owner.ended_at.is_some_and(|at| at < before))
            {
                *slot = None;
            }
        }
        self.minutes = self.minutes.split_off(&minute_of(before));
        pruned
    }

    fn snapshot(&mut self, since: Since, limit: usize) -> Snap {
        let reaped_this_read = self.reap_all();
        self.sync_tokens();
        let now = self.now;
        let since = match since {
            Since::Ago(ago) => now - ago.as_millis() as i64,
            Since::At(at) => at.millis_since(T0),
        };
        let mut lanes: BTreeMap<String, LaneObs> = BTreeMap::new();
        let empty = |cap| LaneObs {
            service: String::new(),
            provider: String::new(),
            cap,
            executing: 0,
            waiting: 0,
            abandoned: 0,
            unsettled: 0,
            owner_lost: 0,
            late_settles: 0,
            resurrections: 0,
            longest_wait_ms: 0,
            next_waiting_reap_in_ms: None,
            effective_cap: cap,
            cooling_until: None,
            cooldowns: 0,
            by_priority: [(0, 0); 3],
            tokens_last_minute: 0,
            tokens_reserved: 0,
        };
        lanes.insert(CAPPED_LANE.to_owned(), empty(Some(CAP as u32)));
        lanes.insert(RANKED_LANE.to_owned(), empty(Some(RANKED_CAP as u32)));
        for (key, state) in &self.lanes {
            let lane = lanes.get_mut(*key).unwrap();
            lane.cooling_until = state.cooling_until.filter(|until| now < *until);
            lane.cooldowns = state.cooldowns;
            if let Some(cap) = state.effective_cap {
                lane.effective_cap = Some(cap as u32);
            }
        }
        let mut everything = Tot::default();
        for (key, tot) in &self.totals {
            everything.calls += tot.calls;
            everything.succeeded += tot.succeeded;
            everything.failed += tot.failed;
            everything.cancelled += tot.cancelled;
            everything.abandoned += tot.abandoned;
            everything.unsettled += tot.unsettled;
            everything.owner_lost += tot.owner_lost;
            everything.late_settles += tot.late_settles;
            everything.resurrections += tot.resurrections;
            if key.6 == Admission::Direct {
                continue;
            }
            let lane = lanes
                .entry(format!("{}::{}", key.0, key.3))
                .or_insert_with(|| empty(None));
            lane.abandoned += tot.abandoned;
            lane.unsettled += tot.unsettled;
            lane.owner_lost += tot.owner_lost;
            lane.late_settles += tot.late_settles;
            lane.resurrections += tot.resurrections;
        }
        let mut in_flight: Vec<&Rec> = self.recs.iter().flatten().filter(|rec| rec.in_flight()).collect();
        in_flight.sort_by_key(|rec| (rec.enqueued_at, self.ids[rec.r]));
        let in_lane = |rec: &&&Rec| {
            rec.admission == Admission::Queued
                || (rec.admission == Admission::External && rec.state == State::Executing)
        };
        for rec in in_flight.iter().filter(in_lane) {
            let lane = lanes.entry(lane_key(rec)).or_insert_with(|| empty(None));
            let by_priority =
                &mut lane.by_priority[PRIORITIES.iter().position(|p| *p == rec.priority).unwrap()];
            if rec.state == State::Executing {
                by_priority.0 += 1;
            } else {
                by_priority.1 += 1;
            }
            if rec.state == State::Executing {
                lane.executing += 1;
            } else {
                if lane.waiting == 0 {
                    lane.longest_wait_ms = (now - rec.enqueued_at).max(0);
                }
                lane.waiting += 1;
                let reap_in = (rec.reapable_at.unwrap() - now).max(0);
                lane.next_waiting_reap_in_ms =
                    Some(lane.next_waiting_reap_in_ms.map_or(reap_in, |ms| ms.min(reap_in)));
            }
        }
        // A second counts while any of it is within the last minute.
        let first_second = second_of(now - MINUTE);
        for ((second, key), tokens) in &self.token_seconds {
            if *second >= first_second && *tokens != 0 {
                let lane = lanes.entry(key.clone()).or_insert_with(|| empty(None));
                if *second == RESERVED {
                    lane.tokens_reserved += tokens;
                } else {
                    lane.tokens_last_minute += tokens;
                }
            }
        }
        for (key, lane) in &mut lanes {
            let (service, provider) = key.split_once("::").unwrap();
            (lane.service, lane.provider) = (service.to_owned(), provider.to_owned());
        }
        let mut recent: Vec<&Rec> = self
            .recs
            .iter()
            .flatten()
            .filter(|rec| rec.state.is_settled() && rec.completed_at.unwrap() >= since)
            .collect();
        recent.sort_by_key(|rec| std::cmp::Reverse((rec.completed_at, self.ids[rec.r])));
        let mut reaped: Vec<&Rec> = self
            .recs
            .iter()
            .flatten()
            .filter(|rec| rec.state == State::Reaped && rec.reaped_at.unwrap() >= since)
            .collect();
        reaped.sort_by_key(|rec| std::cmp::Reverse((rec.reaped_at, self.ids[rec.r])));
        // The window's partial first minute from the records, whole minutes
        // from the per-minute counters.
        let first_minute = minute_of(since);
        let next_minute = (first_minute + 1) * MINUTE - T0.as_millis();
        let partial = self
            .recs
            .iter()
            .flatten()
            .filter(|rec| rec.state.is_settled())
            .filter(|rec| (since..next_minute).contains(&rec.completed_at.unwrap()))
            .count() as i64;
        let whole: i64 = self.minutes.range(first_minute + 1..).map(|(_, n)| n).sum();
        let aggregates = self
            .totals
            .iter()
            .filter(|(_, tot)| tot.in_flight > 0 || tot.last_seen.is_some_and(|seen| seen >= since))
            .map(|(key, tot)| {
                let avg = |sum: i64, count: i64| (count > 0).then(|| sum / count);
                let max = |max: i64, count: i64| (count > 0).then_some(max);
                AggObs {
                    key: key.clone(),
                    calls: tot.calls,
                    successes: tot.succeeded,
                    failures: tot.failed,
                    cancelled: tot.cancelled,
                    abandoned: tot.abandoned,
                    unsettled: tot.unsettled,
                    late_settles: tot.late_settles,
                    in_flight: tot.in_flight,
                    avg_queue_wait_ms: avg(tot.qw_sum, tot.qw_count),
                    max_queue_wait_ms: max(tot.qw_max, tot.qw_count),
                    avg_execution_ms: avg(tot.ex_sum, tot.ex_count),
                    max_execution_ms: max(tot.ex_max, tot.ex_count),
                    last_seen_at: tot.last_seen,
                    owner_lost: tot.owner_lost,
                    owner_lost_abandoned: tot.owner_lost_abandoned,
                    succeeded_unstarted: tot.succeeded_unstarted,
                    resurrections: tot.resurrections,
                    queue_waits: (tot.qw_count, tot.qw_sum, tot.qw_max),
                    executions: (tot.ex_count, tot.ex_sum, tot.ex_max),
                    tokens: (tot.input_tokens, tot.output_tokens),
                }
            })
            .collect();
        // In registration order here; each store's ids order them (rule 1).
        let owners = self
            .owners
            .iter()
            .flatten()
            .filter(|owner| owner.state == OwnerState::Live || owner.ended_at.is_some_and(|at| at >= since))
            .cloned()
            .collect();
        let listed =
            |records: &[&Rec]| -> Vec<Rec> { records.iter().take(limit).map(|&rec| rec.clone()).collect() };
        let status = if reaped.is_empty() && reaped_this_read == (0, 0) {
            "ok"
        } else {
            "degraded"
        };
        Snap {
            status: status.to_owned(),
            at: now,
            since,
            lanes: lanes.into_iter().collect(),
            total_activities: everything.calls,
            total_succeeded: everything.succeeded,
            total_failed: everything.failed,
            total_cancelled: everything.cancelled,
            total_in_flight: in_flight.len() as i64,
            total_recent_completions: partial + whole,
            total_reaped: everything.abandoned + everything.unsettled,
            total_reaped_owner_lost: everything.owner_lost,
            total_late_settles: everything.late_settles,
            total_resurrections: everything.resurrections,
            reaped_this_read,
            in_flight: listed(&in_flight)
                .into_iter()
                .map(|rec| ((now - rec.enqueued_at).max(0), rec))
                .collect(),
            recent_completions: listed(&recent),
            reaped: listed(&reaped)
                .into_iter()
                .map(|rec| ((now - rec.enqueued_at).max(0), rec))
                .collect(),
            truncated: (
                in_flight.len() > limit,
                recent.len() > limit,
                reaped.len() > limit,
            ),
            aggregates,
            owners,
            warnings: Vec::new(),
            unknown_classes: Vec::new(),
        }
    }
}

fn count(counts: &mut (i64, i64), disposition: Disposition) {
    match disposition {
        Disposition::Abandoned => counts.0 += 1,
        Disposition::Unsettled => counts.1 += 1,
    }
}

fn sanitized(reason: Option<&str>) -> Option<String> {
    reason.map(|reason| {
        REASONS
            .iter()
            .find(|(given, _)| *given == reason)
            .map_or(reason, |(_, stored)| stored)
            .to_owned()
    })
}

// ---------------------------------------------------------------------------
// Resolving generated operations into steps.

fn recent_index(len: usize, k: usize) -> Option<usize> {
    (len > 0).then(|| len - 1 - k % len)
}

fn clamp_future(restrict: Restrict, now: i64, at: i64) -> i64 {
    if restrict.no_future && at > now && at <= now + SKEW {
        now
    } else {
        at
    }
}

impl Model {
    /// A fresh id, ordered among the others by `key`.
    fn new_id(&mut self, key: u8) -> usize {
        let r = self.ids.len();
        let id = format!("{key:08x}-0000-7000-8000-{r:012x}").parse().unwrap();
        self.ids.push(id);
        self.recs.push(None);
        r
    }

    fn pick(&mut self, pick: Pick) -> usize {
        let stored: Vec<usize> = (0..self.ids.len()).filter(|&r| self.rec(r).is_some()).collect();
        let in_flight = self.in_flight();
        let found = match pick {
            Pick::InFlight(k) => recent_index(in_flight.len(), k)
                .map(|i| in_flight[i])
                .or_else(|| stored.last().copied()),
            Pick::Stored(k) => recent_index(stored.len(), k).map(|i| stored[i]),
            Pick::Any(k) => recent_index(self.ids.len(), k),
            Pick::Missing => None,
        };
        found.unwrap_or_else(|| self.new_id(0xff))
    }

    fn owner_ref(&self, pick: OwnerPick) -> OwnerRef {
        match pick {
            OwnerPick::Nobody => OwnerRef::Nobody,
            OwnerPick::Recent(k) => {
                recent_index(self.owners.len(), k).map_or(OwnerRef::Nobody, OwnerRef::Known)
            }
            OwnerPick::Unknown => OwnerRef::Unknown,
            OwnerPick::Malformed => OwnerRef::Malformed,
        }
    }

    fn ts(&self, r: usize, ts: Ts, restrict: Restrict) -> Option<i64> {
        let latest = self.rec(r).map_or(self.now, Rec::latest);
        let at = match ts {
            Ts::Default => return None,
            Ts::Now(offset) => self.now + offset,
            Ts::AfterLatest(offset) => latest + offset,
            Ts::BeforeLatest(offset) => latest - offset,
        };
        Some(clamp_future(restrict, self.now, at))
    }

    fn resolve(&mut self, op: &Op, restrict: Restrict) -> Step {
        let now = self.now;
        match op {
            Op::Begin(b) => {
                let r = match b.duplicate.and_then(|k| recent_index(self.ids.len(), k)) {
                    Some(r) => r,
                    None => self.new_id(b.id_key),
                };
                let mut enqueued = b.enqueued.map(|offset| clamp_future(restrict, now, now + offset));
                let started = b
                    .started
                    .map(|offset| clamp_future(restrict, now, enqueued.unwrap_or(now) + offset));
                if restrict.enqueued_with_started && enqueued.is_none() {
                    enqueued = started.map(|started| started.min(now));
                }
                Step::Begin(
                    r,
                    BeginSpec {
                        lane: b.lane,
                        class: CLASS_CHOICES[b.class],
                        admission: [Admission::Queued, Admission::Direct, Admission::External][b.admission],
                        priority: PRIORITIES[b.priority],
                        enqueued,
                        started,
                        deadline: b.deadline,
                        max_tokens: b.max_tokens,
                        owner: self.owner_ref(b.owner),
                        key: b.key.map(|k| KEYS[k]),
                    },
                )
            }
            Op::Repeat(k) => match recent_index(self.keyed_begins.len(), *k) {
                Some(i) => {
                    let spec = self.keyed_begins[i].clone();
                    Step::Begin(self.new_id(0), spec)
                }
                None => Step::Stats,
            },
            Op::Start(p, ts) => {
                let r = self.pick(*p);
                Step::Start(r, self.ts(r, *ts, restrict))
            }
            Op::Settle(p, success, stage, ts, retry, usage) => {
                let r = self.pick(*p);
                Step::Settle(r, *success, *stage, self.ts(r, *ts, restrict), *retry, *usage)
            }
            Op::Cancel(p, reason, ts) => {
                let r = self.pick(*p);
                Step::Cancel(r, reason.map(|i| REASONS[i].0), self.ts(r, *ts, restrict))
            }
            Op::Refine(p, m) => Step::Refine(self.pick(*p), *m),
            Op::Get(p) => Step::Get(self.pick(*p)),
            Op::Register(name, ttl) => Step::Register(OWNER_NAMES[*name], TTLS[*ttl]),
            Op::Renew(owner) => Step::Renew(self.owner_ref(*owner)),
            Op::Release(owner) => Step::Release(self.owner_ref(*owner)),
            Op::Advance(ms) => Step::Advance(*ms),
            Op::Reap => Step::Reap,
            Op::Snapshot(since, limit) => {
                let since = match since {
                    SinceOp::Ago(ms) => Since::Ago(millis(*ms)),
                    SinceOp::Start => Since::At(T0),
                    SinceOp::Later => Since::At(T0 + 5 * MINUTE),
                };
                Step::Snapshot(since, *limit)
            }
            Op::Prune => Step::Prune,
        }
    }
}

// ---------------------------------------------------------------------------
// The stores under test.

struct Subject {
    name: &'static str,
    store: Arc<dyn Store>,
    /// The owner ids this store handed out, by `o`.
    owner_ids: Vec<String>,
    _keep: Box<dyn std::any::Any>,
    _dir: tempfile::TempDir,
}

fn scratch_dir() -> tempfile::TempDir {
    // On a RAM disk when there is one: SQLite syncs every commit.
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(dir) = tempfile::Builder::new().prefix("inflight-diff").tempdir_in(shm) {
            return dir;
        }
    }
    tempfile::tempdir().unwrap()
}

fn open_stores(clock: &FakeClock) -> Vec<Subject> {
    let config = Arc::new(config());
    STORES
        .iter()
        .map(|(name, url)| {
            let dir = scratch_dir();
            let (url, keep) = url(dir.path());
            let store = store::open(&url, Arc::clone(&config), Arc::new(clock.clone()))
                .unwrap_or_else(|err| panic!("cannot open the {name} store: {err}"));
            Subject {
                name,
                store,
                owner_ids: Vec::new(),
                _keep: keep,
                _dir: dir,
            }
        })
        .collect()
}

impl Subject {
    fn owner_string(&self, owner: OwnerRef) -> Option<String> {
        match owner {
            OwnerRef::Nobody => None,
            OwnerRef::Known(o) => Some(self.owner_ids[o].clone()),
            OwnerRef::Unknown => Some(UNKNOWN_OWNER.to_owned()),
            OwnerRef::Malformed => Some(MALFORMED_OWNER.to_owned()),
        }
    }

    fn owner_id(&self, owner: OwnerRef) -> OwnerId {
        let id = self
            .owner_string(owner)
            .unwrap_or_else(|| UNKNOWN_OWNER.to_owned());
        id.parse().unwrap_or_else(|_| UNKNOWN_OWNER.parse().unwrap())
    }

    fn command(&self, model: &Model, step: &Step) -> Option<Command> {
        let transition = |r: usize, transition: Transition| Command::Transition {
            id: model.ids[r],
            transition,
        };
        let abs = |at: Option<i64>| at.map(|at| T0 + at);
        Some(match step {
            Step::Begin(r, spec) => {
                let (service, provider) = LANES[spec.lane];
                let labels = ActivityLabels::validate(&RawLabels {
                    service,
                    provider,
                    class: spec.class,
                    operation_stage: Some(STAGE),
                    model: Some(MODEL),
                })
                .unwrap();
                Command::Begin {
                    new: NewActivity {
                        activity_id: model.ids[*r],
                        labels,
                        priority: spec.priority,
                        admission: spec.admission,
                        enqueued_at: abs(spec.enqueued),
                        started_at: abs(spec.started),
                        deadline_ms: spec.deadline,
                        max_tokens: spec.max_tokens,
                        owner_id: self.owner_string(spec.owner),
                        extras: {
                            // Any stable function of the request will do.
                            let idempotency = spec.key.map(|key| Idempotency {
                                key: key.to_owned(),
                                fingerprint: Fingerprint::default()
                                    .field(Some(format!("{spec:?}").as_bytes()))
                                    .finish(),
                            });
                            let trace_parent =
                                trace_parent_of(*r).map(|text| TraceParent::parse(&text).unwrap());
                            (idempotency.is_some() || trace_parent.is_some()).then(|| {
                                Box::new(BeginExtras {
                                    idempotency,
                                    trace_parent,
                                })
                            })
                        },
                    },
                }
            }
            Step::Start(r, at) => transition(*r, Transition::Start { at: abs(*at) }),
            Step::Settle(r, success, stage, at, retry, usage) => transition(
                *r,
                Transition::Settle {
                    success: *success,
                    failure_stage: *stage,
                    at: abs(*at),
                    retry_after_ms: *retry,
                    usage: *usage,
                },
            ),
            Step::Cancel(r, reason, at) => transition(
                *r,
                Transition::Cancel {
                    reason: reason.map(str::to_owned),
                    at: abs(*at),
                },
            ),
            Step::Refine(r, m) => Command::Refine {
                id: model.ids[*r],
                model: REFINED_MODELS[*m].0.to_owned(),
            },
            Step::Get(r) => Command::Get { id: model.ids[*r] },
            Step::Register(name, ttl_ms) => Command::RegisterOwner {
                name: Label::new("owner name", name).unwrap(),
                ttl_ms: *ttl_ms,
            },
            Step::Renew(owner) => Command::RenewOwner {
                id: self.owner_id(*owner),
            },
            Step::Release(owner) => Command::ReleaseOwner {
                id: self.owner_id(*owner),
            },
            Step::Advance(_) => return None,
            Step::Reap => Command::Reap,
            Step::Snapshot(since, limit) => Command::Snapshot {
                options: SnapshotOptions::default()
                    .with_since(*since)
                    .with_limit(*limit)
                    .unwrap(),
            },
            Step::Prune => Command::Prune { limit: PRUNE_LIMIT },
            Step::Stats => Command::Stats,
        })
    }

    fn owner_index(&self, id: &str) -> usize {
        self.owner_ids
            .iter()
            .position(|known| known == id)
            .unwrap_or_else(|| panic!("{}: an owner id never handed out: {id}", self.name))
    }

    fn observe(&mut self, model: &Model, step: &Step, reply: Result<Reply, inflight::LedgerError>) -> Obs {
        let reply = match reply {
            Err(err) => return Obs::Refused(err.kind()),
            Ok(reply) => reply,
        };
        match reply {
            Reply::Record(record) => Obs::Record(self.rec(model, &record)),
            Reply::Reaped(counts) => Obs::Reaped {
                abandoned: counts.abandoned,
                unsettled: counts.unsettled,
            },
            Reply::Snapshot(snapshot) => Obs::Snapshot(Box::new(self.snap(model, &snapshot))),
            Reply::Owner(owner) => {
                if matches!(step, Step::Register(..)) {
                    self.owner_ids.push(owner.owner_id.to_string());
                }
                Obs::Owner(self.own(&owner))
            }
            Reply::Pruned(count) => Obs::Pruned(count),
            Reply::Stats(stats) => Obs::Stored(stats.stored_records),
            other => panic!("{}: an unexpected reply {other:?}", self.name),
        }
    }

    fn rec(&self, model: &Model, record: &ActivityRecord) -> Rec {
        let rel = |at: Option<Timestamp>| at.map(|at| at.millis_since(T0));
        Rec {
            r: model
                .ids
                .iter()
                .position(|id| *id == record.activity_id)
                .unwrap_or_else(|| panic!("{}: a record id never used: {}", self.name, record.activity_id)),
            service: record.labels.service.as_str().to_owned(),
            provider: record.labels.provider.as_str().to_owned(),
            class: record.labels.class.as_str().to_owned(),
            stage: record.labels.operation_stage.as_str().to_owned(),
            model: record.labels.model.to_string(),
            priority: record.priority,
            admission: record.admission,
            state: record.state,
            disposition: record.disposition,
            reap_reason: record.reap_reason,
            owner: record.owner_id.as_deref().map(|id| self.owner_index(id)),
            enqueued_at: record.enqueued_at.millis_since(T0),
            started_at: rel(record.started_at),
            completed_at: rel(record.completed_at),
            reaped_at: rel(record.reaped_at),
            declared_deadline_ms: record.declared_deadline_ms,
            deadline_ms: record.deadline_ms,
            reapable_at: rel(record.reapable_at),
            queue_wait_ms: record.queue_wait_ms,
            execution_ms: record.execution_ms,
            success: record.success,
            failure_stage: record.failure_stage,
            late_settle: record.late_settle,
            cancel_reason: record.cancel_reason.clone(),
            refined: record.refined,
            usage: record.usage,
            max_tokens: record.max_tokens,
            trace_parent: record.trace_parent.as_deref().map(ToString::to_string),
        }
    }

    fn own(&self, owner: &Owner) -> Own {
        Own {
            o: self.owner_index(owner.owner_id.as_str()),
            name: owner.name.as_str().to_owned(),
            ttl_ms: owner.ttl_ms,
            registered_at: owner.registered_at.millis_since(T0),
            renewed_at: owner.renewed_at.millis_since(T0),
            expires_at: owner.expires_at.millis_since(T0),
            state: owner.state,
            ended_at: owner.ended_at.map(|at| at.millis_since(T0)),
            reaped_records: owner.reaped_records,
            cancelled_records: owner.cancelled_records,
        }
    }

    fn snap(&self, model: &Model, snapshot: &Snapshot) -> Snap {
        let aggregates: Vec<AggObs> = snapshot
            .aggregates
            .iter()
            .map(|a| AggObs {
                key: (
                    a.key.service.to_string(),
                    a.key.operation_stage.to_string(),
                    a.key.class.to_string(),
                    a.key.provider.to_string(),
                    a.key.model.to_string(),
                    a.key.priority,
                    a.key.admission,
                ),
                calls: a.calls,
                successes: a.successes,
                failures: a.failures,
                cancelled: a.cancelled,
                abandoned: a.reaped.abandoned,
                unsettled: a.reaped.unsettled,
                late_settles: a.late_settles,
                in_flight: a.in_flight,
                avg_queue_wait_ms: a.avg_queue_wait_ms,
                max_queue_wait_ms: a.max_queue_wait_ms,
                avg_execution_ms: a.avg_execution_ms,
                max_execution_ms: a.max_execution_ms,
                last_seen_at: a.last_seen_at.map(|at| at.millis_since(T0)),
                owner_lost: a.totals.reaped_owner_lost,
                owner_lost_abandoned: a.totals.reaped_owner_lost_abandoned,
                succeeded_unstarted: a.totals.succeeded_unstarted,
                resurrections: a.totals.resurrections,
                queue_waits: (
                    a.totals.queue_wait_count,
                    a.totals.queue_wait_sum_ms,
                    a.totals.queue_wait_max_ms,
                ),
                executions: (
                    a.totals.execution_count,
                    a.totals.execution_sum_ms,
                    a.totals.execution_max_ms,
                ),
                tokens: (a.input_tokens, a.output_tokens),
            })
            .collect();
        Snap {
            status: snapshot.status.as_str().to_owned(),
            at: snapshot.at.millis_since(T0),
            since: snapshot.since.millis_since(T0),
            lanes: snapshot
                .native_admission
                .iter()
                .map(|(key, lane)| {
                    (
                        key.clone(),
                        LaneObs {
                            service: lane.service.clone(),
                            provider: lane.provider.clone(),
                            cap: lane.cap,
                            executing: lane.executing,
                            waiting: lane.waiting,
                            abandoned: lane.reaped.abandoned,
                            unsettled: lane.reaped.unsettled,
                            owner_lost: lane.reaped_owner_lost,
                            late_settles: lane.late_settles,
                            resurrections: lane.resurrections,
                            longest_wait_ms: lane.longest_wait_ms,
                            next_waiting_reap_in_ms: lane.next_waiting_reap_in_ms,
                            effective_cap: lane.effective_cap,
                            cooling_until: lane.cooling_until.map(|at| at.millis_since(T0)),
                            cooldowns: lane.cooldowns,
                            by_priority: [
                                lane.by_priority.interactive,
                                lane.by_priority.batch,
                                lane.by_priority.unknown,
                            ]
                            .map(|counts| (counts.executing, counts.waiting)),
                            tokens_last_minute: lane.tokens_last_minute,
                            tokens_reserved: lane.tokens_reserved,
                        },
                    )
                })
                .collect(),
            total_activities: snapshot.total_activities,
            total_succeeded: snapshot.total_succeeded,
            total_failed: snapshot.total_failed,
            total_cancelled: snapshot.total_cancelled,
            total_in_flight: snapshot.total_in_flight,
            total_recent_completions: snapshot.total_recent_completions,
            total_reaped: snapshot.total_reaped,
            total_reaped_owner_lost: snapshot.total_reaped_owner_lost,
            total_late_settles: snapshot.total_late_settles,
            total_resurrections: snapshot.total_resurrections,
            reaped_this_read: (
                snapshot.reaped_this_read.abandoned,
                snapshot.reaped_this_read.unsettled,
            ),
            in_flight: snapshot
                .in_flight
                .iter()
                .map(|entry| (entry.elapsed_ms, self.rec(model, &entry.record)))
                .collect(),
            recent_completions: snapshot
                .recent_completions
                .iter()
                .map(|record| self.rec(model, record))
                .collect(),
            reaped: snapshot
                .reaped
                .iter()
                .map(|entry| (entry.age_ms, self.rec(model, &entry.record)))
                .collect(),
            truncated: (
                snapshot.in_flight_truncated,
                snapshot.recent_completions_truncated,
                snapshot.reaped_truncated,
            ),
            aggregates,
            owners: snapshot.owners.iter().map(|owner| self.own(owner)).collect(),
            warnings: snapshot
                .warnings
                .iter()
                .map(|warning| (warning.code.to_owned(), warning.message.clone()))
                .collect(),
            unknown_classes: snapshot
                .unknown_classes
                .iter()
                .map(|(class, calls)| (class.clone(), *calls))
                .collect(),
        }
    }
}

// ---------------------------------------------------------------------------
// Running a case.

/// Orders the owners of a snapshot by `(registeredAt, ownerId)` with the
/// owner ids `ids` of one store (rule 1), or by registration when owner order
/// is not checked.
fn order_owners(obs: &mut Obs, ids: &[String], any_order: bool) {
    if let Obs::Snapshot(snap) = obs {
        if any_order {
            snap.owners.sort_by_key(|owner| owner.o);
        } else {
            snap.owners
                .sort_by(|a, b| (a.registered_at, &ids[a.o]).cmp(&(b.registered_at, &ids[b.o])));
        }
    }
}

/// The first lines where two pretty-printed values differ, with context.
fn difference<T: Debug>(expected: &T, got: &T) -> String {
    let expected = format!("{expected:#?}");
    let got = format!("{got:#?}");
    let (e, g): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), got.lines().collect());
    let first = e
        .iter()
        .zip(&g)
        .position(|(a, b)| a != b)
        .unwrap_or(e.len().min(g.len()));
    let from = first.saturating_sub(8);
    let excerpt = |lines: &[&str]| lines[from.min(lines.len())..(first + 4).min(lines.len())].join("\n");
    format!(
        "first difference at line {}:\n--- expected\n{}\n--- got\n{}",
        first + 1,
        excerpt(&e),
        excerpt(&g)
    )
}

struct Run {
    clock: FakeClock,
    model: Model,
    subjects: Vec<Subject>,
    restrict: Restrict,
}

impl Run {
    fn new(restrict: Restrict) -> Self {
        let clock = FakeClock::at(T0);
        let subjects = open_stores(&clock);
        Self {
            clock,
            model: Model::default(),
            subjects,
            restrict,
        }
    }

    /// Runs `steps` on the model and on every store (each store gets them
    /// all at once, in order, then is awaited), and checks every reply.
    /// Returns each store's observations.
    async fn steps(&mut self, label: &str, steps: &[Step]) -> Result<Vec<Vec<Obs>>, TestCaseError> {
        let mut expected = Vec::with_capacity(steps.len());
        for step in steps {
            expected.push(self.model.apply(step));
            if let Step::Advance(ms) = step {
                self.clock.advance(millis(*ms));
            }
        }
        let mut seen = Vec::with_capacity(self.subjects.len());
        for subject in &mut self.subjects {
            let pending: Vec<_> = steps
                .iter()
                .map(|step| {
                    subject
                        .command(&self.model, step)
                        .map(|command| subject.store.execute(command))
                })
                .collect();
            let mut observed = Vec::with_capacity(steps.len());
            for (step, reply) in steps.iter().zip(pending) {
                observed.push(match reply {
                    None => Obs::Nothing,
                    Some(reply) => {
                        let reply = reply.await;
                        subject.observe(&self.model, step, reply)
                    }
                });
            }
            seen.push(observed);
        }
        for (i, step) in steps.iter().enumerate() {
            let mut problems = Vec::new();
            // Every store gives the same reply (owners compared by
            // registration: each store draws its own owner ids)...
            let normal = |obs: &Obs| {
                let mut obs = obs.clone();
                order_owners(&mut obs, &[], true);
                obs
            };
            let first = normal(&seen[0][i]);
            for (subject, observed) in self.subjects.iter().zip(&seen).skip(1) {
                let other = normal(&observed[i]);
                if first != other {
                    problems.push(format!(
                        "the {} and {} stores disagree\n{}\n=== {}: {first:?}\n=== {}: {other:?}",
                        self.subjects[0].name,
                        subject.name,
                        difference(&first, &other),
                        self.subjects[0].name,
                        subject.name,
                    ));
                }
            }
            // ... and the model's.
            for (subject, observed) in self.subjects.iter().zip(&seen) {
                let mut want = expected[i].clone();
                let mut got = observed[i].clone();
                order_owners(&mut want, &subject.owner_ids, self.restrict.any_owner_order);
                if self.restrict.any_owner_order {
                    order_owners(&mut got, &[], true);
                }
                if want != got {
                    problems.push(format!(
                        "the {} store disagrees with the model\n{}\n=== model: {want:?}\n=== {}: {got:?}",
                        subject.name,
                        difference(&want, &got),
                        subject.name,
                    ));
                }
            }
            prop_assert!(
                problems.is_empty(),
                "{label}, {step:?}:\n{}",
                problems.join("\n\n")
            );
        }
        Ok(seen)
    }

    /// A full picture of each store: a snapshot of everything, every id
    /// ever used, the record count.
    async fn dump(&mut self, label: &str) -> Result<Vec<Vec<Obs>>, TestCaseError> {
        let mut steps = vec![Step::Snapshot(Since::At(Timestamp::MIN), 10_000)];
        steps.extend((0..self.model.ids.len()).map(Step::Get));
        steps.push(Step::Stats);
        self.steps(label, &steps).await
    }

    async fn op(&mut self, index: usize, op: &Op) -> Result<(), TestCaseError> {
        let step = self.model.resolve(op, self.restrict);
        let label = format!("op #{index} {op:?}");
        let mut probe = self.model.clone();
        if !matches!(probe.apply(&step), Obs::Refused(_)) {
            self.steps(&label, &[step]).await?;
            return Ok(());
        }
        // Rule 4: a refusal leaves the store as it found it. Reaping first
        // at the same instant makes the reap it may force a no-op.
        self.steps(&format!("{label} (reap before a refusal)"), &[Step::Reap])
            .await?;
        let before = self.dump(&format!("{label} (dump before a refusal)")).await?;
        self.steps(&label, &[step]).await?;
        let after = self.dump(&format!("{label} (dump after a refusal)")).await?;
        for ((subject, before), after) in self.subjects.iter().zip(&before).zip(&after) {
            prop_assert!(
                before == after,
                "{label}: the {} store changed although it refused\n{}",
                subject.name,
                difference(before, after),
            );
        }
        Ok(())
    }
}

async fn run(ops: Vec<Op>, restrict: Restrict) -> Result<(), TestCaseError> {
    let mut run = Run::new(restrict);
    for (index, op) in ops.iter().enumerate() {
        run.op(index, op).await?;
    }
    run.dump("the final dump").await?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_store_replies_as_the_model(ops in prop::collection::vec(op(), 1..=60)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(run(ops, restrictions()))?;
    }
}

/// The case `0b9969b6` (session 22's CI): two waiting records refined to
/// one new model and reaped, then a refused begin of a new aggregate,
/// which applies the rows written ahead on SQLite.
#[test]
fn refined_records_reaped_before_a_refused_begin_count_once() {
    let begin = |lane, class, enqueued| {
        Op::Begin(BeginOp {
            lane,
            class,
            admission: 0,
            priority: 0,
            enqueued,
            started: None,
            deadline: None,
            max_tokens: None,
            owner: OwnerPick::Nobody,
            id_key: 0,
            duplicate: None,
            key: None,
        })
    };
    let ops = vec![
        begin(1, 1, None),
        begin(1, 1, None),
        Op::Refine(Pick::InFlight(1), 2),
        Op::Refine(Pick::InFlight(2), 2),
        Op::Advance(15_001),
        begin(0, 0, Some(300_001)),
    ];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(ops, restrictions())).unwrap();
}

//! The server's own time per request: a histogram per route and method for
//! `/metrics`, and a warning for a request slower than [`SLOW_REQUEST`]
//! naming what the store did meanwhile, so that an operator can tell a
//! stall of the store (a group held up, a prune, a checkpoint) from one
//! outside it (the machine, the runtime, the network).

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::http::Method;
use inflight::stats::Histogram;
use inflight::store::GroupsRun;
use inflight::Ledger;

/// A request that took longer than this past what it asked to wait is
/// logged.
pub(crate) const SLOW_REQUEST: Duration = Duration::from_secs(1);

/// The upper bounds of the request histogram, in microseconds: 100 µs to
/// 30 s (a begin may wait in line up to 30 s).
const REQUEST_BUCKETS_US: &[u64] = &[
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
    2_500_000, 5_000_000, 10_000_000, 30_000_000,
];

/// Which requests a series counts: a route as the router knows it (its
/// path with `{id}`), and a method. Both come from a short fixed list, so
/// that no request grows the series.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct RouteKey {
    pub(crate) method: &'static str,
    pub(crate) route: String,
    /// Whether the request asked to wait in line (`wait=`): its time is
    /// mostly the wait it asked for, kept apart from the rest.
    pub(crate) waits: bool,
}

/// The histograms of the requests this server answered: a short list
/// (routes times methods), found by comparing, so that a request allocates
/// nothing once its series exists.
#[derive(Debug, Default)]
pub(crate) struct RequestTimes {
    by_route: Mutex<Vec<(RouteKey, Histogram)>>,
}

impl RequestTimes {
    pub(crate) fn observe(&self, method: &'static str, route: &str, waits: bool, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let mut by_route = self.by_route.lock().unwrap_or_else(PoisonError::into_inner);
        let found = by_route
            .iter_mut()
            .find(|(key, _)| key.method == method && key.waits == waits && key.route == route);
        match found {
            Some((_, histogram)) => histogram.observe_us(us),
            None => {
                let mut histogram = Histogram::new(REQUEST_BUCKETS_US);
                histogram.observe_us(us);
                let key = RouteKey {
                    method,
                    route: route.to_owned(),
                    waits,
                };
                by_route.push((key, histogram));
            }
        }
    }

    /// The histograms, in the order of their keys.
    pub(crate) fn snapshot(&self) -> Vec<(RouteKey, Histogram)> {
        let mut series = self
            .by_route
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        series.sort_by(|a, b| a.0.cmp(&b.0));
        series
    }
}

/// `method` as a label: one of the methods the API routes, or `other`.
pub(crate) fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        _ => "other",
    }
}

/// How long a request asked to wait in line: its `wait` parameter, read by
/// the handlers' own rule (`parse_wait`); one they refuse holds nothing.
pub(crate) fn asked_to_wait(query: Option<&str>) -> Option<Duration> {
    query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("wait="))
        .and_then(|text| super::body::parse_wait(text).ok())
}

/// When a request began, and how much the store had run by then.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Began {
    at: Instant,
    groups: GroupsRun,
}

impl Began {
    pub(crate) fn now(ledger: &Ledger) -> Self {
        Self {
            at: Instant::now(),
            groups: ledger.groups_run(),
        }
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.at.elapsed()
    }
}

/// Logs a request that took `took` as slow when that is past
/// [`SLOW_REQUEST`] beyond the wait it asked for, with what the store did
/// over the same time.
pub(crate) fn log_if_slow(
    ledger: &Ledger,
    (method, route): (&'static str, &str),
    status: u16,
    began: Began,
    took: Duration,
    wait: Duration,
) {
    let Some(store) = what_the_store_did(ledger, began, took, wait) else {
        return;
    };
    tracing::warn!(
        method,
        route,
        status,
        took_ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
        asked_to_wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
        store = %store,
        "slow request"
    );
}

/// For a request slow past [`SLOW_REQUEST`] beyond its `wait`, what the
/// store did meanwhile, in words: how many groups it ran and their time,
/// and each piece of its work that took long; `None` for one not slow.
fn what_the_store_did(ledger: &Ledger, began: Began, took: Duration, wait: Duration) -> Option<String> {
    if took < SLOW_REQUEST + wait {
        return None;
    }
    let ran = ledger.groups_run().since(began.groups);
    let work = ledger.slow_work(began.at, began.at + took);
    let groups = if ran.groups == 1 { "group" } else { "groups" };
    let mut said = format!(
        "the store ran {} {groups} of commands, {} ms in all",
        ran.groups,
        ran.time.as_millis()
    );
    if work.is_empty() {
        said.push_str(&format!(
            ", none of its work {} ms or more",
            inflight::store::SLOW_WORK.as_millis()
        ));
        // Neither one slow piece nor many fast ones filled the time.
        if ran.time < took / 2 {
            said.push_str(": the time went outside the store");
        }
    } else {
        let slow: Vec<String> = work.iter().map(ToString::to_string).collect();
        said.push_str(&format!("; {}", slow.join("; ")));
    }
    Some(said)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_is_read_from_the_query_and_a_bad_one_holds_nothing() {
        assert_eq!(
            asked_to_wait(Some("start=now&wait=5s")),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            asked_to_wait(Some("wait=250ms")),
            Some(Duration::from_millis(250))
        );
        assert_eq!(asked_to_wait(Some("wait=soon")), None);
        // Past the handlers' 30 s limit: refused, so it holds nothing.
        assert_eq!(asked_to_wait(Some("wait=31s")), None);
        assert_eq!(asked_to_wait(Some("start=now")), None);
        assert_eq!(asked_to_wait(None), None);
    }

    #[test]
    fn requests_are_counted_by_route_and_method() {
        let times = RequestTimes::default();
        times.observe(
            "POST",
            "/v1/activities/{id}/settle",
            false,
            Duration::from_micros(50),
        );
        times.observe("POST", "/v1/activities", false, Duration::from_micros(300));
        times.observe("POST", "/v1/activities", false, Duration::from_millis(2));
        times.observe("POST", "/v1/activities", true, Duration::from_millis(2));
        let snapshot = times.snapshot();
        assert_eq!(snapshot.len(), 3);
        assert_eq!(
            (snapshot[0].0.route.as_str(), snapshot[0].0.waits),
            ("/v1/activities", false)
        );
        assert_eq!(snapshot[0].1.count(), 2);
        assert_eq!(
            (snapshot[1].0.route.as_str(), snapshot[1].0.waits),
            ("/v1/activities", true)
        );
        assert_eq!(snapshot[2].0.route, "/v1/activities/{id}/settle");
    }

    #[tokio::test]
    async fn a_slow_request_names_the_store_work_it_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slow.db");
        let ledger = Ledger::builder(inflight::LedgerConfig::default())
            .store_url(format!("sqlite://{}", path.display()))
            .build()
            .unwrap();
        let spec = || inflight::ActivitySpec::new("kb", "ollama");
        ledger.begin_record(spec()).await.unwrap();
        // Another process holds the write lock past a second: the begin's
        // group waits for it.
        let other = rusqlite::Connection::open(&path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let began = Began::now(&ledger);
        let begun = tokio::spawn({
            let ledger = ledger.clone();
            async move { ledger.begin_record(spec()).await }
        });
        tokio::time::sleep(SLOW_REQUEST + Duration::from_millis(100)).await;
        other.execute_batch("COMMIT").unwrap();
        begun.await.unwrap().unwrap();
        let took = began.elapsed();
        let said = what_the_store_did(&ledger, began, took, Duration::ZERO).unwrap();
        assert!(said.starts_with("the store ran 1 group of commands, "), "{said}");
        assert!(said.contains("; a group of 1 command (1 begin) took "), "{said}");
        assert!(!said.contains("outside"), "{said}");
        // Not slow once its asked wait is taken off.
        assert_eq!(what_the_store_did(&ledger, began, took, took), None);

        // Many quick groups, none slow, in a second said to have passed:
        // counted, and the rest of the time placed outside the store.
        let began = Began::now(&ledger);
        for _ in 0..20 {
            ledger.begin_record(spec()).await.unwrap();
        }
        let said = what_the_store_did(&ledger, began, SLOW_REQUEST, Duration::ZERO).unwrap();
        assert!(
            said.starts_with("the store ran 20 groups of commands, "),
            "{said}"
        );
        assert!(
            said.ends_with("none of its work 100 ms or more: the time went outside the store"),
            "{said}"
        );
    }

    #[test]
    fn methods_outside_the_api_share_one_label() {
        assert_eq!(method_label(&Method::POST), "POST");
        assert_eq!(method_label(&Method::from_bytes(b"BREW").unwrap()), "other");
    }
}

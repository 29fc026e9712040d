//! The listener: one connection per instance that `LISTEN`s on the store's
//! channel and wakes this process's waiters when another instance granted
//! or freed a slot. A notification is only a hint (a woken waiter asks the
//! store again), so one lost while the connection was down costs a poll:
//! after every reconnect the waiters are woken once anyway.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use postgres::fallible_iterator::FallibleIterator;

use crate::domain::record::LaneKey;
use crate::store::Watchers;
use crate::store_url::PostgresUrl;

use super::sql;

/// How long the listener waits for a notification before it looks at
/// whether it should stop.
const TICK: Duration = Duration::from_millis(250);
/// How often an idle listener checks that its connection is alive.
const PING_EVERY: Duration = Duration::from_secs(5);
/// The longest pause between two attempts to reconnect.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

pub(super) fn listen_loop(settings: &PostgresUrl, watchers: &Watchers, stop: &AtomicBool) {
    // Wakes the first waiter of each lane named, or of every lane (`None`).
    let fire = |lanes: Option<&BTreeSet<LaneKey>>| match lanes {
        Some(lanes) => lanes.iter().for_each(|lane| watchers.wake(Some(lane))),
        None => watchers.wake(None),
    };
    let mut backoff = Duration::from_millis(100);
    while !stop.load(Ordering::SeqCst) {
        let mut client = match settings.client() {
            Ok(client) => client,
            Err(err) => {
                tracing::warn!(error = %err, "the PostgreSQL listener cannot connect; retrying");
                std::thread::sleep(jittered(backoff));
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        if let Err(err) = client.batch_execute(&sql::listen(&settings.channel)) {
            tracing::warn!(error = %err, "the PostgreSQL listener cannot LISTEN; retrying");
            std::thread::sleep(jittered(backoff));
            continue;
        }
        backoff = Duration::from_millis(100);
        // Whatever was sent while no one listened.
        fire(None);
        let mut last_ping = Instant::now();
        while !stop.load(Ordering::SeqCst) {
            let next = client.notifications().timeout_iter(TICK).next();
            match next {
                Ok(Some(first)) => {
                    // Every pending one at once: one wake-up a lane serves them all.
                    let mut lanes = noticed(first.payload()).map(BTreeSet::from_iter);
                    let mut pending = client.notifications();
                    let mut more = pending.iter();
                    while let Ok(Some(next)) = more.next() {
                        match (&mut lanes, noticed(next.payload())) {
                            (Some(lanes), Some(named)) => lanes.extend(named),
                            (lanes, _) => *lanes = None,
                        }
                    }
                    fire(lanes.as_ref());
                }
                Ok(None) => {
                    if last_ping.elapsed() >= PING_EVERY {
                        last_ping = Instant::now();
                        if client.is_valid(Duration::from_secs(2)).is_err() {
                            break;
                        }
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, "the PostgreSQL listener lost its connection; reconnecting");
                    break;
                }
            }
        }
    }
}

/// The payload of a notification: the lanes whose slots changed, as
/// `service::provider` separated by spaces (labels hold none), or empty,
/// which means any lane, when they would not fit in PostgreSQL's 8,000
/// bytes.
pub(super) fn notice(lanes: &BTreeSet<LaneKey>) -> String {
    let payload = lanes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" ");
    if payload.len() < NOTICE_MAX {
        payload
    } else {
        String::new()
    }
}

/// The most a payload may hold (PostgreSQL's limit is 8,000 bytes).
const NOTICE_MAX: usize = 7_900;

/// The lanes a notification's payload names, or `None` for any lane: an
/// empty payload (an earlier version's, or too many lanes) or one this
/// version cannot read.
pub(super) fn noticed(payload: &str) -> Option<Vec<LaneKey>> {
    if payload.is_empty() {
        return None;
    }
    payload.split(' ').map(|lane| LaneKey::parse(lane).ok()).collect()
}

/// `pause` plus up to half of it again, so that instances that lost the
/// server together do not all come back in the same instant.
fn jittered(pause: Duration) -> Duration {
    let random = RandomState::new().hash_one(Instant::now());
    pause + pause.mul_f64((random % 1000) as f64 / 2000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(key: &str) -> LaneKey {
        LaneKey::parse(key).unwrap()
    }

    #[test]
    fn a_notice_names_its_lanes_and_any_lane_when_they_do_not_fit() {
        let lanes = BTreeSet::from([lane("kb::ollama"), lane("chat.v2::openai-compat")]);
        let payload = notice(&lanes);
        assert_eq!(noticed(&payload), Some(lanes.into_iter().collect()));
        // Too many lanes for PostgreSQL's payload: an empty one, any lane.
        let many: BTreeSet<_> = (0..100)
            .map(|n| lane(&format!("{}::{}{n}", "s".repeat(60), "p".repeat(60))))
            .collect();
        assert_eq!(notice(&many), "");
        assert_eq!(noticed(""), None);
        // One this version cannot read wakes every lane rather than none.
        assert_eq!(noticed("kb::ollama not-a-lane"), None);
    }
}

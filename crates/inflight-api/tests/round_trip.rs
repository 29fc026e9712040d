//! Every wire type reads back what it writes, and writes the documented
//! names.

use std::collections::BTreeMap;
use std::fmt::Debug;

use inflight_api::*;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

/// 2026-08-13T12:00:00.000Z.
const T0: i64 = 1_786_622_400_000;

fn at(offset_ms: i64) -> Timestamp {
    Timestamp::from_millis(T0 + offset_ms)
}

/// Serializes `value` to JSON text, reads it back, and expects the same value.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) -> Value {
    let text = serde_json::to_string(value).expect("serializes");
    let back: T = serde_json::from_str(&text).unwrap_or_else(|err| panic!("{err}: {text}"));
    assert_eq!(&back, value, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// As [`round_trip`], through a query string.
fn round_trip_query<T: Serialize + DeserializeOwned + PartialEq + Debug>(value: &T) -> String {
    let text = serde_urlencoded::to_string(value).expect("serializes");
    let back: T = serde_urlencoded::from_str(&text).unwrap_or_else(|err| panic!("{err}: {text}"));
    assert_eq!(&back, value, "{text}");
    text
}

fn record(state: State) -> ActivityRecord {
    ActivityRecord {
        activity_id: "5b0f0e4e-6a1d-4a57-9a55-1f9d3f3c2a10".to_owned(),
        service: "knowledge-base".to_owned(),
        provider: "ollama".to_owned(),
        class: "embedding".to_owned(),
        operation_stage: "kb-tenant-ingestion-embedding".to_owned(),
        model: "nomic-embed-text".to_owned(),
        priority: Priority::Batch,
        admission: Admission::Queued,
        state,
        disposition: None,
        reap_reason: None,
        owner_id: Some("0d9c4c57-2f43-4c1e-9a0e-6b7a2d3c1f55".to_owned()),
        enqueued_at: at(0),
        started_at: Some(at(2_000)),
        completed_at: None,
        reaped_at: None,
        deadline_ms: 300_000,
        reapable_at: Some(at(1_202_000)),
        queue_wait_ms: Some(2_000),
        execution_ms: None,
        success: None,
        failure_stage: None,
        late_settle: false,
        unstarted_success: false,
        refined: true,
        input_tokens: Some(12),
        output_tokens: None,
        max_tokens: Some(400),
        cancel_reason: None,
        traceparent: None,
        ignored_fields: Vec::new(),
    }
}

fn reaped_record() -> ActivityRecord {
    ActivityRecord {
        disposition: Some(Disposition::Unsettled),
        reap_reason: Some(ReapReason::OwnerLost),
        reaped_at: Some(at(1_300_000)),
        reapable_at: None,
        late_settle: true,
        ..record(State::Reaped)
    }
}

fn owner(state: OwnerState) -> Owner {
    Owner {
        owner_id: "0d9c4c57-2f43-4c1e-9a0e-6b7a2d3c1f55".to_owned(),
        name: "worker-a".to_owned(),
        ttl_ms: 30_000,
        registered_at: at(0),
        renewed_at: at(20_000),
        expires_at: at(50_000),
        state,
        ended_at: (state != OwnerState::Live).then(|| at(60_000)),
        reaped_records: 1,
        cancelled_records: 0,
    }
}

fn snapshot() -> Snapshot {
    let lane = Lane {
        service: "knowledge-base".to_owned(),
        provider: "ollama".to_owned(),
        cap: Some(4),
        executing: 1,
        waiting: 2,
        reaped: ReapCounts {
            abandoned: 3,
            unsettled: 4,
        },
        reaped_owner_lost: 1,
        late_settles: 5,
        resurrections: 6,
        longest_wait_ms: 7_000,
        effective_cap: Some(2),
        cooling_until: Some(at(3_601_500)),
        cooldowns: 3,
        by_priority: ByPriority {
            interactive: PriorityCounts {
                executing: 1,
                waiting: 0,
            },
            batch: PriorityCounts {
                executing: 0,
                waiting: 2,
            },
            unknown: PriorityCounts::default(),
        },
        tokens_last_minute: 1_240,
        tokens_reserved: 800,
        tokens_per_minute: Some(5_000),
        provider_tokens_per_minute: Some(90_000),
    };
    let uncapped = Lane {
        provider: "openai".to_owned(),
        cap: None,
        effective_cap: None,
        cooling_until: None,
        longest_wait_ms: 0,
        ..lane.clone()
    };
    let mut settled = record(State::Failed);
    settled.completed_at = Some(at(3_000));
    settled.reapable_at = None;
    settled.execution_ms = Some(1_000);
    settled.success = Some(false);
    settled.failure_stage = Some(FailureStage::Provider);
    let mut cancelled = record(State::Cancelled);
    cancelled.cancel_reason = Some("client went away".to_owned());
    Snapshot {
        status: SnapshotStatus::Degraded,
        at: at(3_600_000),
        since: at(-86_400_000),
        native_admission: BTreeMap::from([
            ("knowledge-base::ollama".to_owned(), lane),
            ("knowledge-base::openai".to_owned(), uncapped),
        ]),
        total_activities: 10,
        total_succeeded: 1,
        total_succeeded_unstarted: 0,
        total_failed: 1,
        total_cancelled: 1,
        total_in_flight: 1,
        total_recent_completions: 2,
        total_reaped: 7,
        total_reaped_owner_lost: 1,
        total_late_settles: 5,
        total_resurrections: 6,
        reaped_this_read: ReapCounts {
            abandoned: 0,
            unsettled: 1,
        },
        in_flight: vec![InFlightRecord {
            record: record(State::Executing),
            elapsed_ms: 3_600_000,
        }],
        recent_completions: vec![settled, cancelled],
        reaped: vec![ReapedRecord {
            record: reaped_record(),
            age_ms: 3_600_000,
        }],
        in_flight_truncated: false,
        recent_completions_truncated: true,
        reaped_truncated: false,
        aggregates: vec![Aggregate {
            service: "knowledge-base".to_owned(),
            operation_stage: "unknown".to_owned(),
            class: "embedding".to_owned(),
            provider: "ollama".to_owned(),
            model: "redacted".to_owned(),
            priority: Priority::Unknown,
            admission: Admission::Direct,
            calls: 10,
            successes: 1,
            successes_unstarted: 0,
            failures: 1,
            cancelled: 1,
            reaped: ReapCounts {
                abandoned: 3,
                unsettled: 4,
            },
            late_settles: 5,
            in_flight: 1,
            avg_queue_wait_ms: Some(2_000),
            max_queue_wait_ms: Some(2_000),
            avg_execution_ms: None,
            max_execution_ms: None,
            last_seen_at: Some(at(3_000)),
            input_tokens: 1_200,
            output_tokens: 40,
        }],
        owners: vec![
            owner(OwnerState::Live),
            owner(OwnerState::Lost),
            owner(OwnerState::Released),
        ],
        warnings: vec![SnapshotWarning {
            code: "unknown_class".to_owned(),
            message: "class embeding is not configured".to_owned(),
        }],
    }
}

#[test]
fn requests_round_trip_full_and_minimal() {
    let full = BeginRequest {
        class: Some("embedding".to_owned()),
        operation_stage: Some("kb-tenant-ingestion-embedding".to_owned()),
        model: Some("nomic-embed-text".to_owned()),
        priority: Some(Priority::Interactive),
        admission: Some(Admission::Direct),
        enqueued_at: Some(at(-2_000)),
        started_at: Some(at(-1_000)),
        deadline_ms: Some(1_000),
        owner_id: Some("0d9c4c57-2f43-4c1e-9a0e-6b7a2d3c1f55".to_owned()),
        max_tokens: Some(2_000),
        ..BeginRequest::new("knowledge-base", "ollama")
    };
    let json = round_trip(&full);
    assert_eq!(json["maxTokens"], 2_000);
    assert_eq!(json["operationStage"], "kb-tenant-ingestion-embedding");
    assert_eq!(json["enqueuedAt"], "2026-08-13T11:59:58.000Z");
    assert_eq!(json["deadlineMs"], 1_000);
    assert_eq!(
        round_trip(&BeginRequest::new("kb", "ollama")),
        json!({"service": "kb", "provider": "ollama"}),
        "unset fields are left out"
    );

    assert_eq!(round_trip(&StartRequest::default()), json!({}));
    round_trip(&StartRequest {
        started_at: Some(at(4_000)),
    });
    for success in [true, false] {
        round_trip(&SettleRequest {
            success,
            ..SettleRequest::default()
        });
    }
    let settle = round_trip(&SettleRequest {
        success: false,
        failure_stage: Some(FailureStage::Queue),
        completed_at: Some(at(1)),
        retry_after_ms: Some(2_000),
        usage: Some(Usage {
            input_tokens: Some(7),
            output_tokens: None,
        }),
    });
    assert_eq!(settle["failureStage"], "queue");
    assert_eq!(settle["retryAfterMs"], 2_000);
    assert_eq!(settle["usage"], json!({"inputTokens": 7}));
    assert_eq!(round_trip(&CancelRequest::default()), json!({}));
    round_trip(&CancelRequest {
        reason: Some("client went away".to_owned()),
    });
    let register = round_trip(&RegisterOwnerRequest {
        name: "worker-a".to_owned(),
        ttl_ms: Some(30_000),
    });
    assert_eq!(register, json!({"name": "worker-a", "ttlMs": 30_000}));
}

#[test]
fn query_strings_round_trip() {
    assert_eq!(round_trip_query(&SnapshotQuery::default()), "");
    let query = SnapshotQuery {
        limit: Some(20),
        since: Some("24h".to_owned()),
    };
    assert_eq!(round_trip_query(&query), "limit=20&since=24h");
    round_trip_query(&SnapshotQuery {
        limit: None,
        since: Some("2026-08-13T12:00:00.000Z".to_owned()),
    });
    assert_eq!(round_trip_query(&StartQuery::default()), "");
    assert_eq!(
        round_trip_query(&StartQuery {
            wait: Some("5s".to_owned())
        }),
        "wait=5s"
    );
    // JSON carries `limit` as a number.
    round_trip(&query);
}

#[test]
fn a_limit_is_a_whole_number_as_text_or_json() {
    let read = |text: &str| serde_urlencoded::from_str::<SnapshotQuery>(text).map(|q| q.limit);
    assert_eq!(read("limit=%205").unwrap(), Some(5));
    for bad in [
        "limit=ten",
        "limit=",
        "limit=-3",
        "limit=1.5",
        "limit=99999999999",
    ] {
        let err = read(bad).unwrap_err().to_string();
        assert!(err.contains("must be a whole number"), "{bad}: {err}");
    }
    let json = |text: &str| serde_json::from_str::<SnapshotQuery>(text).map(|q| q.limit);
    assert_eq!(json(r#"{"limit": 7}"#).unwrap(), Some(7));
    assert_eq!(json(r#"{"limit": null}"#).unwrap(), None);
    assert!(json(r#"{"limit": -7}"#).is_err());
}

#[test]
fn answers_round_trip() {
    for state in State::ALL {
        round_trip(&record(*state));
    }
    round_trip(&reaped_record());
    for state in OwnerState::ALL {
        round_trip(&owner(*state));
    }
    round_trip(&ReapCounts::default());
    round_trip(&snapshot());
    let health = round_trip(&Health {
        status: HealthStatus::Ok,
    });
    assert_eq!(health, json!({"status": "ok"}));
}

#[test]
fn the_record_writes_every_documented_field_in_order() {
    let text = serde_json::to_string(&record(State::Executing)).unwrap();
    assert_eq!(
        text,
        concat!(
            r#"{"activityId":"5b0f0e4e-6a1d-4a57-9a55-1f9d3f3c2a10","service":"knowledge-base","#,
            r#""provider":"ollama","class":"embedding","operationStage":"kb-tenant-ingestion-embedding","#,
            r#""model":"nomic-embed-text","priority":"batch","admission":"queued","state":"executing","#,
            r#""disposition":null,"reapReason":null,"ownerId":"0d9c4c57-2f43-4c1e-9a0e-6b7a2d3c1f55","#,
            r#""enqueuedAt":"2026-08-13T12:00:00.000Z","startedAt":"2026-08-13T12:00:02.000Z","#,
            r#""completedAt":null,"reapedAt":null,"deadlineMs":300000,"#,
            r#""reapableAt":"2026-08-13T12:20:02.000Z","queueWaitMs":2000,"executionMs":null,"#,
            r#""success":null,"failureStage":null,"lateSettle":false,"unstartedSuccess":false,"refined":true,"#,
            r#""inputTokens":12,"outputTokens":null,"maxTokens":400}"#
        )
    );
    let mut cancelled = record(State::Cancelled);
    cancelled.cancel_reason = Some("bye".to_owned());
    assert!(serde_json::to_string(&cancelled)
        .unwrap()
        .ends_with(r#""lateSettle":false,"unstartedSuccess":false,"refined":true,"inputTokens":12,"outputTokens":null,"maxTokens":400,"cancelReason":"bye"}"#));
    let mut traced = record(State::Executing);
    traced.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned());
    assert!(serde_json::to_string(&traced).unwrap().ends_with(
        r#""maxTokens":400,"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}"#
    ));
    round_trip(&traced);
}

#[test]
fn snapshot_rows_carry_the_record_inline() {
    let json = round_trip(&snapshot());
    let row = &json["inFlight"][0];
    assert_eq!(row["activityId"], "5b0f0e4e-6a1d-4a57-9a55-1f9d3f3c2a10");
    assert_eq!(row["elapsedMs"], 3_600_000);
    assert_eq!(json["reaped"][0]["ageMs"], 3_600_000);
    assert_eq!(json["reaped"][0]["reapReason"], "owner-lost");
    let lane = &json["nativeAdmission"]["knowledge-base::openai"];
    assert_eq!(lane["cap"], Value::Null);
    assert_eq!(lane["reaped"], json!({"abandoned": 3, "unsettled": 4}));
    assert_eq!(json["status"], "degraded");
}

#[test]
fn errors_round_trip_with_their_codes_and_statuses() {
    for code in ErrorCode::ALL {
        let body = ErrorBody::new(*code, "what happened");
        let json = round_trip(&body);
        assert_eq!(
            json,
            json!({"error": {"code": code.as_str(), "message": "what happened"}})
        );
        assert_eq!(code.to_string(), code.as_str());
        assert!((400..=504).contains(&code.http_status()));
    }
    assert_eq!(ErrorCode::LaneFull.http_status(), 429);
    assert_eq!(ErrorCode::UpstreamUnreachable.http_status(), 502);
    assert_eq!(ErrorCode::UpstreamTimeout.http_status(), 504);
    assert_eq!(ErrorCode::Unavailable.http_status(), 503);
    assert_eq!(ErrorCode::RequestTimeout.http_status(), 408);
}

#[test]
fn timestamps_read_millis_or_rfc3339_and_refuse_the_rest() {
    #[derive(Debug, serde::Deserialize)]
    struct At {
        at: Timestamp,
    }
    let read = |text: &str| serde_json::from_str::<At>(text).map(|at| at.at.as_millis());
    assert_eq!(read(r#"{"at": 1786622400000}"#).unwrap(), T0);
    assert_eq!(read(r#"{"at": "2026-08-13T14:00:00+02:00"}"#).unwrap(), T0);
    assert_eq!(read(r#"{"at": 0}"#).unwrap(), 0);
    for (bad, says) in [
        (r#"{"at": -1}"#, "out of range"),
        (r#"{"at": 9223372036854775807}"#, "out of range"),
        (r#"{"at": 18446744073709551615}"#, "out of range"),
        (r#"{"at": 1.5}"#, "whole epoch milliseconds"),
        (r#"{"at": "soon"}"#, "not an RFC 3339 time"),
        (
            r#"{"at": true}"#,
            "epoch milliseconds (an integer) or an RFC 3339 time",
        ),
        (r#"{"at": null}"#, "epoch milliseconds"),
    ] {
        let err = read(bad).unwrap_err().to_string();
        assert!(err.contains(says), "{bad}: {err}");
    }
}

#[test]
fn unknown_fields_are_ignored_and_null_is_missing() {
    let begin: BeginRequest = serde_json::from_str(
        r#"{"service": "kb", "provider": "o", "class": null, "fromTheFuture": {"x": [1, 2]}}"#,
    )
    .unwrap();
    assert_eq!(begin, BeginRequest::new("kb", "o"));
    let mut json = serde_json::to_value(snapshot()).unwrap();
    json["newerField"] = json!(1);
    json["inFlight"][0]["newerField"] = json!("x");
    let back: Snapshot = serde_json::from_value(json).unwrap();
    assert_eq!(back, snapshot());
}

#[test]
fn an_older_servers_snapshot_has_no_warnings() {
    let mut json = serde_json::to_value(snapshot()).unwrap();
    json.as_object_mut().unwrap().remove("warnings");
    let back: Snapshot = serde_json::from_value(json).unwrap();
    assert!(back.warnings.is_empty());
    assert_eq!(
        serde_json::to_value(snapshot()).unwrap()["warnings"],
        json!([{"code": "unknown_class", "message": "class embeding is not configured"}])
    );
}

#[test]
fn enums_refuse_names_they_do_not_know() {
    assert!(serde_json::from_str::<Priority>(r#""urgent""#).is_err());
    assert!(serde_json::from_str::<Admission>(r#""vip""#).is_err());
    assert!(serde_json::from_str::<FailureStage>(r#""network""#).is_err());
    assert_eq!(
        serde_json::from_str::<ReapReason>(r#""owner-lost""#).unwrap(),
        ReapReason::OwnerLost
    );
    let err = serde_json::from_str::<Admission>(r#""vip""#)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unknown variant `vip`, expected one of `queued`, `direct`, `external`"),
        "{err}"
    );
    // Another JSON type is a wrong type for the field, not broken JSON.
    let err = serde_json::from_str::<Admission>("true").unwrap_err();
    assert_eq!(err.classify(), serde_json::error::Category::Data);
    assert!(
        err.to_string()
            .contains("invalid type: boolean `true`, expected one of `queued`, `direct`"),
        "{err}"
    );
}

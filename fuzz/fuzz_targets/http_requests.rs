//! Any request, to any route, over a memory ledger: never a 5xx, never a
//! panic. The first byte picks the route, the bytes up to the first newline
//! are its query string, and the rest is its body.
#![no_main]

use std::sync::OnceLock;

use axum::body::Body;
use axum::http::{header, Method, Request};
use axum::Router;
use inflight::{ActivitySpec, Ledger, LedgerConfig};
use inflight_server::http::{app, AppState};
use libfuzzer_sys::fuzz_target;
use tokio::runtime::Runtime;
use tower::ServiceExt;

struct World {
    runtime: Runtime,
    router: Router,
    activity: String,
    owner: String,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        let config = LedgerConfig::default()
            .with_lane_cap("kb::ollama", 1)
            .expect("a valid lane");
        let (router, activity, owner) = runtime.block_on(async {
            let ledger = Ledger::builder(config)
                .store_url("memory:")
                .build()
                .expect("a memory ledger");
            let record = ledger
                .begin_record(ActivitySpec::new("kb", "ollama"))
                .await
                .expect("a record");
            let owner = ledger
                .register_owner("worker", std::time::Duration::from_secs(60))
                .await
                .expect("an owner");
            (
                app(AppState::new(ledger)),
                record.activity_id.to_string(),
                owner.owner_id.to_string(),
            )
        });
        World {
            runtime,
            router,
            activity,
            owner,
        }
    })
}

/// Every route, and the methods it takes and does not take.
const ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/activities"),
    ("GET", "/v1/activities/{id}"),
    ("POST", "/v1/activities/{id}/start"),
    ("POST", "/v1/activities/{id}/settle"),
    ("POST", "/v1/activities/{id}/cancel"),
    ("GET", "/v1/snapshot"),
    ("POST", "/v1/reap"),
    ("GET", "/metrics"),
    ("POST", "/v1/owners"),
    ("POST", "/v1/owners/{owner}/renew"),
    ("DELETE", "/v1/owners/{owner}"),
    ("GET", "/healthz"),
    ("GET", "/"),
    ("PUT", "/v1/activities/{id}"),
    ("POST", "/v1/activities/not-a-uuid/settle"),
    ("GET", "/v1/nowhere"),
];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let world = world();
    let (method, path) = ROUTES[usize::from(pick) % ROUTES.len()];
    let (query, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (&[][..], rest),
    };
    let mut uri = path
        .replace("{id}", &world.activity)
        .replace("{owner}", &world.owner);
    if !query.is_empty() {
        let Ok(query) = std::str::from_utf8(query) else {
            return;
        };
        uri = format!("{uri}?{query}");
    }
    let Ok(request) = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).expect("a method"))
        .uri(&uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_vec()))
    else {
        // Not a URI a client could send.
        return;
    };
    let response = world
        .runtime
        .block_on(world.router.clone().oneshot(request))
        .expect("infallible");
    assert!(
        !response.status().is_server_error(),
        "{method} {uri} answered {} for body {:?}",
        response.status(),
        String::from_utf8_lossy(body)
    );
});

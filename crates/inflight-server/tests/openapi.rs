//! `GET /openapi.json` against the router, both ways: every operation the
//! document lists is a route of the router, and the router has no route
//! (path or method) that the document does not list. Validating the
//! document and fuzzing a live server against it is `.ci/openapi.sh`'s job.

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use inflight::{Ledger, LedgerConfig};
use inflight_server::http::{app, openapi, AppState};
use serde_json::Value;
use tower::ServiceExt;

const METHODS: [&str; 7] = ["get", "put", "post", "delete", "options", "head", "patch"];

/// Any well-formed id: no record or owner has it.
const SOME_ID: &str = "01939b1c-0000-7000-8000-000000000000";

fn router(token: Option<&str>) -> Router {
    let ledger = Ledger::builder(LedgerConfig::default())
        .store_url("memory:")
        .build()
        .unwrap();
    app(AppState::new(ledger).with_token(token.map(str::to_owned)))
}

async fn send(router: &Router, method: &str, path: &str) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(Method::from_bytes(method.to_uppercase().as_bytes()).unwrap())
        .uri(path)
        .body(Body::empty())
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// Whether the answer is the router's own: no route, or not that method.
fn is_the_routers_refusal(status: StatusCode, body: &Value) -> bool {
    status == StatusCode::METHOD_NOT_ALLOWED
        || (status == StatusCode::NOT_FOUND
            && body["error"]["message"]
                .as_str()
                .is_some_and(|message| message.starts_with("no route")))
}

/// Every (method, path template) the document lists.
fn operations(document: &Value) -> Vec<(String, String)> {
    let mut operations = Vec::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        for method in METHODS {
            if item.get(method).is_some() {
                operations.push((method.to_owned(), path.clone()));
            }
        }
    }
    operations
}

fn concrete(path: &str) -> String {
    path.replace("{id}", SOME_ID)
}

#[tokio::test]
async fn the_document_is_served_as_openapi_3_1() {
    let router = router(Some("s3cret"));
    let (status, served) = send(&router, "get", "/openapi.json").await;
    assert_eq!(status, StatusCode::OK, "never behind the token");
    assert_eq!(served, openapi::document_json().unwrap());
    assert_eq!(served["openapi"], "3.1.0");
    assert_eq!(served["info"]["title"], "inflight");
    assert_eq!(
        served["components"]["securitySchemes"]["bearerToken"]["scheme"],
        "bearer"
    );
}

#[tokio::test]
async fn every_documented_operation_is_a_route_of_the_router() {
    let document = openapi::document_json().unwrap();
    let operations = operations(&document);
    assert!(operations.len() >= 13, "{operations:?}");
    let router = router(None);
    for (method, path) in &operations {
        let (status, body) = send(&router, method, &concrete(path)).await;
        assert!(
            !is_the_routers_refusal(status, &body),
            "{method} {path} is documented but not routed: {status} {body}"
        );
    }
}

#[tokio::test]
async fn the_router_has_no_route_the_document_lacks() {
    let document = openapi::document_json().unwrap();
    let documented = operations(&document);
    let router = router(None);
    // On a documented path, every method the document does not list is 405.
    for path in document["paths"].as_object().unwrap().keys() {
        for method in METHODS {
            if documented.contains(&(method.to_owned(), path.clone())) || method == "head" {
                // axum answers HEAD wherever GET is routed.
                continue;
            }
            let (status, body) = send(&router, method, &concrete(path)).await;
            assert!(
                is_the_routers_refusal(status, &body),
                "{method} {path} is routed but not documented: {status} {body}"
            );
        }
    }
    // Paths near the documented ones that are not documented are not routed.
    for path in [
        "/",
        "/v1",
        "/v1/",
        "/v1/activities/{id}/x",
        "/v1/owners/{id}/start",
        "/v2/snapshot",
        "/openapi",
        "/metrics/x",
        "/healthz/x",
    ] {
        if document["paths"].get(path).is_some() {
            continue;
        }
        for method in ["get", "post", "delete"] {
            let (status, body) = send(&router, method, &concrete(path)).await;
            assert!(
                is_the_routers_refusal(status, &body),
                "{method} {path} is routed but not documented: {status} {body}"
            );
        }
    }
    // And every route is registered through the one list that also makes
    // the document: `app` adds none of its own but the proxy's, which
    // passes an upstream's API through (docs/api.md, "Proxy").
    let module = include_str!("../src/http/mod.rs");
    let module = module.replacen(".route(proxy::PATH,", "", 1);
    for call in [
        ".route(",
        ".route_service(",
        ".nest(",
        ".nest_service(",
        ".merge(",
    ] {
        assert!(
            !module.contains(call),
            "src/http/mod.rs calls `{call}`: add the route to `api_routes` with `routes!` instead"
        );
    }
}

#[tokio::test]
async fn the_token_is_documented_where_the_server_requires_it() {
    let document = openapi::document_json().unwrap();
    let token = router(Some("s3cret"));
    for (method, path) in operations(&document) {
        let operation = &document["paths"][&path][&method];
        let (status, _) = send(&token, &method, &concrete(&path)).await;
        let secured = operation["security"].as_array().is_some_and(|any_of| {
            any_of
                .iter()
                .any(|requirement| requirement.get("bearerToken").is_some())
        });
        assert_eq!(
            secured,
            status == StatusCode::UNAUTHORIZED,
            "{method} {path}: documented secured {secured}, answered {status}"
        );
        if secured {
            assert!(
                operation["responses"]["401"].is_object(),
                "{method} {path} documents no 401"
            );
        }
    }
}

#[tokio::test]
async fn every_error_answer_is_the_error_body() {
    let document = openapi::document_json().unwrap();
    for (method, path) in operations(&document) {
        let responses = document["paths"][&path][&method]["responses"]
            .as_object()
            .unwrap();
        for (status, response) in responses {
            let json = &response["content"]["application/json"]["schema"]["$ref"];
            if status.starts_with('4') || status.starts_with('5') {
                assert_eq!(json, "#/components/schemas/ErrorBody", "{method} {path} {status}");
            }
        }
    }
    // Every route but /healthz may be refused at the request limit; every
    // route that reads a body, for a slow one.
    for (method, path) in operations(&document) {
        let responses = &document["paths"][&path][&method]["responses"];
        assert_eq!(
            responses["503"].is_object(),
            path != "/healthz",
            "{method} {path}"
        );
        let reads_a_body = document["paths"][&path][&method]["requestBody"].is_object();
        assert_eq!(responses["408"].is_object(), reads_a_body, "{method} {path}");
        assert_eq!(responses["413"].is_object(), reads_a_body, "{method} {path}");
    }
    let detail = &document["components"]["schemas"]["ErrorDetail"];
    assert_eq!(detail["required"], serde_json::json!(["code", "message"]));
    let codes = &document["components"]["schemas"]["ErrorCode"]["enum"];
    assert_eq!(
        codes.as_array().unwrap().len(),
        inflight_api::ErrorCode::ALL.len()
    );
}

#[tokio::test]
async fn answers_document_their_fields_as_the_wire_writes_them() {
    let document = openapi::document_json().unwrap();
    let record = &document["components"]["schemas"]["ActivityRecord"];
    // camelCase, every field written (unset ones as null) except
    // cancelReason, traceparent and ignoredFields, written only when set.
    let required: Vec<&str> = record["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|name| name.as_str().unwrap())
        .collect();
    assert!(required.contains(&"activityId") && required.contains(&"reapableAt"));
    for optional in ["cancelReason", "traceparent", "ignoredFields"] {
        assert!(!required.contains(&optional), "{optional}");
    }
    assert_eq!(
        record["properties"].as_object().unwrap().len(),
        required.len() + 3
    );
    assert_eq!(record["properties"]["ignoredFields"]["items"]["type"], "string");
    // Timestamps are RFC 3339 strings in answers; requests also take millis.
    let timestamp = &document["components"]["schemas"]["Timestamp"];
    assert_eq!(
        (&timestamp["type"], &timestamp["format"]),
        (&Value::from("string"), &Value::from("date-time"))
    );
    let enqueued = &document["components"]["schemas"]["BeginRequest"]["properties"]["enqueuedAt"];
    assert_eq!(enqueued["oneOf"].as_array().unwrap().len(), 3, "{enqueued}");
    // `?wait=` and `?limit=&since=` are documented query parameters.
    let start = &document["paths"]["/v1/activities/{id}/start"]["post"];
    let names = |operation: &Value| -> Vec<String> {
        operation["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| format!("{}:{}", p["in"].as_str().unwrap(), p["name"].as_str().unwrap()))
            .collect()
    };
    assert_eq!(names(start), ["path:id", "query:wait"]);
    assert_eq!(start["requestBody"]["required"], false);
    let snapshot = &document["paths"]["/v1/snapshot"]["get"];
    assert_eq!(names(snapshot), ["query:limit", "query:since"]);
    // The header the server sends with a 201 and a 429.
    let begin = &document["paths"]["/v1/activities"]["post"]["responses"];
    assert!(begin["201"]["headers"]["Location"].is_object());
    assert!(begin["429"]["headers"]["Retry-After"].is_object());
    assert_eq!(begin["201"]["links"]["getActivity"]["operationId"], "getActivity");
    let metrics = &document["paths"]["/metrics"]["get"]["responses"]["200"]["content"];
    assert!(metrics.get("application/openmetrics-text").is_some(), "{metrics}");
}

#[test]
fn an_answer_that_makes_an_id_links_every_operation_that_takes_it() {
    let document = openapi::document_json().unwrap();
    let paths = document["paths"].as_object().unwrap();
    for collection in ["/v1/activities", "/v1/owners"] {
        let links = document["paths"][collection]["post"]["responses"]["201"]["links"]
            .as_object()
            .unwrap_or_else(|| panic!("POST {collection} links nothing"));
        let linked: std::collections::BTreeSet<&str> = links
            .values()
            .map(|link| link["operationId"].as_str().unwrap())
            .collect();
        let taking: std::collections::BTreeSet<&str> = paths
            .iter()
            .filter(|(path, _)| path.starts_with(&format!("{collection}/{{id}}")))
            .flat_map(|(_, operations)| operations.as_object().unwrap().values())
            .filter_map(|operation| operation["operationId"].as_str())
            .collect();
        assert!(!taking.is_empty(), "{collection}");
        assert_eq!(linked, taking, "POST {collection}'s 201");
    }
}

#[tokio::test]
async fn every_parameterless_read_answers_a_documented_status_and_media_type() {
    let document = openapi::document_json().unwrap();
    let router = router(None);
    let mut checked = 0;
    for (method, path) in operations(&document) {
        if method != "get" || path.contains('{') {
            continue;
        }
        let request = Request::builder().uri(&path).body(Body::empty()).unwrap();
        let response = router.clone().oneshot(request).await.unwrap();
        let status = response.status().as_u16().to_string();
        let documented = &document["paths"][&path]["get"]["responses"][&status];
        assert!(
            documented.is_object(),
            "GET {path} answered an undocumented {status}"
        );
        let served = response.headers()[header::CONTENT_TYPE].to_str().unwrap();
        let media_type = served.split(';').next().unwrap().trim();
        assert!(
            documented["content"].get(media_type).is_some(),
            "GET {path} answered {served}, documented {}",
            documented["content"]
        );
        checked += 1;
    }
    // /, /dashboard.js, /dashboard.css, /healthz, /metrics, /openapi.json, /v1/snapshot.
    assert!(checked >= 7, "{checked}");
}

/// The document the clients are built and checked against, committed.
const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../clients/openapi.json");

/// A route or a field of the wire that changes without the committed
/// document changing fails here: the clients would no longer match.
/// `INFLIGHT_WRITE_OPENAPI=1 cargo test -p inflight-server --test openapi`
/// rewrites it, for a change that is meant.
#[tokio::test]
async fn the_committed_document_is_the_served_one() {
    let (_, served) = send(&router(None), "get", "/openapi.json").await;
    let text = format!("{}\n", serde_json::to_string_pretty(&served).unwrap());
    if std::env::var_os("INFLIGHT_WRITE_OPENAPI").is_some() {
        std::fs::write(COMMITTED, &text).unwrap();
    }
    let committed = std::fs::read_to_string(COMMITTED).unwrap_or_default();
    assert!(
        committed == text,
        "clients/openapi.json differs from the document the server serves: a route or a field \
         changed. If the change is meant, rewrite it with \
         `INFLIGHT_WRITE_OPENAPI=1 cargo test -p inflight-server --test openapi` and update the clients."
    );
}

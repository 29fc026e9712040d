//! `/proxy/NAME/...`: the ledger and admission in front of a provider, for
//! clients that only take a base URL.
//!
//! A request to `/proxy/NAME/PATH` is forwarded to the route's upstream
//! (`[proxy.NAME]`, [`Route`]) at `PATH`. When it is a call (`call.rs`: a
//! POST whose path names a class, or any request with `X-Inflight-Class`),
//! it is recorded first: begun on arrival, it waits in its lane's line
//! (priorities, cooldowns, budgets) up to its max wait, and is started when
//! forwarded. Its answer streams back through `answer.rs`, which reads its
//! usage (`usage.rs`) and settles it when it ends. Anything else (a model
//! list, a health check) is forwarded unrecorded.
//!
//! Only configured upstreams are reachable: the client's `Host` and any
//! absolute request target are never used to pick one.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody as _};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, Uri};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt as _, Full, Limited};
use tokio::time::Instant;

use inflight::domain::record::FailureStage;
use inflight::domain::trace::TraceParent;
use inflight::{ActivitySpec, Outcome, Permit};

use inflight::Ledger;

use crate::http::auth::{check_service, Grant};
use crate::http::error::ApiError;

mod answer;
mod call;
mod route;
mod usage;

pub(crate) use call::TOKEN_HEADER;
pub use route::{Route, Routes, DEFAULT_MAX_BODY_BYTES};

/// The answer's header naming the call's record.
const ACTIVITY_ID: HeaderName = HeaderName::from_static("x-inflight-activity-id");

/// The cancel reason of a call whose client went away before its answer
/// ended.
pub const CLIENT_DISCONNECTED: &str = "client-disconnected";

/// The router's path for every proxied request.
pub(crate) const PATH: &str = "/proxy/{name}/{*path}";

/// What the proxy reads of the server's state.
#[derive(Clone)]
pub(crate) struct ProxyState {
    pub(crate) ledger: Ledger,
    pub(crate) routes: Arc<Routes>,
    /// How long a request's body may take to arrive.
    pub(crate) body_timeout: Duration,
    /// Whether the server requires a token: a request then carries the
    /// [`Grant`] its token earned, or is refused (fail closed).
    pub(crate) has_tokens: bool,
}

/// Forwards one request through its route.
pub(crate) async fn forward(State(state): State<ProxyState>, request: Request) -> Response {
    match forwarded(&state, request).await {
        Ok(response) => response,
        Err(err) => err.into_response(),
    }
}

async fn forwarded(state: &ProxyState, request: Request) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    if parts.uri.scheme().is_some() || parts.uri.authority().is_some() {
        return Err(ApiError::invalid(
            "a proxied request names its path only (origin form), never a host: the route picks the upstream",
        ));
    }
    let (name, path) = split(parts.uri.path())?;
    let route = state
        .routes
        .get(name)
        .ok_or_else(|| ApiError::not_found(format!("no proxy route {name:?}; {}", state.routes.names())))?;
    let asked = call::asked(&parts.headers)?;
    let upstream_path = format!("{}{path}", route.base_path);
    let class = asked
        .class
        .as_ref()
        .map(|class| class.as_str().to_owned())
        .or_else(|| call::class_of(&parts.method, &upstream_path).map(str::to_owned));
    let body = read_body(body, route.max_body, state.body_timeout).await?;
    let uri = Uri::builder()
        .scheme(route.scheme.clone())
        .authority(route.authority.clone())
        .path_and_query(match parts.uri.query() {
            Some(query) => format!("{upstream_path}?{query}"),
            None => upstream_path.clone(),
        })
        .build()
        .map_err(|_| ApiError::invalid("the path and query do not make a URL"))?;
    let mut upstream = hyper::Request::builder().method(parts.method.clone()).uri(uri);
    if let Some(headers) = upstream.headers_mut() {
        *headers = forwarded_headers(&parts.headers, class.is_some());
    }
    let upstream = upstream
        .body(Full::new(body.clone()))
        .map_err(|_| ApiError::invalid("the request cannot be forwarded"))?;
    let Some(class) = class else {
        // Not a call: forwarded unrecorded.
        let answer = route
            .client
            .request(upstream)
            .await
            .map_err(|err| unreachable_upstream(route, &err, None))?;
        let (head, incoming) = answer.into_parts();
        return Ok(respond(head, Body::new(incoming), None));
    };

    let grant = match (parts.extensions.get::<Grant>(), state.has_tokens) {
        (Some(grant), _) => grant.clone(),
        (None, false) => Grant::everything(),
        (None, true) => {
            return Err(ApiError::forbidden(
                "this route is not open to this request's token",
            ))
        }
    };
    if let Some(why) = grant.refuses_method(&Method::POST) {
        return Err(ApiError::forbidden(why));
    }
    let service = asked
        .service
        .as_ref()
        .unwrap_or(&route.service)
        .as_str()
        .to_owned();
    check_service(&grant, &service, "/proxy")?;
    let model = call::model_of_path(&upstream_path)
        .map(str::to_owned)
        .or_else(|| model_of_body(&body));
    let mut spec = ActivitySpec::new(service, route.provider.as_str().to_owned()).class(class.clone());
    if let Some(stage) = asked.stage {
        spec = spec.operation_stage(stage.as_str().to_owned());
    }
    if let Some(model) = &model {
        spec = spec.model(model.clone());
    }
    if let Some(priority) = asked.priority {
        spec = spec.priority(priority);
    }
    // A hop on the call's path, the proxy propagates trace context as W3C
    // asks: a malformed `traceparent` is ignored, never refused (it is
    // still forwarded as sent).
    if let Some(parent) = parts
        .headers
        .get("traceparent")
        .and_then(|value| value.to_str().ok())
        .and_then(|text| TraceParent::parse(text).ok())
    {
        spec = spec.trace_parent(parent);
    }
    let ledger = &state.ledger;
    let permit = ledger
        .admit_within(
            spec,
            asked.max_wait.unwrap_or(route.max_wait),
            CLIENT_DISCONNECTED,
        )
        .await?;
    // The upstream has the class's deadline to answer, to the last byte.
    let deadline_ms = ledger.config().policy().effective_deadline_ms(&class, None);
    let deadline = Instant::now() + Duration::from_millis(u64::try_from(deadline_ms).unwrap_or(u64::MAX));
    let id = permit.id();
    let answer = match tokio::time::timeout_at(deadline, route.client.request(upstream)).await {
        Ok(Ok(answer)) => answer,
        // Recorded failed: the answer names the record, as an upstream's does.
        Ok(Err(err)) => {
            fail(permit).await;
            return Ok(naming(
                unreachable_upstream(route, &err, Some(id)).into_response(),
                id,
            ));
        }
        Err(_) => {
            fail(permit).await;
            let error = ApiError::upstream_timeout(format!(
                "the upstream of proxy route {:?} did not answer within class {class:?}'s deadline of {}; \
                 activity {id} is recorded failed",
                route.name,
                humantime::format_duration(Duration::from_millis(u64::try_from(deadline_ms).unwrap_or(0)))
            ));
            return Ok(naming(error.into_response(), id));
        }
    };
    let (head, incoming) = answer.into_parts();
    let ending = answer::Ending::new(permit, model, head.status, &head.headers);
    let body = if incoming.is_end_stream() {
        // No body to wait for (a 204, say): settled now.
        ending.settle(usage::Read::default(), false).await;
        Body::empty()
    } else {
        let content_type = head
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok());
        let framing = usage::Framing::of(content_type);
        Body::new(answer::Answer::new(incoming, ending, framing, deadline))
    };
    Ok(respond(head, body, Some(id)))
}

/// The route's name and the rest of the path (with its leading `/`) of
/// `/proxy/NAME/REST`; a dot segment, plain or percent-encoded, is
/// refused, so that no path climbs out of the upstream's base path.
fn split(path: &str) -> Result<(&str, &str), ApiError> {
    let rest = path.strip_prefix("/proxy/").unwrap_or(path);
    let (name, rest) = rest
        .split_once('/')
        .map_or((rest, ""), |(name, rest)| (name, rest));
    let rest = &path[path.len() - rest.len() - 1..];
    let climbs = rest.split('/').any(|segment| {
        let lower = segment.to_ascii_lowercase();
        let dots = lower.replace("%2e", ".");
        dots == "."
            || dots == ".."
            || lower.contains("%2f")
            || lower.contains("%5c")
            || segment.contains('\\')
    });
    if climbs {
        return Err(ApiError::invalid(format!(
            "the path {rest:?} has a dot segment or an encoded slash; send the path as the upstream spells it"
        )));
    }
    Ok((name, rest))
}

/// The request body, whole: its model is read before the call begins, and
/// it is forwarded once admitted.
async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    let collected = tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await;
    match collected {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(err)) if err.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::payload_too_large(limit))
        }
        Ok(Err(err)) => Err(ApiError::invalid(format!(
            "the request body could not be read: {err}"
        ))),
        Err(_) => Err(ApiError::request_timeout(timeout)),
    }
}

/// The body's top-level `model`, read as an answer's is.
fn model_of_body(body: &[u8]) -> Option<String> {
    let mut reader = usage::Reader::new(usage::Framing::Json);
    reader.feed(body);
    reader.read().model
}

/// The headers that are not the connection's: hop-by-hop ones (and any
/// the `Connection` header names) go, as do `Host`, the length (the body
/// sets it) and the proxy's own `X-Inflight-*`.
fn end_to_end(headers: &HeaderMap) -> HeaderMap {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect();
    let mut kept = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let name_str = name.as_str();
        // `Proxy-*` are this hop's (its authorization, its status).
        let hop = name_str.starts_with("proxy-")
            || matches!(
                name_str,
                "connection"
                    | "keep-alive"
                    | "te"
                    | "trailer"
                    | "transfer-encoding"
                    | "upgrade"
                    | "host"
                    | "content-length"
                    | "expect"
            );
        if !hop && !call::is_own(name_str) && !named.iter().any(|named| named == name_str) {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

/// A request's headers as the upstream gets them. A call asks for its
/// answer uncompressed, so that its usage can be read as it passes.
fn forwarded_headers(headers: &HeaderMap, recorded: bool) -> HeaderMap {
    let mut kept = end_to_end(headers);
    if recorded {
        kept.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    }
    kept
}

/// The client's answer: the upstream's status and end-to-end headers,
/// the record's id, and `body`.
fn respond(head: hyper::http::response::Parts, body: Body, id: Option<inflight::ActivityId>) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = head.status;
    *response.headers_mut() = end_to_end(&head.headers);
    if let Some(length) = head.headers.get(header::CONTENT_LENGTH) {
        // The body passes unchanged, so its length holds.
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, length.clone());
    }
    match id {
        Some(id) => naming(response, id),
        None => response,
    }
}

/// `response`, with the id of the record the call made
/// (`X-Inflight-Activity-Id`).
fn naming(mut response: Response, id: inflight::ActivityId) -> Response {
    if let Ok(id) = HeaderValue::try_from(id.to_string()) {
        response.headers_mut().insert(ACTIVITY_ID, id);
    }
    response
}

/// Settles a call whose upstream never answered as the provider's failure.
async fn fail(permit: Permit) {
    let id = permit.id();
    if let Err(err) = permit.settle(Outcome::Failure(FailureStage::Provider)).await {
        tracing::warn!(error = %err, %id, "cannot settle a proxied call");
    }
}

/// The answer to a call whose upstream could not be reached; `recorded`,
/// the record it made, if it was one.
fn unreachable_upstream(
    route: &Route,
    err: &hyper_util::client::legacy::Error,
    recorded: Option<inflight::ActivityId>,
) -> ApiError {
    tracing::info!(route = route.name(), error = %err, "a proxy route's upstream is unreachable");
    // The client's own words ("client error (Connect)") say little; its
    // causes say what failed ("dns error: failed to lookup address ...").
    let mut causes = Vec::new();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        causes.push(cause.to_string());
        source = cause.source();
    }
    let cause = if causes.is_empty() {
        err.to_string()
    } else {
        causes.join(": ")
    };
    let recorded = recorded
        .map(|id| format!("; activity {id} is recorded failed"))
        .unwrap_or_default();
    ApiError::upstream_unreachable(format!(
        "the upstream of proxy route {:?} cannot be reached: {cause}{recorded}",
        route.name
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_splits_into_route_and_rest_and_never_climbs() {
        assert_eq!(
            split("/proxy/ollama/api/embed").unwrap(),
            ("ollama", "/api/embed")
        );
        assert_eq!(
            split("/proxy/oa/v1/chat/completions").unwrap(),
            ("oa", "/v1/chat/completions")
        );
        for bad in [
            "/proxy/o/../x",
            "/proxy/o/a/./b",
            "/proxy/o/%2e%2E/x",
            "/proxy/o/.%2e/x",
            "/proxy/o/a%2Fb",
            "/proxy/o/a%5cb",
        ] {
            let err = split(bad).unwrap_err();
            assert_eq!(err.code(), "invalid_request", "{bad}");
        }
    }

    #[test]
    fn hop_by_hop_and_own_headers_stay_behind() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-custom-hop"),
            ("x-custom-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic cHJveHk6cHc="),
            ("proxy-status", "cache; hit"),
            ("transfer-encoding", "chunked"),
            ("host", "evil.example"),
            ("content-length", "12"),
            ("x-inflight-token", "secret"),
            ("x-inflight-service", "kb"),
            ("authorization", "Bearer upstream-key"),
            ("content-type", "application/json"),
            ("accept-encoding", "gzip"),
        ] {
            headers.append(HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        let kept = forwarded_headers(&headers, true);
        let names: Vec<&str> = kept.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["authorization", "content-type", "accept-encoding"]);
        assert_eq!(kept["accept-encoding"], "identity");
        assert_eq!(forwarded_headers(&headers, false)["accept-encoding"], "gzip");
    }
}

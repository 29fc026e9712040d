//! Whose call a proxied request is: its labels from the `X-Inflight-*`
//! headers, or else from its route, its path and its body.

use std::time::Duration;

use axum::http::{HeaderMap, Method};

use inflight::domain::labels::Label;
use inflight::domain::record::Priority;

use super::route::MAX_WAIT_LIMIT;
use crate::http::body::bounded_duration;
use crate::http::error::ApiError;

/// The token of a proxied request: `Authorization` is the upstream's.
pub(crate) const TOKEN_HEADER: &str = "x-inflight-token";
/// Every request header of the proxy's own; none is forwarded.
const OWN_PREFIX: &str = "x-inflight-";
/// The headers a request may set, after the prefix.
const ASKED: [&str; 6] = ["service", "stage", "priority", "class", "max-wait", "token"];

/// What a request's `X-Inflight-*` headers ask for.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Asked {
    pub(super) service: Option<Label>,
    pub(super) stage: Option<Label>,
    pub(super) priority: Option<Priority>,
    pub(super) class: Option<Label>,
    pub(super) max_wait: Option<Duration>,
}

/// Whether `name` (lower case, as `http` keeps it) is one of the proxy's
/// own headers, never forwarded.
pub(super) fn is_own(name: &str) -> bool {
    name.starts_with(OWN_PREFIX)
}

/// Reads the `X-Inflight-*` headers; a header it does not know is refused,
/// so that a misspelt one does not pass silently.
pub(super) fn asked(headers: &HeaderMap) -> Result<Asked, ApiError> {
    let mut asked = Asked::default();
    for name in headers.keys() {
        let Some(which) = name.as_str().strip_prefix(OWN_PREFIX) else {
            continue;
        };
        let header = spelled(which);
        let value = single(headers, name.as_str(), &header)?;
        match which {
            "service" => asked.service = Some(label(&header, "service", value)?),
            "stage" => asked.stage = Some(label(&header, "operationStage", value)?),
            "class" => asked.class = Some(label(&header, "class", value)?),
            "priority" => {
                asked.priority = Some(value.parse().map_err(|_| {
                    ApiError::invalid(format!(
                        "{header}: {value:?} is not a priority; send interactive, batch or unknown"
                    ))
                })?);
            }
            "max-wait" => asked.max_wait = Some(bounded_duration(&header, value, MAX_WAIT_LIMIT)?),
            "token" => {}
            _ => {
                let known: Vec<String> = ASKED.iter().map(|which| spelled(which)).collect();
                return Err(ApiError::invalid(format!(
                    "{header} is not a header of the proxy's; it takes {}",
                    known.join(", ")
                )));
            }
        }
    }
    Ok(asked)
}

/// `max-wait` as it is documented: `X-Inflight-Max-Wait`.
fn spelled(which: &str) -> String {
    let words: Vec<String> = which
        .split('-')
        .map(|word| {
            let mut chars = word.chars();
            chars
                .next()
                .map(|first| first.to_ascii_uppercase().to_string() + chars.as_str())
                .unwrap_or_default()
        })
        .collect();
    format!("X-Inflight-{}", words.join("-"))
}

/// The header's one value, as text.
fn single<'a>(headers: &'a HeaderMap, name: &str, header: &str) -> Result<&'a str, ApiError> {
    let mut values = headers.get_all(name).iter();
    let value = values.next().map(|value| value.to_str());
    if values.next().is_some() {
        return Err(ApiError::invalid(format!("{header}: sent more than once")));
    }
    match value {
        Some(Ok(value)) => Ok(value.trim()),
        _ => Err(ApiError::invalid(format!("{header}: not printable ASCII"))),
    }
}

fn label(header: &str, field: &'static str, value: &str) -> Result<Label, ApiError> {
    Label::new(field, value).map_err(|err| ApiError::invalid(format!("{header}: {value:?} {}", err.problem)))
}

/// The class a request's method and path name, as the providers' APIs
/// spell their calls; `None` for what is not a call (a model list, a
/// health check), which is forwarded unrecorded.
pub(super) fn class_of(method: &Method, path: &str) -> Option<&'static str> {
    if method != Method::POST {
        return None;
    }
    // Gemini: `.../models/{model}:{method}`.
    if let Some((_, call)) = path.rsplit('/').next().and_then(|last| last.split_once(':')) {
        return match call {
            "embedContent" | "batchEmbedContents" => Some("embedding"),
            "generateContent" | "streamGenerateContent" => Some("chat"),
            _ => None,
        };
    }
    const EMBEDDING: [&str; 3] = ["/embeddings", "/api/embed", "/api/embeddings"];
    // Anthropic's `/v1/messages` whole: a thread's `.../messages` is not a call.
    const CHAT: [&str; 6] = [
        "/chat/completions",
        "/completions",
        "/responses",
        "/v1/messages",
        "/api/chat",
        "/api/generate",
    ];
    if EMBEDDING.iter().any(|end| path.ends_with(end)) {
        Some("embedding")
    } else if CHAT.iter().any(|end| path.ends_with(end)) {
        Some("chat")
    } else {
        None
    }
}

/// The model of a Gemini path, `.../models/{model}:{method}`.
pub(super) fn model_of_path(path: &str) -> Option<&str> {
    let (_, tail) = path.rsplit_once("/models/")?;
    let (model, _) = tail.split_once(':')?;
    (!model.is_empty() && !model.contains('/')).then_some(model)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn the_path_names_the_class_of_a_post() {
        for (path, class) in [
            ("/v1/embeddings", Some("embedding")),
            ("/api/embed", Some("embedding")),
            ("/api/embeddings", Some("embedding")),
            (
                "/v1beta/models/text-embedding-004:embedContent",
                Some("embedding"),
            ),
            (
                "/v1beta/models/text-embedding-004:batchEmbedContents",
                Some("embedding"),
            ),
            ("/v1/chat/completions", Some("chat")),
            ("/v1/completions", Some("chat")),
            ("/v1/responses", Some("chat")),
            ("/v1/messages", Some("chat")),
            ("/v1/threads/thread_1/messages", None),
            ("/api/chat", Some("chat")),
            ("/api/generate", Some("chat")),
            ("/v1beta/models/gemini-2.0-flash:generateContent", Some("chat")),
            (
                "/v1beta/models/gemini-2.0-flash:streamGenerateContent",
                Some("chat"),
            ),
            ("/v1beta/models/gemini-2.0-flash:countTokens", None),
            ("/v1/models", None),
            ("/api/tags", None),
            ("/v1/responses/resp_1", None),
        ] {
            assert_eq!(class_of(&Method::POST, path), class, "{path}");
        }
        assert_eq!(class_of(&Method::GET, "/v1/chat/completions"), None);
    }

    #[test]
    fn a_gemini_path_names_its_model() {
        assert_eq!(
            model_of_path("/v1beta/models/gemini-2.0-flash:generateContent"),
            Some("gemini-2.0-flash")
        );
        assert_eq!(model_of_path("/v1/chat/completions"), None);
        assert_eq!(model_of_path("/v1beta/models/:generateContent"), None);
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn the_headers_set_the_labels_and_bad_ones_are_named() {
        let asked = asked(&headers(&[
            ("x-inflight-service", "kb"),
            ("x-inflight-stage", "answer"),
            ("x-inflight-priority", "batch"),
            ("x-inflight-class", "chat"),
            ("x-inflight-max-wait", "2s"),
            ("x-inflight-token", "t"),
            ("authorization", "Bearer upstream"),
        ]))
        .unwrap();
        assert_eq!(asked.service.unwrap().as_str(), "kb");
        assert_eq!(asked.stage.unwrap().as_str(), "answer");
        assert_eq!(asked.priority, Some(Priority::Batch));
        assert_eq!(asked.class.unwrap().as_str(), "chat");
        assert_eq!(asked.max_wait, Some(Duration::from_secs(2)));
        for (pairs, says) in [
            (
                &[("x-inflight-service", "a b")][..],
                "X-Inflight-Service: \"a b\" character",
            ),
            (
                &[("x-inflight-priority", "high")],
                "X-Inflight-Priority: \"high\" is not a priority",
            ),
            (
                &[("x-inflight-max-wait", "5")],
                "X-Inflight-Max-Wait must be a duration such as",
            ),
            (
                &[("x-inflight-max-wait", "11m")],
                "X-Inflight-Max-Wait must be at most 10m",
            ),
            (
                &[("x-inflight-sevice", "kb")],
                "X-Inflight-Sevice is not a header of the proxy's",
            ),
            (
                &[("x-inflight-class", "a"), ("x-inflight-class", "b")],
                "X-Inflight-Class: sent more than once",
            ),
        ] {
            let err = asked_err(pairs);
            assert!(err.contains(says), "{err}");
        }
    }

    fn asked_err(pairs: &[(&'static str, &'static str)]) -> String {
        let err = asked(&headers(pairs)).unwrap_err();
        assert_eq!(err.code(), "invalid_request");
        err.message().to_owned()
    }
}

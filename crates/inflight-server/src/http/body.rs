//! Reading requests into the wire types of [`inflight_api`]: bodies and
//! query strings, so that every malformed request is a JSON
//! `invalid_request` naming the field at fault (or `payload_too_large`), and
//! never a framework's plain-text rejection.
//!
//! A body is one JSON object (`Content-Type` is not checked); unknown fields
//! are ignored and `null` is the same as a missing field, as the wire types
//! say. A body that is empty (or only whitespace) is refused where the route
//! needs fields ([`RequiredBody`]) and read as `{}` where it does not
//! ([`OptionalBody`]).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use inflight::MAX_START_WAIT;
use inflight_api::{MAX_IGNORED_FIELDS, MAX_IGNORED_FIELD_CHARS};
use serde::de::{self, DeserializeOwned, IgnoredAny, Visitor};
use serde::Deserialize;
use serde_json::error::Category;

use super::error::ApiError;

/// The largest request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A body the route needs: one JSON object, read as `T`.
#[derive(Debug, Clone)]
pub struct RequiredBody<T>(pub T);

/// A body the route needs, read as `T` as [`RequiredBody`] does, with the
/// names of its top-level fields that `T` does not know ([`ignored_fields`]).
#[derive(Debug, Clone)]
pub struct NotingBody<T>(pub T, pub Vec<String>);

/// A body the route may go without: one JSON object, or empty (the same as
/// `{}`), read as `T`.
#[derive(Debug, Clone)]
pub struct OptionalBody<T>(pub T);

/// The query string, read as `T`.
#[derive(Debug, Clone)]
pub struct QueryString<T>(pub T);

/// Whether `bytes` hold no body: empty or only whitespace.
fn is_blank(bytes: &[u8]) -> bool {
    bytes.iter().all(u8::is_ascii_whitespace)
}

/// Reads `bytes`, one JSON object, as `T`.
///
/// # Errors
/// `invalid_request` for anything that is not a JSON object, and for an
/// object whose fields `T` refuses, naming the field.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let first = bytes.iter().find(|byte| !byte.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Err(not_an_object(bytes));
    }
    // A body that reads pays no path tracking; one refused is read again
    // with it, to name the field.
    if let Ok(value) = serde_json::from_slice(bytes) {
        return Ok(value);
    }
    let mut json = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut json).map_err(field_error)?;
    json.end().map_err(not_json)?;
    Ok(value)
}

/// The names of the top-level fields of `bytes`, a JSON object that `T`
/// read, that `T` does not know: at most [`MAX_IGNORED_FIELDS`], each cut
/// to [`MAX_IGNORED_FIELD_CHARS`] characters, so that a hostile body cannot
/// grow the answer. A second, shallow pass over the body (its values are
/// skipped, not built), paid only by the routes that report them.
pub fn ignored_fields<'de, T: Deserialize<'de>>(bytes: &[u8]) -> Vec<String> {
    let known = fields_of::<T>();
    let mut ignored = Vec::new();
    let mut json = serde_json::Deserializer::from_slice(bytes);
    // Stopping at the limit ends the pass with an error: what it found stands.
    let _ = serde::Deserializer::deserialize_map(
        &mut json,
        UnknownKeys {
            known,
            ignored: &mut ignored,
        },
    );
    ignored
}

/// The field names the derived `Deserialize` of a struct `T` passes to
/// `deserialize_struct` (after any renaming): a deserializer that only
/// takes note of them.
fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    struct Note<'a>(&'a mut &'static [&'static str]);

    impl<'de> serde::Deserializer<'de> for Note<'_> {
        type Error = serde::de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("noted"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Note(&mut fields));
    fields
}

/// Visits an object's keys, skipping its values, and notes those not known.
struct UnknownKeys<'a> {
    known: &'static [&'static str],
    ignored: &'a mut Vec<String>,
}

impl<'de> Visitor<'de> for UnknownKeys<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(unknown) = map.next_key_seed(UnknownKey(self.known))? {
            map.next_value::<IgnoredAny>()?;
            if let Some(name) = unknown {
                if self.ignored.len() == MAX_IGNORED_FIELDS {
                    return Err(de::Error::custom("enough"));
                }
                self.ignored.push(name);
            }
        }
        Ok(())
    }
}

/// A key, as its name cut to [`MAX_IGNORED_FIELD_CHARS`] when it is not
/// one of the known ones: compared where it lies in the body, copied only
/// when unknown.
struct UnknownKey(&'static [&'static str]);

impl<'de> de::DeserializeSeed<'de> for UnknownKey {
    type Value = Option<String>;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl Visitor<'_> for UnknownKey {
    type Value = Option<String>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Option<String>, E> {
        Ok((!self.0.contains(&key)).then(|| key.chars().take(MAX_IGNORED_FIELD_CHARS).collect()))
    }
}

/// Reads `bytes` as `T`, an empty body as `{}`.
///
/// # Errors
/// As [`parse_body`].
pub fn parse_optional_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    parse_body(if is_blank(bytes) { b"{}" } else { bytes })
}

/// Reads a query string (`limit=20&since=1h`) as `T`.
///
/// # Errors
/// `invalid_request` naming the parameter `T` refuses.
pub fn parse_query<T: DeserializeOwned>(query: &str) -> Result<T, ApiError> {
    // As for bodies: path tracking only to name what was refused.
    if let Ok(value) = serde_urlencoded::from_str(query) {
        return Ok(value);
    }
    let pairs = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
    serde_path_to_error::deserialize(pairs).map_err(|err| {
        let at_root = err.path().iter().next().is_none();
        let path = err.path().to_string();
        let problem = err.into_inner();
        ApiError::invalid(if at_root {
            format!("bad query string: {problem}")
        } else {
            format!("`{path}`: {problem}")
        })
    })
}

/// Why a body that does not start an object is refused: it is JSON of
/// another type (told by its first byte), or not JSON.
fn not_an_object(bytes: &[u8]) -> ApiError {
    if let Err(err) = serde_json::from_slice::<IgnoredAny>(bytes) {
        return not_json(err);
    }
    let first = bytes.iter().find(|byte| !byte.is_ascii_whitespace());
    let got = match first {
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    };
    ApiError::invalid(format!("the request body must be a JSON object, got {got}"))
}

fn not_json(err: serde_json::Error) -> ApiError {
    ApiError::invalid(format!("the request body is not valid JSON: {err}"))
}

/// A field the wire type refused, named by its path (`success`), or the
/// whole body (`missing field `service``); or JSON that breaks off.
fn field_error(err: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let at_root = err.path().iter().next().is_none();
    let path = err.path().to_string();
    let err = err.into_inner();
    if err.classify() != Category::Data {
        return not_json(err);
    }
    // The path names the field; where it sits in the text adds nothing.
    let text = err.to_string();
    let position = format!(" at line {} column {}", err.line(), err.column());
    let problem = text.strip_suffix(&position).unwrap_or(&text);
    ApiError::invalid(if at_root {
        problem.to_owned()
    } else {
        format!("`{path}`: {problem}")
    })
}

/// How long a request's body may take to arrive, once its header has: set
/// on each request by the router from the server's limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyTimeout(pub(crate) Duration);

/// The body's bytes, within [`MAX_BODY_BYTES`] and the body timeout.
async fn read_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    let timeout = req
        .extensions()
        .get::<BodyTimeout>()
        .map_or(crate::limits::DEFAULT_BODY_TIMEOUT, |timeout| timeout.0);
    let read = tokio::time::timeout(timeout, Bytes::from_request(req, state))
        .await
        .map_err(|_| ApiError::request_timeout(timeout))?;
    read.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(MAX_BODY_BYTES)
        } else {
            ApiError::invalid(format!("the request body could not be read: {rejection}"))
        }
    })
}

/// The body's bytes, refused when there are none.
async fn required_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    let bytes = read_bytes(req, state).await?;
    if is_blank(&bytes) {
        return Err(ApiError::invalid(
            "the request body must be a JSON object; it was empty",
        ));
    }
    Ok(bytes)
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for RequiredBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        parse_body(&required_bytes(req, state).await?).map(Self)
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for NotingBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = required_bytes(req, state).await?;
        let value = parse_body(&bytes)?;
        Ok(Self(value, ignored_fields::<T>(&bytes)))
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for OptionalBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_bytes(req, state).await?;
        parse_optional_body(&bytes).map(Self)
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for QueryString<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parse_query(parts.uri.query().unwrap_or_default()).map(Self)
    }
}

/// `wait`: a duration of at most 30 s.
pub(super) fn parse_wait(text: &str) -> Result<Duration, ApiError> {
    bounded_duration("`wait`", text, MAX_START_WAIT)
}

/// A duration such as `5s` of at most `most`, the one rule for every wait a
/// request asks for (`?wait=`, the proxy's `X-Inflight-Max-Wait`); errors
/// name `what`.
pub(crate) fn bounded_duration(what: &str, text: &str, most: Duration) -> Result<Duration, ApiError> {
    let wait = humantime::parse_duration(text.trim()).map_err(|_| {
        ApiError::invalid(format!(
            "{what} must be a duration such as \"5s\" or \"500ms\", got {text:?}"
        ))
    })?;
    if wait > most {
        return Err(ApiError::invalid(format!(
            "{what} must be at most {}, got {text:?}",
            humantime::format_duration(most)
        )));
    }
    Ok(wait)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inflight_api::{BeginRequest, SettleRequest, SnapshotQuery, StartRequest};

    fn refusal<T: DeserializeOwned + std::fmt::Debug>(bytes: &[u8]) -> String {
        let err = parse_body::<T>(bytes).unwrap_err();
        assert_eq!(err.code(), "invalid_request");
        err.message().to_owned()
    }

    #[test]
    fn bodies_are_objects_or_empty_where_allowed() {
        assert_eq!(
            parse_optional_body::<StartRequest>(b" \n").unwrap(),
            StartRequest::default()
        );
        assert_eq!(
            parse_body::<StartRequest>(b"{}").unwrap(),
            StartRequest::default()
        );
        for bad in [
            &b"[]"[..],
            b"null",
            b"{",
            b"\"x\"",
            b"{\"a\":1}x",
            b"[{}]",
            b"[null]",
        ] {
            refusal::<StartRequest>(bad);
        }
        assert_eq!(
            refusal::<StartRequest>(b"[null]"),
            "the request body must be a JSON object, got an array"
        );
        assert!(refusal::<StartRequest>(b"{").starts_with("the request body is not valid JSON"));
        assert!(refusal::<StartRequest>(b"{} {}").starts_with("the request body is not valid JSON"));
        for (body, got) in [
            (&b" \"x\""[..], "a string"),
            (b"true", "a boolean"),
            (b"null", "null"),
            (b"-1.5e3", "a number"),
            (b"[1, {}]", "an array"),
        ] {
            assert_eq!(
                refusal::<StartRequest>(body),
                format!("the request body must be a JSON object, got {got}")
            );
        }
    }

    #[test]
    fn a_refused_field_is_named() {
        let says = |body: &str, field: &str| {
            let message = refusal::<BeginRequest>(body.as_bytes());
            assert!(message.contains(field), "{body}: {message}");
            message
        };
        says(r#"{"provider": "o"}"#, "missing field `service`");
        says(r#"{"service": null, "provider": "o"}"#, "`service`");
        says(r#"{"service": 7, "provider": "o"}"#, "`service`");
        says(
            r#"{"service": "kb", "provider": "o", "priority": "urgent"}"#,
            "`priority`",
        );
        says(
            r#"{"service": "kb", "provider": "o", "deadlineMs": "5m"}"#,
            "`deadlineMs`",
        );
        let message = says(
            r#"{"service": "kb", "provider": "o", "enqueuedAt": "yesterday"}"#,
            "`enqueuedAt`",
        );
        assert!(message.contains("not an RFC 3339 time"), "{message}");
        assert!(
            !message.contains("line 1"),
            "the field is named, not the column: {message}"
        );
        let message = refusal::<SettleRequest>(br#"{"success": "yes"}"#);
        assert_eq!(
            message,
            "`success`: invalid type: string \"yes\", expected a boolean"
        );
    }

    #[test]
    fn null_fields_are_missing_fields_and_unknown_ones_are_ignored() {
        let begin: BeginRequest =
            parse_body(br#"{"service": "kb", "provider": "o", "class": null, "n": 3, "b": {"c": []}}"#)
                .unwrap();
        assert_eq!(begin, BeginRequest::new("kb", "o"));
    }

    #[test]
    fn ignored_fields_are_the_unknown_top_level_names_and_bounded() {
        let body = br#"{"service": "kb", "provider": "o", "clas": "embedding", "modle": {"class": 1},
            "operationStage": "s", "enqueuedAt": null, "caf\u00e9": []}"#;
        assert_eq!(ignored_fields::<BeginRequest>(body), ["clas", "modle", "café"]);
        assert!(ignored_fields::<BeginRequest>(br#"{"service": "kb", "provider": "o"}"#).is_empty());
        let long = "x".repeat(1000);
        let many: Vec<String> = (0..1000).map(|i| format!("\"{long}{i}\": {i}")).collect();
        let hostile = format!("{{{}}}", many.join(","));
        let ignored = ignored_fields::<BeginRequest>(hostile.as_bytes());
        assert_eq!(ignored.len(), MAX_IGNORED_FIELDS);
        assert!(ignored
            .iter()
            .all(|name| name.chars().count() == MAX_IGNORED_FIELD_CHARS));
    }

    #[test]
    fn query_strings_name_the_parameter() {
        let query: SnapshotQuery = parse_query("limit=5&since=1h&other=x").unwrap();
        assert_eq!((query.limit, query.since.as_deref()), (Some(5), Some("1h")));
        assert_eq!(
            parse_query::<SnapshotQuery>("").unwrap(),
            SnapshotQuery::default()
        );
        let err = parse_query::<SnapshotQuery>("limit=ten").unwrap_err();
        assert_eq!(err.message(), "`limit`: must be a whole number, got \"ten\"");
        assert!(parse_query::<SnapshotQuery>("limit=1&limit=2").is_err());
    }
}

//! Request parsing: bodies, fields, timestamps and query parameters, so that
//! every malformed request is a JSON `invalid_request` (or
//! `payload_too_large`) and never a framework's plain-text rejection.

use std::str::FromStr;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde_json::{Map, Value};

use super::error::ApiError;
use inflight::domain::timestamp::{parse_rfc3339, Millis};

/// The largest request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The latest timestamp accepted: 9999-12-31T23:59:59.999Z.
const MAX_TIMESTAMP_MS: Millis = 253_402_300_799_999;

/// A request body that is a JSON object, or empty.
///
/// Unknown fields are kept and ignored by the handlers, so older servers
/// accept newer clients. A `null` field is the same as a missing one.
#[derive(Debug, Clone, Default)]
pub struct JsonObject {
    fields: Map<String, Value>,
    empty: bool,
}

impl JsonObject {
    /// Parses `bytes`: empty (or only whitespace) or one JSON object.
    ///
    /// # Errors
    /// `invalid_request` for anything else.
    pub fn parse(bytes: &[u8]) -> Result<Self, ApiError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self {
                fields: Map::new(),
                empty: true,
            });
        }
        match serde_json::from_slice::<Value>(bytes) {
            Ok(Value::Object(fields)) => Ok(Self { fields, empty: false }),
            Ok(other) => Err(ApiError::invalid(format!(
                "the request body must be a JSON object, got {}",
                json_type(&other)
            ))),
            Err(err) => Err(ApiError::invalid(format!(
                "the request body is not valid JSON: {err}"
            ))),
        }
    }

    /// Refuses an empty body, for routes that need fields.
    ///
    /// # Errors
    /// `invalid_request` when the body was empty.
    pub fn require_body(self) -> Result<Self, ApiError> {
        if self.empty {
            return Err(ApiError::invalid(
                "the request body must be a JSON object; it was empty",
            ));
        }
        Ok(self)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.fields.get(key).filter(|value| !value.is_null())
    }

    /// The optional string field `key`.
    ///
    /// # Errors
    /// `invalid_request` when it is present and not a string.
    pub fn string(&self, key: &str) -> Result<Option<String>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(other) => Err(ApiError::invalid(format!(
                "`{key}` must be a string, got {}",
                json_type(other)
            ))),
        }
    }

    /// The required string field `key`.
    ///
    /// # Errors
    /// `invalid_request` when it is missing or not a string.
    pub fn required_string(&self, key: &str) -> Result<String, ApiError> {
        self.string(key)?
            .ok_or_else(|| ApiError::invalid(format!("`{key}` is required")))
    }

    /// The required boolean field `key`.
    ///
    /// # Errors
    /// `invalid_request` when it is missing or not a boolean.
    pub fn required_bool(&self, key: &str) -> Result<bool, ApiError> {
        match self.get(key) {
            None => Err(ApiError::invalid(format!("`{key}` is required (true or false)"))),
            Some(Value::Bool(value)) => Ok(*value),
            Some(other) => Err(ApiError::invalid(format!(
                "`{key}` must be a boolean (true or false), got {}",
                json_type(other)
            ))),
        }
    }

    /// The optional integer field `key`.
    ///
    /// # Errors
    /// `invalid_request` when it is present and not an integer that fits in
    /// 64 bits.
    pub fn integer(&self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(number)) => number
                .as_i64()
                .map(Some)
                .ok_or_else(|| ApiError::invalid(format!("`{key}` must be a whole number, got {number}"))),
            Some(other) => Err(ApiError::invalid(format!(
                "`{key}` must be a whole number, got {}",
                json_type(other)
            ))),
        }
    }

    /// The optional field `key`, parsed from one of its wire names.
    ///
    /// # Errors
    /// `invalid_request` when it is present and not one of the names.
    pub fn wire<T: FromStr<Err = inflight::domain::ParseError>>(
        &self,
        key: &str,
    ) -> Result<Option<T>, ApiError> {
        self.string(key)?
            .map(|text| {
                text.parse::<T>()
                    .map_err(|problem| ApiError::invalid(format!("`{key}`: {problem}")))
            })
            .transpose()
    }

    /// The optional timestamp field `key`: epoch milliseconds or RFC 3339.
    ///
    /// # Errors
    /// `invalid_request` when it is present and neither, or out of range.
    pub fn timestamp(&self, key: &str) -> Result<Option<Millis>, ApiError> {
        self.get(key).map(|value| parse_timestamp(key, value)).transpose()
    }
}

/// Parses a timestamp: an integer of epoch milliseconds, or an RFC 3339
/// string. Only the years 1970 to 9999 are accepted.
///
/// # Errors
/// `invalid_request`, naming `key`.
pub fn parse_timestamp(key: &str, value: &Value) -> Result<Millis, ApiError> {
    let at = match value {
        Value::Number(number) => number.as_i64().ok_or_else(|| {
            ApiError::invalid(format!(
                "`{key}` must be whole epoch milliseconds or an RFC 3339 time, got {number}"
            ))
        })?,
        Value::String(text) => parse_rfc3339(text).ok_or_else(|| {
            ApiError::invalid(format!(
                "`{key}` {text:?} is not an RFC 3339 time (e.g. \"2026-08-12T08:20:48.562Z\")"
            ))
        })?,
        other => {
            return Err(ApiError::invalid(format!(
                "`{key}` must be epoch milliseconds or an RFC 3339 time, got {}",
                json_type(other)
            )))
        }
    };
    if !(0..=MAX_TIMESTAMP_MS).contains(&at) {
        return Err(ApiError::invalid(format!(
            "`{key}` is out of range: times from 1970 to 9999 are accepted"
        )));
    }
    Ok(at)
}

fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large(MAX_BODY_BYTES)
            } else {
                ApiError::invalid(format!("the request body could not be read: {rejection}"))
            }
        })?;
        Self::parse(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn timestamps_are_milliseconds_or_rfc3339_within_range() {
        assert_eq!(parse_timestamp("t", &json!(1_000)).unwrap(), 1_000);
        assert_eq!(
            parse_timestamp("t", &json!("1970-01-01T00:00:01.5Z")).unwrap(),
            1_500
        );
        for bad in [
            json!(-1),
            json!(1.5),
            json!("soon"),
            json!(true),
            json!(i64::MAX),
            json!(u64::MAX),
        ] {
            let err = parse_timestamp("t", &bad).unwrap_err();
            assert_eq!(err.code(), "invalid_request", "{bad}");
        }
    }

    #[test]
    fn bodies_are_objects_or_empty() {
        assert!(JsonObject::parse(b"").unwrap().require_body().is_err());
        assert!(JsonObject::parse(b" \n").is_ok());
        assert!(JsonObject::parse(b"{}").unwrap().require_body().is_ok());
        for bad in [&b"[]"[..], b"null", b"{", b"\"x\"", b"{\"a\":1}x"] {
            assert_eq!(JsonObject::parse(bad).unwrap_err().code(), "invalid_request");
        }
    }

    #[test]
    fn null_fields_are_missing_fields() {
        let body = JsonObject::parse(br#"{"service": null, "n": 3, "b": "yes"}"#).unwrap();
        assert!(body.string("service").unwrap().is_none());
        assert!(body.required_string("service").is_err());
        assert_eq!(body.integer("n").unwrap(), Some(3));
        assert!(body.required_bool("b").is_err());
    }
}

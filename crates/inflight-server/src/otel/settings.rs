//! `[otel]`: where and how the server exports its records' spans and the
//! GenAI metrics, read and checked whether or not this build exports, so
//! that `check-config` refuses what `serve` would.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::settings::duration_within;
use inflight::config::{parse_count, parse_duration, parse_string, ConfigError, ConfigWarning};

/// The export's settings.
#[derive(Clone, PartialEq, Eq)]
pub struct OtelSettings {
    /// The collector's base URL (`/v1/traces` and `/v1/metrics` are
    /// appended); `None`: the `OTEL_EXPORTER_OTLP_*ENDPOINT` variables,
    /// else `http://localhost:4318`.
    pub endpoint: Option<String>,
    /// The `service.name` of the spans' and metrics' resource.
    pub service_name: String,
    /// Headers sent with every export (an API key, say); the
    /// `OTEL_EXPORTER_OTLP_HEADERS` variable adds to them.
    pub headers: BTreeMap<String, String>,
    /// How long one export may take before it counts as failed.
    pub timeout: Duration,
    /// How many ended records may wait to be exported; past that, ends are
    /// dropped and counted (`inflight_otel_dropped_total`).
    pub queue: usize,
    /// How long a record reaped `abandoned` is held before its span goes
    /// out, in case a late start brings it back: it then gives one span,
    /// when it really ends, with the reap as an event.
    pub hold_abandoned: Duration,
}

/// The variables that name a collector, as the OTLP exporters read them.
const ENDPOINT_VARIABLES: [&str; 3] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
];

/// The defaults of what `[otel]` leaves out.
pub const DEFAULT_SERVICE_NAME: &str = "inflight";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_QUEUE: usize = 4096;
const MAX_QUEUE: usize = 1_000_000;
const DEFAULT_HOLD: Duration = Duration::from_secs(5 * 60);
const MAX_HOLD: Duration = Duration::from_secs(3600);

impl fmt::Debug for OtelSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Header values are credentials.
        let headers: Vec<&String> = self.headers.keys().collect();
        f.debug_struct("OtelSettings")
            .field("endpoint", &self.endpoint)
            .field("service_name", &self.service_name)
            .field("headers", &headers)
            .field("timeout", &self.timeout)
            .field("queue", &self.queue)
            .field("hold_abandoned", &self.hold_abandoned)
            .finish()
    }
}

impl OtelSettings {
    /// What `[otel]` (`table`) and the standard variables (`env`) ask for:
    /// `None` when export is off. It is on with an `[otel]` table, or with
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
    /// set; `OTEL_SDK_DISABLED=true` turns it off either way.
    ///
    /// # Errors
    /// The first invalid setting, named (`otel.KEY`).
    pub fn resolve(
        table: Option<&toml::Table>,
        env: &dyn Fn(&str) -> Option<String>,
        warnings: &mut Vec<ConfigWarning>,
    ) -> Result<Option<Self>, ConfigError> {
        let set = |name: &str| env(name).filter(|value| !value.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|value| value.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        // The exporters read these when they are built; checked here too, so
        // that `check-config` refuses what `serve` would.
        for name in ENDPOINT_VARIABLES {
            if let Some(url) = set(name) {
                endpoint(name, url.trim())?;
            }
        }
        let from_env = set("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
            || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some();
        let table = match table {
            Some(table) => table,
            None if from_env => &toml::Table::new(),
            None => return Ok(None),
        };
        let mut settings = Self {
            endpoint: None,
            service_name: set("OTEL_SERVICE_NAME").unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned()),
            headers: BTreeMap::new(),
            timeout: DEFAULT_TIMEOUT,
            queue: DEFAULT_QUEUE,
            hold_abandoned: DEFAULT_HOLD,
        };
        for (field, value) in table {
            let key = format!("otel.{field}");
            match field.as_str() {
                "endpoint" => settings.endpoint = Some(endpoint(&key, &parse_string(&key, value)?)?),
                "service_name" => {
                    let name = parse_string(&key, value)?;
                    if name.trim().is_empty() {
                        return Err(ConfigError::new(key, "must not be empty"));
                    }
                    settings.service_name = name;
                }
                "headers" => settings.headers = headers(&key, value)?,
                "timeout" => {
                    settings.timeout =
                        duration_within(&key, parse_duration(&key, value, warnings)?, false, MAX_TIMEOUT)?;
                }
                "queue" => settings.queue = parse_count(&key, value, 1..=MAX_QUEUE, "records")?,
                "hold_abandoned" => {
                    settings.hold_abandoned =
                        duration_within(&key, parse_duration(&key, value, warnings)?, false, MAX_HOLD)?;
                }
                _ => {
                    return Err(ConfigError::new(
                        key,
                        "is not a setting; [otel] takes endpoint, service_name, headers, timeout, queue, \
                         hold_abandoned",
                    ))
                }
            }
        }
        Ok(Some(settings))
    }

    /// The URL of one signal's export (`/v1/traces`, `/v1/metrics`), when
    /// `[otel] endpoint` sets the base.
    pub fn signal_url(&self, path: &str) -> Option<String> {
        self.endpoint
            .as_ref()
            .map(|base| format!("{}{path}", base.trim_end_matches('/')))
    }
}

/// An `http://` or `https://` URL with a host, and no query or fragment.
fn endpoint(key: &str, text: &str) -> Result<String, ConfigError> {
    crate::settings::http_url(key, text, "http://127.0.0.1:4318", "put them in otel.headers")?;
    Ok(text.to_owned())
}

/// A table of header names to string values, each a valid HTTP header.
fn headers(key: &str, value: &toml::Value) -> Result<BTreeMap<String, String>, ConfigError> {
    let table = value.as_table().ok_or_else(|| {
        ConfigError::new(
            key,
            format!(
                "must be a table of header names to values, e.g. {{ \"x-api-key\" = \"...\" }}, got a {}",
                value.type_str()
            ),
        )
    })?;
    table
        .iter()
        .map(|(name, value)| {
            let at = format!("{key}.{name}");
            let text = parse_string(&at, value)?;
            axum::http::HeaderName::try_from(name.as_str())
                .map_err(|_| ConfigError::new(&at, "is not a valid header name"))?;
            axum::http::HeaderValue::try_from(text.as_str())
                .map_err(|_| ConfigError::new(&at, "is not a valid header value"))?;
            Ok((name.clone(), text))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str, env: &[(&str, &str)]) -> Result<Option<OtelSettings>, ConfigError> {
        let table: Option<toml::Table> = if text.is_empty() {
            None
        } else {
            let mut file: toml::Table = text.parse().unwrap();
            Some(file.remove("otel").unwrap().as_table().unwrap().clone())
        };
        let env = |name: &str| {
            env.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| (*value).to_owned())
        };
        OtelSettings::resolve(table.as_ref(), &env, &mut Vec::new())
    }

    #[test]
    fn export_is_on_with_a_table_or_an_endpoint_variable_and_off_when_disabled() {
        assert_eq!(read("", &[]).unwrap(), None);
        let defaults = read("[otel]\n", &[]).unwrap().unwrap();
        assert_eq!(
            defaults.endpoint, None,
            "the SDK's variables, else localhost:4318"
        );
        assert_eq!(defaults.service_name, "inflight");
        assert_eq!(
            (defaults.queue, defaults.timeout),
            (4096, Duration::from_secs(10))
        );
        assert_eq!(defaults.hold_abandoned, Duration::from_secs(300));
        let from_env = read(
            "",
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_SERVICE_NAME", "llm-gw"),
            ],
        );
        assert_eq!(from_env.unwrap().unwrap().service_name, "llm-gw");
        assert!(read(
            "",
            &[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/v1/traces")]
        )
        .unwrap()
        .is_some());
        assert_eq!(read("[otel]\n", &[("OTEL_SDK_DISABLED", "true")]).unwrap(), None);
        let bad = read("", &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")]).unwrap_err();
        assert!(
            bad.to_string()
                .starts_with("OTEL_EXPORTER_OTLP_ENDPOINT: \"collector:4318\" is not"),
            "{bad}"
        );
        let set = read(
            "[otel]\nendpoint = \"https://collector:4318/\"\nservice_name = \"gw\"\n\
             headers = { \"x-api-key\" = \"k\" }\ntimeout = \"3s\"\nqueue = 10\nhold_abandoned = \"1m\"\n",
            &[("OTEL_SERVICE_NAME", "ignored")],
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            set.signal_url("/v1/traces").unwrap(),
            "https://collector:4318/v1/traces"
        );
        assert_eq!(set.service_name, "gw");
        assert_eq!(set.headers["x-api-key"], "k");
        assert!(
            !format!("{set:?}").contains("\"k\""),
            "header values stay out of logs"
        );
        assert_eq!(
            (set.queue, set.timeout, set.hold_abandoned),
            (10, Duration::from_secs(3), Duration::from_secs(60))
        );
    }

    #[test]
    fn every_bad_setting_is_named() {
        for (text, expected) in [
            (
                "endpoint = \"grpc://c:4317\"",
                "otel.endpoint: \"grpc://c:4317\" is not an http:// or https:// URL",
            ),
            (
                "endpoint = \"http://c:4318/?x=1\"",
                "otel.endpoint: \"http://c:4318/?x=1\" has a query",
            ),
            (
                "endpoint = \"http://u:p@c:4318\"",
                "otel.endpoint: \"http://u:p@c:4318\" carries credentials",
            ),
            ("endpoint = 4318", "otel.endpoint: must be a string"),
            ("service_name = \" \"", "otel.service_name: must not be empty"),
            ("headers = \"x=1\"", "otel.headers: must be a table"),
            (
                "headers = { \"bad name\" = \"v\" }",
                "otel.headers.bad name: is not a valid header name",
            ),
            (
                "headers = { \"k\" = \"a\\nb\" }",
                "otel.headers.k: is not a valid header value",
            ),
            (
                "timeout = \"2m\"",
                "otel.timeout: must be more than 0 and at most 1m, got 2m",
            ),
            (
                "queue = 0",
                "otel.queue: must be a whole number of records from 1 to 1000000, got 0",
            ),
            (
                "hold_abandoned = \"2h\"",
                "otel.hold_abandoned: must be more than 0 and at most 1h",
            ),
            ("endpont = \"http://c\"", "otel.endpont: is not a setting"),
        ] {
            let error = read(&format!("[otel]\n{text}\n"), &[]).unwrap_err().to_string();
            assert!(error.starts_with(expected), "{text}: {error}");
        }
    }
}

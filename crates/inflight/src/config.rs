//! Configuration: the ledger's classes, factor, reap interval and lanes, and
//! the server's file format.
//!
//! Invalid settings cannot be constructed: every error names the key at
//! fault, and nothing falls back to a silent default.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use crate::domain::admission::{AdmissionDefaults, LaneRules, LaneSettings, MAX_RETRY_AFTER_MS};
use crate::domain::bounds::{ClassBounds, ReapPolicy, DEFAULT_FACTOR};
use crate::domain::cardinality::{Cardinality, Overflow, Vocabularies};
use crate::domain::labels::{sanitize_model, Label, LabelSet};
use crate::domain::record::LaneKey;

/// The default interval between background reaper passes.
pub const DEFAULT_REAP_INTERVAL: Duration = Duration::from_secs(10);
/// The default retention of settled and reaped records.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// A setting that is not valid, and the key it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The key at fault, as written in the file (`classes.chat.deadline`).
    pub key: String,
    /// What is wrong with it.
    pub problem: String,
}

impl ConfigError {
    /// The error for `key`, saying `problem`.
    pub fn new(key: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            problem: problem.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            f.write_str(&self.problem)
        } else {
            write!(f, "{}: {}", self.key, self.problem)
        }
    }
}

impl std::error::Error for ConfigError {}

/// A setting that is valid but most likely not what was meant, and the key
/// it came from: `check-config` prints it and `serve` logs it at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigWarning {
    /// The key it is about, as written in the file.
    pub key: String,
    /// What it means, and how to say what was meant.
    pub message: String,
}

impl ConfigWarning {
    /// The warning about `key`, saying `message`.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// What a ledger runs under: its reaping rules, reap interval and lanes.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerConfig {
    policy: ReapPolicy,
    reap_interval: Duration,
    retention: Duration,
    lanes: BTreeMap<LaneKey, LaneSettings>,
    /// `[admission]`: for a lane that sets nothing itself.
    admission: AdmissionDefaults,
    /// `[providers.NAME] shared_cooldown = true`: a cooldown on one lane
    /// of these providers holds for all of its lanes.
    shared_cooldown: BTreeSet<String>,
    /// `[providers.NAME] tokens_per_minute`: a token budget shared by
    /// every lane of the provider.
    provider_budgets: BTreeMap<String, u32>,
    /// Whether any lane is adaptive ([`LedgerConfig::any_adaptive`]).
    any_adaptive: bool,
    cardinality: Cardinality,
}

impl Default for LedgerConfig {
    /// Classes `embedding` (deadline 5 min) and `chat` (deadline 10 min),
    /// factor 4, reap interval 10 s, no lanes declared.
    fn default() -> Self {
        let classes = BTreeMap::from([
            (
                "embedding".to_owned(),
                ClassBounds::new(Duration::from_secs(5 * 60), None).expect("non-zero"),
            ),
            (
                "chat".to_owned(),
                ClassBounds::new(Duration::from_secs(10 * 60), None).expect("non-zero"),
            ),
        ]);
        Self::new(ReapPolicy::new(classes, DEFAULT_FACTOR).expect("valid built-in policy"))
    }
}

impl LedgerConfig {
    /// A configuration with `policy` and the default interval and retention.
    pub fn new(policy: ReapPolicy) -> Self {
        Self {
            policy,
            reap_interval: DEFAULT_REAP_INTERVAL,
            retention: DEFAULT_RETENTION,
            lanes: BTreeMap::new(),
            admission: AdmissionDefaults::default(),
            shared_cooldown: BTreeSet::new(),
            provider_budgets: BTreeMap::new(),
            any_adaptive: false,
            cardinality: Cardinality::default(),
        }
    }

    /// Runs the background reaper every `interval`.
    ///
    /// # Errors
    /// A zero interval.
    pub fn with_reap_interval(mut self, interval: Duration) -> Result<Self, ConfigError> {
        if interval.is_zero() {
            return Err(ConfigError::new("reap.interval", "must be at least 1ms"));
        }
        self.reap_interval = interval;
        Ok(self)
    }

    /// Declares `lane` with `cap` executing records. Take the lane from the
    /// spec the calls use ([`ActivitySpec::lane`](crate::ActivitySpec::lane)),
    /// so that the cap and the calls cannot be spelled apart.
    pub fn with_cap(mut self, lane: &LaneKey, cap: std::num::NonZeroU32) -> Self {
        self.lanes.entry(lane.clone()).or_default().cap = Some(cap.get());
        self
    }

    /// Declares the lane `"service::provider"` with `cap` executing records.
    ///
    /// # Errors
    /// A malformed lane key or a zero cap.
    pub fn with_lane_cap(self, lane: &str, cap: u32) -> Result<Self, ConfigError> {
        self.declare_lane(lane, Some(i64::from(cap)))
    }

    /// Declares the lane `"service::provider"`, with a cap or without one.
    fn declare_lane(mut self, lane: &str, cap: Option<i64>) -> Result<Self, ConfigError> {
        let key = parse_lane(lane)?;
        let cap = cap
            .map(|cap| whole(&format!("lanes.{lane:?}.cap"), cap, 1))
            .transpose()?;
        self.lanes.entry(key).or_default().cap = cap;
        Ok(self)
    }

    /// Ranks the line of the lane `"service::provider"`, declared with a
    /// cap: at most `batch_cap` of its slots (below the cap) for batch
    /// work, and at most `max_overtakes` interactive records admitted in a
    /// row while batch work waits (`None`: the
    /// [default](Self::with_max_overtakes)). `docs/semantics.md` §6 states
    /// the rules.
    ///
    /// # Errors
    /// A lane not declared with a cap, or a `batch_cap` of 0 or not below
    /// the cap.
    pub fn with_lane_ranking(
        mut self,
        lane: &str,
        batch_cap: Option<u32>,
        max_overtakes: Option<u32>,
    ) -> Result<Self, ConfigError> {
        let key = parse_lane(lane)?;
        let settings = self.lanes.entry(key).or_default();
        let Some(cap) = settings.cap else {
            let field = if batch_cap.is_some() {
                "batch_cap"
            } else {
                "max_overtakes"
            };
            return Err(ConfigError::new(
                format!("lanes.{lane:?}.{field}"),
                "needs the lane's cap: without one, the lane admits everything",
            ));
        };
        if let Some(batch_cap) = batch_cap {
            if batch_cap == 0 || batch_cap >= cap {
                return Err(ConfigError::new(
                    format!("lanes.{lane:?}.batch_cap"),
                    format!("must be at least 1 and below the lane's cap ({cap}), got {batch_cap}"),
                ));
            }
        }
        settings.batch_cap = batch_cap;
        settings.max_overtakes = max_overtakes;
        Ok(self)
    }

    /// `[admission] max_overtakes`: how many interactive records a lane
    /// with a cap admits in a row while batch work waits, unless it sets
    /// its own. 0 (the default) keeps each line first come, first served.
    pub fn with_max_overtakes(mut self, max_overtakes: u32) -> Self {
        self.admission.max_overtakes = max_overtakes;
        self
    }

    /// `[admission] max_cooldown`: the longest a provider's `Retry-After`
    /// cools a capped lane down, unless it sets its own (default a
    /// minute).
    ///
    /// # Errors
    /// A zero duration, or one over an hour.
    pub fn with_max_cooldown(mut self, max_cooldown: Duration) -> Result<Self, ConfigError> {
        self.admission.max_cooldown_ms = cooldown_ms("admission.max_cooldown", max_cooldown)?;
        Ok(self)
    }

    /// What a cooldown and a provider's refusal do to the lane
    /// `"service::provider"`, declared with a cap: `max_cooldown` (`None`:
    /// the [default](Self::with_max_cooldown)), and whether its cap is
    /// `adaptive` (halved by each refusal, a slot back after each run of
    /// `cap` successes).
    ///
    /// # Errors
    /// A lane not declared with a cap, or a `max_cooldown` of zero or over
    /// an hour.
    pub fn with_lane_cooldown(
        mut self,
        lane: &str,
        max_cooldown: Option<Duration>,
        adaptive: bool,
    ) -> Result<Self, ConfigError> {
        let key = parse_lane(lane)?;
        let settings = self.lanes.entry(key).or_default();
        if settings.cap.is_none() {
            let field = if adaptive { "adaptive" } else { "max_cooldown" };
            return Err(ConfigError::new(
                format!("lanes.{lane:?}.{field}"),
                "needs the lane's cap: without one, the lane admits everything",
            ));
        }
        settings.max_cooldown_ms = max_cooldown
            .map(|max| cooldown_ms(&format!("lanes.{lane:?}.max_cooldown"), max))
            .transpose()?;
        settings.adaptive = adaptive;
        self.any_adaptive = self.lanes.values().any(|settings| settings.adaptive);
        Ok(self)
    }

    /// `[providers.NAME] shared_cooldown = true`: a provider's limits
    /// belong to its account, so a cooldown on one capped lane of
    /// `provider` holds for every capped lane of it.
    ///
    /// # Errors
    /// A malformed provider name.
    pub fn with_shared_cooldown(mut self, provider: &str) -> Result<Self, ConfigError> {
        Label::new("provider", provider)
            .map_err(|err| ConfigError::new(format!("providers.{provider}"), err.problem))?;
        self.shared_cooldown.insert(provider.to_owned());
        Ok(self)
    }

    /// `[lanes."S::P"] tokens_per_minute`: the lane `"service::provider"`
    /// (declared, if it was not) starts a call only while the tokens its
    /// calls spent in the last minute, the estimates of those executing
    /// and the call's own estimate fit in `tokens_per_minute`
    /// (`docs/semantics.md` §8).
    ///
    /// # Errors
    /// A malformed lane key or a budget of 0.
    pub fn with_lane_budget(mut self, lane: &str, tokens_per_minute: i64) -> Result<Self, ConfigError> {
        let key = parse_lane(lane)?;
        let budget = whole(&format!("lanes.{lane:?}.tokens_per_minute"), tokens_per_minute, 1)?;
        self.lanes.entry(key).or_default().tokens_per_minute = Some(budget);
        Ok(self)
    }

    /// `[providers.NAME] tokens_per_minute`: a token budget shared by every
    /// lane of `provider`, declared or not, since a provider's token limit
    /// belongs to its account. A lane's own budget holds as well.
    ///
    /// # Errors
    /// A malformed provider name or a budget of 0.
    pub fn with_provider_budget(
        mut self,
        provider: &str,
        tokens_per_minute: i64,
    ) -> Result<Self, ConfigError> {
        Label::new("provider", provider)
            .map_err(|err| ConfigError::new(format!("providers.{provider}"), err.problem))?;
        let budget = whole(
            &format!("providers.{provider}.tokens_per_minute"),
            tokens_per_minute,
            1,
        )?;
        self.provider_budgets.insert(provider.to_owned(), budget);
        Ok(self)
    }

    /// `[providers.NAME] tokens_per_minute`: each provider's token budget.
    pub fn provider_budgets(&self) -> &BTreeMap<String, u32> {
        &self.provider_budgets
    }

    /// The token budget `provider`'s lanes share, if it has one.
    #[inline]
    pub fn provider_budget(&self, provider: &str) -> Option<u32> {
        if self.provider_budgets.is_empty() {
            return None;
        }
        self.provider_budgets.get(provider).copied()
    }

    /// The capped lanes a cooldown on `lane` holds for: `lane`, and every
    /// other capped lane of its provider when the provider shares them.
    pub fn cooled_with(&self, lane: &LaneKey) -> Vec<LaneKey> {
        if !self.shared_cooldown.contains(lane.provider.as_str()) {
            return vec![lane.clone()];
        }
        self.lanes
            .iter()
            .filter(|(other, settings)| other.provider == lane.provider && settings.cap.is_some())
            .map(|(other, _)| other.clone())
            .collect()
    }

    /// The reaping rules.
    pub fn policy(&self) -> &ReapPolicy {
        &self.policy
    }

    /// Keeps settled and reaped records for `keep` before pruning them. The
    /// counters they were counted in are never lowered by pruning.
    ///
    /// # Errors
    /// A zero retention.
    pub fn with_retention(mut self, keep: Duration) -> Result<Self, ConfigError> {
        if keep.is_zero() {
            return Err(ConfigError::new("retention.keep", "must be at least 1ms"));
        }
        self.retention = keep;
        Ok(self)
    }

    /// The interval between background reaper passes.
    pub fn reap_interval(&self) -> Duration {
        self.reap_interval
    }

    /// How long settled and reaped records are kept.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// `[admission]`: what capped lanes take when they set nothing.
    pub fn admission(&self) -> &AdmissionDefaults {
        &self.admission
    }

    /// Declared lanes, with their caps and rules.
    pub fn lanes(&self) -> &BTreeMap<LaneKey, LaneSettings> {
        &self.lanes
    }

    /// Bounds the distinct lanes and label sets that calls create (see
    /// [`Cardinality`]).
    pub fn with_cardinality(mut self, cardinality: Cardinality) -> Self {
        self.cardinality = cardinality;
        self
    }

    /// The bounds on distinct lanes and label sets.
    pub fn cardinality(&self) -> &Cardinality {
        &self.cardinality
    }

    /// Whether the lane of a call with `labels` is declared (with a cap or
    /// without): a declared lane is never folded.
    pub fn declares(&self, labels: &LabelSet) -> bool {
        self.lanes
            .keys()
            .any(|lane| lane.service == labels.service && lane.provider == labels.provider)
    }

    /// The cap of `lane`, if one is declared.
    pub fn cap(&self, lane: &LaneKey) -> Option<u32> {
        self.settings_for(&lane.service, &lane.provider)
            .and_then(|settings| settings.cap)
    }

    /// The rules of `lane`, if it is governed: a cap, or a token budget
    /// of its own or its provider's.
    pub fn lane_rules(&self, lane: &LaneKey) -> Option<LaneRules> {
        self.rules_for(&lane.service, &lane.provider)
    }

    /// The rules of the lane of a call with `labels`, if it is governed.
    pub fn rules_of(&self, labels: &LabelSet) -> Option<LaneRules> {
        self.rules_for(&labels.service, &labels.provider)
    }

    /// Whether the lane of a call with `labels` is governed (a cap or a
    /// token budget): what a start and every counted effect ask, without
    /// resolving the lane's rules.
    #[inline]
    pub fn is_governed(&self, labels: &LabelSet) -> bool {
        self.settings_for(&labels.service, &labels.provider)
            .is_some_and(|settings| settings.cap.is_some() || settings.tokens_per_minute.is_some())
            || self.provider_budget(labels.provider.as_str()).is_some()
    }

    /// Whether any lane has an adaptive cap, which every settle then
    /// updates; when none has, a settle without `Retry-After` looks up no
    /// lane.
    #[inline]
    pub fn any_adaptive(&self) -> bool {
        self.any_adaptive
    }

    fn rules_for(&self, service: &Label, provider: &Label) -> Option<LaneRules> {
        let provider_budget = self.provider_budget(provider.as_str());
        match self.settings_for(service, provider) {
            Some(settings) => settings.rules(&self.admission, provider_budget),
            // An undeclared lane is governed by its provider's budget only.
            None => {
                provider_budget.and_then(|_| LaneSettings::default().rules(&self.admission, provider_budget))
            }
        }
    }

    /// Found without building a [`LaneKey`]: this runs on every start, and
    /// lanes are few.
    #[inline]
    fn settings_for(&self, service: &Label, provider: &Label) -> Option<&LaneSettings> {
        self.lanes
            .iter()
            .find(|(lane, _)| lane.service == *service && lane.provider == *provider)
            .map(|(_, settings)| settings)
    }
}

/// `lane` as a key, or an error naming it.
fn parse_lane(lane: &str) -> Result<LaneKey, ConfigError> {
    LaneKey::parse(lane).map_err(|problem| ConfigError::new(format!("lanes.{lane:?}"), problem.to_string()))
}

/// A cooldown's longest, in milliseconds: 1 ms to an hour, or an error
/// naming `key`.
fn cooldown_ms(key: &str, max: Duration) -> Result<i64, ConfigError> {
    let ms = i64::try_from(max.as_millis()).unwrap_or(i64::MAX);
    if !(1..=MAX_RETRY_AFTER_MS).contains(&ms) {
        return Err(ConfigError::new(key, "must be from 1ms to 1h"));
    }
    Ok(ms)
}

/// `value` as a whole number of at least `min`, or an error naming `key`.
fn whole(key: &str, value: i64, min: u32) -> Result<u32, ConfigError> {
    match u32::try_from(value) {
        Ok(value) if value >= min => Ok(value),
        _ => Err(ConfigError::new(
            key,
            format!("must be a whole number of at least {min}, got {value}"),
        )),
    }
}

/// Everything a configuration file can say.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Settings {
    /// `listen`: the address to serve on.
    pub listen: Option<String>,
    /// `store` (or `[store] url`): the store URL, with the file's
    /// `[store] synchronous` folded in as its `?synchronous=` parameter.
    pub store: Option<String>,
    /// `token`: the bearer token the API requires.
    pub token: Option<String>,
    /// The `[[tokens]]` entries as written: scoped tokens, which
    /// `inflight-server` reads and checks (they are not the ledger's).
    pub tokens: Vec<toml::Table>,
    /// `[metrics] aggregates`: whether `/metrics` also exposes the series
    /// per aggregate, with all seven labels (off when unset).
    pub metrics_aggregates: Option<bool>,
    /// The `[server]` table as written: the HTTP server's limits, which
    /// `inflight-server` reads and checks (they are not the ledger's).
    pub server: Option<toml::Table>,
    /// The `[proxy.NAME]` tables as written: the routes of the server's
    /// proxy, which `inflight-server` reads and checks.
    pub proxy: BTreeMap<String, toml::Table>,
    /// The `[otel]` table as written: the server's OpenTelemetry export,
    /// which `inflight-server` reads and checks.
    pub otel: Option<toml::Table>,
    /// The ledger's own settings.
    pub ledger: LedgerConfig,
    /// What the file says that is valid but most likely not meant.
    pub warnings: Vec<ConfigWarning>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    listen: Option<String>,
    store: Option<RawStore>,
    token: Option<String>,
    tokens: Option<Vec<toml::Table>>,
    server: Option<toml::Table>,
    proxy: Option<BTreeMap<String, toml::Table>>,
    otel: Option<toml::Table>,
    labels: Option<RawLabelBounds>,
    reap: Option<RawReap>,
    retention: Option<RawRetention>,
    classes: Option<BTreeMap<String, RawClass>>,
    lanes: Option<BTreeMap<String, RawLane>>,
    admission: Option<RawAdmission>,
    providers: Option<BTreeMap<String, RawProvider>>,
    metrics: Option<RawMetrics>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    aggregates: Option<bool>,
}

/// `[labels]`: the bounds on distinct lanes and label sets.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLabelBounds {
    max_lanes: Option<i64>,
    max_aggregates: Option<i64>,
    overflow: Option<String>,
    service: Option<Vec<String>>,
    provider: Option<Vec<String>>,
    operation_stage: Option<Vec<String>>,
    model: Option<Vec<String>>,
}

impl RawLabelBounds {
    fn cardinality(self) -> Result<Cardinality, ConfigError> {
        let mut bounds = Cardinality::default();
        let positive = |key: &str, value: i64| {
            u32::try_from(value)
                .ok()
                .and_then(std::num::NonZeroU32::new)
                .ok_or_else(|| {
                    ConfigError::new(key, format!("must be a whole number of at least 1, got {value}"))
                })
        };
        if let Some(max) = self.max_lanes {
            bounds = bounds.with_max_lanes(positive("labels.max_lanes", max)?);
        }
        if let Some(max) = self.max_aggregates {
            bounds = bounds.with_max_aggregates(positive("labels.max_aggregates", max)?);
        }
        if let Some(overflow) = self.overflow {
            bounds = bounds.with_overflow(match overflow.as_str() {
                "fold" => Overflow::Fold,
                "refuse" => Overflow::Refuse,
                other => {
                    return Err(ConfigError::new(
                        "labels.overflow",
                        format!("must be \"fold\" or \"refuse\", got {other:?}"),
                    ))
                }
            });
        }
        let vocabulary = |key: &'static str, field: &'static str, values: Option<Vec<String>>| {
            values
                .map(|values| {
                    values
                        .into_iter()
                        .map(|value| {
                            let valid = if field == "model" {
                                sanitize_model(Some(&value)) == value
                            } else {
                                Label::new(field, &value).is_ok()
                            };
                            if valid {
                                Ok(value)
                            } else {
                                Err(ConfigError::new(key, format!("{value:?} is not a valid {field}")))
                            }
                        })
                        .collect::<Result<BTreeSet<_>, _>>()
                })
                .transpose()
        };
        Ok(bounds.with_vocabularies(Vocabularies {
            service: vocabulary("labels.service", "service", self.service)?,
            provider: vocabulary("labels.provider", "provider", self.provider)?,
            operation_stage: vocabulary("labels.operation_stage", "operationStage", self.operation_stage)?,
            model: vocabulary("labels.model", "model", self.model)?,
        }))
    }
}

/// `store = "URL"`, or a `[store]` table.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawStore {
    Url(String),
    Table(RawStoreTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStoreTable {
    url: Option<String>,
    synchronous: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReap {
    factor: Option<f64>,
    interval: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetention {
    keep: Option<toml::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClass {
    deadline: Option<toml::Value>,
    max_queue_wait: Option<toml::Value>,
    tokens: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLane {
    cap: Option<i64>,
    batch_cap: Option<i64>,
    max_overtakes: Option<i64>,
    max_cooldown: Option<toml::Value>,
    adaptive: Option<bool>,
    tokens_per_minute: Option<i64>,
}

/// `[admission]`: defaults for every lane with a cap.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmission {
    max_overtakes: Option<i64>,
    max_cooldown: Option<toml::Value>,
}

/// `[providers.NAME]`: what holds for every lane of a provider.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    shared_cooldown: Option<bool>,
    tokens_per_minute: Option<i64>,
}

/// Reads a duration written as a humantime string (`"300ms"`, `"5m"`) or
/// integer milliseconds. A bare integer under 1000 is most likely seconds
/// written without their unit: it is read as milliseconds, as documented,
/// and `warnings` says so.
///
/// # Errors
/// Names `key` and says what is wrong.
pub fn parse_duration(
    key: &str,
    value: &toml::Value,
    warnings: &mut Vec<ConfigWarning>,
) -> Result<Duration, ConfigError> {
    match value {
        toml::Value::Integer(ms) if *ms >= 0 => {
            if (1..1000).contains(ms) {
                warnings.push(ConfigWarning::new(
                    key,
                    format!("{ms} means {ms} ms; write \"{ms}s\" for seconds, or \"{ms}ms\" to say milliseconds"),
                ));
            }
            Ok(Duration::from_millis(*ms as u64))
        }
        toml::Value::Integer(ms) => Err(ConfigError::new(key, format!("must not be negative, got {ms}"))),
        toml::Value::String(text) => humantime::parse_duration(text.trim()).map_err(|err| {
            ConfigError::new(
                key,
                format!("{text:?} is not a duration ({err}); write e.g. \"300ms\", \"5m\", \"1h\" or integer milliseconds"),
            )
        }),
        other => Err(ConfigError::new(
            key,
            format!(
                "expected a duration string such as \"5m\" or integer milliseconds, got a {}",
                other.type_str()
            ),
        )),
    }
}

/// Reads a string setting.
///
/// # Errors
/// Names `key` when `value` is not a string.
pub fn parse_string(key: &str, value: &toml::Value) -> Result<String, ConfigError> {
    value
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| ConfigError::new(key, format!("must be a string, got {value}")))
}

/// Reads a whole number of `unit` within `range`.
///
/// # Errors
/// Names `key` and the range when `value` is not such a number.
pub fn parse_count(
    key: &str,
    value: &toml::Value,
    range: std::ops::RangeInclusive<usize>,
    unit: &str,
) -> Result<usize, ConfigError> {
    value
        .as_integer()
        .and_then(|n| usize::try_from(n).ok())
        .filter(|n| range.contains(n))
        .ok_or_else(|| {
            ConfigError::new(
                key,
                format!(
                    "must be a whole number of {unit} from {} to {}, got {value}",
                    range.start(),
                    range.end()
                ),
            )
        })
}

/// A key path as the file writes it: `lanes."kb::ollama".cap`,
/// `tokens[1].scope`.
fn key_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut key = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => key.push_str(&format!("[{index}]")),
            Segment::Map { key: name } | Segment::Enum { variant: name } => {
                if !key.is_empty() {
                    key.push('.');
                }
                let bare = !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                if bare {
                    key.push_str(name);
                } else {
                    key.push_str(&format!("{name:?}"));
                }
            }
            Segment::Unknown => {}
        }
    }
    key
}

/// serde's names for the types a key expects, in the file's words.
fn in_file_words(message: &str) -> String {
    let mut message = message.to_owned();
    for (rust, words) in [
        ("expected i64", "expected an integer"),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected an array"),
        ("expected a map", "expected a table"),
    ] {
        message = message.replace(rust, words);
    }
    message
}

/// The configuration error of a file that does not read as [`RawFile`]:
/// the key path where it failed, and the line.
fn file_error(text: &str, err: serde_path_to_error::Error<toml::de::Error>) -> ConfigError {
    let key = key_path(err.path());
    let err = err.into_inner();
    let message = err.message().to_owned();
    let location = err
        .span()
        .map(|span| {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            format!(" (line {line})")
        })
        .unwrap_or_default();
    ConfigError::new(key, format!("{}{location}", in_file_words(&message)))
}

/// Says which built-in classes a file's class set leaves out, if any, and
/// how to keep them.
fn dropped_built_ins(classes: &BTreeMap<String, ClassBounds>) -> Option<ConfigWarning> {
    let built_in = LedgerConfig::default();
    let (names, keep): (Vec<&str>, Vec<String>) = built_in
        .policy
        .classes()
        .iter()
        .filter(|(name, _)| !classes.contains_key(*name))
        .map(|(name, bounds)| {
            let deadline = Duration::from_millis(bounds.deadline_ms().unsigned_abs());
            (
                name.as_str(),
                format!(
                    "[classes.{name}] deadline = \"{}\"",
                    humantime::format_duration(deadline)
                ),
            )
        })
        .unzip();
    (!names.is_empty()).then(|| {
        ConfigWarning::new(
            "classes",
            format!(
                "replaces the built-in classes, leaving out {} (a call of a class not configured \
                 gets the widest bound); to keep {}, add {}",
                names.join(" and "),
                if names.len() == 1 { "it" } else { "them" },
                keep.join(" and ")
            ),
        )
    })
}

impl Settings {
    /// Parses a configuration file's text.
    ///
    /// A file that configures classes replaces the built-in ones.
    ///
    /// # Errors
    /// Malformed TOML, an unknown key, a factor below 1, a zero deadline, a
    /// malformed lane key or a bad duration, naming the key.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let raw: RawFile = serde_path_to_error::deserialize(toml::Deserializer::new(text))
            .map_err(|err| file_error(text, err))?;
        let mut warnings = Vec::new();

        let defaults = LedgerConfig::default();
        let factor = raw.reap.as_ref().and_then(|r| r.factor).unwrap_or(DEFAULT_FACTOR);
        let classes = match raw.classes {
            None => defaults.policy.classes().clone(),
            Some(raw_classes) => {
                let mut classes = BTreeMap::new();
                for (name, class) in raw_classes {
                    let key = format!("classes.{name}");
                    Label::new("class", &name).map_err(|err| ConfigError::new(&key, err.problem))?;
                    let deadline = class
                        .deadline
                        .as_ref()
                        .ok_or_else(|| ConfigError::new(format!("{key}.deadline"), "is required"))
                        .and_then(|v| parse_duration(&format!("{key}.deadline"), v, &mut warnings))?;
                    let max_queue_wait = class
                        .max_queue_wait
                        .as_ref()
                        .map(|v| parse_duration(&format!("{key}.max_queue_wait"), v, &mut warnings))
                        .transpose()?;
                    let bounds = ClassBounds::new(deadline, max_queue_wait)
                        .and_then(|bounds| match class.tokens {
                            Some(tokens) => bounds.with_tokens(tokens),
                            None => Ok(bounds),
                        })
                        .map_err(|err| ConfigError::new(format!("{key}.{}", err.field), err.problem))?;
                    classes.insert(name, bounds);
                }
                warnings.extend(dropped_built_ins(&classes));
                classes
            }
        };
        let policy = ReapPolicy::new(classes, factor).map_err(|err| {
            let key = if err.field == "factor" {
                "reap.factor"
            } else {
                err.field
            };
            ConfigError::new(key, err.problem)
        })?;
        let mut ledger = LedgerConfig::new(policy);
        if let Some(interval) = raw.reap.as_ref().and_then(|r| r.interval.as_ref()) {
            ledger = ledger.with_reap_interval(parse_duration("reap.interval", interval, &mut warnings)?)?;
        }
        if let Some(keep) = raw.retention.as_ref().and_then(|r| r.keep.as_ref()) {
            ledger = ledger.with_retention(parse_duration("retention.keep", keep, &mut warnings)?)?;
        }
        if let Some(admission) = raw.admission {
            if let Some(max) = admission.max_overtakes {
                ledger = ledger.with_max_overtakes(whole("admission.max_overtakes", max, 0)?);
            }
            if let Some(max) = &admission.max_cooldown {
                let max = parse_duration("admission.max_cooldown", max, &mut warnings)?;
                ledger = ledger.with_max_cooldown(max)?;
            }
        }
        for (provider, settings) in raw.providers.unwrap_or_default() {
            if settings.shared_cooldown == Some(true) {
                ledger = ledger.with_shared_cooldown(&provider)?;
            }
            if let Some(budget) = settings.tokens_per_minute {
                ledger = ledger.with_provider_budget(&provider, budget)?;
            }
        }
        for (lane, settings) in raw.lanes.unwrap_or_default() {
            ledger = ledger.declare_lane(&lane, settings.cap)?;
            if let Some(budget) = settings.tokens_per_minute {
                ledger = ledger.with_lane_budget(&lane, budget)?;
            }
            if settings.batch_cap.is_some() || settings.max_overtakes.is_some() {
                let batch_cap = settings
                    .batch_cap
                    .map(|cap| whole(&format!("lanes.{lane:?}.batch_cap"), cap, 1))
                    .transpose()?;
                let max_overtakes = settings
                    .max_overtakes
                    .map(|max| whole(&format!("lanes.{lane:?}.max_overtakes"), max, 0))
                    .transpose()?;
                ledger = ledger.with_lane_ranking(&lane, batch_cap, max_overtakes)?;
            }
            if settings.max_cooldown.is_some() || settings.adaptive.is_some() {
                let key = format!("lanes.{lane:?}.max_cooldown");
                let max_cooldown = settings
                    .max_cooldown
                    .as_ref()
                    .map(|max| parse_duration(&key, max, &mut warnings))
                    .transpose()?;
                ledger =
                    ledger.with_lane_cooldown(&lane, max_cooldown, settings.adaptive.unwrap_or(false))?;
            }
        }
        if let Some(labels) = raw.labels {
            ledger = ledger.with_cardinality(labels.cardinality()?);
        }
        let store = match raw.store {
            None => None,
            Some(RawStore::Url(url)) => Some(url),
            Some(RawStore::Table(table)) => store_url(table)?,
        };
        if let Some(url) = &store {
            // The check `serve` makes when it opens the store, so that
            // `check-config` refuses what `serve` would.
            crate::store_url::check_url(url).map_err(|err| ConfigError::new("store", err.message()))?;
        }
        Ok(Self {
            listen: raw.listen,
            store,
            token: raw.token,
            tokens: raw.tokens.unwrap_or_default(),
            metrics_aggregates: raw.metrics.and_then(|metrics| metrics.aggregates),
            server: raw.server,
            proxy: raw.proxy.unwrap_or_default(),
            otel: raw.otel,
            ledger,
            warnings,
        })
    }
}

/// The URL a `[store]` table describes: `synchronous` checked here, so
/// that `check-config` names it, and folded into the URL.
fn store_url(table: RawStoreTable) -> Result<Option<String>, ConfigError> {
    let Some(synchronous) = table.synchronous else {
        return Ok(table.url);
    };
    let synchronous: crate::store_url::Synchronous = synchronous
        .parse()
        .map_err(|err: crate::domain::ParseError| ConfigError::new("store.synchronous", err.to_string()))?;
    let url = table
        .url
        .unwrap_or_else(|| crate::store_url::DEFAULT_URL.to_owned());
    if !url.starts_with("sqlite://") {
        return Err(ConfigError::new(
            "store.synchronous",
            format!("applies to a sqlite:// store, not {url:?}"),
        ));
    }
    if url.contains("synchronous=") {
        return Err(ConfigError::new(
            "store.synchronous",
            "is also set in store.url: say it once".to_owned(),
        ));
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    Ok(Some(format!("{url}{separator}synchronous={synchronous}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_is_a_url_or_a_table_with_its_durability() {
        let url = |text: &str| Settings::from_toml(text).map(|s| s.store);
        assert_eq!(url("store = \"memory:\"\n").unwrap().as_deref(), Some("memory:"));
        assert_eq!(
            url("[store]\nurl = \"sqlite://x.db\"\nsynchronous = \"normal\"\n")
                .unwrap()
                .as_deref(),
            Some("sqlite://x.db?synchronous=normal")
        );
        assert_eq!(
            url("[store]\nsynchronous = \"full\"\n").unwrap().as_deref(),
            Some("sqlite://inflight.db?synchronous=full")
        );
        assert_eq!(url("[store]\n").unwrap(), None);
        for (text, key) in [
            ("[store]\nsynchronous = \"off\"\n", "store.synchronous"),
            (
                "[store]\nurl = \"memory:\"\nsynchronous = \"normal\"\n",
                "store.synchronous",
            ),
            (
                "[store]\nurl = \"sqlite://x.db?synchronous=full\"\nsynchronous = \"normal\"\n",
                "store.synchronous",
            ),
        ] {
            assert_eq!(url(text).unwrap_err().key, key, "{text}");
        }
    }

    const EXAMPLE: &str = r#"
listen = "127.0.0.1:7878"
store = "sqlite://inflight.db"
[reap]
factor = 4
interval = "10s"
[classes.embedding]
deadline = "5m"
[classes.chat]
deadline = "10m"
max_queue_wait = "2m"
[lanes."knowledge-base::ollama"]
cap = 4
"#;

    #[test]
    fn the_documented_example_parses() {
        let settings = Settings::from_toml(EXAMPLE).unwrap();
        assert_eq!(settings.listen.as_deref(), Some("127.0.0.1:7878"));
        let policy = settings.ledger.policy();
        assert_eq!(policy.classes()["chat"].max_queue_wait_ms(), 120_000);
        assert_eq!(policy.classes()["embedding"].max_queue_wait_ms(), 300_000);
        let lane = LaneKey::parse("knowledge-base::ollama").unwrap();
        assert_eq!(settings.ledger.cap(&lane), Some(4));
        assert_eq!(settings.ledger.reap_interval(), Duration::from_secs(10));
    }

    #[test]
    fn durations_accept_integer_milliseconds() {
        let settings = Settings::from_toml("[classes.x]\ndeadline = 300\n").unwrap();
        assert_eq!(settings.ledger.policy().classes()["x"].deadline_ms(), 300);
        assert_eq!(
            settings.ledger.policy().classes().len(),
            1,
            "file classes replace built-ins"
        );
    }

    fn warnings(text: &str) -> Vec<String> {
        let settings = Settings::from_toml(text).unwrap();
        settings.warnings.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_bare_integer_under_a_second_is_read_as_milliseconds_with_a_warning() {
        let said = warnings(
            "[reap]\ninterval = 10\n[retention]\nkeep = 999\n\
             [classes.embedding]\ndeadline = 300\nmax_queue_wait = 1000\n[classes.chat]\ndeadline = \"300ms\"\n",
        );
        assert_eq!(
            said,
            [
                "classes.embedding.deadline: 300 means 300 ms; write \"300s\" for seconds, or \"300ms\" to say milliseconds",
                "reap.interval: 10 means 10 ms; write \"10s\" for seconds, or \"10ms\" to say milliseconds",
                "retention.keep: 999 means 999 ms; write \"999s\" for seconds, or \"999ms\" to say milliseconds",
            ]
        );
        let settings =
            Settings::from_toml("[classes.embedding]\ndeadline = 300\n[classes.chat]\ndeadline = 1\n")
                .unwrap();
        assert_eq!(
            settings.ledger.policy().classes()["embedding"].deadline_ms(),
            300,
            "still milliseconds"
        );
        assert!(warnings(EXAMPLE).is_empty(), "{:?}", warnings(EXAMPLE));
    }

    #[test]
    fn a_class_set_that_drops_a_built_in_class_says_so() {
        let said = warnings("[classes.embeding]\ndeadline = \"5m\"\n");
        assert_eq!(
            said,
            ["classes: replaces the built-in classes, leaving out chat and embedding (a call of a class not \
              configured gets the widest bound); to keep them, add [classes.chat] deadline = \"10m\" and \
              [classes.embedding] deadline = \"5m\""]
        );
        let said = warnings("[classes.embedding]\ndeadline = \"5m\"\n[classes.batch]\ndeadline = \"1h\"\n");
        assert_eq!(said.len(), 1);
        assert!(
            said[0].contains("leaving out chat (") && said[0].contains("[classes.chat] deadline = \"10m\""),
            "{said:?}"
        );
        assert!(warnings("").is_empty(), "the built-in classes themselves");
    }

    #[test]
    fn type_errors_name_the_key_path_at_every_depth() {
        for (text, said) in [
            ("[lanes.\"kb::ollama\"]\ncap = \"4\"\n", "lanes.\"kb::ollama\".cap: invalid type: string \"4\", expected an integer (line 2)"),
            ("listen = 7878\n", "listen: invalid type: integer `7878`, expected a string (line 1)"),
            ("[reap]\nfactor = \"4\"\n", "reap.factor: invalid type: string \"4\", expected a number (line 2)"),
            ("[labels]\nservice = \"kb\"\n", "labels.service: invalid type: string \"kb\", expected an array (line 2)"),
            ("[labels]\nservice = [\"kb\", 3]\n", "labels.service[1]: invalid type: integer `3`, expected a string (line 2)"),
            ("[metrics]\naggregates = \"yes\"\n", "metrics.aggregates: invalid type: string \"yes\", expected a boolean (line 2)"),
            ("[classes.chat]\ndeadline = \"1m\"\ndedline = \"1m\"\n", "classes.chat.dedline: unknown field `dedline`, expected one of `deadline`, `max_queue_wait`, `tokens` (line 3)"),
        ] {
            let err = Settings::from_toml(text).unwrap_err();
            assert_eq!(err.to_string(), said, "{text}");
        }
    }

    #[test]
    fn token_budgets_are_read_for_lanes_and_providers_and_bad_ones_named() {
        let settings = Settings::from_toml(
            "[lanes.\"kb::openai\"]\ntokens_per_minute = 1000\n\
             [providers.ollama]\ntokens_per_minute = 90000\n",
        )
        .unwrap();
        let ledger = &settings.ledger;
        let lane = LaneKey::parse("kb::openai").unwrap();
        let rules = ledger.lane_rules(&lane).expect("a budget alone governs the lane");
        assert_eq!(
            (rules.budget, rules.provider_budget, rules.cap),
            (Some(1_000), None, u32::MAX)
        );
        assert_eq!(ledger.cap(&lane), None, "no cap of its own");
        // Every lane of a budgeted provider is governed, declared or not.
        let undeclared = LaneKey::parse("chat::ollama").unwrap();
        assert_eq!(
            ledger.lane_rules(&undeclared).unwrap().provider_budget,
            Some(90_000)
        );
        assert_eq!(ledger.lane_rules(&LaneKey::parse("chat::gemini").unwrap()), None);
        for (text, key) in [
            (
                "[lanes.\"a::b\"]\ntokens_per_minute = 0\n",
                "lanes.\"a::b\".tokens_per_minute",
            ),
            (
                "[providers.ollama]\ntokens_per_minute = -5\n",
                "providers.ollama.tokens_per_minute",
            ),
            (
                "[providers.ollama]\ntokens_per_minute = 5000000000\n",
                "providers.ollama.tokens_per_minute",
            ),
        ] {
            let err = Settings::from_toml(text).unwrap_err();
            assert_eq!(err.key, key, "{text}");
            assert!(err.problem.contains("at least 1"), "{text}: {err}");
        }
    }

    #[test]
    fn a_store_url_is_checked_as_serve_opens_it() {
        for (text, says) in [
            ("store = \"sqlit://x.db\"\n", "unsupported store URL"),
            ("store = \"sqlite://\"\n", "needs a file path"),
            ("store = \"sqlite://x.db?journal=wal\"\n", "unknown parameter"),
            ("[store]\nurl = \"memry:\"\n", "unsupported store URL"),
        ] {
            let err = Settings::from_toml(text).unwrap_err();
            assert_eq!(err.key, "store", "{text}");
            assert!(err.problem.contains(says), "{text}: {err}");
        }
        assert!(Settings::from_toml("store = \"memory:\"\n").is_ok());
    }

    #[test]
    fn labels_bound_lanes_label_sets_and_vocabularies() {
        let settings = Settings::from_toml(
            "[labels]\nmax_lanes = 20\nmax_aggregates = 300\noverflow = \"refuse\"\n\
             service = [\"knowledge-base\", \"memory-core\"]\nmodel = [\"nomic-embed-text\"]\n",
        )
        .unwrap();
        let bounds = settings.ledger.cardinality();
        assert_eq!((bounds.max_lanes(), bounds.max_aggregates()), (20, 300));
        assert_eq!(bounds.overflow(), Overflow::Refuse);
        let services = bounds.vocabularies().service.as_ref().unwrap();
        assert!(services.contains("memory-core") && services.len() == 2);
        assert_eq!(bounds.vocabularies().provider, None);
        assert_eq!(
            Settings::from_toml("").unwrap().ledger.cardinality(),
            &Cardinality::default()
        );
    }

    #[test]
    fn a_lane_ranks_its_line_with_its_own_rules_or_the_admission_default() {
        let text = "[admission]\nmax_overtakes = 2\n\
                    [lanes.\"kb::ollama\"]\ncap = 4\nbatch_cap = 3\n\
                    [lanes.\"chat::openai\"]\ncap = 2\nmax_overtakes = 0\n\
                    [lanes.\"mc::ollama\"]\n";
        let ledger = Settings::from_toml(text).unwrap().ledger;
        let rules = |lane: &str| {
            let lane = LaneKey::parse(lane).unwrap();
            ledger.lanes()[&lane].rules(ledger.admission(), None)
        };
        assert_eq!(
            rules("kb::ollama"),
            Some(LaneRules {
                batch_cap: Some(3),
                max_overtakes: 2,
                ..LaneRules::capped(4)
            })
        );
        assert_eq!(rules("chat::openai"), Some(LaneRules::capped(2)));
        assert_eq!(rules("mc::ollama"), None, "no cap, no admission");
        assert!(!LaneRules::capped(2).ranked());
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            ("bogus = 1", "bogus"),
            ("[reap]\nfactor = 0.5", "reap.factor"),
            ("[classes.chat]\ndeadline = 0", "classes.chat.deadline"),
            ("[classes.chat]\ndeadline = \"soon\"", "classes.chat.deadline"),
            ("[classes.chat]\n", "classes.chat.deadline"),
            (
                "[classes.chat]\ndeadline = \"1m\"\ntokens = -1",
                "classes.chat.tokens",
            ),
            (
                "[classes.chat]\ndeadline = \"1m\"\ntokens = 1000000001",
                "classes.chat.tokens",
            ),
            ("[classes]\n", "classes"),
            ("[lanes.\"no-separator\"]\ncap = 1", "lanes.\"no-separator\""),
            ("[lanes.\"a::b\"]\ncap = 0", "lanes.\"a::b\".cap"),
            (
                "[lanes.\"a::b\"]\ncap = 4\nbatch_cap = 4",
                "lanes.\"a::b\".batch_cap",
            ),
            (
                "[lanes.\"a::b\"]\ncap = 4\nbatch_cap = 0",
                "lanes.\"a::b\".batch_cap",
            ),
            ("[lanes.\"a::b\"]\nbatch_cap = 1", "lanes.\"a::b\".batch_cap"),
            (
                "[lanes.\"a::b\"]\nmax_overtakes = 1",
                "lanes.\"a::b\".max_overtakes",
            ),
            (
                "[lanes.\"a::b\"]\ncap = 4\nmax_overtakes = -1",
                "lanes.\"a::b\".max_overtakes",
            ),
            ("[admission]\nmax_overtakes = -1", "admission.max_overtakes"),
            ("[admission]\nmax_overtake = 1", "admission.max_overtake"),
            ("[reap]\ninterval = \"0s\"", "reap.interval"),
            ("[classes.chat]\ndedline = \"1m\"", "classes.chat.dedline"),
            ("[labels]\nmax_lanes = 0", "labels.max_lanes"),
            ("[labels]\nmax_aggregates = -1", "labels.max_aggregates"),
            ("[labels]\noverflow = \"drop\"", "labels.overflow"),
            ("[labels]\nservice = [\"bad name\"]", "labels.service"),
            ("[labels]\nmodel = [\"http://host:1234\"]", "labels.model"),
        ];
        for (text, key) in cases {
            let err = Settings::from_toml(text).unwrap_err();
            assert_eq!(err.key, key, "{text:?}: {err}");
        }
    }
}

//! Bounded labels and model redaction.
//!
//! Labels become map keys, metric labels and table columns, so their
//! alphabet and length are bounded: an unbounded label is how `unknown` junk
//! and secrets end up in an operator's dashboard.

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;

use serde::{Serialize, Serializer};

/// The label used when an optional label is missing.
pub const UNKNOWN: &str = "unknown";
/// What a model name that does not look like a model identifier is stored as.
pub const REDACTED: &str = "redacted";

const MAX_LABEL_LEN: usize = 64;
const MAX_MODEL_LEN: usize = 160;
const CREDENTIAL_PREFIXES: [&str; 5] = ["sk-", "ghp_", "github_pat_", "glpat-", "AIza"];

/// A validated label: 1 to 64 characters of `[A-Za-z0-9._-]`. Cheap to
/// clone: records and counters share one allocation per label.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Label(Arc<str>);

impl Serialize for Label {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

/// Why a label was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelError {
    /// The field that carried the label (`service`, `provider`, ...).
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

impl fmt::Display for LabelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {}: {}", self.field, self.problem)
    }
}

impl std::error::Error for LabelError {}

impl Label {
    /// Validates `value` as the label of `field`.
    ///
    /// # Errors
    /// Returns a [`LabelError`] naming `field` when `value` is empty, longer
    /// than 64 characters, or holds a character outside `[A-Za-z0-9._-]`.
    pub fn new(field: &'static str, value: &str) -> Result<Self, LabelError> {
        if value.is_empty() {
            return Err(LabelError {
                field,
                problem: "must not be empty".into(),
            });
        }
        if value.len() > MAX_LABEL_LEN {
            return Err(LabelError {
                field,
                problem: format!("must be at most {MAX_LABEL_LEN} characters"),
            });
        }
        if let Some(bad) = value
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(LabelError {
                field,
                problem: format!("character {bad:?} is not allowed (use A-Z, a-z, 0-9, '.', '_', '-')"),
            });
        }
        Ok(Self(value.into()))
    }

    /// Validates an optional label; a missing one is `unknown`.
    ///
    /// # Errors
    /// As [`Label::new`] when a value is present.
    pub fn or_unknown(field: &'static str, value: Option<&str>) -> Result<Self, LabelError> {
        match value {
            None => Ok(Self::unknown()),
            Some(value) => Self::new(field, value),
        }
    }

    /// The `unknown` label.
    pub fn unknown() -> Self {
        Self(UNKNOWN.into())
    }

    /// The label as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Wraps a value read back from a store, which validated it on the way in.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))] // only stores that read text back
    pub(crate) fn trusted(value: String) -> Self {
        Self(value.into())
    }

    /// The shared text, for counters keyed by labels.
    pub(crate) fn shared(&self) -> Arc<str> {
        Arc::clone(&self.0)
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Label {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// The labels of one activity, validated together.
#[derive(Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSet {
    /// The calling service.
    pub service: Label,
    /// The provider called (`ollama`, `openai`, ...).
    pub provider: Label,
    /// The deadline class, which its bounds derive from.
    pub class: Label,
    /// The caller's stage (`kb-tenant-ingestion-embedding`, ...).
    pub operation_stage: Label,
    /// The model, or `unknown` / `redacted`.
    #[serde(serialize_with = "serialize_shared_str")]
    pub model: Arc<str>,
}

fn serialize_shared_str<S: Serializer>(value: &Arc<str>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(value)
}

/// A shared [`LabelSet`]. Records of the same kind of call point at one
/// allocation, so copying a record costs one reference count rather than
/// one per label, and comparing two sets from the same source is a pointer
/// comparison. Read the labels through `Deref`: `record.labels.service`.
#[derive(Clone)]
pub struct ActivityLabels(Arc<SharedLabels>);

struct SharedLabels {
    set: LabelSet,
    /// Computed once, so counters keyed by the set never rehash its text.
    hash: u64,
}

impl ActivityLabels {
    /// Shares `set`.
    pub fn new(set: LabelSet) -> Self {
        let hash = foldhash::fast::FixedState::with_seed(0).hash_one(&set);
        Self(Arc::new(SharedLabels { set, hash }))
    }

    /// Validates the labels of a call; a missing optional label is
    /// `unknown`, and the model is sanitized with [`sanitize_model`].
    ///
    /// # Errors
    /// As [`Label::new`], naming the first field that is refused.
    pub fn validate(raw: &RawLabels<'_>) -> Result<Self, LabelError> {
        Ok(Self::new(LabelSet {
            service: Label::new("service", raw.service)?,
            provider: Label::new("provider", raw.provider)?,
            class: Label::or_unknown("class", raw.class)?,
            operation_stage: Label::or_unknown("operationStage", raw.operation_stage)?,
            model: sanitize_model(raw.model).into(),
        }))
    }
}

impl std::ops::Deref for ActivityLabels {
    type Target = LabelSet;
    fn deref(&self) -> &LabelSet {
        &self.0.set
    }
}

impl ActivityLabels {
    /// Which shared set this is: equal for clones of one set, different for
    /// sets built apart (even equal ones). Kept as a number, so that holding
    /// it holds nothing.
    pub(crate) fn identity(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// Whether both are the same shared set, not merely equal ones.
    #[cfg(test)]
    pub(crate) fn is_shared_with(&self, other: &Self) -> bool {
        self.same_set(other)
    }

    /// These labels with `model` instead of theirs.
    pub(crate) fn with_model(&self, model: Arc<str>) -> Self {
        Self::new(LabelSet {
            service: self.service.clone(),
            provider: self.provider.clone(),
            class: self.class.clone(),
            operation_stage: self.operation_stage.clone(),
            model,
        })
    }

    /// Whether both are the same shared set: one pointer compared.
    pub(crate) fn same_set(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl PartialEq for ActivityLabels {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || (self.0.hash == other.0.hash && self.0.set == other.0.set)
    }
}

impl Eq for ActivityLabels {}

impl std::hash::Hash for ActivityLabels {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.hash);
    }
}

impl fmt::Debug for ActivityLabels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.set.fmt(f)
    }
}

impl Serialize for ActivityLabels {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.set.serialize(serializer)
    }
}

/// The labels of a call as its caller spelled them, before validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawLabels<'a> {
    /// The calling service.
    pub service: &'a str,
    /// The provider.
    pub provider: &'a str,
    /// The deadline class, if given.
    pub class: Option<&'a str>,
    /// The caller's stage, if given.
    pub operation_stage: Option<&'a str>,
    /// The model, if given.
    pub model: Option<&'a str>,
}

/// How many distinct label sets a [`LabelInterner`] remembers before it
/// starts over. Label sets are few by design (services, providers, classes,
/// stages, models); this bounds memory if a caller sends unbounded ones.
const MAX_INTERNED: usize = 4096;

/// Remembers validated label sets by their raw spelling, so that a call
/// like the last thousand is validated and allocated once, not per call.
#[derive(Default)]
pub struct LabelInterner {
    sets: HashMap<u64, Interned, foldhash::fast::FixedState>,
    /// The last set spelled by string literals, by where they are
    /// ([`LabelInterner::intern_spelled`]).
    last_spelled: Option<(Spelling, ActivityLabels)>,
}

/// Where a call's five labels are (address and length of each, `(0, 0)`
/// for one absent), when each is a `'static` string: memory that is never
/// freed, so the same place always holds the same text.
pub type Spelling = [(usize, usize); 5];

struct Interned {
    /// The model as sent: validation rewrites it, so a hit compares this.
    raw_model: Option<Box<str>>,
    labels: ActivityLabels,
}

impl Interned {
    fn matches(&self, raw: &RawLabels<'_>) -> bool {
        let set = &*self.labels;
        set.service.as_str() == raw.service
            && set.provider.as_str() == raw.provider
            && set.class.as_str() == raw.class.unwrap_or(UNKNOWN)
            && set.operation_stage.as_str() == raw.operation_stage.unwrap_or(UNKNOWN)
            && self.raw_model.as_deref() == raw.model
    }
}

impl fmt::Debug for LabelInterner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LabelInterner")
            .field("sets", &self.sets.len())
            .finish()
    }
}

impl LabelInterner {
    /// The validated labels for `raw`: the remembered set when this spelling
    /// was seen before, else a newly validated one.
    ///
    /// # Errors
    /// As [`ActivityLabels::validate`]; a refused spelling is not remembered.
    pub fn labels(&mut self, raw: &RawLabels<'_>) -> Result<ActivityLabels, LabelError> {
        self.intern(raw).map(|(labels, _)| labels)
    }

    /// Like [`LabelInterner::labels`], and says whether the set was newly
    /// validated (`true`) rather than remembered: what a caller checks once
    /// per label set, not once per call.
    ///
    /// # Errors
    /// As [`ActivityLabels::validate`].
    pub fn intern(&mut self, raw: &RawLabels<'_>) -> Result<(ActivityLabels, bool), LabelError> {
        let key = self.sets.hasher().hash_one(raw);
        if let Some(interned) = self.sets.get(&key).filter(|interned| interned.matches(raw)) {
            return Ok((interned.labels.clone(), false));
        }
        let labels = ActivityLabels::validate(raw)?;
        if self.sets.len() >= MAX_INTERNED {
            self.sets.clear();
        }
        // On the rare hash collision, the newer spelling takes the slot.
        self.sets.insert(
            key,
            Interned {
                raw_model: raw.model.map(Box::from),
                labels: labels.clone(),
            },
        );
        Ok((labels, true))
    }

    /// Like [`LabelInterner::intern`], for labels spelled by `'static`
    /// strings at `spelling`: most services begin every call from the same
    /// literals, so the last such set is answered without hashing or
    /// comparing its labels.
    ///
    /// Kept per interner (per ledger), not per thread, so that each ledger
    /// sees its own first use of a label set. It saves 3.9 % of a
    /// `memory_lifecycle` lifecycle at `cfaa354`: 5,343 instructions
    /// against 5,551 without it (`inflight-bench --count-lifecycles`;
    /// docs/performance.md, "Tricks measured"). It is neither `unsafe` nor
    /// process-global, and the lookup it saves is the interner's own.
    ///
    /// # Errors
    /// As [`ActivityLabels::validate`].
    pub fn intern_spelled(
        &mut self,
        spelling: Spelling,
        raw: &RawLabels<'_>,
    ) -> Result<(ActivityLabels, bool), LabelError> {
        if let Some((seen, labels)) = &self.last_spelled {
            if *seen == spelling {
                return Ok((labels.clone(), false));
            }
        }
        let (labels, new) = self.intern(raw)?;
        self.last_spelled = Some((spelling, labels.clone()));
        Ok((labels, new))
    }
}

/// Keeps a model name only when it looks like a model identifier.
///
/// A missing or empty name is `unknown`. Credentials, URLs and endpoints,
/// paths and overlong names become `redacted`, because callers have been
/// seen passing their base URL or API key where the model belongs.
///
/// ```
/// use inflight::domain::labels::sanitize_model;
/// assert_eq!(sanitize_model(Some("llama3.1:8b")), "llama3.1:8b");
/// assert_eq!(sanitize_model(Some("BAAI/bge-m3")), "BAAI/bge-m3");
/// assert_eq!(sanitize_model(Some("localhost:11434")), "redacted");
/// assert_eq!(sanitize_model(Some("sk-live-abc")), "redacted");
/// assert_eq!(sanitize_model(None), "unknown");
/// ```
pub fn sanitize_model(raw: Option<&str>) -> String {
    let Some(raw) = raw.map(str::trim).filter(|raw| !raw.is_empty()) else {
        return UNKNOWN.to_owned();
    };
    if looks_like_model(raw) {
        raw.to_owned()
    } else {
        REDACTED.to_owned()
    }
}

/// The model a refinement names, sanitized as a begin's is
/// ([`sanitize_model`]).
///
/// # Errors
/// A [`LabelError`] naming `model` when it is empty: a refinement says
/// which model served the call, so it must name one.
pub fn refinement_model(raw: &str) -> Result<Arc<str>, LabelError> {
    if raw.trim().is_empty() {
        return Err(LabelError {
            field: "model",
            problem: "must not be empty".into(),
        });
    }
    Ok(sanitize_model(Some(raw)).into())
}

/// Keeps a free-text diagnostic (such as a cancel reason) only when it carries
/// no credential, endpoint or path, for the same reasons as model names.
pub fn sanitize_note(raw: Option<&str>) -> Option<String> {
    let raw = raw.map(str::trim).filter(|raw| !raw.is_empty())?;
    let leaks = raw.len() > MAX_MODEL_LEN
        || raw.chars().any(char::is_control)
        || raw.split_whitespace().any(|word| {
            looks_like_secret_or_location(
                word.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '/' && c != '.' && c != '~'),
            )
        });
    Some(if leaks {
        REDACTED.to_owned()
    } else {
        raw.to_owned()
    })
}

fn looks_like_model(raw: &str) -> bool {
    if raw.len() > MAX_MODEL_LEN {
        return false;
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':' | '/' | '+');
    raw.chars().all(allowed) && !looks_like_secret_or_location(raw)
}

fn looks_like_secret_or_location(raw: &str) -> bool {
    CREDENTIAL_PREFIXES.iter().any(|prefix| raw.starts_with(prefix))
        || raw.contains("://")
        || raw.contains('@')
        || raw.contains('\\')
        || raw.contains("..")
        || raw.starts_with(['/', '.', '~'])
        || raw.matches('/').count() > 1
        || looks_like_host_port(raw)
}

/// `localhost:11434`, `10.1.2.3:11434`, `ollama.internal:443`, `gpu-box:8080`
/// are endpoints; `mistral:7` and `llama3.1:8b` are models with a tag.
fn looks_like_host_port(raw: &str) -> bool {
    let Some((host, port)) = raw.rsplit_once(':') else {
        return false;
    };
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    let port: u32 = port.parse().unwrap_or(0);
    let host = host.rsplit('/').next().unwrap_or(host);
    let is_ipv4 = host.split('.').count() == 4
        && host
            .split('.')
            .all(|octet| !octet.is_empty() && octet.len() <= 3 && octet.bytes().all(|b| b.is_ascii_digit()));
    let is_domain = host
        .rsplit_once('.')
        .is_some_and(|(_, tld)| tld.len() >= 2 && tld.bytes().all(|b| b.is_ascii_alphabetic()));
    host.eq_ignore_ascii_case("localhost") || is_ipv4 || is_domain || port >= 1024
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_accept_the_bounded_alphabet() {
        assert!(Label::new("service", "knowledge-base").is_ok());
        assert!(Label::new("service", "a.b_c-D9").is_ok());
        assert!(Label::new("service", &"x".repeat(64)).is_ok());
    }

    #[test]
    fn labels_refuse_empty_long_and_foreign_characters() {
        for bad in ["", &"x".repeat(65), "kb tenant", "a/b", "a::b", "é", "x\n"] {
            let err = Label::new("service", bad).unwrap_err();
            assert_eq!(err.field, "service", "{bad:?}");
        }
    }

    #[test]
    fn real_model_names_are_kept() {
        for model in [
            "nomic-embed-text",
            "llama3.1:8b",
            "mistral:7",
            "BAAI/bge-m3",
            "models/gemini-1.5-pro",
            "text-embedding-3-small",
            "qwen2.5:32b",
        ] {
            assert_eq!(sanitize_model(Some(model)), model);
        }
    }

    #[test]
    fn credentials_endpoints_and_paths_are_redacted() {
        for bad in [
            "sk-proj-123",
            "ghp_abc",
            "github_pat_11",
            "glpat-xyz",
            "AIzaSyA",
            "http://localhost:11434",
            "user@host",
            "localhost:11434",
            "10.1.2.3:11434",
            "ollama.internal:443",
            "gpu-box:8080",
            "/models/llama",
            "./model",
            "~/model",
            "C:\\models\\x",
            "a/../b",
            "a/b/c",
            &"m".repeat(161),
            "two words",
        ] {
            assert_eq!(sanitize_model(Some(bad)), REDACTED, "{bad:?}");
        }
    }

    fn raw<'a>(service: &'a str, model: Option<&'a str>) -> RawLabels<'a> {
        RawLabels {
            service,
            provider: "ollama",
            class: Some("embedding"),
            operation_stage: None,
            model,
        }
    }

    #[test]
    fn interner_shares_one_set_per_spelling() {
        let mut interner = LabelInterner::default();
        let first = interner.labels(&raw("kb", Some("nomic-embed-text"))).unwrap();
        let again = interner.labels(&raw("kb", Some("nomic-embed-text"))).unwrap();
        assert!(Arc::ptr_eq(&first.0, &again.0), "a repeated spelling is shared");
        assert_eq!(again.operation_stage.as_str(), UNKNOWN);
        let other = interner.labels(&raw("bot", Some("nomic-embed-text"))).unwrap();
        assert_ne!(first, other);
        assert_eq!(other.service.as_str(), "bot");
    }

    #[test]
    fn interner_compares_the_model_as_sent() {
        let mut interner = LabelInterner::default();
        let secret = interner.labels(&raw("kb", Some("sk-live-1"))).unwrap();
        let plain = interner.labels(&raw("kb", Some("redacted"))).unwrap();
        assert_eq!(&*secret.model, REDACTED);
        // Same labels after validation, so equal, but remembered apart.
        assert_eq!(secret, plain);
        assert_eq!(interner.sets.len(), 2);
    }

    #[test]
    fn interner_refuses_like_validation_and_forgets_the_refusal() {
        let mut interner = LabelInterner::default();
        let err = interner.labels(&raw("kb tenant", None)).unwrap_err();
        assert_eq!(err.field, "service");
        assert!(interner.sets.is_empty());
    }

    #[test]
    fn equal_sets_built_apart_are_equal_and_hash_alike() {
        let a = ActivityLabels::validate(&raw("kb", None)).unwrap();
        let b = ActivityLabels::validate(&raw("kb", None)).unwrap();
        assert!(!Arc::ptr_eq(&a.0, &b.0));
        assert_eq!(a, b);
        let state = foldhash::fast::FixedState::with_seed(7);
        assert_eq!(state.hash_one(&a), state.hash_one(&b));
    }

    #[test]
    fn missing_model_is_unknown() {
        assert_eq!(sanitize_model(None), UNKNOWN);
        assert_eq!(sanitize_model(Some("  ")), UNKNOWN);
    }

    #[test]
    fn notes_keep_prose_but_not_secrets() {
        assert_eq!(
            sanitize_note(Some("client went away")).as_deref(),
            Some("client went away")
        );
        assert_eq!(
            sanitize_note(Some("key sk-abc leaked")).as_deref(),
            Some(REDACTED)
        );
        assert_eq!(sanitize_note(Some("see http://x")).as_deref(), Some(REDACTED));
        assert_eq!(sanitize_note(None), None);
    }
}

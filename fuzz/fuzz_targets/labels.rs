//! Labels and model redaction: any text is accepted as a label only in its
//! documented shape, and a model or note comes back as sent, `unknown` or
//! `redacted`, never as something else.
#![no_main]

use inflight::domain::labels::{sanitize_model, sanitize_note, ActivityLabels, Label, RawLabels};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(label) = Label::new("service", text) {
        assert!((1..=64).contains(&label.as_str().len()), "{text:?}");
        assert!(
            label
                .as_str()
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')),
            "{text:?}"
        );
    }
    let model = sanitize_model(Some(text));
    assert!(
        model == text.trim() || model == "unknown" || model == "redacted",
        "{text:?} became {model:?}"
    );
    if let Some(note) = sanitize_note(Some(text)) {
        assert!(
            note == text.trim() || note == "redacted",
            "{text:?} became {note:?}"
        );
        assert!(!note.chars().any(char::is_control), "{note:?}");
    }
    let mut parts = text.splitn(5, '|');
    let raw = RawLabels {
        service: parts.next().unwrap_or_default(),
        provider: parts.next().unwrap_or_default(),
        class: parts.next(),
        operation_stage: parts.next(),
        model: parts.next(),
    };
    if let Ok(labels) = ActivityLabels::validate(&raw) {
        assert_eq!(labels.service.as_str(), raw.service);
    }
});

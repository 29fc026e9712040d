//! Idempotent begins: a key the caller sends with a begin, so that a retry
//! after a lost answer answers the record the first attempt made instead of
//! making a second one (which would leak, reaped `abandoned`).

use std::hash::Hasher;

use fnv::FnvHasher;

use super::refusal::Refusal;

/// The longest key, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// A begin's idempotency key, and the fingerprint of the request it came
/// with: a repeat with the same key and the same fingerprint answers the
/// record the first made; the same key with another fingerprint is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idempotency {
    /// The key: 1 to 255 printable ASCII characters.
    pub key: String,
    /// [`Fingerprint`] of the request, as the caller sent it.
    pub fingerprint: i64,
}

impl Idempotency {
    /// Checks `key` and pairs it with `fingerprint`.
    ///
    /// # Errors
    /// [`Refusal::Invalid`] naming `Idempotency-Key` when the key is empty,
    /// longer than 255 characters, or holds a character outside printable
    /// ASCII.
    pub fn new(key: String, fingerprint: i64) -> Result<Self, Refusal> {
        let problem = if key.is_empty() {
            Some("must not be empty".to_owned())
        } else if key.len() > MAX_KEY_LEN {
            Some(format!(
                "must be at most {MAX_KEY_LEN} characters, got {}",
                key.chars().count()
            ))
        } else {
            key.chars()
                .find(|c| !(' '..='~').contains(c))
                .map(|bad| format!("character {bad:?} is not printable ASCII"))
        };
        match problem {
            Some(problem) => Err(Refusal::Invalid(format!("Idempotency-Key: {problem}"))),
            None => Ok(Self { key, fingerprint }),
        }
    }
}

/// A stable hash of a request's fields (FNV-1a, 64 bits): it is stored, and
/// compared by later builds and other hosts, so it must not depend on the
/// build as `std`'s and `foldhash`'s hashes may.
#[derive(Default)]
pub struct Fingerprint(FnvHasher);

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Fingerprint").field(&self.finish()).finish()
    }
}

impl Fingerprint {
    /// Adds a field that may be absent; absent and empty differ.
    pub fn field(mut self, value: Option<&[u8]>) -> Self {
        match value {
            None => self.0.write_u8(0),
            Some(bytes) => {
                self.0.write_u8(1);
                self.0.write_u64(bytes.len() as u64);
                self.0.write(bytes);
            }
        }
        self
    }

    /// The fingerprint.
    pub fn finish(&self) -> i64 {
        self.0.finish() as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_printable_ascii_of_1_to_255_characters() {
        for good in [
            "a",
            "0d9c4c57-2f43-4c1e-9a0e-6b7a2d3c1f55",
            "with space ~!",
            &"k".repeat(255),
        ] {
            assert!(Idempotency::new(good.to_owned(), 0).is_ok(), "{good:?}");
        }
        for bad in ["", &"k".repeat(256), "tab\there", "é", "nul\0"] {
            let Err(Refusal::Invalid(message)) = Idempotency::new(bad.to_owned(), 0) else {
                panic!("{bad:?} accepted");
            };
            assert!(message.starts_with("Idempotency-Key: "), "{message}");
        }
    }

    #[test]
    fn a_fingerprint_is_stable_and_tells_fields_apart() {
        let of = |fields: &[Option<&str>]| {
            fields
                .iter()
                .fold(Fingerprint::default(), |print, field| {
                    print.field(field.map(str::as_bytes))
                })
                .finish()
        };
        // Stored and compared across builds: a change here breaks stores.
        assert_eq!(of(&[Some("kb"), None]), of(&[Some("kb"), None]));
        assert_ne!(of(&[Some("kb"), None]), of(&[Some("kb"), Some("")]));
        assert_ne!(of(&[Some("ab"), Some("c")]), of(&[Some("a"), Some("bc")]));
        assert_eq!(of(&[]), 0xcbf2_9ce4_8422_2325_u64 as i64, "FNV-1a's offset basis");
    }
}

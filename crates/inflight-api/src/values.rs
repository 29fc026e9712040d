//! The values fields take: the string enums of the wire, and timestamps.

use std::fmt;
use std::ops::{Add, Sub};
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::{DateTime, SecondsFormat, Utc};
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

wire_enum! {
    /// Where a record is in its life (`state`).
    State {
        /// Enqueued, not started.
        Waiting => "waiting",
        /// Started, not settled.
        Executing => "executing",
        /// Settled with success.
        Succeeded => "succeeded",
        /// Settled with failure.
        Failed => "failed",
        /// An abort the ledger observed.
        Cancelled => "cancelled",
        /// Its bound passed with no settle: a leak, kept as evidence.
        Reaped => "reaped",
    }
}

impl State {
    /// Whether it is still in flight: waiting or executing.
    pub fn is_in_flight(self) -> bool {
        matches!(self, Self::Waiting | Self::Executing)
    }

    /// Whether it settled: succeeded, failed or cancelled.
    pub fn is_settled(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

wire_enum! {
    /// How a reaped record had leaked (`disposition`).
    Disposition {
        /// Never started.
        Abandoned => "abandoned",
        /// Started, never settled.
        Unsettled => "unsettled",
    }
}

wire_enum! {
    /// Why a record was reaped (`reapReason`).
    ReapReason {
        /// Past the bound derived from its deadline class.
        Deadline => "deadline",
        /// Its owner's lease ran out.
        OwnerLost => "owner-lost",
    }
}

wire_enum! {
    /// The caller's priority for a call (`priority`).
    Priority {
        /// A user is waiting on it.
        Interactive => "interactive",
        /// Background or bulk work.
        Batch => "batch",
        /// Not said (the default).
        Unknown => "unknown",
    }
}

wire_enum! {
    /// Whether a record passes through native admission (`admission`).
    Admission {
        /// Counts in its lane (the default).
        Queued => "queued",
        /// Observed only.
        Direct => "direct",
        /// Admitted by the caller's own limiter, its start reported as a
        /// fact: executing, it takes a slot of its lane's cap; waiting, it
        /// holds no place in line; it is never refused.
        External => "external",
    }
}

wire_enum! {
    /// Where a failed call failed (`failureStage`).
    FailureStage {
        /// The provider answered with an error or timed out.
        Provider => "provider",
        /// The call failed before it reached the provider.
        Queue => "queue",
        /// Not said (the default for a failure).
        Unknown => "unknown",
    }
}

wire_enum! {
    /// Where an owner is in its life (`state` of an owner).
    OwnerState {
        /// Renewing its lease.
        Live => "live",
        /// Its lease ran out unrenewed.
        Lost => "lost",
        /// It released its lease on a clean shutdown.
        Released => "released",
    }
}

wire_enum! {
    /// A snapshot's `status`.
    SnapshotStatus {
        /// Nothing was reaped within the window.
        Ok => "ok",
        /// Records were reaped within the window.
        Degraded => "degraded",
    }
}

wire_enum! {
    /// `GET /healthz`'s `status`.
    HealthStatus {
        /// The server answers.
        Ok => "ok",
    }
}

/// An instant, in epoch milliseconds.
///
/// On the wire it is written as RFC 3339 UTC with milliseconds and a `Z`
/// (`"2026-08-13T12:00:00.000Z"`), and read from either that (any offset,
/// `"2026-08-13T14:00:00+02:00"`) or integer epoch milliseconds
/// (`1786622400000`). Only the years 1970 to 9999 are read
/// ([`Timestamp::MIN`] to [`Timestamp::MAX`]); within them, writing then
/// reading gives the same instant back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The earliest instant read: 1970-01-01T00:00:00.000Z.
    pub const MIN: Self = Self(0);
    /// The latest instant read: 9999-12-31T23:59:59.999Z.
    pub const MAX: Self = Self(253_402_300_799_999);
    /// The earliest instant a caller may give for a call
    /// (2001-09-09T01:46:40Z, 10^12 ms): below it, an integer is most
    /// likely epoch seconds taken for milliseconds, a time decades before
    /// the call. The ledger refuses it, naming the field.
    pub const EARLIEST_CALL: Self = Self(1_000_000_000_000);

    /// The instant `millis` after the epoch. Any value is kept, but only
    /// those from [`Timestamp::MIN`] to [`Timestamp::MAX`] read back.
    pub const fn from_millis(millis: i64) -> Self {
        Self(millis)
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// `self - earlier`, in milliseconds (saturating).
    pub const fn millis_since(self, earlier: Self) -> i64 {
        self.0.saturating_sub(earlier.0)
    }

    /// The instant `millis` later (earlier when negative), saturating.
    #[must_use]
    pub const fn add_millis(self, millis: i64) -> Self {
        Self(self.0.saturating_add(millis))
    }

    /// The instant `millis` earlier, saturating.
    #[must_use]
    pub const fn sub_millis(self, millis: i64) -> Self {
        Self(self.0.saturating_sub(millis))
    }

    /// The instant as a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        match u64::try_from(self.0) {
            Ok(after) => UNIX_EPOCH + Duration::from_millis(after),
            Err(_) => UNIX_EPOCH - Duration::from_millis(self.0.unsigned_abs()),
        }
    }

    /// The instant `millis` after the epoch, if it is in the range read.
    ///
    /// # Errors
    /// Says the range when `millis` is outside it.
    pub fn checked(millis: i64) -> Result<Self, String> {
        if (Self::MIN.0..=Self::MAX.0).contains(&millis) {
            Ok(Self(millis))
        } else {
            Err(format!(
                "out of range: timestamps are epoch milliseconds, from {} ({}) to the year 9999",
                Self::EARLIEST_CALL,
                Self::EARLIEST_CALL.0
            ))
        }
    }
}

/// Milliseconds later, saturating, as the ledger's `*Ms` durations are.
impl Add<i64> for Timestamp {
    type Output = Self;

    fn add(self, millis: i64) -> Self {
        self.add_millis(millis)
    }
}

/// Milliseconds earlier, saturating.
impl Sub<i64> for Timestamp {
    type Output = Self;

    fn sub(self, millis: i64) -> Self {
        self.sub_millis(millis)
    }
}

/// Later by a [`Duration`], to the millisecond, saturating.
impl Add<Duration> for Timestamp {
    type Output = Self;

    fn add(self, by: Duration) -> Self {
        self.add_millis(i64::try_from(by.as_millis()).unwrap_or(i64::MAX))
    }
}

/// Earlier by a [`Duration`], to the millisecond, saturating.
impl Sub<Duration> for Timestamp {
    type Output = Self;

    fn sub(self, by: Duration) -> Self {
        self.sub_millis(i64::try_from(by.as_millis()).unwrap_or(i64::MAX))
    }
}

impl From<SystemTime> for Timestamp {
    /// Truncated to the millisecond; saturates far outside `i64` range.
    fn from(at: SystemTime) -> Self {
        let millis = match at.duration_since(UNIX_EPOCH) {
            Ok(after) => i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
            Err(before) => i64::try_from(before.duration().as_millis()).map_or(i64::MIN, |ms| -ms),
        };
        Self(millis)
    }
}

impl From<Timestamp> for SystemTime {
    fn from(at: Timestamp) -> Self {
        at.to_system_time()
    }
}

impl Timestamp {
    /// The text [`Display`](fmt::Display) writes, into `buf` without
    /// allocating, for an instant in years 0 to 9999 (every instant read
    /// back is); `None` otherwise. An answer carries up to five timestamps,
    /// and chrono's writer allocated a `String` for each.
    fn rfc3339_into(self, buf: &mut [u8; 24]) -> Option<&str> {
        use chrono::{Datelike, Timelike};
        let at = DateTime::<Utc>::from_timestamp_millis(self.0).unwrap_or_default();
        let year = u32::try_from(at.year()).ok().filter(|year| *year <= 9999)?;
        let mut put = |from: usize, digits: usize, mut value: u32| {
            for at in (from..from + digits).rev() {
                buf[at] = b'0' + (value % 10) as u8;
                value /= 10;
            }
        };
        put(0, 4, year);
        put(5, 2, at.month());
        put(8, 2, at.day());
        put(11, 2, at.hour());
        put(14, 2, at.minute());
        put(17, 2, at.second());
        put(20, 3, at.timestamp_subsec_millis());
        for (at, byte) in [
            (4, b'-'),
            (7, b'-'),
            (10, b'T'),
            (13, b':'),
            (16, b':'),
            (19, b'.'),
            (23, b'Z'),
        ] {
            buf[at] = byte;
        }
        std::str::from_utf8(buf).ok()
    }
}

impl fmt::Display for Timestamp {
    /// RFC 3339 UTC with milliseconds and a `Z`. An instant no calendar date
    /// holds is written as the epoch, as the server always has.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0; 24];
        match self.rfc3339_into(&mut buf) {
            Some(text) => f.write_str(text),
            None => {
                let at = DateTime::<Utc>::from_timestamp_millis(self.0).unwrap_or_default();
                f.write_str(&at.to_rfc3339_opts(SecondsFormat::Millis, true))
            }
        }
    }
}

impl FromStr for Timestamp {
    type Err = String;

    /// An RFC 3339 time, any offset, surrounding whitespace ignored, in the
    /// range read.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let at = DateTime::parse_from_rfc3339(text.trim())
            .map_err(|_| format!("{text:?} is not an RFC 3339 time (e.g. \"2026-08-12T08:20:48.562Z\")"))?;
        Self::checked(at.timestamp_millis())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut buf = [0; 24];
        match self.rfc3339_into(&mut buf) {
            Some(text) => serializer.serialize_str(text),
            None => serializer.collect_str(self),
        }
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TimestampVisitor)
    }
}

// In answers a timestamp is always the RFC 3339 string it is written as.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for Timestamp {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime)))
            .description(Some("RFC 3339 UTC with milliseconds and a `Z`"))
            .examples(["2026-08-13T12:00:00.000Z"])
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for Timestamp {}

/// The schema of an optional timestamp in a request, which reads more than
/// answers write: an RFC 3339 string with any offset, integer epoch
/// milliseconds, or `null` (the same as missing).
#[cfg(feature = "openapi")]
pub(crate) fn timestamp_input() -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, OneOfBuilder, SchemaFormat, Type};
    OneOfBuilder::new()
        .item(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime))),
        )
        .item(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                .minimum(Some(Timestamp::EARLIEST_CALL.0))
                .maximum(Some(Timestamp::MAX.0)),
        )
        .item(ObjectBuilder::new().schema_type(Type::Null))
        .description(Some(
            "RFC 3339 with any offset, or integer epoch milliseconds; from 2001-09-09T01:46:40Z \
             (1000000000000: a smaller integer is most likely seconds) to the year 9999, \
             and at most 5 minutes ahead of the server's clock",
        ))
        .into()
}

struct TimestampVisitor;

impl Visitor<'_> for TimestampVisitor {
    type Value = Timestamp;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("epoch milliseconds (an integer) or an RFC 3339 time (a string)")
    }

    fn visit_i64<E: de::Error>(self, millis: i64) -> Result<Timestamp, E> {
        Timestamp::checked(millis).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, millis: u64) -> Result<Timestamp, E> {
        self.visit_i64(i64::try_from(millis).unwrap_or(i64::MAX))
    }

    fn visit_f64<E: de::Error>(self, number: f64) -> Result<Timestamp, E> {
        Err(E::custom(format!(
            "must be whole epoch milliseconds or an RFC 3339 time, got {number}"
        )))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Timestamp, E> {
        text.parse().map_err(E::custom)
    }
}

/// `Option<u32>` fields that a query string carries as text (`limit=20`)
/// and JSON as a number; surrounding whitespace is ignored.
pub(crate) mod whole_number {
    use std::fmt;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    /// Writes the number, or nothing (with `skip_serializing_if`).
    pub(crate) fn serialize<S: Serializer>(value: &Option<u32>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(number) => serializer.serialize_u32(*number),
            None => serializer.serialize_none(),
        }
    }

    /// Reads a number, or a string of one.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u32>, D::Error> {
        deserializer.deserialize_any(WholeNumber)
    }

    struct WholeNumber;

    impl WholeNumber {
        fn refuse<E: de::Error>(got: impl fmt::Display) -> E {
            E::custom(format!("must be a whole number, got {got}"))
        }
    }

    impl Visitor<'_> for WholeNumber {
        type Value = Option<u32>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a whole number")
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_u64<E: de::Error>(self, number: u64) -> Result<Self::Value, E> {
            u32::try_from(number).map(Some).map_err(|_| Self::refuse(number))
        }

        fn visit_i64<E: de::Error>(self, number: i64) -> Result<Self::Value, E> {
            u32::try_from(number).map(Some).map_err(|_| Self::refuse(number))
        }

        fn visit_f64<E: de::Error>(self, number: f64) -> Result<Self::Value, E> {
            Err(Self::refuse(number))
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
            text.trim()
                .parse::<u32>()
                .map(Some)
                .map_err(|_| Self::refuse(format_args!("{text:?}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_write_rfc3339_utc_with_milliseconds() {
        assert_eq!(
            Timestamp::from_millis(1_786_622_400_000).to_string(),
            "2026-08-13T12:00:00.000Z"
        );
        assert_eq!(Timestamp::MIN.to_string(), "1970-01-01T00:00:00.000Z");
        assert_eq!(Timestamp::MAX.to_string(), "9999-12-31T23:59:59.999Z");
        // No calendar date holds it: written as the epoch, as always.
        assert_eq!(
            Timestamp::from_millis(i64::MAX).to_string(),
            "1970-01-01T00:00:00.000Z"
        );
    }

    #[test]
    fn the_writer_without_allocation_writes_what_chrono_writes() {
        let chrono_writes = |millis: i64| {
            DateTime::<Utc>::from_timestamp_millis(millis)
                .unwrap_or_default()
                .to_rfc3339_opts(SecondsFormat::Millis, true)
        };
        let mut millis = -62_167_219_200_000; // 0000-01-01
        while millis < Timestamp::MAX.0 + 10_000_000_000_000 {
            let at = Timestamp::from_millis(millis);
            assert_eq!(at.to_string(), chrono_writes(millis), "{millis}");
            assert_eq!(
                serde_json::to_string(&at).unwrap(),
                format!("\"{}\"", chrono_writes(millis)),
                "{millis}"
            );
            millis += 7_919_993_123; // about 92 days and an odd remainder
        }
        // Years past 9999 and before 0 are chrono's to write.
        for millis in [-62_167_219_200_001, 253_402_300_800_000] {
            assert_eq!(Timestamp::from_millis(millis).to_string(), chrono_writes(millis));
        }
    }

    #[test]
    fn timestamps_read_any_offset_within_1970_to_9999() {
        let at: Timestamp = "2026-08-13T14:00:00+02:00".parse().unwrap();
        assert_eq!(at.as_millis(), 1_786_622_400_000);
        assert_eq!(
            " 1970-01-01T00:00:01.5Z "
                .parse::<Timestamp>()
                .unwrap()
                .as_millis(),
            1_500
        );
        for bad in [
            "yesterday",
            "",
            "1969-12-31T23:59:59.999Z",
            "0000-01-01T00:00:00Z",
        ] {
            assert!(bad.parse::<Timestamp>().is_err(), "{bad:?}");
        }
        assert!(Timestamp::checked(-1).is_err());
        assert!(Timestamp::checked(Timestamp::MAX.as_millis() + 1).is_err());
    }

    #[test]
    fn timestamps_convert_to_and_from_system_time() {
        let at = Timestamp::from_millis(1_786_622_400_123);
        let system = SystemTime::from(at);
        assert_eq!(Timestamp::from(system), at);
        assert_eq!(Timestamp::from(system + Duration::from_micros(999)), at);
        let before = Timestamp::from_millis(-1_500);
        assert_eq!(Timestamp::from(before.to_system_time()), before);
        assert_eq!(
            at.add_millis(877).sub_millis(1_000),
            Timestamp::from_millis(1_786_622_400_000)
        );
        assert_eq!(
            Timestamp::from_millis(i64::MAX).add_millis(1).as_millis(),
            i64::MAX
        );
        assert_eq!(at + 877 - 1_000, at.add_millis(-123));
        assert_eq!(at + Duration::from_secs(1) - Duration::from_millis(1), at + 999);
    }

    #[test]
    fn every_enum_writes_its_documented_name() {
        let names = |all: &[State]| all.iter().map(|s| s.as_str()).collect::<Vec<_>>();
        assert_eq!(
            names(State::ALL),
            [
                "waiting",
                "executing",
                "succeeded",
                "failed",
                "cancelled",
                "reaped"
            ]
        );
        assert_eq!(ReapReason::OwnerLost.to_string(), "owner-lost");
    }
}

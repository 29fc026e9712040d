//! The report: a [`Case`] per line, its [`Target`], the human line and the
//! JSON object, and the statistics and formatting helpers the cases share.

use std::time::Duration;

use serde_json::{json, Value};

/// What a case must show: every case has one (issue 28), so that no figure
/// is only reported.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target {
    /// `ratio <= x` (ours is a cost).
    AtMost(f64),
    /// `ratio >= x` (ours is a throughput).
    AtLeast(f64),
    /// `ratio <= ratio` and ours at most `ceiling`, in the case's unit: a
    /// cost that must stay flat (as history grows, under load) and small in
    /// absolute terms too.
    Bounded { ratio: f64, ceiling: f64 },
    /// An absolute aim with no baseline, judged by the case itself (its
    /// note says what the aim is).
    Aim {
        /// Whether this run met it.
        met: bool,
    },
}

impl Target {
    fn label(self) -> String {
        match self {
            Self::AtMost(x) => format!("<= {x}x"),
            Self::AtLeast(x) => format!(">= {x}x"),
            Self::Bounded { ratio, ceiling } => format!("<= {ratio}x, <= {ceiling}"),
            Self::Aim { .. } => "aim".to_owned(),
        }
    }

    fn ok(self, ratio: Option<f64>, ours: f64) -> bool {
        match (self, ratio) {
            (Self::Bounded { ratio: x, ceiling }, Some(r)) => r <= x && ours <= ceiling,
            (Self::Aim { met }, _) => met,
            (Self::AtMost(x), Some(r)) => r <= x,
            (Self::AtLeast(x), Some(r)) => r >= x,
            (_, None) => false,
        }
    }
}

/// One line of the report.
#[derive(Debug)]
pub(crate) struct Case {
    pub(crate) name: String,
    pub(crate) ours: f64,
    pub(crate) baseline: Option<f64>,
    pub(crate) unit: &'static str,
    pub(crate) target: Target,
    /// The ratio when it is not `ours / baseline`: the median of the ratios
    /// of interleaved pairs of samples (every case with a baseline but
    /// `http_lifecycle`, which has none).
    pub(crate) paired_ratio: Option<f64>,
    /// Human detail, also in the JSON as `note`.
    pub(crate) note: String,
    /// Extra machine-readable figures.
    pub(crate) extra: serde_json::Map<String, Value>,
}

impl Case {
    fn ratio(&self) -> Option<f64> {
        match (self.target, self.baseline) {
            (Target::Aim { .. }, _) | (_, None) => None,
            _ if self.paired_ratio.is_some() => self.paired_ratio,
            (_, Some(base)) if base > 0.0 => Some(self.ours / base),
            _ => None,
        }
    }

    fn ok(&self) -> bool {
        self.target.ok(self.ratio(), self.ours)
    }

    pub(crate) fn human(&self) -> String {
        let baseline = self
            .baseline
            .map_or_else(|| "-".to_owned(), |b| format!("{} {}", fig(b), self.unit));
        let ratio = self
            .ratio()
            .map_or_else(|| "-".to_owned(), |r| format!("{r:.2}x"));
        format!(
            "{:<26} ours {:>12} {:<14} baseline {:>20}  ratio {:>7}  target {:<14} {}  ({})",
            self.name,
            fig(self.ours),
            self.unit,
            baseline,
            ratio,
            self.target.label(),
            if self.ok() { "ok" } else { "FAIL" },
            self.note
        )
    }

    pub(crate) fn json(&self) -> Value {
        let mut object = serde_json::Map::new();
        object.insert("name".into(), json!(self.name));
        object.insert("ours".into(), json!(round(self.ours)));
        object.insert("baseline".into(), json!(self.baseline.map(round)));
        object.insert("unit".into(), json!(self.unit));
        object.insert("ratio".into(), json!(self.ratio().map(round)));
        object.insert("target".into(), json!(self.target.label()));
        object.insert("ok".into(), json!(self.ok()));
        object.insert("note".into(), json!(self.note));
        for (key, value) in &self.extra {
            object.insert(key.clone(), value.clone());
        }
        Value::Object(object)
    }
}

/// Interleaved pairs of rates, baseline then ours, so that a slow spell of
/// the shared machine hits both sides of a pair alike.
#[derive(Debug, Default)]
pub(crate) struct Pairs {
    ours: Vec<f64>,
    base: Vec<f64>,
}

impl Pairs {
    pub(crate) fn push(&mut self, base: f64, ours: f64) {
        self.base.push(base);
        self.ours.push(ours);
    }

    /// The case these pairs of `window`s make: ours and the baseline as
    /// medians, the ratio the median of the pairs' ratios, its spread in
    /// the note (after `note`), in `extra` and on standard error.
    pub(crate) fn case(
        &self,
        name: String,
        unit: &'static str,
        target: Target,
        window: Duration,
        note: &str,
        mut extra: serde_json::Map<String, Value>,
    ) -> Case {
        let ratios: Vec<f64> = self.ours.iter().zip(&self.base).map(|(o, b)| o / b).collect();
        let (o_min, ours, o_max) = spread(&self.ours);
        let (b_min, base, b_max) = spread(&self.base);
        let (r_min, ratio, r_max) = spread(&ratios);
        eprintln!(
            "  {name}: ours median {ours:.0}/s (min {o_min:.0}, max {o_max:.0}); baseline median {base:.0}/s \
             (min {b_min:.0}, max {b_max:.0}); per-pair ratio median {ratio:.2}x (min {r_min:.2}, max {r_max:.2})"
        );
        extra.extend([
            ("pairs".to_owned(), json!(ratios.len())),
            ("ratio_min".to_owned(), json!(round(r_min))),
            ("ratio_max".to_owned(), json!(round(r_max))),
            ("ratio_of_medians".to_owned(), json!(round(ours / base))),
        ]);
        Case {
            note: format!(
                "{note}; ratio = median of {} interleaved pairs of {:.1}s windows (min {r_min:.2}x, max \
                 {r_max:.2}x; ratio of medians {:.2}x)",
                ratios.len(),
                window.as_secs_f64(),
                ours / base
            ),
            name,
            ours,
            baseline: Some(base),
            unit,
            target,
            paired_ratio: Some(ratio),
            extra,
        }
    }
}

/// A figure with sensible precision.
fn fig(x: f64) -> String {
    if x >= 1000.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else if x >= 0.1 {
        format!("{x:.3}")
    } else {
        format!("{x:.4}")
    }
}

pub(crate) fn round(x: f64) -> f64 {
    if x.abs() >= 100.0 {
        (x * 10.0).round() / 10.0
    } else {
        (x * 10_000.0).round() / 10_000.0
    }
}

pub(crate) fn median(mut samples: Vec<f64>) -> f64 {
    assert!(!samples.is_empty(), "no samples");
    samples.sort_by(f64::total_cmp);
    let mid = samples.len() / 2;
    if samples.len() % 2 == 1 {
        samples[mid]
    } else {
        (samples[mid - 1] + samples[mid]) / 2.0
    }
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Min, median and max of `samples`.
pub(crate) fn spread(samples: &[f64]) -> (f64, f64, f64) {
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let max = samples.iter().copied().fold(0.0, f64::max);
    (min, median(samples.to_vec()), max)
}

pub(crate) fn human_count(n: usize) -> String {
    if n >= 1_000_000 && n % 1_000_000 == 0 {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000 && n % 1_000 == 0 {
        format!("{}k", n / 1_000)
    } else {
        n.to_string()
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_read_both_ways() {
        assert!(Target::AtMost(3.0).ok(Some(2.9), 0.0));
        assert!(!Target::AtMost(3.0).ok(Some(3.1), 0.0));
        assert!(Target::AtLeast(3.0).ok(Some(3.1), 0.0));
        assert!(!Target::AtLeast(3.0).ok(None, 0.0));
        assert!(Target::Aim { met: true }.ok(None, 0.0));
        assert!(!Target::Aim { met: false }.ok(Some(9.0), 0.0));
        let flat = Target::Bounded {
            ratio: 1.5,
            ceiling: 2.0,
        };
        assert!(flat.ok(Some(1.4), 1.9));
        assert!(!flat.ok(Some(1.6), 1.9), "too steep");
        assert!(!flat.ok(Some(1.4), 2.1), "flat but slow");
        assert!(!flat.ok(None, 1.0));
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.0);
    }

    #[test]
    fn a_paired_ratio_replaces_the_ratio_of_medians() {
        let case = |paired_ratio| Case {
            name: "c".into(),
            ours: 3.0,
            baseline: Some(2.0),
            unit: "us",
            target: Target::AtMost(1.2),
            paired_ratio,
            note: String::new(),
            extra: serde_json::Map::new(),
        };
        assert_eq!(case(None).ratio(), Some(1.5));
        assert!(!case(None).ok());
        assert_eq!(case(Some(1.1)).ratio(), Some(1.1));
        assert!(case(Some(1.1)).ok());
    }
}

//! Runtime values: longs, strings and statistics aggregates.

use std::cmp::Ordering;
use std::fmt;

use super::ast::HistKind;

/// A scalar value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Value {
    /// 64-bit signed integer.
    Long(i64),
    /// String (at most MAXSTRINGLEN-1 bytes).
    Str(String),
}

impl Value {
    /// The long, or 0 for a string (the checker keeps them apart).
    pub fn as_long(&self) -> i64 {
        match self {
            Value::Long(n) => *n,
            Value::Str(_) => 0,
        }
    }

    /// The string, or "" for a long.
    pub fn as_str(&self) -> &str {
        match self {
            Value::Str(s) => s,
            Value::Long(_) => "",
        }
    }

    /// Compares two values of the same type (longs numerically, strings bytewise).
    pub fn compare(&self, other: &Value) -> Ordering {
        self.cmp(other)
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Long(n) => write!(f, "{n}"),
            Value::Str(s) => f.write_str(s),
        }
    }
}

/// Cuts `s` to fewer than `max_len` bytes at a character boundary, as SystemTap's
/// fixed-size string buffers do.
pub fn truncate(mut s: String, max_len: usize) -> String {
    let limit = max_len.saturating_sub(1);
    if s.len() > limit {
        let mut cut = limit;
        while cut > 0 && !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

/// Number of buckets of a log histogram.
pub const LOG_BUCKETS: usize = 128;
/// Bucket of the value 0 in a log histogram.
pub const LOG_BUCKET0: usize = 64;
/// Most buckets a linear histogram may have (under- and overflow included).
pub const MAX_LINEAR_BUCKETS: i64 = 128;

/// The log-histogram bucket of `v`: 64 for 0, 64+k+1 for 2^k <= v < 2^(k+1), mirrored for
/// negative values.
pub fn log_bucket(v: i64) -> usize {
    if v == 0 {
        return LOG_BUCKET0;
    }
    let bits = 64 - v.unsigned_abs().leading_zeros() as usize;
    let b = if v > 0 {
        LOG_BUCKET0 + bits
    } else {
        LOG_BUCKET0 - bits
    };
    b.min(LOG_BUCKETS - 1)
}

/// The smallest-magnitude value of log bucket `b`.
pub fn log_bucket_value(b: usize) -> i64 {
    match b.cmp(&LOG_BUCKET0) {
        Ordering::Equal => 0,
        Ordering::Less => i64::MIN >> b.min(63),
        Ordering::Greater => 1i64 << (b - LOG_BUCKET0 - 1).min(62),
    }
}

/// Number of buckets of a linear histogram, under- and overflow included.
pub fn linear_buckets(start: i64, stop: i64, interval: i64) -> Option<usize> {
    if interval <= 0 || stop <= start {
        return None;
    }
    let n = (stop.checked_sub(start)? / interval).checked_add(3)?;
    if n > MAX_LINEAR_BUCKETS {
        return None;
    }
    usize::try_from(n).ok()
}

/// A statistics aggregate fed with `<<<`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Number of values.
    pub count: i64,
    /// Sum (wrapping).
    pub sum: i64,
    /// Smallest value.
    pub min: i64,
    /// Largest value.
    pub max: i64,
    /// Log histogram buckets, empty unless the script prints `@hist_log` of it.
    pub log: Vec<u64>,
    /// Linear histogram and its layout, when the script prints `@hist_linear` of it.
    pub linear: Option<(HistKind, Vec<u64>)>,
    /// Bits of fixed-point precision of the variance (`@variance(s, shift)`).
    pub variance_shift: u32,
    /// Running average, shifted left by `variance_shift` (Welford's algorithm).
    pub avg_s: i64,
    /// Running sum of squared differences from the average, shifted twice.
    pub m2: i64,
}

/// Which histograms an aggregate keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HistLayout {
    /// Keep a log histogram.
    pub log: bool,
    /// Keep this linear histogram.
    pub linear: Option<HistKind>,
    /// `@variance(s, shift)` is used, with this bit shift.
    pub variance_shift: Option<u32>,
}

impl Stats {
    /// An empty aggregate keeping the histograms of `layout`.
    pub fn new(layout: HistLayout) -> Stats {
        let log = if layout.log {
            vec![0; LOG_BUCKETS]
        } else {
            Vec::new()
        };
        let linear = layout.linear.and_then(|k| match k {
            HistKind::Linear {
                start,
                stop,
                interval,
            } => linear_buckets(start, stop, interval).map(|n| (k, vec![0; n])),
            HistKind::Log => None,
        });
        Stats {
            log,
            linear,
            variance_shift: layout.variance_shift.unwrap_or(0),
            ..Stats::default()
        }
    }

    /// Adds one value.
    pub fn add(&mut self, v: i64) {
        let scaled = v.wrapping_shl(self.variance_shift);
        if self.count == 0 {
            self.min = v;
            self.max = v;
            self.avg_s = scaled;
            self.m2 = 0;
        } else {
            self.min = self.min.min(v);
            self.max = self.max.max(v);
        }
        self.count = self.count.wrapping_add(1);
        self.sum = self.sum.wrapping_add(v);
        if self.count > 1 {
            // SystemTap's integer Welford step, wrapping where its C arithmetic would.
            let delta = scaled.wrapping_sub(self.avg_s);
            self.avg_s = self.avg_s.wrapping_add(delta.wrapping_div(self.count));
            self.m2 = self
                .m2
                .wrapping_add(delta.wrapping_mul(scaled.wrapping_sub(self.avg_s)));
        }
        if let Some(slot) = self.log.get_mut(log_bucket(v)) {
            *slot += 1;
        }
        if let Some((
            HistKind::Linear {
                start, interval, ..
            },
            buckets,
        )) = &mut self.linear
        {
            let n = buckets.len();
            let off = v.wrapping_sub(*start);
            let idx = if v < *start {
                0
            } else {
                (off as u64 / *interval as u64) as usize + 1
            };
            let idx = idx.min(n - 1);
            buckets[idx] += 1;
        }
    }

    /// The integer variance as SystemTap's `@variance` gives it (0 for one value), or None
    /// when empty: the running sums corrected to the exact average of all values, divided by
    /// count - 1, then scaled back by the bit shift.
    pub fn variance(&self) -> Option<i64> {
        if self.count == 0 {
            return None;
        }
        if self.count < 2 {
            return Some(0);
        }
        let shift = self.variance_shift;
        let avg = self.sum.wrapping_shl(shift).wrapping_div(self.count);
        let d = self.avg_s.wrapping_sub(avg);
        let m2 = self
            .m2
            .wrapping_add(self.count.wrapping_mul(d.wrapping_mul(d)));
        Some(m2.wrapping_div(self.count - 1) >> (2 * shift).min(63))
    }

    /// The integer average, or None when empty.
    pub fn avg(&self) -> Option<i64> {
        if self.count == 0 {
            None
        } else {
            Some(self.sum.wrapping_div(self.count))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats_of(values: impl IntoIterator<Item = i64>, shift: u32) -> Stats {
        let mut s = Stats::new(HistLayout {
            variance_shift: Some(shift),
            ..HistLayout::default()
        });
        values.into_iter().for_each(|v| s.add(v));
        s
    }

    #[test]
    fn variance_matches_systemtaps_manual_example() {
        assert_eq!(stats_of(1..=5, 0).variance(), Some(12));
        assert_eq!(stats_of(1..=5, 1).variance(), Some(2));
    }

    #[test]
    fn variance_of_one_value_is_zero_and_of_none_is_absent() {
        assert_eq!(stats_of([7], 0).variance(), Some(0));
        assert_eq!(stats_of([], 0).variance(), None);
    }

    #[test]
    fn log_bucket_of_one_is_sixty_five() {
        assert_eq!(log_bucket(1), 65);
        assert_eq!(log_bucket(3), 66);
        assert_eq!(log_bucket(-3), 62);
    }

    #[test]
    fn log_bucket_value_inverts_log_bucket_for_powers_of_two() {
        assert_eq!(log_bucket_value(log_bucket(1024)), 1024);
        assert_eq!(log_bucket_value(log_bucket(-2)), -2);
        assert_eq!(log_bucket_value(LOG_BUCKET0), 0);
    }

    #[test]
    fn minimum_long_has_a_bucket() {
        assert_eq!(log_bucket(i64::MIN), 0);
        assert_eq!(log_bucket_value(0), i64::MIN);
    }

    #[test]
    fn linear_buckets_include_under_and_overflow() {
        assert_eq!(linear_buckets(0, 100, 10), Some(13));
        assert_eq!(linear_buckets(0, 100, 0), None);
    }

    #[test]
    fn stats_track_min_max_sum() {
        let mut s = Stats::new(HistLayout::default());
        for v in [5, -2, 9] {
            s.add(v);
        }
        assert_eq!(
            (s.count, s.sum, s.min, s.max, s.avg()),
            (3, 12, -2, 9, Some(4))
        );
    }

    #[test]
    fn linear_overflow_lands_in_last_bucket() {
        let layout = HistLayout {
            log: false,
            linear: Some(HistKind::Linear {
                start: 0,
                stop: 10,
                interval: 5,
            }),
            variance_shift: None,
        };
        let mut s = Stats::new(layout);
        s.add(1000);
        s.add(-1);
        let (_, b) = s.linear.unwrap();
        assert_eq!(b, vec![1, 0, 0, 0, 1]);
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("aé".to_string(), 3), "a");
    }
}

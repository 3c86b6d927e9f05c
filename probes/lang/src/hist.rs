//! Histograms in SystemTap's ASCII layout (`value |@@@@ count`, two zero rows of margin,
//! runs of empty rows elided with `~`) and as JSON buckets.

use super::ast::HistKind;
use super::value::{log_bucket_value, LOG_BUCKET0};

/// Bar width in characters.
const HIST_WIDTH: u64 = 50;
/// Zero rows kept around non-zero ones before eliding.
const HIST_ELISION: usize = 2;

/// A histogram ready to print: its layout and bucket counts.
#[derive(Debug, Clone, Copy)]
pub struct Histogram<'a> {
    /// Log or linear.
    pub kind: HistKind,
    /// Counts per bucket (linear: underflow first, overflow last).
    pub buckets: &'a [u64],
}

fn needed_space(v: i64) -> usize {
    if v == 0 {
        return 1;
    }
    let digits = v.unsigned_abs().to_string().len();
    digits + usize::from(v < 0)
}

impl Histogram<'_> {
    fn bucket_value(&self, i: usize) -> (i64, &'static str) {
        match self.kind {
            HistKind::Log => (log_bucket_value(i), ""),
            HistKind::Linear {
                start, interval, ..
            } => {
                let n = self.buckets.len();
                if i == 0 {
                    (start, "<")
                } else if i == n - 1 {
                    (
                        start.wrapping_add((i as i64 - 2).wrapping_mul(interval)),
                        ">",
                    )
                } else {
                    (
                        start.wrapping_add((i as i64 - 1).wrapping_mul(interval)),
                        "",
                    )
                }
            }
        }
    }

    /// Renders the histogram as SystemTap's runtime does (stat-common.c), final blank line
    /// included. An all-zero histogram renders as an empty string.
    pub fn render(&self) -> String {
        let b = self.buckets;
        let n = b.len();
        let Some(first) = b.iter().position(|&c| c > 0) else {
            return String::new();
        };
        let mut low = first;
        let mut high = b.iter().rposition(|&c| c > 0).unwrap_or(first);
        let valmax = b.iter().copied().max().unwrap_or(0);
        let linear = matches!(self.kind, HistKind::Linear { .. });
        for _ in 0..2 {
            if linear {
                low = low.saturating_sub(1);
            } else if low != LOG_BUCKET0 && low > 0 {
                low -= 1;
            }
            if high < n - 1 {
                high += 1;
            }
        }
        let (mut under, mut over) = (0, 0);
        if linear {
            if low == 0 && b[0] == 0 {
                low += 1;
            }
            if high == n - 1 && b[high] == 0 {
                high -= 1;
            }
            under = usize::from(low == 0);
            over = usize::from(high == n - 1);
        }
        let scale = if valmax <= HIST_WIDTH {
            1
        } else {
            valmax.div_ceil(HIST_WIDTH)
        };
        let cnt_space = needed_space(valmax.min(i64::MAX as u64) as i64);
        let val_space = match self.kind {
            HistKind::Linear {
                start, interval, ..
            } => (needed_space(start) + under)
                .max(needed_space(start.wrapping_add(interval.wrapping_mul(high as i64))) + over),
            HistKind::Log => {
                needed_space(log_bucket_value(high)).max(needed_space(log_bucket_value(low)))
            }
        }
        .max(5);
        let mut out = format!(
            "{:>val_space$} |{} count\n",
            "value",
            "-".repeat(HIST_WIDTH as usize)
        );
        let mut eliding = false;
        for i in low..=high {
            let lo = low.max(i.saturating_sub(HIST_ELISION));
            let hi = high.min(i + HIST_ELISION);
            if b[lo..=hi].iter().all(|&c| c == 0) {
                eliding = true;
                continue;
            }
            if eliding {
                out.push_str(&format!("{:>val_space$} ~\n", ""));
                eliding = false;
            }
            let (val, prefix) = self.bucket_value(i);
            let pad = val_space.saturating_sub(needed_space(val));
            out.push_str(&format!("{prefix:>pad$}{val} |"));
            let bar = b[i] / scale;
            out.push_str(&"@".repeat(bar as usize));
            let w = (HIST_WIDTH - bar) as usize + 1 + cnt_space;
            out.push_str(&format!("{:>w$}\n", b[i]));
        }
        out.push('\n');
        out
    }

    /// Non-empty buckets as JSON objects `{"min":..,"max":..,"count":..}` (bpftrace's layout;
    /// the open ends of linear under- and overflow buckets have no `min` or `max`).
    pub fn json_buckets(&self) -> Vec<serde_json::Value> {
        let n = self.buckets.len();
        let mut out = Vec::new();
        for (i, &count) in self.buckets.iter().enumerate() {
            if count == 0 {
                continue;
            }
            let mut obj = serde_json::Map::new();
            match self.kind {
                HistKind::Log => {
                    let v = log_bucket_value(i);
                    let (min, max) = match i.cmp(&LOG_BUCKET0) {
                        std::cmp::Ordering::Equal => (0, 0),
                        std::cmp::Ordering::Greater => (v, v.wrapping_mul(2).wrapping_sub(1)),
                        std::cmp::Ordering::Less => (v.wrapping_mul(2).wrapping_add(1), v),
                    };
                    obj.insert("min".into(), min.into());
                    obj.insert("max".into(), max.into());
                }
                HistKind::Linear {
                    start, interval, ..
                } => {
                    if i == 0 {
                        obj.insert("max".into(), start.wrapping_sub(1).into());
                    } else if i == n - 1 {
                        let min = start.wrapping_add((i as i64 - 1).wrapping_mul(interval));
                        obj.insert("min".into(), min.into());
                    } else {
                        let min = start.wrapping_add((i as i64 - 1).wrapping_mul(interval));
                        obj.insert("min".into(), min.into());
                        obj.insert("max".into(), min.wrapping_add(interval - 1).into());
                    }
                }
            }
            obj.insert("count".into(), count.into());
            out.push(serde_json::Value::Object(obj));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::{log_bucket, LOG_BUCKETS};

    fn log_hist(values: &[i64]) -> Vec<u64> {
        let mut b = vec![0; LOG_BUCKETS];
        for &v in values {
            b[log_bucket(v)] += 1;
        }
        b
    }

    #[test]
    fn log_histogram_has_two_zero_rows_of_margin() {
        let b = log_hist(&[8, 8, 16]);
        let text = Histogram {
            kind: HistKind::Log,
            buckets: &b,
        }
        .render();
        let expected = "\
value |-------------------------------------------------- count
    2 |                                                   0
    4 |                                                   0
    8 |@@                                                 2
   16 |@                                                  1
   32 |                                                   0
   64 |                                                   0

";
        assert_eq!(text, expected);
    }

    #[test]
    fn log_histogram_elides_long_zero_runs() {
        let b = log_hist(&[1, 1024]);
        let text = Histogram {
            kind: HistKind::Log,
            buckets: &b,
        }
        .render();
        assert!(text.contains(
            "    4 |                                                   0\n      ~\n  256 |"
        ));
    }

    #[test]
    fn linear_histogram_marks_underflow() {
        let mut b = vec![0; 13];
        b[0] = 3;
        b[1] = 1;
        let kind = HistKind::Linear {
            start: 0,
            stop: 100,
            interval: 10,
        };
        let text = Histogram { kind, buckets: &b }.render();
        assert!(text.starts_with("value |"));
        assert!(text.contains("   <0 |@@@"));
    }

    #[test]
    fn large_counts_are_scaled_to_fifty_columns() {
        let mut b = vec![0; LOG_BUCKETS];
        b[65] = 100;
        let text = Histogram {
            kind: HistKind::Log,
            buckets: &b,
        }
        .render();
        assert!(text.contains(&format!("    1 |{} 100\n", "@".repeat(50))));
    }

    #[test]
    fn empty_histogram_renders_nothing() {
        let b = vec![0; LOG_BUCKETS];
        assert_eq!(
            Histogram {
                kind: HistKind::Log,
                buckets: &b
            }
            .render(),
            ""
        );
    }
}

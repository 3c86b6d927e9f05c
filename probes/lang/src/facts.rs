//! What a script may ask about the kernel it will run against before it runs: the facts the
//! preprocessor's `%( kernel_v >= "5.0" %? ... %)` conditions compare with (SystemTap answers
//! them from the build tree of the target kernel; exotap from the guest image's cache).

use std::cmp::Ordering;
use std::collections::HashMap;

/// The target kernel as the preprocessor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetFacts {
    /// `uname -r` of the guest kernel, e.g. `6.1.0-50-cloud-amd64` (SystemTap's `kernel_vr`).
    pub kernel_release: String,
    /// The architecture as SystemTap names it (`x86_64`, `i386`, `arm64`, ...).
    pub arch: String,
    /// The kernel's build configuration: `CONFIG_X` to its value (`y`, `m`, a number or the
    /// text of a quoted string). Options that are not set are absent.
    pub config: HashMap<String, String>,
    /// Where the facts come from, for messages (`the cached 6.1.0-50-cloud-amd64 image`).
    pub origin: String,
}

/// The kernel exotap boots by default (Debian bookworm's cloud kernel).
pub const DEFAULT_KERNEL_RELEASE: &str = "6.1.0-50-cloud-amd64";

impl Default for TargetFacts {
    /// exotap's default guest kernel without its configuration: every `CONFIG_X` is unset.
    fn default() -> Self {
        TargetFacts {
            kernel_release: DEFAULT_KERNEL_RELEASE.to_string(),
            arch: "x86_64".to_string(),
            config: HashMap::new(),
            origin: "exotap's default kernel (no configuration known)".to_string(),
        }
    }
}

impl TargetFacts {
    /// Facts of kernel `release` built with the `.config` text `config`.
    pub fn from_config(release: &str, arch: &str, config: &str, origin: &str) -> Self {
        TargetFacts {
            kernel_release: release.to_string(),
            arch: arch.to_string(),
            config: parse_config(config),
            origin: origin.to_string(),
        }
    }

    /// SystemTap's `kernel_v`: the release up to its first `-` (`6.1.0` for
    /// `6.1.0-50-cloud-amd64`). Like SystemTap, exotap takes it from `uname -r`, so Debian's
    /// 6.1.0-50 kernel, whose sources are 6.1.176, answers `6.1.0`.
    pub fn kernel_version(&self) -> &str {
        self.kernel_release
            .split_once('-')
            .map_or(self.kernel_release.as_str(), |(v, _)| v)
    }
}

/// Parses a kernel `.config`: `CONFIG_X=y` lines; `# CONFIG_X is not set` leaves X absent;
/// quoted values lose their quotes.
pub fn parse_config(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|line| {
            let (name, value) = line.trim().split_once('=')?;
            if !name.starts_with("CONFIG_") {
                return None;
            }
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            Some((name.to_string(), value.to_string()))
        })
        .collect()
}

/// Compares two version strings as SystemTap does for `kernel_v` and `systemtap_v` (glibc's
/// `strverscmp`, without its leading-zero rule): runs of digits compare as numbers
/// (`2.6.30 < 2.6.100`), everything else byte by byte; a string that is a prefix of the other
/// is smaller (`2.6 < 2.6.0`).
pub fn compare_versions(a: &str, b: &str) -> Ordering {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    loop {
        match (a.get(i), b.get(j)) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let run = |s: &[u8], mut k: usize| {
                    let start = k;
                    while s.get(k).is_some_and(u8::is_ascii_digit) {
                        k += 1;
                    }
                    (start, k)
                };
                let ((s1, e1), (s2, e2)) = (run(a, i), run(b, j));
                let trim = |s: &[u8]| -> Vec<u8> {
                    let t: Vec<u8> = s.iter().copied().skip_while(|&c| c == b'0').collect();
                    t
                };
                let (n1, n2) = (trim(&a[s1..e1]), trim(&b[s2..e2]));
                let order = n1.len().cmp(&n2.len()).then_with(|| n1.cmp(&n2));
                if order != Ordering::Equal {
                    return order;
                }
                (i, j) = (e1, e2);
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                i += 1;
                j += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_version_is_the_release_before_the_abi_suffix() {
        let facts = TargetFacts::default();
        assert_eq!(facts.kernel_version(), "6.1.0");
    }

    #[test]
    fn config_keeps_set_options_and_unquotes_strings() {
        let text =
            "CONFIG_64BIT=y\n# CONFIG_FOO is not set\nCONFIG_HZ=250\nCONFIG_LOCALVERSION=\"x\"\n";
        let config = parse_config(text);
        assert_eq!(
            (
                config.get("CONFIG_64BIT").map(String::as_str),
                config.get("CONFIG_FOO"),
                config.get("CONFIG_HZ").map(String::as_str),
                config.get("CONFIG_LOCALVERSION").map(String::as_str)
            ),
            (Some("y"), None, Some("250"), Some("x"))
        );
    }

    #[test]
    fn versions_compare_numerically_piece_by_piece() {
        assert_eq!(compare_versions("2.6.30", "2.6.100"), Ordering::Less);
        assert_eq!(compare_versions("6.1.0", "2.6.30"), Ordering::Greater);
        assert_eq!(compare_versions("4.8", "4.8"), Ordering::Equal);
    }

    #[test]
    fn a_longer_version_with_the_same_prefix_is_greater() {
        assert_eq!(compare_versions("2.6", "2.6.0"), Ordering::Less);
    }
}

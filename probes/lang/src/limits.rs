//! Hard limits that keep hostile or buggy scripts from hurting the host or the guest.
//! Names and defaults follow SystemTap's `-D` settings.

/// Resource limits for parsing, checking and running a script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// MAXACTION: statements executed per probe hit.
    pub max_action: u64,
    /// MAXACTION_INTERRUPTIBLE: statements per run of a probe that SystemTap runs in process
    /// context (begin, end, error, procfs; exotap also runs its timers and input probes on
    /// the host); `None`: ten times MAXACTION, as SystemTap's default.
    pub max_action_interruptible: Option<u64>,
    /// MAXMAPENTRIES: entries per global array unless its declaration says otherwise.
    pub max_map_entries: usize,
    /// MAXSTRINGLEN: bytes per string value, terminator included (strings are cut to one less).
    pub max_string_len: usize,
    /// MAXNESTING: depth of function calls.
    pub max_nesting: usize,
    /// Parser: nesting depth of expressions and of statements.
    pub max_parse_depth: usize,
    /// Parser: size of the script in bytes.
    pub max_source_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_action: 1000,
            max_action_interruptible: None,
            max_map_entries: 2048,
            max_string_len: 512,
            max_nesting: 10,
            max_parse_depth: 100,
            max_source_len: 4 << 20,
        }
    }
}

/// A `-D NAME=VALUE` setting that could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// Not of the form NAME=VALUE.
    #[error("expected NAME=VALUE, got '{0}'")]
    Malformed(String),
    /// NAME is not a known limit.
    #[error(
        "unknown limit '{0}' (known: MAXACTION, MAXACTION_INTERRUPTIBLE, MAXMAPENTRIES, \
         MAXSTRINGLEN, MAXNESTING)"
    )]
    Unknown(String),
    /// VALUE is above what the host can safely give.
    #[error("{name} is at most {max}")]
    TooLarge {
        /// The limit.
        name: String,
        /// Its ceiling.
        max: u64,
    },
    /// VALUE is not a positive integer.
    #[error("value of {name} must be a positive integer, got '{value}'")]
    BadValue {
        /// The limit.
        name: String,
        /// What was given.
        value: String,
    },
}

impl Limits {
    /// Statements per run of a probe that runs in process context on the host (begin, end,
    /// error, timers, procfs, input): MAXACTION_INTERRUPTIBLE.
    pub fn max_action_interruptible(&self) -> u64 {
        self.max_action_interruptible
            .unwrap_or_else(|| self.max_action.saturating_mul(10))
    }

    /// Applies one `NAME=VALUE` setting such as `MAXACTION=10000`.
    ///
    /// # Errors
    /// When the setting is malformed, unknown or not a positive integer.
    pub fn set(&mut self, setting: &str) -> Result<(), LimitError> {
        let (name, value) = setting
            .split_once('=')
            .ok_or_else(|| LimitError::Malformed(setting.to_string()))?;
        let bad = || LimitError::BadValue {
            name: name.to_string(),
            value: value.to_string(),
        };
        let n: u64 = value.trim().parse().map_err(|_| bad())?;
        if n == 0 {
            return Err(bad());
        }
        // Ceilings keep the evaluator's recursion inside the host stack and its memory sane.
        let max = match name.trim() {
            "MAXNESTING" => 200,
            "MAXSTRINGLEN" => 1 << 20,
            "MAXMAPENTRIES" => 1 << 24,
            _ => u64::MAX,
        };
        if n > max {
            return Err(LimitError::TooLarge {
                name: name.trim().to_string(),
                max,
            });
        }
        let as_usize = usize::try_from(n).map_err(|_| bad())?;
        match name.trim() {
            "MAXACTION" => self.max_action = n,
            "MAXACTION_INTERRUPTIBLE" => self.max_action_interruptible = Some(n),
            "MAXMAPENTRIES" => self.max_map_entries = as_usize,
            "MAXSTRINGLEN" => self.max_string_len = as_usize.max(2),
            "MAXNESTING" => self.max_nesting = as_usize,
            other => return Err(LimitError::Unknown(other.to_string())),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_changes_the_named_limit() {
        let mut limits = Limits::default();
        limits.set("MAXACTION=5").unwrap();
        assert_eq!(limits.max_action, 5);
    }

    #[test]
    fn set_refuses_zero() {
        let mut limits = Limits::default();
        assert!(matches!(
            limits.set("MAXNESTING=0"),
            Err(LimitError::BadValue { .. })
        ));
    }

    #[test]
    fn set_refuses_nesting_deeper_than_the_host_stack_allows() {
        let mut limits = Limits::default();
        assert!(matches!(
            limits.set("MAXNESTING=100000"),
            Err(LimitError::TooLarge { .. })
        ));
    }

    #[test]
    fn set_refuses_unknown_names() {
        let mut limits = Limits::default();
        assert!(matches!(
            limits.set("MAXFOO=1"),
            Err(LimitError::Unknown(_))
        ));
    }
}

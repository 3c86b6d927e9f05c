//! The guest protocol on the serial console.
//!
//! The guest's init (guest-images/src/init.rs) and the workloads print markers so the host can
//! tell boot, phases and results apart from kernel log noise:
//!
//! | marker | meaning |
//! |---|---|
//! | `EXOTAP-READY` | init has mounted proc/sys/dev/tracefs and is about to run the job |
//! | `EXOTAP-PHASE <name>` | the job enters a phase |
//! | `EXOTAP-WAIT <name>` | the guest blocks until the host writes one byte to its second serial port |
//! | `EXOTAP-GO <name>` | the guest got the host's go and continues |
//! | `EXOTAP-RESULT <key>=<value>` | a result (workloads print their own) |
//! | `EXOTAP-DONE <rc>` | the job finished with exit code `rc`; the guest powers off next |
//!
//! A kernel message can be printed on the same line before a marker (printk does not wait for
//! the user's newline), so markers are recognised anywhere in a line; the names are
//! upper-case and the kernel's own command line (`exotap.hold=`) cannot match.

use std::collections::VecDeque;

/// One marker from the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marker {
    /// `EXOTAP-READY`.
    Ready,
    /// `EXOTAP-PHASE <name>`.
    Phase(String),
    /// `EXOTAP-WAIT <name>`.
    Wait(String),
    /// `EXOTAP-GO <name>`.
    Go(String),
    /// `EXOTAP-RESULT <key>=<value>`.
    Result {
        /// The key.
        key: String,
        /// The value, as printed.
        value: String,
    },
    /// `EXOTAP-DONE <rc>`.
    Done(i32),
}

fn word(s: &str) -> Option<String> {
    let w = s.split_whitespace().next()?;
    Some(w.to_owned())
}

/// Finds a marker in one console line.
pub fn parse_marker(line: &str) -> Option<Marker> {
    let at = line.find("EXOTAP-")?;
    let rest = &line[at + "EXOTAP-".len()..];
    let (tag, arg) = rest.split_once(' ').unwrap_or((rest.trim_end(), ""));
    match tag.trim_end() {
        "READY" => Some(Marker::Ready),
        "PHASE" => word(arg).map(Marker::Phase),
        "WAIT" => word(arg).map(Marker::Wait),
        "GO" => word(arg).map(Marker::Go),
        "RESULT" => {
            let (key, value) = arg.trim().split_once('=')?;
            (!key.is_empty() && !key.contains(char::is_whitespace)).then(|| Marker::Result {
                key: key.to_owned(),
                value: value.to_owned(),
            })
        }
        "DONE" => word(arg)?.parse().ok().map(Marker::Done),
        _ => None,
    }
}

/// The last lines of the console, for error messages.
#[derive(Debug, Clone)]
pub struct ConsoleTail {
    lines: VecDeque<String>,
    capacity: usize,
}

impl ConsoleTail {
    /// Keeps the last `capacity` lines.
    pub fn new(capacity: usize) -> Self {
        Self {
            lines: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Remembers a line.
    pub fn push(&mut self, line: &str) {
        if self.capacity == 0 {
            return;
        }
        if self.lines.len() == self.capacity {
            self.lines.pop_front();
        }
        self.lines.push_back(line.to_owned());
    }

    /// The remembered lines, oldest first, each indented for an error message.
    pub fn render(&self) -> String {
        if self.lines.is_empty() {
            return "    (the guest printed nothing)".to_owned();
        }
        self.lines
            .iter()
            .map(|l| format!("    | {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_markers_parse() {
        assert_eq!(parse_marker("EXOTAP-READY"), Some(Marker::Ready));
        assert_eq!(
            parse_marker("EXOTAP-PHASE syscalls"),
            Some(Marker::Phase("syscalls".into()))
        );
        assert_eq!(
            parse_marker("EXOTAP-WAIT mixed"),
            Some(Marker::Wait("mixed".into()))
        );
        assert_eq!(
            parse_marker("EXOTAP-GO mixed\r"),
            Some(Marker::Go("mixed".into()))
        );
        assert_eq!(parse_marker("EXOTAP-DONE 0\r"), Some(Marker::Done(0)));
        assert_eq!(parse_marker("EXOTAP-DONE 127"), Some(Marker::Done(127)));
    }

    #[test]
    fn result_keeps_value_verbatim() {
        assert_eq!(
            parse_marker("EXOTAP-RESULT getpid.ns_per_call=1234"),
            Some(Marker::Result {
                key: "getpid.ns_per_call".into(),
                value: "1234".into()
            })
        );
        assert_eq!(
            parse_marker("EXOTAP-RESULT banner=Linux version 6.1"),
            Some(Marker::Result {
                key: "banner".into(),
                value: "Linux version 6.1".into()
            })
        );
    }

    #[test]
    fn marker_after_kernel_message_on_same_line_is_found() {
        assert_eq!(
            parse_marker("[    3.1] random: crng init done EXOTAP-DONE 3"),
            Some(Marker::Done(3))
        );
    }

    #[test]
    fn noise_and_malformed_markers_are_ignored() {
        assert_eq!(
            parse_marker("Command line: console=ttyS0 exotap.hold=all"),
            None
        );
        assert_eq!(parse_marker("EXOTAP-DONE"), None);
        assert_eq!(parse_marker("EXOTAP-DONE zero"), None);
        assert_eq!(parse_marker("EXOTAP-RESULT novalue"), None);
        assert_eq!(parse_marker("EXOTAP-RESULT =5"), None);
        assert_eq!(parse_marker("EXOTAP-PHASE"), None);
        assert_eq!(parse_marker("EXOTAP-READYX"), None);
    }

    #[test]
    fn tail_keeps_only_the_last_lines() {
        let mut tail = ConsoleTail::new(2);
        for l in ["a", "b", "c"] {
            tail.push(l);
        }

        assert_eq!(tail.render(), "    | b\n    | c");
    }
}

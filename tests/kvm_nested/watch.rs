//! The outer guest's console, watched for signs of life: a heartbeat line every
//! [`HEARTBEAT_S`] seconds, and the outer kernel's lockup reports, which are not one.

use std::cell::Cell;
use std::io::Write;
use std::rc::Rc;
use std::time::{Duration, Instant};

use exotap_vmm::qemu::{PhaseHook, QemuError};

/// Seconds between the outer guest's heartbeat lines.
pub(crate) const HEARTBEAT_S: u64 = 20;
/// A console silent this long (but for lockup reports, [`STUCK_LINES`]) means the outer guest
/// is frozen (its heartbeat stopped): four missed beats. In four clean-clone runs of CI the
/// longest gap between two heartbeats of a live outer guest was 20.07 s; a frozen one (once in
/// those four) cost this long before its retry, 200 s at first.
pub(crate) const SILENT: Duration = Duration::from_secs(4 * HEARTBEAT_S);

/// Kernel lines that say the outer guest is stuck, not alive: its soft-lockup watchdog keeps
/// printing while a vCPU is wedged (seen in a clean-clone run, 2026-11-30: `watchdog: BUG:
/// soft lockup - CPU#1 stuck for 26s! [vmm-control:287]` every 28 s for 25 minutes, the
/// heartbeat gone, exotap's VMM thread stuck in the outer kernel's KVM).
pub(crate) const STUCK_LINES: [&str; 2] = ["soft lockup", "self-detected stall"];

/// The outer console, noting when it last printed a line that shows it alive (any but
/// [`STUCK_LINES`]).
pub(crate) struct Watched {
    pub(crate) transcript: Vec<u8>,
    pub(crate) last: Rc<Cell<Instant>>,
}

impl Write for Watched {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let from = self.transcript.len();
        self.transcript.extend_from_slice(buf);
        // The lines this write completed (the one it started may end in a later write).
        let start = self.transcript[..from]
            .iter()
            .rposition(|b| *b == b'\n')
            .map_or(0, |n| n + 1);
        let done = &self.transcript[start..];
        let done = &done[..done.iter().rposition(|b| *b == b'\n').map_or(0, |n| n + 1)];
        let alive = String::from_utf8_lossy(done)
            .lines()
            .any(|l| !STUCK_LINES.iter().any(|s| l.contains(s)));
        if alive {
            self.last.set(Instant::now());
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Lets the outer guest go at once, and ends the run when its console (heartbeat included)
/// has been silent for [`SILENT`].
pub(crate) struct SilenceWatch(pub(crate) Rc<Cell<Instant>>);

impl PhaseHook for SilenceWatch {
    fn at_wait(&mut self, _phase: &str) -> Result<(), QemuError> {
        Ok(())
    }

    fn tick(&mut self) -> Result<(), QemuError> {
        let quiet = self.0.get().elapsed();
        if quiet > SILENT {
            return Err(QemuError::Hook {
                phase: "(running)".into(),
                message: format!(
                    "{FROZEN}: its console, a heartbeat every {HEARTBEAT_S} s included, printed \
                     nothing but lockup reports for {} s",
                    quiet.as_secs()
                ),
            });
        }
        Ok(())
    }
}

/// How [`SilenceWatch`] names a frozen outer guest.
pub(crate) const FROZEN: &str = "the outer guest froze";

#[test]
fn lockup_reports_do_not_count_as_a_live_outer_console() {
    let long_ago = Instant::now() - Duration::from_secs(500);
    let last = Rc::new(Cell::new(long_ago));
    let mut watched = Watched {
        transcript: Vec::new(),
        last: Rc::clone(&last),
    };
    watched
        .write_all(
            b"[  212.9] watchdog: BUG: soft lockup - CPU#1 stuck for 26s! [vmm-control:287]\n",
        )
        .unwrap();
    // A line begun but not ended says nothing yet.
    watched.write_all(b"heartb").unwrap();
    assert_eq!(last.get(), long_ago);
    watched.write_all(b"eat 12\n").unwrap();
    assert!(last.get() > long_ago);
    assert!(String::from_utf8_lossy(&watched.transcript).ends_with("heartbeat 12\n"));
}

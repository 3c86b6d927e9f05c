//! A backtrace as text, one frame a line, with symbols from whatever the caller has.

use std::fmt::{self, Write as _};

use super::unwind::{Backtrace, FrameKind, StackEnd};

/// Formats `backtrace`, naming pcs with `symbolize` (address → symbol name and offset):
///
/// ```text
/// #0  0xffffffff812f4c40 vfs_read+0x0 sp=0xffffc90000013e58
/// #1  0xffffffff812f59a3 ksys_read+0x73 sp=0xffffc90000013e60
/// #2  ? 0xffffffffc0001234 sp=0xffffc90000013ea0 (interrupt)
/// -- end of stack
/// ```
///
/// A return address is looked up one byte back and printed with the offset plus one (as the
/// kernel's `%pB`), so a call at the very end of a function still names that function.
/// `?` marks frames found by a frame-pointer guess.
pub fn format_backtrace<F, N>(backtrace: &Backtrace, mut symbolize: F) -> String
where
    F: FnMut(u64) -> Option<(N, u64)>,
    N: fmt::Display,
{
    let mut out = String::new();
    for (index, frame) in backtrace.frames.iter().enumerate() {
        let back = u64::from(!frame.signal);
        let name = symbolize(frame.pc.wrapping_sub(back))
            .map(|(name, offset)| format!(" {name}+{:#x}", offset.wrapping_add(back)))
            .unwrap_or_default();
        let guess = if frame.reliable { "" } else { "? " };
        let kind = match frame.kind {
            FrameKind::Interrupt => " (interrupt)",
            FrameKind::Iret => " (iret)",
            FrameKind::Start | FrameKind::Call => "",
        };
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "#{index:<2} {guess}{:#018x}{name} sp={:#x}{kind}",
            frame.pc, frame.sp
        );
    }
    let _ = match &backtrace.end {
        StackEnd::EndOfStack => writeln!(out, "-- end of stack"),
        StackEnd::UserMode { pc, sp } => writeln!(out, "-- user mode: ip={pc:#x} sp={sp:#x}"),
        StackEnd::FrameLimit { max } => writeln!(out, "-- stopped after {max} frames"),
        StackEnd::Error(err) => {
            let mut line = format!("-- stopped: {err}");
            let mut source = std::error::Error::source(err);
            while let Some(cause) = source {
                let _ = write!(line, ": {cause}");
                source = cause.source();
            }
            writeln!(out, "{line}")
        }
    };
    out
}

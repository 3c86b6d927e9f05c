//! `--compile check`'s output side ([`super::compiled::CompileMode::Check`]): copies of what
//! the script's session and its shadow print, and the verdict on the two. The run itself
//! (the shadow session, the hits fired in both, the in-flight hits finished before a read)
//! is in [`super::compiled`].

/// Check mode's copy of what a session prints: a buffer the writer shares with the run.
#[derive(Clone, Default)]
pub(crate) struct Copied(pub(crate) std::rc::Rc<std::cell::RefCell<Vec<u8>>>);

impl std::io::Write for Copied {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A writer that also keeps a copy of what went through it.
pub(crate) struct Tee<W>(pub(crate) W, pub(crate) Copied);

impl<W: std::io::Write> std::io::Write for Tee<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(buf)?;
        self.1.write(&buf[..n])
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// A writer several holders write through, one after another (the run's diagnostics: the
/// session's, then check mode's verdict after the session ended).
pub(crate) struct Shared<W>(pub(crate) std::rc::Rc<std::cell::RefCell<W>>);

impl<W> Clone for Shared<W> {
    fn clone(&self) -> Self {
        Shared(self.0.clone())
    }
}

impl<W: std::io::Write> std::io::Write for Shared<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.borrow_mut().flush()
    }
}

/// Check mode's verdict on the two outputs: `Ok(lines)` when they are the same bytes, else
/// where they part, and whether they are the same lines in another order (records of
/// several vCPUs: the compiled ones in their TSC order, the host's in the order of its stops).
pub(crate) fn check_verdict(compiled: &[u8], host: &[u8]) -> Result<usize, String> {
    let (c, h) = (
        String::from_utf8_lossy(compiled),
        String::from_utf8_lossy(host),
    );
    if compiled == host {
        return Ok(c.lines().count());
    }
    let (cl, hl): (Vec<&str>, Vec<&str>) = (c.lines().collect(), h.lines().collect());
    let at = cl.iter().zip(&hl).take_while(|(a, b)| a == b).count();
    let line = |v: &[&str]| {
        v.get(at)
            .map_or("(the output ends)".to_owned(), |l| format!("{l:?}"))
    };
    // A few lines more of each, to see whether the outputs part for good or meet again.
    let more = |v: &[&str]| -> String {
        v.iter()
            .skip(at + 1)
            .take(CONTEXT)
            .map(|l| format!("\n    {l:?}"))
            .collect()
    };
    let (mut cs, mut hs) = (cl.clone(), hl.clone());
    cs.sort_unstable();
    hs.sort_unstable();
    let order = if cs == hs {
        " (the same lines, in another order)"
    } else {
        ""
    };
    Err(format!(
        "line {} of {} (compiled) / {} (host-evaluated) differs{order}:\n  compiled:        {}\n  \
         host-evaluated:  {}\n  then compiled:{}\n  then host-evaluated:{}",
        at + 1,
        cl.len(),
        hl.len(),
        line(&cl),
        line(&hl),
        more(&cl),
        more(&hl)
    ))
}

/// Lines of each output the verdict shows after the first that differs.
const CONTEXT: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_counts_equal_lines_and_names_the_first_that_differs() {
        assert_eq!(check_verdict(b"a\nb\n", b"a\nb\n"), Ok(2));
        let why = check_verdict(b"a\nb\nc\n", b"a\nx\n").unwrap_err();
        assert!(
            why.starts_with("line 2 of 3 (compiled) / 2 (host-evaluated) differs"),
            "{why}"
        );
        assert!(why.contains("compiled:        \"b\"") && why.contains("host-evaluated:  \"x\""));
        assert!(!why.contains("another order"), "{why}");
        let swapped = check_verdict(b"a\nb\nc\n", b"a\nc\nb\n").unwrap_err();
        assert!(
            swapped.starts_with(
                "line 2 of 3 (compiled) / 3 (host-evaluated) differs (the same lines, in \
                 another order)"
            ),
            "{swapped}"
        );
        let short = check_verdict(b"a\nb\n", b"a\n").unwrap_err();
        assert!(
            short.contains("host-evaluated:  (the output ends)"),
            "{short}"
        );
    }
}

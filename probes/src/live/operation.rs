//! The fixed operations of the verbs (`count`, `time`, `trace`, `nullify`, `replace`,
//! `splice-report`) as the engine takes them: names and patterns resolved to splice
//! [`Request`]s against the image's symbols.

use std::collections::BTreeSet;

use anyhow::{bail, Context};

use super::kernel_image::KernelImage;
use super::splicer::{Action, Request};

/// What to do at the sites.
#[derive(Debug, Clone)]
pub enum Operation {
    /// A call counter at every matching function's entry.
    Count(Vec<String>),
    /// Entry-to-return time of every call of the matching functions, in log2 histograms.
    Time(Vec<String>),
    /// Entry (first argument) and return (value) records of the matching functions.
    Trace(Vec<String>),
    /// Every call of the function returns the value at once.
    Nullify(String, u64),
    /// Every call of the first function runs the second instead.
    Replace(String, String),
    /// Plan a splice at every ftrace site and tally the decisions; no requests of its own.
    Report {
        /// Name every site that is not a splice.
        list: bool,
        /// Also install counting splices at this many splice-able sites.
        install: Option<usize>,
    },
}

/// Resolves names to entry requests; unknown names are errors.
///
/// # Errors
/// A pattern that matches no function, or a name that is not a function.
pub fn requests(op: &Operation, image: &KernelImage, slide: u64) -> anyhow::Result<Vec<Request>> {
    let text = |name: &str| -> anyhow::Result<u64> {
        let sym = image
            .symbols
            .all_named(name)
            .find(|s| s.is_text())
            .with_context(|| {
                if image.symbols.get(name).is_some() {
                    format!("{name} is not a function (not a text symbol)")
                } else {
                    format!("the kernel has no function {name}")
                }
            })?;
        Ok(sym.addr.wrapping_add(slide))
    };
    Ok(match op {
        Operation::Count(patterns) | Operation::Time(patterns) | Operation::Trace(patterns) => {
            let mut out: Vec<Request> = Vec::new();
            let mut seen = BTreeSet::new();
            for p in patterns {
                let found: Vec<_> = image
                    .symbols
                    .matching(p)
                    .into_iter()
                    .filter(|s| s.is_text())
                    .collect();
                if found.is_empty() {
                    bail!("no kernel function matches {p}");
                }
                for s in found {
                    let addr = s.addr.wrapping_add(slide);
                    if seen.insert(addr) {
                        let action = match op {
                            Operation::Time(_) => Action::Time,
                            Operation::Trace(_) => Action::Trace(u32::try_from(out.len())?),
                            _ => Action::Count,
                        };
                        out.push(Request {
                            name: s.name.clone(),
                            addr,
                            action,
                        });
                    }
                }
            }
            out
        }
        Operation::Nullify(f, v) => vec![Request {
            name: f.clone(),
            addr: text(f)?,
            action: Action::Nullify(*v),
        }],
        Operation::Replace(f, o) => vec![Request {
            name: f.clone(),
            addr: text(f)?,
            action: Action::Replace(text(o)?),
        }],
        Operation::Report { .. } => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slide the tests resolve at (any 2 MiB multiple).
    const SLIDE: u64 = 0x1c00_0000;

    /// The cached Debian kernel (its kallsyms) and the linker's own `System.map` from its -dbg
    /// package, the oracle for what the names are and where. `None` only when either is not
    /// cached; one that is there and fails to load or read panics (the test fails, it does
    /// not skip).
    fn image_and_map() -> Option<(KernelImage, String)> {
        let image = crate::live::kernel_image::cached_debian_image()?;
        let path = image.path.with_file_name("debug").join("System.map");
        match std::fs::read_to_string(&path) {
            Ok(map) => Some((image, map)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => panic!("cannot read the cached {}: {e}", path.display()),
        }
    }

    /// The addresses of System.map's text symbols (`T`, `t`) whose names `keep`.
    fn map_text(map: &str, keep: impl Fn(&str) -> bool) -> BTreeSet<u64> {
        map.lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                let addr = u64::from_str_radix(f.next()?, 16).ok()?;
                let kind = f.next()?;
                let name = f.next()?;
                (matches!(kind, "T" | "t") && keep(name)).then_some(addr)
            })
            .collect()
    }

    #[test]
    fn a_pattern_requests_every_text_symbol_the_linker_placed_under_it_once_slid() {
        let Some((image, map)) = image_and_map() else {
            eprintln!(
                "SKIP: the Debian kernel or its System.map is not cached \
                 (exotap image fetch --debuginfo)"
            );
            return;
        };
        let expected: BTreeSet<u64> = map_text(&map, |n| n.starts_with("vfs_r"))
            .into_iter()
            .map(|a| a + SLIDE)
            .collect();

        let got = requests(&Operation::Count(vec!["vfs_r*".into()]), &image, SLIDE).unwrap();

        let addrs: BTreeSet<u64> = got.iter().map(|r| r.addr).collect();
        assert!(expected.len() >= 5, "{expected:x?}");
        assert_eq!(addrs, expected);
        assert_eq!(got.len(), addrs.len(), "an address requested twice");
        assert!(got.iter().all(|r| r.action == Action::Count));
    }

    #[test]
    fn replace_diverts_to_the_other_functions_slid_address() {
        let Some((image, map)) = image_and_map() else {
            eprintln!(
                "SKIP: the Debian kernel or its System.map is not cached \
                 (exotap image fetch --debuginfo)"
            );
            return;
        };
        let read = map_text(&map, |n| n == "vfs_read");
        let write = map_text(&map, |n| n == "vfs_write");

        let got = requests(
            &Operation::Replace("vfs_read".into(), "vfs_write".into()),
            &image,
            SLIDE,
        )
        .unwrap();

        assert_eq!(got.len(), 1);
        assert_eq!(Some(&(got[0].addr - SLIDE)), read.first());
        let Action::Replace(to) = got[0].action else {
            panic!("{:?}", got[0].action)
        };
        assert_eq!(Some(&(to - SLIDE)), write.first());
    }

    #[test]
    fn names_that_are_not_functions_are_refused_with_what_they_are() {
        let Some((image, map)) = image_and_map() else {
            eprintln!(
                "SKIP: the Debian kernel or its System.map is not cached \
                 (exotap image fetch --debuginfo)"
            );
            return;
        };
        // The oracle: jiffies is data, not text.
        assert!(map.lines().any(|l| l.ends_with(" D jiffies")));

        let data = requests(&Operation::Nullify("jiffies".into(), 0), &image, SLIDE);
        let missing = requests(
            &Operation::Nullify("exotap_no_such_function".into(), 0),
            &image,
            SLIDE,
        );
        let no_match = requests(
            &Operation::Time(vec!["exotap_no_such_*".into()]),
            &image,
            SLIDE,
        );

        assert_eq!(
            format!("{:#}", data.unwrap_err()),
            "jiffies is not a function (not a text symbol)"
        );
        assert_eq!(
            format!("{:#}", missing.unwrap_err()),
            "the kernel has no function exotap_no_such_function"
        );
        assert_eq!(
            format!("{:#}", no_match.unwrap_err()),
            "no kernel function matches exotap_no_such_*"
        );
    }
}

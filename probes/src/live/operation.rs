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

//! Where a trap point may go: the kernel's functions and the text that must not be trapped
//! (entry text, freed `__init` code, instructions with an exception-table fixup), from the
//! image; and the plan of one point against the live bytes.

use std::collections::HashSet;

use anyhow::{bail, Context as _};
use exotap_vmm::control::Machine;

use super::super::kernel_image::KernelImage;
use super::super::trap_point::{instruction_at, plan as plan_trap, TrapAction, MAX_INSN};
use super::{read_guest, MAX_FUNCTION};

/// Where kernel functions start and end, and what must not be trapped, from the image.
pub(super) struct TextMap<'a> {
    image: &'a KernelImage,
    /// Start addresses of the code symbols, sorted (link-time).
    starts: Vec<u64>,
    /// The entry text runs on the user page tables, where the patch heap is not mapped.
    entry_text: Option<(u64, u64)>,
    /// `__init` code, freed after boot: its pages hold something else now.
    init_text: Option<(u64, u64)>,
    /// Instructions with an exception-table fixup (link-time): a fault there must happen at
    /// its own address for the kernel to find the fixup.
    fixups: HashSet<u64>,
}

impl<'a> TextMap<'a> {
    pub(super) fn new(image: &'a KernelImage) -> Self {
        let mut starts: Vec<u64> = image
            .symbols
            .iter()
            .filter(|s| s.is_text())
            .map(|s| s.addr)
            .collect();
        starts.dedup();
        let entry_text = image
            .symbols
            .get("__entry_text_start")
            .zip(image.symbols.get("__entry_text_end"))
            .map(|(a, b)| (a.addr, b.addr));
        let init_text = image
            .symbols
            .get("_sinittext")
            .zip(image.symbols.get("_einittext"))
            .map(|(a, b)| (a.addr, b.addr));
        let fixups = exception_table(image).unwrap_or_else(|e| {
            tracing::warn!("no exception table ({e}): faulting instructions are not refused");
            HashSet::new()
        });
        Self {
            image,
            starts,
            entry_text,
            init_text,
            fixups,
        }
    }

    /// The function containing `link`: (name, start, end), link-time.
    pub(super) fn function(&self, link: u64) -> Option<(String, u64, u64)> {
        let (sym, _) = self.image.symbols.lookup_addr(link)?;
        if !sym.is_text() {
            return None;
        }
        let after = self.starts.partition_point(|a| *a <= sym.addr);
        let end = self.starts.get(after).copied()?;
        let end = if sym.size > 0 {
            end.min(sym.addr.wrapping_add(sym.size))
        } else {
            end
        };
        Some((sym.name.clone(), sym.addr, end))
    }

    /// Why the point at `link` is refused before looking at its bytes.
    pub(super) fn refusal(&self, link: u64) -> Option<String> {
        if let Some((start, end)) = self.entry_text {
            if (start..end).contains(&link) {
                return Some(format!(
                    "{link:#x} is in the entry text, which runs on page tables without the \
                     patch heap"
                ));
            }
        }
        if let Some((start, end)) = self.init_text {
            if (start..end).contains(&link) {
                return Some(format!(
                    "{link:#x} is in the kernel's __init code, which it freed after booting: \
                     the function never runs again, and its pages hold something else now"
                ));
            }
        }
        self.fixups.contains(&link).then(|| {
            format!(
                "the instruction at {link:#x} has an exception-table fixup: a fault there must \
                 happen at its own address"
            )
        })
    }
}

/// The instructions `__ex_table` names (x86-64: 12-byte entries of self-relative `insn`,
/// `fixup`, `data`).
fn exception_table(image: &KernelImage) -> anyhow::Result<HashSet<u64>> {
    let section = image
        .vmlinux
        .section("__ex_table")
        .context("the vmlinux has no __ex_table section")?
        .addr;
    let data = image.vmlinux.section_data("__ex_table")?;
    Ok(data
        .chunks_exact(12)
        .enumerate()
        .map(|(i, e)| {
            let rel = i32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            (section + 12 * i as u64).wrapping_add(rel as i64 as u64)
        })
        .collect())
}

/// Checks that `addr` (slid; `link` before the slide) is an instruction boundary of its
/// function, with the live bytes, and plans how a hit gets past it using `slot`. Returns
/// the function's name, the instruction window and the action.
pub(super) fn plan_point(
    machine: &mut dyn Machine,
    text: &TextMap<'_>,
    slide: u64,
    link: u64,
    slot: u64,
) -> anyhow::Result<(String, Vec<u8>, TrapAction)> {
    let Some((function, start, end)) = text.function(link) else {
        bail!("{link:#x} is not inside a kernel function");
    };
    if let Some(why) = text.refusal(link) {
        bail!(why);
    }
    let addr = link.wrapping_add(slide);
    let fstart = start.wrapping_add(slide);
    if link - start >= MAX_FUNCTION {
        bail!("{link:#x} is more than {MAX_FUNCTION:#x} bytes into {function}");
    }
    // Decode up to the point's instruction; bytes past the function's end are never needed.
    let want = (link - start + MAX_INSN as u64).min(end - start);
    let mut code = vec![0u8; usize::try_from(want)?];
    read_guest(machine, fstart, &mut code)
        .with_context(|| format!("cannot read {function} at {fstart:#x}"))?;
    let instr = instruction_at(&function, fstart, &code, addr)?;
    let from = usize::try_from(link - start)?;
    let window = code[from..].to_vec();
    let action = plan_trap(&instr, &window, slot)?;
    Ok((function, window, action))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::live::kernel_image::cached_debian_image as image;

    #[test]
    fn entry_text_init_text_and_exception_table_instructions_are_refused_before_any_byte_is_read() {
        let Some(image) = image() else {
            eprintln!("SKIP: the Debian kernel is not cached (exotap boot fetches it)");
            return;
        };
        let text = TextMap::new(&image);

        let syscall = image.address("entry_SYSCALL_64").unwrap();
        assert!(
            text.refusal(syscall + 0x10)
                .is_some_and(|why| why.contains("entry text")),
            "entry_SYSCALL_64 is not refused"
        );
        // Fixed-up instructions are instruction boundaries (the table parses right), and each
        // is refused.
        assert!(text.fixups.len() > 100, "{} fixups", text.fixups.len());
        let mut fixups: Vec<u64> = text.fixups.iter().copied().collect();
        fixups.sort_unstable();
        for addr in fixups.iter().step_by(37) {
            let (name, start, end) = text.function(*addr).unwrap();
            let code = image
                .vmlinux
                .read_at(start, usize::try_from(end - start).unwrap())
                .unwrap();
            // A real instruction boundary of its function (a misparsed table would not be).
            let at = instruction_at(&name, start, code, *addr);
            assert!(at.is_ok(), "{addr:#x}: {at:?}");
            assert!(text
                .refusal(*addr)
                .is_some_and(|why| why.contains("exception-table fixup")));
        }
        let vfs_read = image.address("vfs_read").unwrap();
        let (name, start, end) = text.function(vfs_read + 0x10).unwrap();
        assert_eq!((name.as_str(), start), ("vfs_read", vfs_read));
        assert!(
            end > start + 0x10 && end - start < 0x1000,
            "{start:#x}..{end:#x}"
        );
        assert_eq!(text.refusal(vfs_read + 0x10), None);
        // __init code (freed after boot): start_kernel is in it.
        let init = image.address("start_kernel").unwrap();
        assert!(
            text.refusal(init)
                .is_some_and(|why| why.contains("__init code")),
            "start_kernel is not refused"
        );
    }
}

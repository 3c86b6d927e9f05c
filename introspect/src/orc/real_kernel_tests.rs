//! The ORC tables of the Debian 6.1 kernel, checked against an oracle that shares nothing
//! with them: the stack effect of each function's first instructions, decoded with iced-x86
//! (`push` adds 8 bytes, `sub $imm, %rsp` adds imm, `push %rbp` saves the frame pointer).

use std::sync::OnceLock;

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess,
    OpKind, Register,
};
use object::{Object, ObjectSection};

use super::testing::debug_vmlinux;
use super::*;
use crate::symbols::SymbolTable;

/// The stack of the synthetic chain.
const STACK: u64 = 0xffff_c900_0040_0000;

struct Kernel {
    map: memmap2::Mmap,
    table: OrcTable,
    symbols: SymbolTable,
    /// `(address, size, file offset)` of the sections with file bytes.
    sections: Vec<(u64, u64, u64)>,
}

/// The `-dbg` vmlinux with its ORC table and symbols, parsed once; `None` after `SKIP`.
fn kernel() -> Option<&'static Kernel> {
    static KERNEL: OnceLock<Option<Kernel>> = OnceLock::new();
    let kernel = KERNEL.get_or_init(|| {
        let map = debug_vmlinux()?;
        let table = OrcTable::from_elf(&map).unwrap();
        let symbols = SymbolTable::from_elf(&map).unwrap();
        let file = object::File::parse(&*map).unwrap();
        let sections = file
            .sections()
            .filter(|s| s.address() != 0)
            .filter_map(|s| {
                s.file_range()
                    .map(|(offset, _)| (s.address(), s.size(), offset))
            })
            .collect();
        Some(Kernel {
            map,
            table,
            symbols,
            sections,
        })
    });
    if kernel.is_none() {
        println!("SKIP: the Debian -dbg vmlinux is not cached");
    }
    kernel.as_ref()
}

impl Kernel {
    fn addr(&self, name: &str) -> u64 {
        self.symbols.get(name).unwrap().addr
    }

    /// Up to `len` bytes of text at `addr`, when a section holds them in the file.
    fn code(&self, addr: u64, len: u64) -> Option<&[u8]> {
        let &(start, size, offset) = self
            .sections
            .iter()
            .find(|(start, size, _)| (*start..start + size).contains(&addr))?;
        let from = usize::try_from(offset + (addr - start)).ok()?;
        let to = usize::try_from(offset + size.min(addr - start + len)).ok()?;
        self.map.get(from..to)
    }
}

/// What the decoder says about one instruction of straight-line code from a function's
/// entry: its address, the caller's stack pointer (CFA) as a base register plus offset
/// before it runs, and where `%rbp` has been saved (CFA-relative) by then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Expected {
    ip: u64,
    cfa: (OrcReg, i64),
    rbp_saved_at: Option<i64>,
}

/// A call site the decoder followed the stack to.
#[derive(Debug, Clone, Copy)]
struct CallSite {
    /// The return address.
    ret: u64,
    /// The CFA rule there.
    cfa: (OrcReg, i64),
    /// Where the caller's `%rbp` is saved, CFA-relative.
    rbp_saved_at: Option<i64>,
}

/// The straight-line code from a function's entry, as far as the decoder can follow the
/// stack: from `call __fentry__` when `fentry` is given (a traceable C function), until the
/// first jump or return, or the first write to `%rsp` other than `push` and `sub $imm`
/// (after `push %rbp; mov %rsp, %rbp` the CFA follows `%rbp`, so then until `%rbp`
/// changes). Also gives the first call site (after `__fentry__`), or the first call to
/// `target`, when the walk gets that far.
fn straight_line(
    code: &[u8],
    addr: u64,
    fentry: Option<u64>,
    target: Option<u64>,
) -> (Vec<Expected>, Option<CallSite>) {
    let mut rows = Vec::new();
    let mut depth = 8i64;
    let mut cfa = (OrcReg::Sp, depth);
    let mut rbp_saved_at = None;
    let mut info = InstructionInfoFactory::new();
    for (index, insn) in Decoder::with_ip(64, code, addr, DecoderOptions::NONE)
        .into_iter()
        .enumerate()
        .take(256)
    {
        let is_call = insn.mnemonic() == Mnemonic::Call;
        let calls_fentry = is_call && Some(insn.near_branch_target()) == fentry;
        if index == 0 && fentry.is_some() && !calls_fentry {
            break;
        }
        rows.push(Expected {
            ip: insn.ip(),
            cfa,
            rbp_saved_at,
        });
        let used = info.info(&insn).used_registers().to_vec();
        let writes = |reg: Register| {
            used.iter().any(|used| {
                used.register() == reg
                    && matches!(
                        used.access(),
                        OpAccess::Write | OpAccess::ReadWrite | OpAccess::CondWrite
                    )
            })
        };
        let (writes_rsp, writes_rbp) = (writes(Register::RSP), writes(Register::RBP));
        let op = |n: u32| (insn.op_kind(n), insn.op_register(n));
        match insn.mnemonic() {
            Mnemonic::Call if index == 0 && calls_fentry => continue,
            Mnemonic::Call if target.is_none() || target == Some(insn.near_branch_target()) => {
                let site = CallSite {
                    ret: insn.next_ip(),
                    cfa,
                    rbp_saved_at,
                };
                return (rows, Some(site));
            }
            Mnemonic::Call => {}
            Mnemonic::Push => {
                depth += 8;
                // The first save of a callee-saved register is where the caller's value is.
                if op(0) == (OpKind::Register, Register::RBP) && rbp_saved_at.is_none() {
                    rbp_saved_at = Some(-depth);
                }
            }
            Mnemonic::Sub
                if op(0) == (OpKind::Register, Register::RSP)
                    && insn.op1_kind() != OpKind::Register =>
            {
                depth += insn.immediate(1) as i64;
            }
            // `push %rbp; mov %rsp, %rbp` sets up a frame pointer, and the CFA follows it;
            // any other copy of rsp into rbp is just a value.
            Mnemonic::Mov
                if (op(0), op(1))
                    == (
                        (OpKind::Register, Register::RBP),
                        (OpKind::Register, Register::RSP),
                    )
                    && rbp_saved_at == Some(-depth)
                    && cfa.0 == OrcReg::Sp =>
            {
                cfa = (OrcReg::Bp, depth);
            }
            _ if cfa.0 == OrcReg::Bp && writes_rbp => break,
            _ if cfa.0 == OrcReg::Sp && writes_rsp => break,
            _ => {}
        }
        if cfa.0 == OrcReg::Sp {
            cfa.1 = depth;
        }
        if !matches!(
            insn.flow_control(),
            FlowControl::Next | FlowControl::ConditionalBranch | FlowControl::Call
        ) {
            break;
        }
    }
    (rows, None)
}

/// How the ORC rules of one function's straight-line code compare with the decoder.
#[derive(Debug, Default)]
struct Comparison {
    /// Instructions compared.
    compared: usize,
    /// Instructions whose entry is undefined: code objtool did not process (files marked
    /// `OBJECT_FILES_NON_STANDARD`, such as the vDSO helpers), which has no rule to check.
    undefined: usize,
    /// Instructions whose rule differs from the decoder's, described.
    mismatches: Vec<String>,
}

/// Compares the ORC rule at each straight-line instruction of `name` (at `addr`) with what
/// the decoder expects.
fn compare_prologue(kernel: &Kernel, name: &str, addr: u64) -> Comparison {
    let mut out = Comparison::default();
    let Some(code) = kernel.code(addr, 256) else {
        return out;
    };
    let (rows, _) = straight_line(code, addr, Some(kernel.addr("__fentry__")), None);
    for row in rows {
        out.compared += 1;
        let Some((_, entry)) = kernel.table.lookup(row.ip) else {
            out.mismatches
                .push(format!("{name}+{:#x}: no entry", row.ip - addr));
            continue;
        };
        if entry.kind == OrcType::Undefined {
            out.undefined += 1;
            continue;
        }
        let bp = match entry.bp_reg {
            OrcReg::Undefined => None,
            reg => Some((reg, i64::from(entry.bp_offset))),
        };
        let ok = entry.kind == OrcType::Call
            && (entry.sp_reg, i64::from(entry.sp_offset)) == row.cfa
            && bp == row.rbp_saved_at.map(|offset| (OrcReg::PrevSp, offset));
        if !ok {
            out.mismatches.push(format!(
                "{name}+{:#x}: orc {entry}, decoder {row:?}",
                row.ip - addr
            ));
        }
    }
    out
}

#[test]
fn real_vmlinux_tables_are_complete_sorted_and_in_the_4_14_layout() {
    let Some(kernel) = kernel() else { return };
    let table = &kernel.table;

    let (first, last) = table.ip_range();
    let ends = table
        .iter()
        .filter(|(_, e)| e.kind == OrcType::EndOfStack)
        .count();
    let unknown = table
        .iter()
        .filter(|(_, e)| {
            matches!(e.kind, OrcType::Unknown(_)) || matches!(e.sp_reg, OrcReg::Unknown(_))
        })
        .count();
    println!(
        "{} entries from {first:#x} to {last:#x}, {ends} end-of-stack, layout {:?}",
        table.len(),
        table.layout()
    );

    assert!(table.len() > 300_000, "only {} entries", table.len());
    assert_eq!(table.layout(), OrcLayout::Linux4_14);
    assert_eq!(table.header(), None);
    assert_eq!(first, kernel.addr("_stext"));
    assert!(ends > 10);
    assert_eq!(unknown, 0);
}

/// Well-known traceable functions.
const FUNCTIONS: [&str; 6] = [
    "vfs_read",
    "vfs_write",
    "ksys_read",
    "do_sys_openat2",
    "schedule",
    "kmem_cache_alloc",
];

#[test]
fn real_vmlinux_function_entry_is_8_deep_and_16_after_the_first_push() {
    let Some(kernel) = kernel() else { return };
    let fentry = kernel.addr("__fentry__");

    let rules: Vec<[(OrcType, OrcReg, i16); 2]> = FUNCTIONS
        .iter()
        .map(|name| {
            let addr = kernel.addr(name);
            let (rows, _) =
                straight_line(kernel.code(addr, 256).unwrap(), addr, Some(fentry), None);
            let after_push = rows.iter().find(|row| row.cfa == (OrcReg::Sp, 16)).unwrap();
            [addr, after_push.ip].map(|at| {
                let (_, entry) = kernel.table.lookup(at).unwrap();
                (entry.kind, entry.sp_reg, entry.sp_offset)
            })
        })
        .collect();

    assert_eq!(
        rules,
        vec![
            [
                (OrcType::Call, OrcReg::Sp, 8),
                (OrcType::Call, OrcReg::Sp, 16)
            ];
            FUNCTIONS.len()
        ]
    );
}

#[test]
fn real_vmlinux_prologues_match_the_decoded_pushes() {
    let Some(kernel) = kernel() else { return };

    let results: Vec<Comparison> = FUNCTIONS
        .iter()
        .map(|name| compare_prologue(kernel, name, kernel.addr(name)))
        .collect();
    let compared: Vec<usize> = results.iter().map(|r| r.compared).collect();
    println!("instructions compared per function: {compared:?}");

    assert!(
        compared.iter().all(|&n| n >= 3),
        "too few instructions compared: {compared:?}"
    );
    assert!(results.iter().all(|r| r.undefined == 0));
    assert_eq!(
        results
            .into_iter()
            .flat_map(|r| r.mismatches)
            .collect::<Vec<_>>(),
        Vec::<String>::new()
    );
}

#[test]
fn real_vmlinux_every_traceable_function_prologue_matches_the_decoder() {
    let Some(kernel) = kernel() else { return };
    let functions: Vec<(&str, u64)> = kernel
        .symbols
        .iter()
        .filter(|s| s.is_text() && s.size >= 16)
        .map(|s| (s.name.as_str(), s.addr))
        .collect();

    let results: Vec<(&str, Comparison)> = functions
        .iter()
        .map(|&(name, addr)| (name, compare_prologue(kernel, name, addr)))
        .collect();
    let traced = results.iter().filter(|(_, r)| r.compared > 0).count();
    let compared: usize = results.iter().map(|(_, r)| r.compared).sum();
    let without_orc: Vec<&str> = results
        .iter()
        .filter(|(_, r)| r.undefined > 0)
        .map(|(name, _)| *name)
        .collect();
    let mismatches: Vec<&String> = results.iter().flat_map(|(_, r)| &r.mismatches).collect();
    println!(
        "{} text symbols, {traced} start with call __fentry__, {compared} instructions \
         compared, {} mismatches; without ORC data: {without_orc:?}",
        functions.len(),
        mismatches.len()
    );

    assert!(traced > 30_000, "only {traced} traceable functions");
    assert!(compared > 400_000, "only {compared} instructions compared");
    assert!(
        without_orc.len() < 20,
        "{} functions without ORC data",
        without_orc.len()
    );
    assert_eq!(mismatches, Vec::<&String>::new());
}

impl Kernel {
    /// The call site in `function` the decoder reaches first (traceable functions are
    /// walked from their `__fentry__` call), or its first call to `target`.
    fn call_site(&self, function: &str, target: Option<&str>) -> CallSite {
        let addr = self.addr(function);
        let code = self.code(addr, 4096).unwrap();
        let fentry = self.addr("__fentry__");
        let traceable = !straight_line(code, addr, Some(fentry), None).0.is_empty();
        let target = target.map(|name| self.addr(name));
        straight_line(code, addr, traceable.then_some(fentry), target)
            .1
            .unwrap()
    }

    /// The return address of the first call to `target` anywhere in the assembly routine
    /// `function` (no stack tracking: entry code is not straight-line).
    fn ret_after_call(&self, function: &str, target: &str) -> u64 {
        let addr = self.addr(function);
        let target = self.addr(target);
        Decoder::with_ip(
            64,
            self.code(addr, 4096).unwrap(),
            addr,
            DecoderOptions::NONE,
        )
        .into_iter()
        .find(|insn| insn.mnemonic() == Mnemonic::Call && insn.near_branch_target() == target)
        .unwrap()
        .next_ip()
    }

    fn backtrace_text(&self, bt: &Backtrace, slide: u64) -> String {
        format_backtrace(bt, |addr| {
            self.symbols
                .lookup_addr(addr.wrapping_sub(slide))
                .map(|(sym, offset)| (sym.name.clone(), offset))
        })
    }
}

/// Where a call site's CFA is, from the stack pointer and frame pointer of its frame.
fn cfa_of(site: &CallSite, sp: u64, bp: u64) -> u64 {
    match site.cfa {
        (OrcReg::Sp, offset) => sp + offset as u64,
        (OrcReg::Bp, offset) => bp + offset as u64,
        other => panic!("no CFA rule {other:?}"),
    }
}

#[test]
fn real_vmlinux_unwinds_a_kernel_thread_down_to_ret_from_fork() {
    let Some(kernel) = kernel() else { return };
    let slide = 0x1a0_0000;
    let ksys_read = kernel.call_site("ksys_read", None);
    let openat = kernel.call_site("do_sys_openat2", None);
    // A kernel thread's function is called from ret_from_fork, whose rule there ends the stack.
    let thread = kernel.ret_after_call("ret_from_fork", "__x86_indirect_thunk_rbx");
    let sp_k = STACK + 8;
    let sp_o = cfa_of(&ksys_read, sp_k, 0);
    let sp_t = cfa_of(&openat, sp_o, 0);
    let mut stack = super::testing::StackImage::new(STACK, 0x1000);
    stack
        .put(STACK, ksys_read.ret + slide)
        .put(sp_o - 8, openat.ret + slide)
        .put(sp_t - 8, thread + slide);
    let begin = UnwindStart {
        ip: kernel.addr("vfs_read") + slide,
        sp: STACK,
        bp: 0,
        regs: None,
        signal: true,
    };

    let bt = Unwinder::new(&kernel.table, slide).unwind(&begin, &mut stack.snapshot());
    println!("{}", kernel.backtrace_text(&bt, slide));

    assert_eq!(
        bt.pcs().collect::<Vec<_>>(),
        [kernel.addr("vfs_read"), ksys_read.ret, openat.ret, thread].map(|pc| pc + slide)
    );
    assert_eq!(
        bt.frames.iter().map(|f| f.sp).collect::<Vec<_>>(),
        [STACK, sp_k, sp_o, sp_t]
    );
    assert!(matches!(bt.end, StackEnd::EndOfStack));
    assert!(bt.is_reliable());
}

#[test]
fn real_vmlinux_unwinds_a_syscall_through_pt_regs_to_user_mode() {
    let Some(kernel) = kernel() else { return };
    let slide = 0x3c0_0000;
    let ksys_read = kernel.call_site("ksys_read", None);
    // do_syscall_64 moves its stack pointer by a random offset, so it keeps a frame pointer.
    let syscall = kernel.call_site("do_syscall_64", Some("x64_sys_call"));
    // entry_SYSCALL_64 calls it with the user registers saved (struct pt_regs) on top of
    // the stack.
    let entry = kernel.ret_after_call("entry_SYSCALL_64", "do_syscall_64");
    let user = PtRegs {
        ip: 0x7f12_3456_7890,
        sp: 0x7ffd_0000_1000,
        bp: 0x7ffd_0000_2000,
        cs: 0x33,
        ss: 0x2b,
        ..PtRegs::default()
    };
    let sp_k = STACK + 8;
    let sp_d = cfa_of(&ksys_read, sp_k, 0);
    let bp_d = sp_d + 0x40;
    let sp_e = cfa_of(&syscall, sp_d, bp_d);
    let mut stack = super::testing::StackImage::new(STACK, 0x1000);
    stack
        .put(STACK, ksys_read.ret + slide)
        .put(sp_d - 8, syscall.ret + slide)
        .put(sp_e - 8, entry + slide)
        .put(bp_d, user.bp)
        .put_words(sp_e, &user.to_words());
    if let Some(saved) = ksys_read.rbp_saved_at {
        stack.put(sp_d.wrapping_add_signed(saved), bp_d);
    }
    let begin = UnwindStart {
        ip: kernel.addr("vfs_read") + slide,
        sp: STACK,
        bp: bp_d,
        regs: None,
        signal: true,
    };

    let bt = Unwinder::new(&kernel.table, slide).unwind(&begin, &mut stack.snapshot());
    println!("{}", kernel.backtrace_text(&bt, slide));

    assert_eq!(syscall.cfa, (OrcReg::Bp, 16));
    assert_eq!(
        bt.pcs().collect::<Vec<_>>(),
        [kernel.addr("vfs_read"), ksys_read.ret, syscall.ret, entry].map(|pc| pc + slide)
    );
    assert_eq!(
        bt.frames.iter().map(|f| f.sp).collect::<Vec<_>>(),
        [STACK, sp_k, sp_d, sp_e]
    );
    assert_eq!(bt.frames[3].bp, user.bp);
    assert!(matches!(
        bt.end,
        StackEnd::UserMode { pc, sp } if pc == user.ip && sp == user.sp
    ));
    assert!(bt.is_reliable());
}

#[test]
fn real_bzimage_vmlinux_carries_the_same_orc_tables() {
    let Some(kernel) = kernel() else { return };
    let Some(vmlinux) = crate::bzimage::tests::real_vmlinux() else {
        return;
    };

    let from_image = OrcTable::from_vmlinux(&vmlinux).unwrap();

    assert_eq!(from_image.len(), kernel.table.len());
    assert!(from_image.iter().eq(kernel.table.iter()));
}

/// The image, its BTF's `struct alt_instr`, and the alternatives sites the table does not
/// describe.
fn undescribed_sites_of(
    vmlinux: &crate::bzimage::Vmlinux,
    table: &OrcTable,
) -> (AltInstrLayout, Vec<AltSite>) {
    let btf = crate::btf::Btf::from_elf(vmlinux.bytes()).unwrap();
    let layout = AltInstrLayout::from_btf(&btf).unwrap();
    let sites = undescribed_sites(vmlinux, &layout, table).unwrap();
    (layout, sites)
}

/// At every alternatives site, the rules walked through the image's own bytes there (the
/// original, which objtool checked at build time) equal the table's at each instruction the
/// walk reaches: the walk and objtool agree where objtool saw the code.
#[test]
fn real_vmlinux_rules_walked_through_the_original_text_of_each_site_equal_objtools() {
    let Some(kernel) = kernel() else { return };
    let vmlinux =
        crate::bzimage::Vmlinux::map(&super::testing::debug_vmlinux_file().unwrap()).unwrap();
    let (layout, undescribed) = undescribed_sites_of(&vmlinux, &kernel.table);
    let mut sites: Vec<AltSite> = alternatives(&vmlinux, &layout)
        .unwrap()
        .into_iter()
        .map(|alt| alt.site)
        .collect();
    sites.sort_by_key(|s| s.addr);
    sites.dedup();
    let table_rule = |addr| kernel.table.lookup(addr).map(|(_, entry)| entry);
    let (mut walked, mut compared) = (0, 0);
    for site in &sites {
        let rules = PatchedRules::derive(&[*site], 0, table_rule, |at, buf| {
            vmlinux
                .read_at(at, buf.len())
                .map(|bytes| buf.copy_from_slice(bytes))
                .is_ok()
        });
        walked += rules.len();
        for (addr, rule) in rules.iter() {
            assert_eq!(
                Some(rule),
                table_rule(addr),
                "site {:#x} at {addr:#x}",
                site.addr
            );
            compared += 1;
        }
    }
    println!(
        "{} alternatives sites, {walked} walked, {compared} instructions compared; \
         {} sites the table does not describe for every variant",
        sites.len(),
        undescribed.len()
    );
    assert!(walked * 2 > sites.len(), "the walk followed too few sites");
    assert!(!undescribed.is_empty() && undescribed.len() * 100 < sites.len());
}

/// A sample inside the RSB-stuffing loop that CPUs with `X86_FEATURE_RSB_CTXSW` run in
/// `__switch_to_asm` (its replacement patched in as the kernel does) unwinds to the
/// `__schedule` that called it with the rules derived from the patched text; the table's rule
/// there (objtool's, for the one-call variant) reads the return address 16 bytes too low.
#[test]
fn real_vmlinux_unwinds_a_sample_in_the_patched_rsb_fill_of_switch_to_asm() {
    let Some(kernel) = kernel() else { return };
    let vmlinux =
        crate::bzimage::Vmlinux::map(&super::testing::debug_vmlinux_file().unwrap()).unwrap();
    let (layout, sites) = undescribed_sites_of(&vmlinux, &kernel.table);
    let switch = kernel.symbols.get("__switch_to_asm").unwrap();
    let in_switch = |addr: u64| (switch.addr..switch.addr + switch.size).contains(&addr);
    let site = *sites.iter().find(|s| in_switch(s.addr)).unwrap();
    let table_rule = |addr| kernel.table.lookup(addr).map(|(_, entry)| entry);
    let slide = 0x2a0_0000;
    // Each replacement patched in (padded with nops, as the kernel pads), the deepest one.
    let (rules, live) = alternatives(&vmlinux, &layout)
        .unwrap()
        .into_iter()
        .filter(|alt| alt.site == site)
        .map(|alt| {
            let mut live = vmlinux
                .read_at(alt.replacement, usize::from(alt.replacement_len))
                .unwrap()
                .to_vec();
            live.resize(usize::from(site.len), 0x90);
            let rules = PatchedRules::derive(&[site], slide, table_rule, |_, buf| {
                buf.copy_from_slice(&live);
                true
            });
            (rules, live)
        })
        .max_by_key(|(rules, _)| {
            (0..u64::from(site.len))
                .filter_map(|off| rules.entry_at(site.addr + slide + off))
                .map(|rule| rule.sp_offset)
                .max()
        })
        .unwrap();
    // The instruction after the loop's second call: two return addresses pushed.
    let calls: Vec<Instruction> = Decoder::with_ip(64, &live, site.addr, DecoderOptions::NONE)
        .into_iter()
        .filter(|insn| insn.mnemonic() == Mnemonic::Call)
        .collect();
    assert_eq!(calls.len(), 2, "the loop's two intra-function calls");
    let deepest = calls[1].near_branch_target();
    let start = table_rule(site.addr).unwrap();
    let derived = rules.entry_at(deepest + slide).unwrap();
    assert_eq!(derived.sp_offset, start.sp_offset + 16);
    assert_ne!(
        Some(derived),
        table_rule(deepest),
        "the table already had this rule"
    );

    // The stack: the loop's two return addresses, six saved registers, then __schedule's.
    let schedule = kernel.ret_after_call("__schedule", "__switch_to_asm");
    let cfa = STACK + u64::try_from(derived.sp_offset).unwrap();
    let mut stack = super::testing::StackImage::new(STACK, 0x1000);
    stack
        .put(STACK, calls[1].next_ip() + slide)
        .put(STACK + 8, calls[0].next_ip() + slide)
        .put(cfa - 8, schedule + slide);
    let begin = UnwindStart {
        ip: deepest + slide,
        sp: STACK,
        bp: 0,
        regs: None,
        signal: true,
    };
    let patched = Unwinder::new(&kernel.table, slide)
        .with_patched(&rules)
        .unwind(&begin, &mut stack.snapshot());
    println!("{}", kernel.backtrace_text(&patched, slide));
    assert_eq!(patched.frames[1].pc, schedule + slide);
    assert_eq!(patched.frames[1].sp, cfa);
    let unpatched = Unwinder::new(&kernel.table, slide).unwind(&begin, &mut stack.snapshot());
    assert_ne!(
        unpatched.frames.get(1).map(|f| f.pc),
        Some(schedule + slide),
        "the table alone unwound the loop"
    );
}

/// A sample inside the retpoline of `__x86_indirect_thunk_rax`, after its call, unwinds to
/// the function that called the thunk with the rules walked from [`THUNK_ENTRY`]; the
/// table's rule there (`UNWIND_HINT_EMPTY`) ends the stack at the thunk as if it were
/// complete.
#[test]
fn real_vmlinux_unwinds_a_sample_in_a_retpoline_thunk_to_its_caller() {
    let Some(kernel) = kernel() else { return };
    let thunk = kernel.addr("__x86_indirect_thunk_rax");
    let code = kernel.code(thunk, 32).unwrap().to_vec();
    let site = AltSite {
        addr: thunk,
        len: 32,
    };
    let slide = 0x120_0000;
    let rules = PatchedRules::derive(
        &[site],
        slide,
        |_| Some(THUNK_ENTRY),
        |_, buf| {
            buf.copy_from_slice(&code);
            true
        },
    );
    // The retpoline's `mov %rax, (%rsp)`: the target of its call.
    let call = Decoder::with_ip(64, &code, thunk, DecoderOptions::NONE)
        .into_iter()
        .find(|insn| insn.mnemonic() == Mnemonic::Call)
        .unwrap();
    let inside = call.near_branch_target();
    assert_eq!(
        rules.entry_at(inside + slide).map(|r| r.sp_offset),
        Some(16)
    );

    let caller = kernel.call_site("ksys_read", None).ret;
    let mut stack = super::testing::StackImage::new(STACK, 0x1000);
    stack
        .put(STACK, call.next_ip() + slide)
        .put(STACK + 8, caller + slide);
    let begin = UnwindStart {
        ip: inside + slide,
        sp: STACK,
        bp: 0,
        regs: None,
        signal: true,
    };
    let walked = Unwinder::new(&kernel.table, slide)
        .with_patched(&rules)
        .unwind(&begin, &mut stack.snapshot());
    println!("{}", kernel.backtrace_text(&walked, slide));
    assert_eq!(walked.frames[1].pc, caller + slide);
    assert_eq!(walked.frames[1].sp, STACK + 16);
    let table_only = Unwinder::new(&kernel.table, slide).unwind(&begin, &mut stack.snapshot());
    assert_eq!(
        table_only.frames.len(),
        1,
        "the table alone went past the thunk"
    );
}

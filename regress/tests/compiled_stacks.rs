//! Stack snapshots of compiled probe bodies (exotap_probes::compile::snapshot) run under
//! Unicorn: the record must hold the registers the probed code had, its stack pointer and
//! exactly the stack bytes above it that Unicorn's memory holds, never past the stack's
//! 16 KiB boundary, and no page past one the kernel's fault-tolerant copy refused. The
//! oracle is Unicorn's own memory and the registers the test gave the run.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use exotap_probes::compile::{
    self,
    codegen::Env,
    snapshot::{self, Snapshot, StackFormat, Unwound, REGS},
    DataLayout, Facts, Interner, MemoryFns, SiteBodies, SitePoint, TaskFields,
};
use exotap_probes::lang::driver::{compile as check_script, ScriptSource};
use exotap_probes::lang::eval::Store;
use exotap_probes::lang::value::{truncate, Value};
use exotap_probes::lang::Limits;
use exotap_vmm::control::X86Registers;
use exotap_vmm::unicorn::{Isa, RunEnd, UnicornMachine};
use iced_x86::code_asm::{eax, qword_ptr, rax, rcx, rdx, rsi, CodeAssembler};

const CODE: u64 = 0xffff_ffff_a000_0000;
const DATA: u64 = 0xffff_ffff_a100_0000;
/// Four 16 KiB stacks' worth of memory (16 KiB aligned).
const STACK: u64 = 0xffff_c900_0000_0000;
const PERCPU: u64 = 0xffff_8880_0100_0000;
const TASK: u64 = 0xffff_8880_0200_0000;
/// A stand-in for `copy_from_kernel_nofault(dst, src, len)`: copies, unless any byte of
/// the source lies at or past the address in [`GUARD_AT`] (a guard page): then -EFAULT.
const COPY: u64 = CODE + 0xf_0000;
/// Where the stand-in keeps its guard address.
const GUARD_AT: u64 = CODE + 0xf_1000;
/// Where the stand-in counts its calls.
const CALLS_AT: u64 = CODE + 0xf_1008;
/// A stand-in for `stack_trace_save_regs(regs, store, size, skip)`: keeps its size and skip
/// at [`SAVED_AT`] and the `pt_regs` it got after them, then stores the first pcs of the
/// list at [`PCS_AT`] (a count, then the pcs) that fit `size`, and returns how many.
const SAVE: u64 = CODE + 0xf_2000;
const SAVED_AT: u64 = CODE + 0xf_3000;
const PCS_AT: u64 = CODE + 0xf_4000;

fn copy_routine() -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut fault = a.create_label();
    a.add_instruction(
        iced_x86::Instruction::with1(
            iced_x86::Code::Inc_rm64,
            iced_x86::MemoryOperand::with_base_displ(iced_x86::Register::RIP, CALLS_AT as i64),
        )
        .unwrap(),
    )
    .unwrap();
    a.lea(rax, qword_ptr(rsi + rdx)).unwrap();
    a.mov(rcx, GUARD_AT).unwrap();
    a.cmp(rax, qword_ptr(rcx)).unwrap();
    a.ja(fault).unwrap();
    a.mov(rcx, rdx).unwrap();
    a.rep().movsb().unwrap();
    a.xor(eax, eax).unwrap();
    a.ret().unwrap();
    a.set_label(&mut fault).unwrap();
    a.mov(rax, -14i64).unwrap();
    a.ret().unwrap();
    a.assemble(COPY).unwrap()
}

fn save_routine() -> Vec<u8> {
    use iced_x86::code_asm::{r10, r11, r8, r9, rdi};
    let mut a = CodeAssembler::new(64).unwrap();
    a.mov(r8, SAVED_AT).unwrap();
    a.mov(qword_ptr(r8), rdx).unwrap();
    a.mov(qword_ptr(r8 + 8), rcx).unwrap();
    a.mov(r9, rsi).unwrap();
    a.mov(r10, rdx).unwrap();
    a.mov(rsi, rdi).unwrap();
    a.lea(rdi, qword_ptr(r8 + 16)).unwrap();
    a.mov(rcx, 168u64).unwrap();
    a.rep().movsb().unwrap();
    a.mov(r11, PCS_AT).unwrap();
    a.mov(rcx, qword_ptr(r11)).unwrap();
    a.cmp(rcx, r10).unwrap();
    a.cmova(rcx, r10).unwrap();
    a.mov(rax, rcx).unwrap();
    a.lea(rsi, qword_ptr(r11 + 8)).unwrap();
    a.mov(rdi, r9).unwrap();
    a.shl(rcx, 3).unwrap();
    a.rep().movsb().unwrap();
    a.ret().unwrap();
    a.assemble(SAVE).unwrap()
}

fn facts() -> Facts {
    Facts {
        current_task: 0x100,
        cpu_number: 0x108,
        task: TaskFields {
            pid: 0x10,
            tgid: Some(0x14),
            comm: 0x20,
            real_parent: None,
            cred: None,
            cred_uid: None,
            utime: None,
            stime: None,
        },
        realtime_ns: None,
        copy_nofault: Some(COPY),
        stack_save: Some(SAVE),
        memory: MemoryFns::default(),
        types: None,
        globals: Default::default(),
        jiffies: None,
        data_slide: 0,
        irq_regs: None,
    }
}

struct Rig {
    uc: UnicornMachine,
    layout: DataLayout,
    interner: Interner,
    entry: u64,
    end: u64,
}

/// The probe point the site's stacks start at.
const PROBE_PC: u64 = 0xffff_ffff_8123_4560;

fn rig(script: &str) -> Rig {
    let limits = Limits::default();
    let prog = check_script(
        &ScriptSource {
            name: "t.stp".into(),
            text: script.into(),
        },
        &limits,
    )
    .expect("the script checks");
    let facts = facts();
    let mut layout = DataLayout::new(&prog, &limits).expect("lays out");
    if compile::codegen::prints(&prog) {
        layout = layout.with_rings(1);
    }
    let rt = compile::runtime(&layout, DATA, CODE).unwrap();
    let env = Env {
        prog: &prog,
        limits: &limits,
        facts: &facts,
        layout: &layout,
        data: DATA,
        helpers: &rt.helpers,
    };
    let mut interner = Interner::default();
    let bodies = SiteBodies {
        entry: vec![SitePoint {
            probe: 0,
            name: "kernel.function(\"f\")".into(),
            function: "f".into(),
            params: vec!["a".into(), "b".into()],
            is_return: false,
            locals: None,
            guard: None,
        }],
        ret: Vec::new(),
        pc: PROBE_PC,
    };
    let entry = CODE + 0x8_0000;
    let mut code = compile::entry_code(env, &mut interner, entry, &bodies, None).expect("compiles");
    // What the host does when it installs the site.
    for f in &mut interner.stacks {
        f.pc = PROBE_PC;
    }
    code.push(0xf4); // hlt
    let end = entry + code.len() as u64 - 1;
    let mut uc = UnicornMachine::new(Isa::X86_64).unwrap();
    uc.map(CODE, 1 << 20).unwrap();
    uc.map(DATA, layout.size.div_ceil(4096) * 4096).unwrap();
    uc.map(STACK, 64 << 10).unwrap();
    uc.map(PERCPU, 4096).unwrap();
    uc.map(TASK, 4096).unwrap();
    uc.write(CODE, &rt.code).unwrap();
    uc.write(entry, &code).unwrap();
    uc.write(COPY, &copy_routine()).unwrap();
    uc.write(SAVE, &save_routine()).unwrap();
    uc.write(GUARD_AT, &u64::MAX.to_le_bytes()).unwrap();
    let mut init = layout.initial(&prog, &mut interner);
    init.resize(layout.size as usize, 0);
    uc.write(DATA, &init).unwrap();
    uc.write(PERCPU + 0x100, &TASK.to_le_bytes()).unwrap();
    uc.write(PERCPU + 0x108, &0u32.to_le_bytes()).unwrap();
    uc.write(TASK + 0x14, &77i32.to_le_bytes()).unwrap();
    uc.write(TASK + 0x20, b"stacker\0").unwrap();
    // Every stack word says where it is.
    let words: Vec<u8> = (0..(64u64 << 10) / 8)
        .flat_map(|i| (STACK + 8 * i).to_le_bytes())
        .collect();
    uc.write(STACK, &words).unwrap();
    Rig {
        uc,
        layout,
        interner,
        entry,
        end,
    }
}

impl Rig {
    /// Runs the site with the probed code's stack pointer at `sp` and its registers given
    /// values of their own (rax = 0x1000, rcx = 0x1001, ... in the site's push order).
    fn hit(&mut self, sp: u64) -> X86Registers {
        let mut regs = X86Registers::default();
        // gdb order: rax rbx rcx rdx rsi rdi rbp rsp r8..r15.
        for (i, g) in regs.gpr.iter_mut().enumerate() {
            *g = 0x1000 + i as u64;
        }
        regs.gpr[7] = sp;
        regs.rip = self.entry;
        regs.rflags = 0x246;
        self.uc.set_x86_registers(&regs).unwrap();
        self.uc.set_gs_base(PERCPU).unwrap();
        self.uc.set_halt(Some(self.end)).unwrap();
        self.uc.set_budget(10_000_000);
        let end = self.uc.run().unwrap();
        assert!(matches!(end, RunEnd::Halted(_)), "{end:?}");
        regs
    }

    fn records(&self) -> Vec<Vec<u8>> {
        let rings = self.layout.ring_set(DATA).unwrap();
        let mut head = [0u8; 8];
        self.uc.read(rings.ring(0), &mut head).unwrap();
        (0..u64::from_le_bytes(head))
            .map(|i| {
                let mut record = vec![0u8; rings.record as usize];
                self.uc.read(rings.slot(0, i), &mut record).unwrap();
                record
            })
            .collect()
    }

    fn format(&self, record: &[u8]) -> StackFormat {
        snapshot::stack_format(&self.interner.stacks, record)
            .expect("a stack record")
            .clone()
    }

    fn calls(&self) -> u64 {
        let mut n = [0u8; 8];
        self.uc.read(CALLS_AT, &mut n).unwrap();
        u64::from_le_bytes(n)
    }
}

/// The stack bytes from `sp` as Unicorn's memory holds them.
fn memory(rig: &Rig, sp: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    rig.uc.read(sp, &mut bytes).unwrap();
    bytes
}

fn snap<'r>(format: &StackFormat, record: &'r [u8]) -> Snapshot<'r> {
    snapshot::snapshot(format, record).expect("a whole snapshot")
}

#[test]
fn print_backtrace_copies_the_registers_and_as_much_stack_as_the_record_holds() {
    let mut rig = rig(r#"probe kernel.function("f") { print_backtrace() }"#);
    let sp = STACK + 0x8000 + 0x100; // 16 KiB - 256 bytes below its stack's top

    let regs = rig.hit(sp);

    let records = rig.records();
    assert_eq!(records.len(), 1);
    assert_ne!(records[0][..8], [0; 8], "the TSC marks the record finished");
    let format = rig.format(&records[0]);
    let s = snap(&format, &records[0]);
    assert_eq!(format.snapshot_bytes, 4096 - 16 - snapshot::SNAPSHOT_HEAD);
    assert_eq!((s.pc, s.sp), (PROBE_PC, sp));
    assert_eq!(s.stack.len() as u64, format.snapshot_bytes);
    assert_eq!(s.stack, &memory(&rig, sp, s.stack.len())[..]);
    // The site's push order against the registers the run started with (gdb order).
    let gdb = [0, 2, 3, 1, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15];
    for (i, g) in gdb.iter().enumerate() {
        assert_eq!(s.saved(i), regs.gpr[*g], "saved register {i}");
    }
    assert_eq!(s.saved(15) & 0xfff, 0x246);
    assert_eq!(REGS, 128);
}

#[test]
fn the_copy_stops_at_the_stacks_16_kib_boundary() {
    let mut rig = rig(r#"probe kernel.function("f") { print_backtrace() }"#);
    let top = STACK + 0xc000;
    let sp = top - 0x128;

    rig.hit(sp);

    let records = rig.records();
    let format = rig.format(&records[0]);
    let s = snap(&format, &records[0]);
    assert_eq!(s.stack.len(), 0x128);
    assert_eq!(s.stack, &memory(&rig, sp, 0x128)[..]);
    // Nothing of the next stack (its first word says where it is) came along.
    let at = (format.snapshot_at() + snapshot::SNAPSHOT_HEAD) as usize + 0x128;
    assert!(records[0][at..at + 8] != top.to_le_bytes());
}

#[test]
fn a_page_the_kernels_copy_refuses_ends_the_snapshot_there() {
    let mut rig = rig(r#"probe kernel.function("f") { print_backtrace() }"#);
    let sp = STACK + 0x4000 + 0xf80; // 128 bytes below a page boundary, far from the top
    rig.uc
        .write(GUARD_AT, &(STACK + 0x5000).to_le_bytes())
        .unwrap();

    rig.hit(sp);

    let records = rig.records();
    let format = rig.format(&records[0]);
    let s = snap(&format, &records[0]);
    assert_eq!(s.stack.len(), 0x80);
    assert_eq!(s.stack, &memory(&rig, sp, 0x80)[..]);
    // One call for the first page's tail, one refused for the next page: no byte-by-byte
    // probing of the guard page.
    assert_eq!(rig.calls(), 2);
}

#[test]
fn printf_of_a_backtrace_keeps_the_other_arguments_in_their_places() {
    let mut rig = rig(
        r#"probe kernel.function("f") { printf("%d %s [%s] %d\n", pid(), execname(), backtrace(), $b) }"#,
    );
    let sp = STACK + 0x2000;

    rig.hit(sp);

    let records = rig.records();
    let format = rig.format(&records[0]);
    // A stand-in unwinder: the probe point, then the word at the stack pointer.
    let unwind = |s: &Snapshot<'_>| Unwound {
        frames: vec![
            (s.pc, String::new()),
            (s.word(s.sp).unwrap(), String::new()),
        ],
        cut: true,
    };
    let text = snapshot::render(
        &format,
        &records[0],
        &|raw| rig.interner.decode(raw),
        &unwind,
    )
    .unwrap();
    // $b is rsi (gdb register 4) = 0x1004.
    assert_eq!(
        text,
        format!("77 stacker [{PROBE_PC:#x} {sp:#x} ...] {}\n", 0x1004)
    );
}

#[test]
fn stacks_the_guest_cannot_hold_are_refused_by_name() {
    let limits = Limits::default();
    let refusal_with = |facts: &Facts, script: &str| -> Vec<String> {
        let prog = check_script(
            &ScriptSource {
                name: "t.stp".into(),
                text: script.into(),
            },
            &limits,
        )
        .expect("the script checks");
        let point = |is_return| SitePoint {
            probe: 0,
            name: "kernel.function(\"f\")".into(),
            function: "f".into(),
            params: vec!["a".into()],
            is_return,
            locals: None,
            guard: None,
        };
        compile::check(&prog, &limits, facts, &[point(script.contains(".return"))])
            .into_iter()
            .map(|u| u.construct)
            .collect()
    };
    let refusal = |script: &str| refusal_with(&facts(), script);

    let key = refusal(r#"global s; probe kernel.function("f") { s[backtrace()]++ }"#);
    let no_unwinder = refusal_with(
        &Facts {
            stack_save: None,
            ..facts()
        },
        r#"global s; probe kernel.function("f") { s[backtrace()]++ }"#,
    );
    let ret_key = refusal(r#"global s; probe kernel.function("f").return { s[backtrace()]++ }"#);
    let ret = refusal(r#"probe kernel.function("f").return { print_backtrace() }"#);
    let fine = refusal(r#"probe kernel.function("f") { println(sprint_backtrace()) }"#);
    let syms = refusal(r#"probe kernel.function("f") { print_syms(backtrace()) }"#);
    let lines = refusal(r#"probe kernel.function("f") { s = sprint_backtrace() }"#);
    // A built string may live in the guest's string table, which a stack record lacks.
    let built = refusal(
        r#"probe kernel.function("f") { s = execname() . "!"; printf("%s %s\n", s, backtrace()) }"#,
    );
    let plain =
        refusal(r#"probe kernel.function("f") { printf("%s %s\n", execname(), backtrace()) }"#);

    assert!(key.is_empty(), "{key:?}");
    assert!(
        no_unwinder
            .iter()
            .any(|c| c.contains("the kernel has no stack_trace_save_regs")),
        "{no_unwinder:?}"
    );
    assert!(ret_key.is_empty(), "{ret_key:?}");
    assert!(ret.is_empty(), "{ret:?}");
    assert!(fine.is_empty(), "{fine:?}");
    assert!(syms.is_empty(), "{syms:?}");
    assert!(
        lines
            .iter()
            .any(|c| c.contains("sprint_backtrace() other than as an argument")),
        "{lines:?}"
    );
    assert!(
        built
            .iter()
            .any(|c| c.contains("beside a kernel stack, in a script that builds strings")),
        "{built:?}"
    );
    assert!(plain.is_empty(), "{plain:?}");
}

impl Rig {
    /// The pcs the stand-in unwinder gives.
    fn unwinds_to(&mut self, pcs: &[u64]) {
        let mut list = (pcs.len() as u64).to_le_bytes().to_vec();
        list.extend(pcs.iter().flat_map(|p| p.to_le_bytes()));
        self.uc.write(PCS_AT, &list).unwrap();
    }

    fn data(&self) -> Vec<u8> {
        let mut data = vec![0u8; self.layout.size as usize];
        self.uc.read(DATA, &mut data).unwrap();
        data
    }

    /// The keys of the stats array `name` and their counts.
    fn stack_keys(&self, name: &str) -> Vec<(String, i64)> {
        let Some(Store::StatsArray(m)) = self.layout.decode(name, &self.data(), &self.interner)
        else {
            panic!("{name} is not an array of aggregates");
        };
        m.iter()
            .map(|(k, v)| match &k[..] {
                [Value::Str(s)] => (s.clone(), v.count),
                other => panic!("key {other:?}"),
            })
            .collect()
    }

    /// The stand-in unwinder's arguments: (size, skip, the pt_regs words).
    fn unwinder_args(&self) -> (u64, u64, Vec<u64>) {
        let mut saved = vec![0u8; 16 + 168];
        self.uc.read(SAVED_AT, &mut saved).unwrap();
        let words: Vec<u64> = saved
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        (words[0], words[1], words[2..].to_vec())
    }
}

/// The interpreter's `backtrace()` text of `pcs`.
fn pcs_text(pcs: &[u64]) -> String {
    let text = pcs
        .iter()
        .map(|p| format!("{p:#x}"))
        .collect::<Vec<_>>()
        .join(" ");
    truncate(text, Limits::default().max_string_len)
}

#[test]
fn backtrace_as_a_key_is_the_kernels_unwind_from_the_probed_codes_registers() {
    let mut rig = rig(r#"global s; probe kernel.function("f") { s[backtrace()] <<< 1 }"#);
    // Digits as `{:#x}` writes them: no leading zeros, "0x0" for 0.
    let pcs = [
        PROBE_PC,
        0xffff_ffff_8100_0abc,
        0xabc,
        0,
        0xffff_ffff_81ff_fff0,
    ];
    rig.unwinds_to(&pcs);
    let sp = STACK + 0x6000;

    let regs = rig.hit(sp);
    rig.hit(sp);

    assert_eq!(rig.stack_keys("s"), vec![(pcs_text(&pcs), 2)]);
    let (size, skip, pt_regs) = rig.unwinder_args();
    // MAXSTRINGLEN 512 holds 511 bytes of text: 27 frames of 19 bytes cover it.
    assert_eq!((size, skip), (27, 0));
    // struct pt_regs: r15 r14 r13 r12 bp bx r11 r10 r9 r8 ax cx dx si di (gdb's numbers:
    // rax rbx rcx rdx rsi rdi rbp rsp r8..r15), orig_ax, ip, cs, flags, sp, ss.
    let gdb = [15, 14, 13, 12, 6, 1, 11, 10, 9, 8, 0, 2, 3, 4, 5];
    for (i, g) in gdb.iter().enumerate() {
        assert_eq!(pt_regs[i], regs.gpr[*g], "pt_regs word {i}");
    }
    assert_eq!(
        pt_regs[15..21],
        [u64::MAX, PROBE_PC, 0x10, 0x246, sp, 0x18],
        "orig_ax, ip, cs, flags, sp, ss"
    );
    let header = compile::Header::decode(&rig.data());
    assert_eq!((header.errors, header.stacks_busy), (0, 0));
    // The CPU's guard bit is clear again.
    let mut guard = [0u8; 16];
    rig.uc
        .read(DATA + compile::data::field::STACK_GUARD, &mut guard)
        .unwrap();
    assert_eq!(guard, [0u8; 16]);
}

#[test]
fn a_deep_backtrace_is_cut_at_maxstringlen_as_the_interpreter_cuts_it() {
    let mut rig = rig(r#"global s; probe kernel.function("f") { s[backtrace()] <<< 1 }"#);
    let pcs: Vec<u64> = (0..64).map(|i| 0xffff_ffff_8100_0000 + 0x40 * i).collect();
    rig.unwinds_to(&pcs);

    rig.hit(STACK + 0x6000);

    let keys = rig.stack_keys("s");
    assert_eq!(keys, vec![(pcs_text(&pcs), 1)]);
    assert_eq!(keys[0].0.len(), Limits::default().max_string_len - 1);
}

#[test]
fn a_cpu_already_in_the_unwinder_gets_an_empty_stack_counted_not_a_recursion() {
    let mut rig = rig(r#"global s; probe kernel.function("f") { s[backtrace()] <<< 1 }"#);
    rig.unwinds_to(&[PROBE_PC]);
    // CPU 0 is inside the unwinder already (this probe stands in its path).
    rig.uc
        .write(
            DATA + compile::data::field::STACK_GUARD,
            &1u64.to_le_bytes(),
        )
        .unwrap();

    rig.hit(STACK + 0x6000);

    assert_eq!(rig.stack_keys("s"), vec![(String::new(), 1)]);
    assert_eq!(rig.unwinder_args().0, 0, "the unwinder was not called");
    let header = compile::Header::decode(&rig.data());
    assert_eq!((header.errors, header.stacks_busy), (0, 1));
}

#[test]
fn a_user_function_snapshots_the_probed_codes_stack_not_its_own() {
    let mut rig = rig(
        r#"function show(n) { if (n > 0) return show(n - 1); print_backtrace(); return 0 }
           probe kernel.function("f") { show(3) }"#,
    );
    let sp = STACK + 0x6000;

    rig.hit(sp);

    let records = rig.records();
    assert_eq!(records.len(), 1);
    let format = rig.format(&records[0]);
    let s = snap(&format, &records[0]);
    assert_eq!((s.pc, s.sp), (PROBE_PC, sp));
    assert_eq!(s.stack, &memory(&rig, sp, s.stack.len())[..]);
    assert_eq!(s.stack.len() as u64, format.snapshot_bytes);
}

//! Compiled probe bodies (exotap_probes::compile) run under Unicorn, hit by hit, against the
//! interpreter (exotap_probes::lang) as the oracle: after the same hits with the same
//! arguments and task, every global the guest code built decodes to what the interpreter
//! holds, and what it printed is what the interpreter printed. Errors (division by zero,
//! MAXACTION, a faulting kernel read, a full table) are counted in the data's header and the
//! code returns normally.
//!
//! The Unicorn rig and the differential runner live here; the tests in modules by what the
//! bodies do (`values`, `strings`, `regex`, `arrays`, `errors`, `memory`, `forms`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod arrays;
mod errors;
mod forms;
mod memory;
mod nodes;
mod regex;
mod strings;
mod values;

use std::sync::Arc;

use exotap_probes::compile::{
    self,
    codegen::Env,
    data::{Header, Printed},
    types::{KernelTypes, Shape, TypeRef},
    DataLayout, Facts, Interner, IrqRegs, MemoryFns, SiteBodies, SitePoint, TaskFields,
};
use exotap_probes::lang::context::CapturedContext;
use exotap_probes::lang::driver::{compile as check_script, compile_with, ScriptSource};
use exotap_probes::lang::eval::Store;
use exotap_probes::lang::invocation::Invocation;
use exotap_probes::lang::output::{Format, Output, SharedBuf};
use exotap_probes::lang::runtime::Session;
use exotap_probes::lang::value::{Stats, Value};
use exotap_probes::lang::Limits;
use exotap_vmm::control::{Machine, RegisterFile, X86Registers};
use exotap_vmm::unicorn::{Isa, RunEnd, UnicornMachine};
use iced_x86::code_asm::*;

const CODE: u64 = 0xffff_ffff_a000_0000;
/// Where the rig's site code is (the probe point's address, `addr()`).
const SITE: u64 = CODE + 0x8_0000;
const DATA: u64 = 0xffff_ffff_a100_0000;
const STACK: u64 = 0xffff_c900_0000_0000;
const PERCPU: u64 = 0xffff_8880_0100_0000;
const TASK: u64 = 0xffff_8880_0200_0000;
/// A stand-in for the kernel's `copy_from_kernel_nofault(dst, src, len)`: addresses below
/// 64 KiB fault (-EFAULT), others are copied byte by byte.
const COPY: u64 = CODE + 0xf_0000;
/// A stand-in for `strncpy_from_kernel_nofault(dst, src, count)` (and, with the same
/// results where they matter, `strncpy_from_user_nofault`): byte by byte, a byte outside
/// [`TASK`, `TASK_END`) faults (-EFAULT, dst[0] = 0); returns the bytes read with the NUL,
/// or `count` with the last byte read replaced by a NUL.
const STRNCPY: u64 = CODE + 0xf_1000;
/// The end of the task's pages: strings there run into unreadable memory.
const TASK_END: u64 = TASK + 3 * 4096;

/// The stand-in [`STRNCPY`] routine.
fn strncpy() -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut lp = a.create_label();
    let mut end = a.create_label();
    let mut ret0 = a.create_label();
    let mut fault = a.create_label();
    a.xor(eax, eax).unwrap();
    a.test(rdx, rdx).unwrap();
    a.jle(ret0).unwrap();
    a.mov(r8, rsi).unwrap();
    a.set_label(&mut lp).unwrap();
    a.mov(r9, TASK).unwrap();
    a.cmp(rsi, r9).unwrap();
    a.jb(fault).unwrap();
    a.mov(r9, TASK_END).unwrap();
    a.cmp(rsi, r9).unwrap();
    a.jae(fault).unwrap();
    a.mov(cl, byte_ptr(rsi)).unwrap();
    a.mov(byte_ptr(rdi), cl).unwrap();
    a.inc(rdi).unwrap();
    a.inc(rsi).unwrap();
    a.mov(rax, rsi).unwrap();
    a.sub(rax, r8).unwrap();
    a.test(cl, cl).unwrap();
    a.jz(end).unwrap();
    a.cmp(rax, rdx).unwrap();
    a.jb(lp).unwrap();
    a.set_label(&mut end).unwrap();
    a.mov(byte_ptr(rdi - 1), 0).unwrap();
    a.set_label(&mut ret0).unwrap();
    a.ret().unwrap();
    a.set_label(&mut fault).unwrap();
    a.mov(byte_ptr(rdi), 0).unwrap();
    a.mov(rax, -14i64).unwrap();
    a.ret().unwrap();
    a.assemble(STRNCPY).unwrap()
}

/// Made-up kernel types: `f(struct node *a, long b)`, and
/// `struct node { int x; struct node *next @8; char name[16] @16; short s @32;
/// struct { unsigned char c; } inner @40; }` (0x40 bytes).
#[derive(Debug)]
struct NodeTypes;

/// Type ids of [`NodeTypes`].
const NODE: TypeRef = 1;
const NODE_PTR: TypeRef = 2;
const INT: TypeRef = 3;
const NAME: TypeRef = 4;
const SHORT: TypeRef = 5;
const INNER: TypeRef = 6;
const UCHAR: TypeRef = 7;
const LONG: TypeRef = 8;
const CHAR: TypeRef = 9;

impl KernelTypes for NodeTypes {
    fn param(&self, function: &str, param: Option<&str>) -> Option<TypeRef> {
        match (function, param) {
            ("f", Some("a")) => Some(NODE_PTR),
            ("f", Some("b")) => Some(LONG),
            _ => None,
        }
    }
    fn named(&self, spec: &str) -> Option<TypeRef> {
        (spec == "struct node").then_some(NODE)
    }
    fn shape(&self, ty: TypeRef) -> Shape {
        let int = |size, signed| Shape::Int { size, signed };
        match ty {
            NODE | INNER => Shape::Aggregate,
            NODE_PTR => Shape::Pointer(NODE),
            INT => int(4, true),
            NAME => Shape::Array,
            SHORT => int(2, true),
            UCHAR => int(1, false),
            LONG => int(8, true),
            CHAR => int(1, true),
            _ => Shape::Other,
        }
    }
    fn element(&self, ty: TypeRef) -> Option<TypeRef> {
        (ty == NAME).then_some(CHAR)
    }
    fn size(&self, ty: TypeRef) -> Option<u64> {
        match ty {
            NODE => Some(0x40),
            NODE_PTR | LONG => Some(8),
            INT => Some(4),
            NAME => Some(16),
            SHORT => Some(2),
            INNER | UCHAR | CHAR => Some(1),
            _ => None,
        }
    }
    fn member(&self, ty: TypeRef, name: &str) -> Option<(u64, TypeRef)> {
        match (ty, name) {
            (NODE, "x") => Some((0, INT)),
            (NODE, "next") => Some((8, NODE_PTR)),
            (NODE, "name") => Some((16, NAME)),
            (NODE, "s") => Some((32, SHORT)),
            (NODE, "inner") => Some((40, INNER)),
            (INNER, "c") => Some((0, UCHAR)),
            _ => None,
        }
    }
}

fn facts() -> Facts {
    Facts {
        current_task: 0x100,
        cpu_number: 0x108,
        task: TaskFields {
            pid: 0x10,
            tgid: Some(0x14),
            comm: 0x20,
            real_parent: Some(0x40),
            cred: Some(0x48),
            cred_uid: Some(0x4),
            utime: None,
            stime: None,
        },
        realtime_ns: None,
        copy_nofault: Some(COPY),
        stack_save: None,
        memory: MemoryFns {
            strncpy_kernel: Some(STRNCPY),
            strncpy_user: Some(STRNCPY),
            copy_user: Some(COPY),
            kallsyms: None,
        },
        types: Some(Arc::new(NodeTypes)),
        globals: Default::default(),
        jiffies: None,
        data_slide: 0,
        // The tick's registers (timer.profile): a pt_regs pointer per CPU, ip and cs in it.
        irq_regs: Some(IrqRegs {
            percpu: 0x110,
            ip: 0x80,
            cs: 0x88,
        }),
    }
}

/// One hit: the task and the two arguments.
#[derive(Debug, Clone)]
struct Hit {
    comm: &'static str,
    pid: i32,
    tgid: i32,
    a: i64,
    b: i64,
}

struct Rig {
    uc: UnicornMachine,
    layout: DataLayout,
    interner: Interner,
    entry: u64,
    end: u64,
    /// The catch records the site's code sets up (each handler checked for `endbr64`).
    catch_records: usize,
}

fn rig(script: &str, limits: &Limits) -> (Rig, exotap_probes::lang::check::Program) {
    rig_as(script, limits, &Invocation::default())
}

/// As [`rig`], with the script invoked as `inv` says (e.g. `-g`).
fn rig_as(
    script: &str,
    limits: &Limits,
    inv: &Invocation,
) -> (Rig, exotap_probes::lang::check::Program) {
    rig_guarded(script, limits, inv, &[None])
}

/// The point every probe of a rig's script is at (`pp()`), unless [`rig_at`] says another.
const POINT: &str = "kernel.function(\"f\")";

/// As [`rig_as`], with probe i of the script at the site too, guarded by `guards[i]` (as a
/// tracepoint's probe at its class's shared callback: it runs where `$a`, the first
/// argument, is the guard).
fn rig_guarded(
    script: &str,
    limits: &Limits,
    inv: &Invocation,
    guards: &[Option<u64>],
) -> (Rig, exotap_probes::lang::check::Program) {
    let points: Vec<(Option<u64>, &str)> = guards.iter().map(|g| (*g, POINT)).collect();
    rig_at(script, limits, inv, &points)
}

/// As [`rig_guarded`], probe i at the point named `points[i].1`.
fn rig_at(
    script: &str,
    limits: &Limits,
    inv: &Invocation,
    points: &[(Option<u64>, &str)],
) -> (Rig, exotap_probes::lang::check::Program) {
    let prog = compile_with(
        &ScriptSource {
            name: "t.stp".into(),
            text: script.into(),
        },
        limits,
        inv,
    )
    .expect("the script checks");
    let facts = facts();
    let mut layout = DataLayout::new(&prog, limits).expect("lays out");
    if compile::codegen::prints(&prog) {
        layout = layout.with_rings(1);
    }
    let rt = compile::runtime(&layout, DATA, CODE).unwrap();
    let env = Env {
        prog: &prog,
        limits,
        facts: &facts,
        layout: &layout,
        data: DATA,
        helpers: &rt.helpers,
    };
    let mut interner = Interner::default();
    let bodies = SiteBodies {
        entry: points
            .iter()
            .enumerate()
            .map(|(probe, (guard, name))| SitePoint {
                probe,
                name: (*name).into(),
                function: "f".into(),
                params: vec!["a".into(), "b".into()],
                is_return: false,
                locals: None,
                guard: *guard,
            })
            .collect(),
        ret: Vec::new(),
        pc: SITE,
    };
    let entry = SITE;
    let mut code = compile::entry_code(env, &mut interner, entry, &bodies, None).expect("compiles");
    code.push(0xf4); // hlt: where the run ends (the relocated instruction would be here)
    let end = entry + code.len() as u64 - 1;
    let catch_records = catch_handlers_begin_with_endbr64(&code, entry);

    let mut uc = UnicornMachine::new(Isa::X86_64).unwrap();
    uc.map(CODE, 1 << 20).unwrap();
    uc.map(DATA, layout.size.div_ceil(4096) * 4096).unwrap();
    uc.map(STACK, 64 << 10).unwrap();
    uc.map(PERCPU, 4096).unwrap();
    uc.map(TASK, 3 * 4096).unwrap();
    uc.write(CODE, &rt.code).unwrap();
    uc.write(entry, &code).unwrap();
    // copy_from_kernel_nofault: cmp rsi, 0x10000; jb fault; mov rcx, rdx; rep movsb;
    // xor eax, eax; ret; fault: mov rax, -14; ret
    let copy = [
        0x48, 0x81, 0xfe, 0x00, 0x00, 0x01, 0x00, // cmp rsi, 0x10000
        0x72, 0x08, // jb +8
        0x48, 0x89, 0xd1, // mov rcx, rdx
        0xf3, 0xa4, // rep movsb
        0x31, 0xc0, // xor eax, eax
        0xc3, // ret
        0x48, 0xc7, 0xc0, 0xf2, 0xff, 0xff, 0xff, // mov rax, -14
        0xc3, // ret
    ];
    uc.write(COPY, &copy).unwrap();
    uc.write(STRNCPY, &strncpy()).unwrap();
    let mut init = layout.initial(&prog, &mut interner);
    init.resize(layout.size as usize, 0);
    uc.write(DATA, &init).unwrap();
    uc.write(PERCPU + 0x100, &TASK.to_le_bytes()).unwrap();
    uc.write(PERCPU + 0x108, &0u32.to_le_bytes()).unwrap();
    // The parent (tgid 1) and the cred (uid 1000).
    uc.write(TASK + 0x40, &(TASK + 0x1000).to_le_bytes())
        .unwrap();
    uc.write(TASK + 0x1000 + 0x14, &1i32.to_le_bytes()).unwrap();
    uc.write(TASK + 0x48, &(TASK + 0x2000).to_le_bytes())
        .unwrap();
    uc.write(TASK + 0x2000 + 0x4, &1000u32.to_le_bytes())
        .unwrap();
    // As the live install: the collector keeps what the host placed before the code ran.
    interner.pin_placed();
    (
        Rig {
            uc,
            layout,
            interner,
            entry,
            end,
            catch_records,
        },
        prog,
    )
}

/// The catch records `code` (placed at `at`) sets up: `lea r, [rip+handler]` then
/// `mov [rbx], r`, the handler a user function's error reaches by `jmp [rbx]`, the one
/// indirect branch compiled code makes. Each handler begins with `endbr64`, as IBT requires
/// of an indirect branch's target (QEMU TCG does not enforce IBT: only this check shows the
/// code would hold on a CPU that does). Returns how many there are.
fn catch_handlers_begin_with_endbr64(code: &[u8], at: u64) -> usize {
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind, Register};
    let end = at + code.len() as u64;
    let insns: Vec<_> = Decoder::with_ip(64, code, at, DecoderOptions::NONE)
        .into_iter()
        .collect();
    let mut records = 0;
    for pair in insns.windows(2) {
        let (lea, store) = (&pair[0], &pair[1]);
        let takes = lea.mnemonic() == Mnemonic::Lea
            && lea.op_kind(1) == OpKind::Memory
            && lea.memory_base() == Register::RIP
            && (at..end).contains(&lea.memory_displacement64());
        let records_it = store.mnemonic() == Mnemonic::Mov
            && store.op_kind(0) == OpKind::Memory
            && store.memory_base() == Register::RBX
            && store.memory_displacement64() == 0
            && store.op_kind(1) == OpKind::Register
            && store.op_register(1) == lea.op_register(0);
        if takes && records_it {
            let target = lea.memory_displacement64();
            let off = (target - at) as usize;
            assert_eq!(
                code.get(off..off + 4),
                Some(&[0xf3, 0x0f, 0x1e, 0xfa][..]),
                "the catch record at {:#x} names {target:#x}, which does not begin with endbr64",
                lea.ip()
            );
            records += 1;
        }
    }
    records
}

impl Rig {
    fn hit(&mut self, h: &Hit) {
        self.hit_as(h, h.comm.as_bytes());
    }

    /// As [`Rig::hit`], with the task's comm holding `name` (up to 15 bytes, any bytes).
    fn hit_as(&mut self, h: &Hit, name: &[u8]) {
        self.begin_hit(h, name);
        self.uc.set_budget(10_000_000);
        let end = self.uc.run().unwrap();
        assert!(
            matches!(end, RunEnd::Halted(_)),
            "the body did not return: {end:?}"
        );
    }

    /// Runs hit `h` an instruction at a time until `stop` says so of the machine (the hit
    /// then in progress, `true`) or the hit ends (`false`).
    fn hit_until(&mut self, h: &Hit, stop: impl Fn(&UnicornMachine) -> bool) -> bool {
        self.begin_hit(h, h.comm.as_bytes());
        loop {
            self.uc.set_budget(1);
            match self.uc.run().unwrap() {
                RunEnd::Halted(_) => return false,
                RunEnd::BudgetExhausted(_) if stop(&self.uc) => return true,
                RunEnd::BudgetExhausted(_) => {}
                end => panic!("the body stopped: {end:?}"),
            }
        }
    }

    /// Runs the rest of a hit [`Rig::hit_until`] stopped.
    fn finish_hit(&mut self) {
        self.uc.set_budget(10_000_000);
        let end = self.uc.run().unwrap();
        assert!(
            matches!(end, RunEnd::Halted(_)),
            "the body did not return: {end:?}"
        );
    }

    /// The task and registers of hit `h` (the comm holding `name`), the pc at the site.
    fn begin_hit(&mut self, h: &Hit, name: &[u8]) {
        let mut comm = [0u8; 16];
        comm[..name.len()].copy_from_slice(name);
        self.uc.write(TASK + 0x20, &comm).unwrap();
        self.uc.write(TASK + 0x10, &h.pid.to_le_bytes()).unwrap();
        self.uc.write(TASK + 0x14, &h.tgid.to_le_bytes()).unwrap();
        let mut regs = X86Registers::default();
        regs.gpr[5] = h.a as u64; // rdi
        regs.gpr[4] = h.b as u64; // rsi
        regs.gpr[7] = STACK + (60 << 10); // rsp
        regs.rip = self.entry;
        regs.rflags = 0x2;
        self.uc.set_x86_registers(&regs).unwrap();
        self.uc.set_gs_base(PERCPU).unwrap();
        self.uc.set_halt(Some(self.end)).unwrap();
    }

    fn data(&self) -> Vec<u8> {
        let mut buf = vec![0u8; self.layout.size as usize];
        self.uc.read(DATA, &mut buf).unwrap();
        buf
    }

    /// The host's collection of the string table, as the live loop makes it at a look (the
    /// "guest" stopped between instructions), written back.
    fn collect_strings(&mut self) -> compile::data::collect::Collection {
        let mut data = self.data();
        let got = self
            .layout
            .collect_strings(&mut data, &mut self.interner)
            .expect("a collectable string table");
        self.uc.write(DATA, &data).unwrap();
        got
    }

    /// What the compiled code printed, in order.
    fn printed(&self) -> String {
        let Some(rings) = self.layout.ring_set(DATA) else {
            return String::new();
        };
        let mut head = [0u8; 8];
        self.uc.read(rings.ring(0), &mut head).unwrap();
        (0..u64::from_le_bytes(head))
            .map(|i| {
                let mut record = vec![0u8; rings.record as usize];
                self.uc.read(rings.slot(0, i), &mut record).unwrap();
                self.interner.render(&record).expect("a known format")
            })
            .collect()
    }

    /// What the compiled code printed, as `--format json` prints it (the host's drain:
    /// histograms as their own objects).
    fn printed_json(&self) -> String {
        let out = SharedBuf::default();
        let mut json = Output::new(
            Format::Json,
            Box::new(out.clone()),
            Box::new(std::io::sink()),
        );
        let Some(rings) = self.layout.ring_set(DATA) else {
            return String::new();
        };
        let mut head = [0u8; 8];
        self.uc.read(rings.ring(0), &mut head).unwrap();
        for i in 0..u64::from_le_bytes(head) {
            let mut record = vec![0u8; rings.record as usize];
            self.uc.read(rings.slot(0, i), &mut record).unwrap();
            match self.interner.printed(&record).expect("a known format") {
                Printed::Text(t) => json.text(&t).unwrap(),
                Printed::Hist {
                    name,
                    kind,
                    buckets,
                    newline,
                } => {
                    let h = exotap_probes::lang::hist::Histogram {
                        kind,
                        buckets: &buckets,
                    };
                    json.hist(&name, &h).unwrap();
                    if newline {
                        json.text("\n").unwrap();
                    }
                }
            }
        }
        json.flush().unwrap();
        out.contents()
    }
}

fn context(h: &Hit) -> CapturedContext {
    let mut ctx = CapturedContext {
        pid: i64::from(h.tgid),
        tid: i64::from(h.pid),
        ppid: 1,
        uid: 1000,
        execname: h.comm.into(),
        cpu: 0,
        probefunc: "f".into(),
        // The site's argument registers as the rig sets them: rdi, rsi, the rest 0.
        args: vec![h.a as u64, h.b as u64, 0, 0, 0, 0],
        task: Some(TASK),
        ..Default::default()
    };
    ctx.targets.insert("$a".into(), Value::Long(h.a));
    ctx.targets.insert("$b".into(), Value::Long(h.b));
    ctx
}

/// Pseudo-random hits (xorshift), with awkward values mixed in.
fn hits(n: usize) -> Vec<Hit> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let awkward = [
        0,
        1,
        -1,
        63,
        64,
        -64,
        1 << 40,
        i64::MIN,
        i64::MAX,
        99,
        100,
        -100,
        101,
    ];
    let comms = ["bash", "syscall-loop", "kworker/0:1", "a-long-name-15c"];
    (0..n)
        .map(|i| {
            let r = next();
            let b = if i % 3 == 0 {
                awkward[(r >> 8) as usize % awkward.len()]
            } else {
                (r as i64) >> (r % 50)
            };
            Hit {
                comm: comms[(r >> 4) as usize % comms.len()],
                pid: 100 + (r % 5) as i32,
                tgid: 100 + (r % 3) as i32,
                a: ((r >> 20) % 1000) as i64 - 200,
                b,
            }
        })
        .collect()
}

/// The interpreter's statistics with their running variance state cleared: the guest keeps
/// count, sum, min, max and buckets, and the running variance only where @variance reads it.
fn without_variance(store: Store) -> Store {
    let clear = |mut s: Stats| {
        s.avg_s = 0;
        s.m2 = 0;
        s
    };
    match store {
        Store::Stats(s) => Store::Stats(clear(s)),
        Store::StatsArray(m) => {
            Store::StatsArray(m.into_iter().map(|(k, v)| (k, clear(v))).collect())
        }
        other => other,
    }
}

/// Runs `script` compiled under Unicorn and in the interpreter over the same hits; returns
/// the compiled run's header.
fn differential(script: &str, hits: &[Hit]) -> Header {
    differential_with(script, hits).0
}

/// As [`differential`], also saying how many hits the interpreter reported an error for.
fn differential_with(script: &str, hits: &[Hit]) -> (Header, u64) {
    differential_in(script, hits, |_, _| {}, |_, _| {})
}

/// As [`differential_with`], with `setup` writing the guest's memory before the hits and
/// `known` adding to each hit's context what the interpreter is given (target variables'
/// member chains); the interpreter reads the task's pages as the compiled code saw them.
fn differential_in(
    script: &str,
    hits: &[Hit],
    setup: impl Fn(&mut UnicornMachine, &Hit),
    known: impl Fn(&Hit, &mut CapturedContext),
) -> (Header, u64) {
    differential_limits(script, hits, setup, known, Limits::default())
}

/// As [`differential_in`], under `limits` (e.g. a small MAXSTRINGLEN).
fn differential_limits(
    script: &str,
    hits: &[Hit],
    setup: impl Fn(&mut UnicornMachine, &Hit),
    known: impl Fn(&Hit, &mut CapturedContext),
    limits: Limits,
) -> (Header, u64) {
    differential_between(script, hits, setup, known, limits, |_, _| {})
}

/// As [`differential_limits`], with `between` given the rig after each hit (and its index):
/// what the host does to the data between hits (collect the string table).
fn differential_between(
    script: &str,
    hits: &[Hit],
    setup: impl Fn(&mut UnicornMachine, &Hit),
    known: impl Fn(&Hit, &mut CapturedContext),
    limits: Limits,
    mut between: impl FnMut(&mut Rig, usize),
) -> (Header, u64) {
    let (mut rig, prog) = rig(script, &limits);
    let out = SharedBuf::default();
    let err = SharedBuf::default();
    let output = Output::new(Format::Text, Box::new(out.clone()), Box::new(err.clone()));
    let mut session = Session::new(&prog, limits.clone(), output, "t.stp", script);
    let out_json = SharedBuf::default();
    let output_json = Output::new(
        Format::Json,
        Box::new(out_json.clone()),
        Box::new(std::io::sink()),
    );
    let mut session_json = Session::new(&prog, limits.clone(), output_json, "t.stp", script);
    let mut failed = 0;
    for (i, h) in hits.iter().enumerate() {
        setup(&mut rig.uc, h);
        rig.hit(h);
        between(&mut rig, i);
        let mut ctx = context(h);
        let mut task = vec![0u8; (TASK_END - TASK) as usize];
        rig.uc.read(TASK, &mut task).unwrap();
        ctx.memory = vec![(TASK, task)];
        known(h, &mut ctx);
        if !session.fire(0, "kernel.function(\"f\")", &ctx) {
            failed += 1;
        }
        session_json.fire(0, "kernel.function(\"f\")", &ctx);
    }
    let data = rig.data();
    for name in prog.globals.keys() {
        let compiled = rig.layout.decode(name, &data, &rig.interner).unwrap();
        let mut interpreted = session.global(name).unwrap().clone();
        if prog.globals[name].hist.variance_shift.is_none() {
            interpreted = without_variance(interpreted);
        }
        assert_eq!(
            format!("{compiled:?}"),
            format!("{interpreted:?}"),
            "global {name} after {} hits",
            hits.len()
        );
    }
    assert_eq!(rig.printed(), out.contents(), "printed output");
    assert_eq!(
        rig.printed_json(),
        out_json.contents(),
        "printed output, --format json"
    );
    (Header::decode(&data), failed)
}

/// What `compile::check` names for `script`'s kernel probe at `f(a, b)`.
fn refusals(script: &str) -> Vec<String> {
    let limits = Limits::default();
    let prog = check_script(
        &ScriptSource {
            name: "t.stp".into(),
            text: script.into(),
        },
        &limits,
    )
    .unwrap();
    let point = SitePoint {
        probe: 0,
        name: "kernel.function(\"f\")".into(),
        function: "f".into(),
        params: vec!["a".into(), "b".into()],
        is_return: false,
        locals: None,
        guard: None,
    };
    compile::check(&prog, &limits, &facts(), &[point])
        .into_iter()
        .map(|u| u.construct)
        .collect()
}

//! Built-in functions in a compiled body: the task's context, clocks, kernel reads,
//! `exit()`, and the output records of `printf`/`print`/`println`.

use iced_x86::code_asm::*;
use iced_x86::{Code, Instruction, Register};

use exotap_lang::ast::*;
use exotap_lang::check::Program;

use exotap_lang::Limits;

use super::super::data::{
    field, value_kind, ArgSlot, OutputKind, ValueKind, MAX_PRINT_ARGS, MAX_RECORD, RECORD,
};
use super::super::snapshot::{stack_arg, takes_snapshots};
use super::memory::text_call;
use super::{rip, Gen, K, R};

impl Gen<'_, '_> {
    pub(super) fn task_field(&mut self, off: Option<u64>, what: &str) -> R<()> {
        let off =
            off.ok_or_else(|| self.no(format!("{what} (BTF lacks the task_struct member)")))?;
        asm!(self, self.a.movsxd(rax, dword_ptr(r13 + off as i32)))
    }

    pub(super) fn call(&mut self, c: &Call) -> R<K> {
        let name = c.name.name.as_str();
        if let Some(&index) = self.env.prog.functions.get(name) {
            return self.call_user(index, c);
        }
        let task = self.env.facts.task;
        match name {
            "error" => self.error(c),
            "set_return" => {
                let v = c
                    .args
                    .first()
                    .ok_or_else(|| self.no("set_return() without a value"))?;
                let ret = TargetVar {
                    name: "$return".into(),
                    members: Vec::new(),
                };
                self.write_target(&ret, None, v)
            }
            "pid" => {
                self.task_field(task.tgid, "pid()")?;
                Ok(K::Long)
            }
            "tid" => {
                self.task_field(Some(task.pid), "tid()")?;
                Ok(K::Long)
            }
            "ppid" => {
                let parent = task
                    .real_parent
                    .ok_or_else(|| self.no("ppid() (no real_parent offset)"))?;
                let tgid = task
                    .tgid
                    .ok_or_else(|| self.no("ppid() (no tgid offset)"))?;
                asm!(self, self.a.mov(rax, qword_ptr(r13 + parent as i32)))?;
                asm!(self, self.a.movsxd(rax, dword_ptr(rax + tgid as i32)))?;
                Ok(K::Long)
            }
            "uid" => {
                let cred = task.cred.ok_or_else(|| self.no("uid() (no cred offset)"))?;
                let uid = task
                    .cred_uid
                    .ok_or_else(|| self.no("uid() (no cred.uid offset)"))?;
                asm!(self, self.a.mov(rax, qword_ptr(r13 + cred as i32)))?;
                asm!(self, self.a.mov(eax, dword_ptr(rax + uid as i32)))?;
                Ok(K::Long)
            }
            "jiffies" => self.jiffies(),
            // The task `r13` holds, as the interpreter's context answers it at the stop.
            "task_current" if c.args.is_empty() => {
                asm!(self, self.a.mov(rax, r13))?;
                Ok(K::Long)
            }
            // The session's `-x PID`, fixed when the script is compiled (0 without one).
            "target" if c.args.is_empty() => {
                let pid = self.env.prog.target_pid;
                asm!(self, self.a.mov(rax, pid))?;
                Ok(K::Long)
            }
            // `task_struct`'s own counters, as SystemTap's `@const("current->utime")`.
            "task_utime" | "task_stime" if c.args.is_empty() => {
                let off = if name == "task_utime" {
                    task.utime
                } else {
                    task.stime
                };
                let off = off.ok_or_else(|| {
                    self.no(format!("{name}() (BTF lacks the task_struct member)"))
                })?;
                asm!(self, self.a.mov(rax, qword_ptr(r13 + off as i32)))?;
                Ok(K::Long)
            }
            "cpu" => {
                let cpu_number = self.env.facts.cpu_number;
                asm!(
                    self,
                    exotap_probes_base::rings::emit_cpu_number(self.a, cpu_number)
                )?;
                Ok(K::Long)
            }
            "execname" => {
                let comm = task.comm as i32;
                asm!(self, self.a.mov(rax, qword_ptr(r13 + comm)))?;
                asm!(self, self.a.mov(rdx, qword_ptr(r13 + comm + 8)))?;
                Ok(K::Str)
            }
            // A sample is in no probed function (as the host-evaluated profile answers).
            "probefunc" | "ppfunc" if self.profile() => self.string_const(""),
            "probefunc" | "ppfunc" => {
                let f = self.point.function.clone();
                self.string_const(&f)
            }
            "pp" => {
                let p = self.point.name.clone();
                self.string_const(&p)
            }
            // The guest's own cycle counter, as stap's get_cycles() (host-evaluated probes
            // answer the host's monotonic nanoseconds instead: a time, different by design).
            "get_cycles" => {
                let r = (|| {
                    self.a.rdtsc()?;
                    self.a.shl(rdx, 32)?;
                    self.a.or(rax, rdx)
                })();
                asm!(self, r)?;
                Ok(K::Long)
            }
            "gettimeofday_ns" | "gettimeofday_us" | "gettimeofday_ms" | "gettimeofday_s" => {
                let f = self.env.facts.realtime_ns.ok_or_else(|| {
                    self.no(format!(
                        "{name}() (the kernel has no ktime_get_real_fast_ns)"
                    ))
                })?;
                asm!(self, self.a.call(f))?;
                let div: u64 = match name {
                    "gettimeofday_us" => 1_000,
                    "gettimeofday_ms" => 1_000_000,
                    "gettimeofday_s" => 1_000_000_000,
                    _ => 1,
                };
                if div > 1 {
                    asm!(self, self.a.xor(edx, edx))?;
                    asm!(self, self.a.mov(rcx, div))?;
                    asm!(self, self.a.div(rcx))?;
                }
                Ok(K::Long)
            }
            "printf" | "print" | "println" => self.print(name, &c.args),
            "print_backtrace" | "backtrace" | "print_syms" if self.profile() => {
                self.not_in_profile("a kernel stack").map(|()| K::Long)
            }
            // A tick's interrupted code (SystemTap's addr()): the pc in the interrupt's
            // registers, 0 without them.
            "addr" if self.profile() => {
                self.irq_regs(|g, regs| g.a.mov(rax, qword_ptr(rax + regs.ip as i32)))
            }
            // Whether the tick interrupted user code: its `cs` has a nonzero privilege level.
            "user_mode" if self.profile() => self.irq_regs(|g, regs| {
                g.a.mov(rax, qword_ptr(rax + regs.cs as i32))?;
                g.a.and(eax, 3)?;
                g.a.setne(al)?;
                g.a.movzx(eax, al)
            }),
            // Elsewhere, as the interpreter: the probe point's address, in kernel code.
            "addr" if !self.point.is_return => {
                asm!(self, self.a.mov(rax, self.pc))?;
                Ok(K::Long)
            }
            "user_mode" if !self.point.is_return => {
                asm!(self, self.a.xor(eax, eax))?;
                Ok(K::Long)
            }
            "print_backtrace" => self.print_backtrace(),
            // As the interpreter prints it, the stack's frames one per line, as
            // `print_backtrace()` does.
            "print_syms"
                if matches!(c.args.as_slice(), [Expr { kind: ExprKind::Call(b), .. }]
                    if b.name.name == "backtrace" && b.args.is_empty()) =>
            {
                self.print_backtrace()
            }
            "backtrace" => self.backtrace_string(),
            "sprint_backtrace" => Err(self.no(
                "sprint_backtrace() other than as an argument of printf/print/println (the host \
                 names the frames, from a snapshot in the output record)",
            )),
            // `printd(", ", a, b)` prints what `print(a, ", ", b)` prints.
            "printd" | "printdln" => {
                let args = interleaved(&c.args).ok_or_else(|| {
                    self.no(format!("{name}() with a delimiter that is not a literal"))
                })?;
                self.print(if name == "printd" { "print" } else { "println" }, &args)
            }
            // As the interpreter: a kernel address, or a user one in the task's address space,
            // read through the kernel's nofault copies (a bad address is a probe error).
            "kernel_long" | "kernel_int" | "kernel_short" | "kernel_char" | "user_char"
            | "user_short" | "user_ushort" | "user_int" | "user_uint" | "user_long" => {
                let (len, signed, user) = exotap_lang::native::memory_read(name)
                    .ok_or_else(|| self.no(format!("{name}() (no such read)")))?;
                let (copy, routine) = if user {
                    (self.env.facts.memory.copy_user, "copy_from_user_nofault")
                } else {
                    (self.env.facts.copy_nofault, "copy_from_kernel_nofault")
                };
                let copy =
                    copy.ok_or_else(|| self.no(format!("{name}() (the kernel has no {routine})")))?;
                let arg = c
                    .args
                    .first()
                    .ok_or_else(|| self.no(format!("{name}() without an address")))?;
                self.long(arg)?;
                self.read_kernel(copy, len, signed)?;
                Ok(K::Long)
            }
            // As the interpreter: `$return` in a return probe (elsewhere the probe runs on
            // the host, where it is an error).
            "returnval" => {
                if !self.point.is_return {
                    return Err(self.no("returnval() outside a return probe"));
                }
                let off = super::saved_offset(Register::RAX);
                asm!(self, self.a.mov(rax, qword_ptr(r15 + off)))?;
                Ok(K::Long)
            }
            "int_arg" | "uint_arg" | "long_arg" | "ulong_arg" | "pointer_arg" => {
                self.arg_register(name, c)
            }
            "kernel_string" | "kernel_string_n" | "user_string" | "user_string_n" => {
                self.text_value(c, name.starts_with("user"), name.ends_with("_n"))
            }
            "symname" => self.symname(c),
            "substr" => self.substr(c),
            "strlen" => self.strlen(c),
            "sprint" | "sprintln" => self.sprint(c),
            "text_str" => self.text_str(c),
            "string_quoted" => self.string_quoted(c),
            "isinstr" => self.strpos(c, true),
            "strpos" => self.strpos(c, false),
            "stringat" => self.stringat(c),
            "strtol" => self.strtol(c),
            "str_replace" => self.str_replace(c),
            "sprintf" => self.sprintf(c),
            "signal_str" => self.signal_str(c),
            "errno_str" => self.errno_str(c),
            "_sys_open_flag_str" => {
                let e = open_flag_str(c).ok_or_else(|| {
                    self.no(
                        "_sys_open_flag_str() of something other than a number, a variable or \
                         a target variable (it is read once per flag)",
                    )
                })?;
                self.expr(&e)
            }
            "return_str" => {
                let e = return_str(c).ok_or_else(|| {
                    self.no(
                        "return_str() of arguments other than numbers, variables and target \
                         variables (they are read more than once)",
                    )
                })?;
                self.expr(&e)
            }
            // The escape the interpreter prints: `ESC[fg m`, `ESC[bg;fg m`, `ESC[bg;fg;attr m`.
            "ansi_set_color" if (1..=3).contains(&c.args.len()) => {
                let order: &[usize] = match c.args.len() {
                    1 => &[0],
                    2 => &[1, 0],
                    _ => &[1, 0, 2],
                };
                let format = format!("\x1b[{}m", vec!["%d"; order.len()].join(";"));
                let mut args = vec![Expr {
                    kind: ExprKind::Str(format),
                    span: c.name.span,
                }];
                args.extend(order.iter().map(|&i| c.args[i].clone()));
                self.print("printf", &args)
            }
            "syscall_name" => self.syscall_name(c),
            "exit" => {
                let addr = self.env.data + field::EXIT;
                let i = Instruction::with2(Code::Mov_rm64_imm32, rip(addr), 1)
                    .map_err(|e| self.no(e.to_string()))?;
                asm!(self, self.a.add_instruction(i))?;
                Ok(K::Long)
            }
            other => Err(self.no(format!("the function {other}() in a kernel probe"))),
        }
    }

    /// An output record: the arguments (16 bytes each) pushed, a record reserved in this
    /// vCPU's ring, filled, and its TSC stored last.
    pub(super) fn print(&mut self, name: &str, args: &[Expr]) -> R<K> {
        let Some(rings) = self.env.layout.ring_set(self.env.data) else {
            return Err(self.no(format!("{name}() without output rings")));
        };
        let (kind, values) = if name == "printf" {
            let fmt = match args.first().map(|a| &a.kind) {
                Some(ExprKind::Str(s)) => s.clone(),
                _ => return Err(self.no("printf with a format that is not a literal")),
            };
            (OutputKind::Printf(fmt), &args[1.min(args.len())..])
        } else {
            if let [Expr {
                kind: ExprKind::Hist(kind, target),
                ..
            }] = args
            {
                return self.print_hist(*kind, target, name == "println");
            }
            if args.iter().any(|a| matches!(a.kind, ExprKind::Hist(..))) {
                return Err(self.no(format!("{name}() of a histogram among other values")));
            }
            (OutputKind::Print(name == "println"), args)
        };
        if values.iter().any(|v| stack_arg(v).is_some()) {
            self.not_in_profile("a kernel stack")?;
            return self.print_stack(kind, values);
        }
        if values.len() > MAX_PRINT_ARGS {
            return Err(self.no(format!(
                "{name}() with more than {MAX_PRINT_ARGS} arguments"
            )));
        }
        let mut slots = Vec::new();
        let text = self.text_bytes();
        // Per argument: a string read from memory, and whether its buffer is on the stack.
        let mut on_stack = Vec::new();
        for v in values {
            let local = match &v.kind {
                ExprKind::Var(n) => self.texts.get(n).copied(),
                _ => None,
            };
            on_stack.push(text_call(v).is_some());
            if let Some(at) = local {
                // A local's own buffer: its address as the argument's 16 bytes.
                let off = self.text_local(at);
                asm!(self, self.a.lea(rax, qword_ptr(rbp + off)))?;
                asm!(self, self.a.xor(edx, edx))?;
                slots.push(ArgSlot::Text {
                    slot: text as u32,
                    max_string_len: u32::try_from(self.env.limits.max_string_len)
                        .unwrap_or(u32::MAX),
                });
            } else if let Some((c, user, with_n)) = text_call(v) {
                // The buffer first, then its address (and a 0) as the argument's 16 bytes.
                asm!(self, self.a.sub(rsp, text))?;
                let saved = self.span;
                self.span = v.span;
                self.text(c, user, with_n)?;
                self.span = saved;
                asm!(self, self.a.xor(edx, edx))?;
                slots.push(ArgSlot::Text {
                    slot: text as u32,
                    max_string_len: u32::try_from(self.env.limits.max_string_len)
                        .unwrap_or(u32::MAX),
                });
            } else if let Some(t) = ctime_arg(v) {
                // The time, which the host renders as the interpreter's ctime().
                self.long(t)?;
                asm!(self, self.a.xor(edx, edx))?;
                slots.push(ArgSlot::Ctime {
                    max_string_len: u32::try_from(self.env.limits.max_string_len)
                        .unwrap_or(u32::MAX),
                });
            } else if self.env.layout.strings.is_some() && self.expr(v)? == K::Str {
                // Where strings are built, a string may be in the guest's table: its text
                // goes into the record, as a string read from memory does.
                self.text_on_stack()?;
                *on_stack.last_mut().unwrap_or(&mut false) = true;
                slots.push(ArgSlot::Text {
                    slot: text as u32,
                    max_string_len: u32::try_from(self.env.limits.max_string_len)
                        .unwrap_or(u32::MAX),
                });
            } else if self.env.layout.strings.is_some() {
                // A long, already in rax.
                slots.push(ArgSlot::Long);
                asm!(self, self.a.xor(edx, edx))?;
            } else {
                let k = self.expr(v)?;
                slots.push(if k == K::Str {
                    ArgSlot::Str
                } else {
                    ArgSlot::Long
                });
                if k == K::Long {
                    asm!(self, self.a.xor(edx, edx))?;
                }
            }
            asm!(self, self.a.push(rdx))?;
            asm!(self, self.a.push(rax))?;
        }
        let bytes = 16 + slots.iter().map(ArgSlot::size).sum::<u64>();
        if bytes > self.env.layout.record {
            return Err(self.no(format!(
                "{name}() whose record would take {bytes} bytes (at most {MAX_RECORD})"
            )));
        }
        let stacked: i32 = on_stack
            .iter()
            .map(|s| 16 + if *s { text } else { 0 })
            .sum();
        let offsets: Vec<i32> = slots
            .iter()
            .scan(16i32, |at, s| {
                let here = *at;
                *at += s.size() as i32;
                Some(here)
            })
            .collect();
        let id = self.interner.format(kind, slots.clone());
        let cpu_number = self.env.facts.cpu_number;
        let r = (|| {
            let mut skip = self.a.create_label();
            let mut done = self.a.create_label();
            rings.emit_reserve(self.a, cpu_number, rdi, skip)?;
            self.a.mov(dword_ptr(rdi + 8), id)?;
            self.a.mov(r8, rdi)?;
            for ((slot, at), stack) in slots.iter().zip(&offsets).zip(&on_stack).rev() {
                self.a.pop(rax)?;
                self.a.pop(rdx)?;
                if let ArgSlot::Text { .. } = slot {
                    // The whole buffer (its string ends at a NUL), then free it.
                    self.a.lea(rdi, qword_ptr(r8 + *at))?;
                    if *stack {
                        self.a.mov(rsi, rsp)?;
                    } else {
                        self.a.mov(rsi, rax)?;
                    }
                    self.a.mov(ecx, text as u32)?;
                    self.a.rep().movsb()?;
                    if *stack {
                        self.a.add(rsp, text)?;
                    }
                } else {
                    self.a.mov(qword_ptr(r8 + *at), rax)?;
                    self.a.mov(qword_ptr(r8 + *at + 8), rdx)?;
                }
            }
            self.a.mov(rdi, r8)?;
            self.a.rdtsc()?;
            self.a.shl(rdx, 32)?;
            self.a.or(rax, rdx)?;
            exotap_probes_base::rings::RingSet::emit_finish(self.a, rdi, rax)?;
            self.a.jmp(done)?;
            self.a.set_label(&mut skip)?;
            self.a.add(rsp, stacked)?;
            self.a.set_label(&mut done)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }
}

impl Gen<'_, '_> {
    /// `print(@hist_*(x))`: the statistics value copied whole into a record (an empty one is
    /// a probe error, as in the interpreter); the host renders it as the interpreter does.
    fn print_hist(&mut self, kind: HistKind, target: &Expr, newline: bool) -> R<K> {
        let Some(rings) = self.env.layout.ring_set(self.env.data) else {
            return Err(self.no("print() without output rings"));
        };
        let (name, keys, value_offset) = match &target.kind {
            ExprKind::Var(name) => {
                let slot = self
                    .global(name)
                    .cloned()
                    .filter(|s| s.table.is_none())
                    .ok_or_else(|| self.no(format!("a histogram of {name}")))?;
                self.lea(Register::RAX, self.env.data + slot.offset)?;
                (name.clone(), Vec::new(), 0)
            }
            ExprKind::Index(ix) => {
                let slot = self.array(&ix.array.name)?;
                if self.env.layout.strings.is_some() && slot.key_is_str.contains(&true) {
                    return Err(self.no(format!(
                        "a histogram of an element of {} keyed by strings in a script that \
                         builds strings (the record names it by the keys' encodings)",
                        ix.array.name
                    )));
                }
                self.lookup(&ix.array.name, &ix.keys, false)?;
                (
                    ix.array.name.clone(),
                    slot.key_is_str.clone(),
                    slot.value_offset() as i32,
                )
            }
            _ => return Err(self.no("a histogram of this")),
        };
        let Some(ValueKind::Stats(layout)) = self.global(&name).map(|s| s.value) else {
            return Err(self.no(format!("a histogram of {name}, which is not an aggregate")));
        };
        let bytes = ValueKind::Stats(layout).size();
        let key_bytes = 16 * keys.len() as u64;
        if 16 + bytes + key_bytes > self.env.layout.record {
            return Err(self.no(format!(
                "a histogram of {name} ({bytes} bytes, more than a record holds)"
            )));
        }
        let id = self.interner.format(
            OutputKind::Hist {
                kind,
                layout,
                newline,
                name: name.clone(),
                keys: keys.clone(),
            },
            Vec::new(),
        );
        // After the copy, rsi is just past the element's value; its keys sit at
        // ENTRY_KEYS in the same table entry.
        let keys_back = super::super::data::ENTRY_KEYS as i32 - value_offset - bytes as i32;
        let cpu_number = self.env.facts.cpu_number;
        let empty = self.errors.empty;
        let r = (|| {
            let mut skip = self.a.create_label();
            self.a.test(rax, rax)?;
            self.a.jz(empty)?;
            self.a.cmp(qword_ptr(rax), 0)?;
            self.a.je(empty)?;
            self.a.push(rax)?;
            self.a.push(rax)?;
            rings.emit_reserve(self.a, cpu_number, rdi, skip)?;
            self.a.mov(dword_ptr(rdi + 8), id)?;
            self.a.mov(r8, rdi)?;
            self.a.pop(rsi)?;
            self.a.pop(rsi)?;
            self.a.lea(rdi, qword_ptr(r8 + 16))?;
            self.a.mov(ecx, bytes as u32)?;
            self.a.rep().movsb()?;
            if key_bytes > 0 {
                self.a.lea(rsi, qword_ptr(rsi + keys_back))?;
                self.a.mov(ecx, key_bytes as u32)?;
                self.a.rep().movsb()?;
            }
            self.a.rdtsc()?;
            self.a.shl(rdx, 32)?;
            self.a.or(rax, rdx)?;
            exotap_probes_base::rings::RingSet::emit_finish(self.a, r8, rax)?;
            self.a.add(rsp, -16)?;
            self.a.set_label(&mut skip)?;
            self.a.add(rsp, 16)
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }
}

/// The values of `printd(DELIM, a, b, ...)` with the literal delimiter between them, as
/// `print` takes them; `None` when the delimiter is not a string literal (evaluated once per
/// call, so it cannot be repeated).
fn interleaved(args: &[Expr]) -> Option<Vec<Expr>> {
    let (delim, values) = args.split_first()?;
    if !matches!(delim.kind, ExprKind::Str(_)) {
        return None;
    }
    let mut out = Vec::new();
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push(delim.clone());
        }
        out.push(v.clone());
    }
    Some(out)
}

/// The `printf`/`print`/`println`/`printd`/`printdln` calls of `prog`'s kernel probes.
/// Whether `c` prints its arguments: `printf`, `print`, `println`, `printd`, `printdln`.
pub(crate) fn is_print(c: &Call) -> bool {
    matches!(
        c.name.name.as_str(),
        "printf" | "print" | "println" | "printd" | "printdln"
    )
}

fn print_calls(prog: &Program) -> Vec<&Call> {
    fn expr<'p>(e: &'p Expr, out: &mut Vec<&'p Call>) {
        match &e.kind {
            ExprKind::Call(c) => {
                if is_print(c) {
                    out.push(c);
                }
                c.args.iter().for_each(|a| expr(a, out));
            }
            ExprKind::Unary(_, x) | ExprKind::Stat(_, x) | ExprKind::Hist(_, x) => expr(x, out),
            ExprKind::Binary(_, b) | ExprKind::Assign(_, b) | ExprKind::Aggregate(b) => {
                expr(&b.0, out);
                expr(&b.1, out);
            }
            ExprKind::Ternary(t) => {
                expr(&t.0, out);
                expr(&t.1, out);
                expr(&t.2, out);
            }
            ExprKind::Index(ix) => ix.keys.iter().for_each(|k| expr(k, out)),
            ExprKind::In(i) => i.keys.iter().for_each(|k| expr(k, out)),
            ExprKind::IncDec(i) => expr(&i.target, out),
            _ => {}
        }
    }
    fn stmt<'p>(s: &'p Stmt, out: &mut Vec<&'p Call>) {
        match &s.kind {
            StmtKind::Block(b) => b.stmts.iter().for_each(|s| stmt(s, out)),
            StmtKind::Expr(e) | StmtKind::Delete(e) | StmtKind::Return(Some(e)) => expr(e, out),
            StmtKind::If(i) => {
                expr(&i.cond, out);
                stmt(&i.then, out);
                if let Some(e) = &i.els {
                    stmt(e, out);
                }
            }
            StmtKind::While(w) => {
                expr(&w.0, out);
                stmt(&w.1, out);
            }
            StmtKind::For(f) => {
                for e in [&f.init, &f.cond, &f.step].into_iter().flatten() {
                    expr(e, out);
                }
                stmt(&f.body, out);
            }
            StmtKind::Foreach(f) => stmt(&f.body, out),
            StmtKind::Try(t) => t
                .body
                .stmts
                .iter()
                .chain(&t.handler.stmts)
                .for_each(|s| stmt(s, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for p in crate::guest_probes(prog) {
        if let Some(c) = &p.condition {
            expr(c, &mut out);
        }
        p.body.stmts.iter().for_each(|s| stmt(s, &mut out));
    }
    // User functions print too when a kernel probe calls them.
    for f in &prog.script.functions {
        if let FunctionBody::Block(b) = &f.body {
            b.stmts.iter().for_each(|s| stmt(s, &mut out));
        }
    }
    out
}

/// Whether any kernel probe of `prog` prints (then the data gets output rings).
pub fn prints(prog: &Program) -> bool {
    !print_calls(prog).is_empty() || takes_snapshots(prog)
}

/// The time of `ctime(t)` / `tz_ctime(t)` (a print argument the host renders).
fn ctime_arg(e: &Expr) -> Option<&Expr> {
    match &e.kind {
        ExprKind::Call(c) if matches!(c.name.name.as_str(), "ctime" | "tz_ctime") => {
            match c.args.as_slice() {
                [t] => Some(t),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Bytes of the output records `prog`'s kernel probes need: [`RECORD`], or the next power of
/// two that holds the largest `printf` of strings read from memory (at most [`MAX_RECORD`]).
pub fn record_bytes(prog: &Program, limits: &Limits) -> u64 {
    if takes_snapshots(prog) {
        return MAX_RECORD;
    }
    let text = super::memory::text_slot(limits) as u64;
    let builds = super::strings::builds_strings(prog);
    // Locals that hold strings read from memory, in any kernel probe.
    let texts: std::collections::HashSet<String> = prog
        .script
        .probes
        .iter()
        .flat_map(|p| super::memory::text_locals(&p.body))
        .collect();
    let largest = print_calls(prog)
        .iter()
        .map(|c| {
            let printd;
            let args = match c.name.name.as_str() {
                "printf" => &c.args[1.min(c.args.len())..],
                "printd" | "printdln" => {
                    printd = interleaved(&c.args).unwrap_or_default();
                    &printd[..]
                }
                _ => &c.args[..],
            };
            if let [Expr {
                kind: ExprKind::Hist(_, target),
                ..
            }] = args
            {
                let name = match &target.kind {
                    ExprKind::Var(n) => n,
                    ExprKind::Index(ix) => &ix.array.name,
                    _ => return 0,
                };
                return value_kind(prog, name).map_or(0, |k| 16 + k.size());
            }
            16 + args
                .iter()
                .map(|a| match &a.kind {
                    _ if text_call(a).is_some() => text,
                    ExprKind::Var(n) if texts.contains(n) => text,
                    // Any string may be a built one, whose text the record holds.
                    _ if builds => text,
                    _ => 16,
                })
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    largest.next_power_of_two().clamp(RECORD, MAX_RECORD)
}

/// Byte offsets of the syscall arguments in `struct pt_regs`: di, si, dx, r10, r8, r9.
const SYSCALL_ARG_REGS: [i32; 6] = [112, 104, 96, 56, 72, 64];

impl Gen<'_, '_> {
    /// A `timer.profile` probe (spliced into each tick's `update_process_times`).
    fn profile(&self) -> bool {
        self.point.name.starts_with(super::super::PROFILE_POINT)
    }

    /// Refuses `what` in a `timer.profile` probe: from the tick's splice it would describe
    /// the tick, not the interrupted code a sample is of.
    fn not_in_profile(&self, what: &str) -> R<()> {
        if self.profile() {
            return Err(self.no(format!(
                "{what} in timer.profile (it would start at the tick, not at the interrupted code)"
            )));
        }
        Ok(())
    }

    /// `value` of the tick's interrupted registers: `rax` = the per-CPU `irq_regs` pointer
    /// (`get_irq_regs()`), then `value`; 0 when there are none.
    fn irq_regs(
        &mut self,
        value: impl FnOnce(&mut Self, super::super::IrqRegs) -> Result<(), IcedError>,
    ) -> R<K> {
        let regs = self.env.facts.irq_regs.ok_or_else(|| {
            self.no("the tick's registers (the kernel has no __irq_regs or BTF pt_regs)")
        })?;
        let mut none = self.a.create_label();
        let r = (|| {
            let mut load = Instruction::with2(
                Code::Mov_r64_rm64,
                Register::RAX,
                iced_x86::MemoryOperand::with_base_displ(Register::None, regs.percpu as i64),
            )?;
            load.set_segment_prefix(Register::GS);
            load.set_memory_displ_size(4);
            self.a.add_instruction(load)?;
            self.a.test(rax, rax)?;
            self.a.jz(none)?;
            value(self, regs)?;
            self.a.set_label(&mut none)
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }

    /// `rax` = the `len`-byte word at the address in `rax` (sign-extended when `signed`),
    /// read with the nofault copy routine at `copy`; a fault ends the hit with a probe error.
    fn read_kernel(&mut self, copy: u64, len: u8, signed: bool) -> R<()> {
        let r = self.copy_in(copy, 0, len, signed);
        asm!(self, r)
    }

    /// `int_arg(n)`, `uint_arg(n)`, `long_arg(n)`, `ulong_arg(n)`, `pointer_arg(n)`, as the
    /// interpreter answers them: argument register `n` (1 to 6, a constant) at the entry
    /// (in a return probe the entry's, which the trampoline keeps), or in a syscall wrapper
    /// (`__x64_sys_*`) the syscall's argument from the `pt_regs` that is the wrapper's one
    /// parameter; `int_arg` sign-extends its low 32 bits, `uint_arg` zero-extends them.
    fn arg_register(&mut self, name: &str, c: &Call) -> R<K> {
        let n = match c.args.first().map(|a| &a.kind) {
            Some(ExprKind::Num(n)) if (1..=6).contains(n) => *n as usize,
            _ => {
                return Err(self.no(format!(
                    "{name}() of an argument number other than a constant 1 to 6"
                )))
            }
        };
        let entry_arg = |g: &Self, i: usize| -> i32 {
            if g.point.is_return {
                // The entry's value, which the trampoline pushed under the saved registers.
                8 * i as i32 - super::super::site::ENTRY_ARGS
            } else {
                super::saved_offset(super::ARGS[i])
            }
        };
        if self.point.function.starts_with("__x64_sys_") {
            let copy = self.env.facts.copy_nofault.ok_or_else(|| {
                self.no(format!(
                    "{name}() in a syscall wrapper (the kernel has no copy_from_kernel_nofault)"
                ))
            })?;
            let regs = entry_arg(self, 0);
            let at = SYSCALL_ARG_REGS[n - 1];
            asm!(self, self.a.mov(rax, qword_ptr(r15 + regs)))?;
            asm!(self, self.a.add(rax, at))?;
            self.read_kernel(copy, 8, true)?;
        } else {
            let off = entry_arg(self, n - 1);
            asm!(self, self.a.mov(rax, qword_ptr(r15 + off)))?;
        }
        match name {
            "int_arg" => asm!(self, self.a.movsxd(rax, eax))?,
            "uint_arg" => asm!(self, self.a.mov(eax, eax))?,
            _ => {}
        }
        Ok(K::Long)
    }
}

/// Builds the expressions that stand for tapset functions the interpreter answers natively
/// (each equal to its answer), at the call's place.
struct Ast {
    span: exotap_lang::ast::Span,
}

impl Ast {
    fn at(&self, kind: ExprKind) -> Expr {
        Expr {
            kind,
            span: self.span,
        }
    }
    fn num(&self, n: i64) -> Expr {
        self.at(ExprKind::Num(n))
    }
    fn text(&self, s: &str) -> Expr {
        self.at(ExprKind::Str(s.to_owned()))
    }
    fn bin(&self, op: BinOp, a: Expr, b: Expr) -> Expr {
        self.at(ExprKind::Binary(op, Box::new((a, b))))
    }
    fn call(&self, name: &str, args: Vec<Expr>) -> Expr {
        self.at(ExprKind::Call(Box::new(Call {
            name: Ident {
                name: name.to_owned(),
                span: self.span,
            },
            args,
        })))
    }
    fn ternary(&self, c: Expr, a: Expr, b: Expr) -> Expr {
        self.at(ExprKind::Ternary(Box::new((c, a, b))))
    }
    /// `sprintf(format, args...)`.
    fn sprintf(&self, format: &str, args: &[&Expr]) -> Expr {
        let mut all = vec![self.text(format)];
        all.extend(args.iter().map(|a| (*a).clone()));
        self.call("sprintf", all)
    }
    /// Rust's `{:#o}`, as the interpreter writes octal: `"0o" . sprintf("%o", x)`.
    fn rust_octal(&self, x: &Expr) -> Expr {
        self.bin(BinOp::Concat, self.text("0o"), self.sprintf("%o", &[x]))
    }
}

/// Whether reading `e` more than once reads the same value at no cost beyond the read.
fn pure(e: &Expr) -> bool {
    matches!(
        e.kind,
        ExprKind::Num(_) | ExprKind::Str(_) | ExprKind::Var(_) | ExprKind::Target(_)
    )
}

/// `return_str(format, ret)` as the expression the interpreter's answer equals (an errno
/// named, else decimal, `%#x` or Rust's `0o` octal): `-4095 <= ret && ret < 0 &&
/// errno_str(ret) != "" ? sprintf("%d (%s)", ret, errno_str(ret)) : format == 2 ?
/// sprintf("%#x", ret) : format == 3 ? "0o" . sprintf("%o", ret) : sprintf("%d", ret)`.
/// `None` when an argument could change or cost something if read more than once.
fn return_str(c: &Call) -> Option<Expr> {
    let [format, ret] = c.args.as_slice() else {
        return None;
    };
    if !pure(format) || !pure(ret) {
        return None;
    }
    let t = Ast { span: c.name.span };
    let errno = || t.call("errno_str", vec![ret.clone()]);
    let named = t.bin(
        BinOp::And,
        t.bin(
            BinOp::And,
            t.bin(BinOp::Ge, ret.clone(), t.num(-4095)),
            t.bin(BinOp::Lt, ret.clone(), t.num(0)),
        ),
        t.bin(BinOp::Ne, errno(), t.text("")),
    );
    let plain = t.ternary(
        t.bin(BinOp::Eq, format.clone(), t.num(2)),
        t.sprintf("%#x", &[ret]),
        t.ternary(
            t.bin(BinOp::Eq, format.clone(), t.num(3)),
            t.rust_octal(ret),
            t.sprintf("%d", &[ret]),
        ),
    );
    let errno = errno();
    Some(t.ternary(named, t.sprintf("%d (%s)", &[ret, &errno]), plain))
}

/// `_sys_open_flag_str(flags)` as the interpreter writes it (`native::open_flags`): the
/// access mode, then `|NAME` for each flag bit set in the table's order, then `|0o...` of
/// the bits it does not name. `None` unless `flags` is pure.
fn open_flag_str(c: &Call) -> Option<Expr> {
    let [flags] = c.args.as_slice() else {
        return None;
    };
    if !pure(flags) {
        return None;
    }
    let t = Ast { span: c.name.span };
    let mode = t.bin(BinOp::BitAnd, flags.clone(), t.num(3));
    let s = t.ternary(
        t.bin(BinOp::Eq, mode.clone(), t.num(0)),
        t.text("O_RDONLY"),
        t.ternary(
            t.bin(BinOp::Eq, mode.clone(), t.num(1)),
            t.text("O_WRONLY"),
            t.ternary(
                t.bin(BinOp::Eq, mode, t.num(2)),
                t.text("O_RDWR"),
                t.text("O_ACCMODE"),
            ),
        ),
    );
    // One sprintf of the parts: one string built per call, not one per flag.
    let mut parts = vec![s];
    let mut named = 3;
    for &(bit, name) in exotap_lang::native::OPEN_FLAGS {
        named |= bit;
        let set = t.bin(BinOp::BitAnd, flags.clone(), t.num(bit));
        parts.push(t.ternary(set, t.text(&format!("|{name}")), t.text("")));
    }
    let rest = t.bin(BinOp::BitAnd, flags.clone(), t.num(!named));
    parts.push(t.ternary(
        rest.clone(),
        t.bin(BinOp::Concat, t.text("|"), t.rust_octal(&rest)),
        t.text(""),
    ));
    let format = "%s".repeat(parts.len());
    let refs: Vec<&Expr> = parts.iter().collect();
    Some(t.sprintf(&format, &refs))
}

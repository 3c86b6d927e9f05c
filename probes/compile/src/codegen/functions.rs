//! User functions, `return`, `error()` and `try`/`catch` in a compiled body.
//!
//! A user function a probe reaches is emitted once after that probe's body, as a real
//! subroutine with its own frame under `rbp`: the caller pushes the arguments in order (a
//! long in 8 bytes, a string in 16) and calls it; the result comes back in `rax` (and `rdx`
//! for a string), a function without `return` gives 0 or "". `r12` counts the calls the hit
//! is nested in: a call at MAXNESTING is a probe error before its arguments are evaluated, as
//! in the interpreter, and since every level's frame is known at compile time the worst
//! case's kernel stack is bounded (a function whose MAXNESTING levels would pass
//! [`STACK_BUDGET`] bytes is refused by name). A probe error or `next` inside a function ends
//! the hit: `rbx` holds the probe's stack.
//!
//! `try { } catch (msg) { }`: while the guarded block is emitted, each kind of probe error
//! jumps to the handler instead of the probe's counters; the handler resets the stack to its
//! frame, stores the interpreter's message for that kind in `msg` and runs. Errors inside the
//! user functions the block calls find the handler through the catch record above the
//! probe's frame (`[rbx]`: the handler, its `rbp` and its nesting depth), which the block
//! sets on entry and puts back on the way out; with no record a function's error goes to the
//! probe's counters. A `break`, `continue` or `return` that would leave such a block with its
//! record set is refused by name, and so are reads of guest memory in a block whose message
//! is kept (the interpreter's text names the host's error).

use std::collections::HashMap;

use iced_x86::code_asm::*;

use exotap_lang::ast::*;
use exotap_lang::check::Ty;

use super::{walk, Errors, Gen, K, MAX_KEY_DEPTH, R};

/// Most bytes of kernel stack the nested frames of user functions may take.
pub(super) const STACK_BUDGET: i64 = 6 << 10;

/// The user functions of one body: their entry labels and those still to emit.
#[derive(Debug, Default)]
pub(super) struct Functions {
    labels: HashMap<usize, CodeLabel>,
    pending: Vec<usize>,
    /// While a function is emitted: where its `return` jumps, and what it returns.
    current: Option<(CodeLabel, K)>,
}

/// The kind of a value of type `ty` in registers (a function's result, a parameter).
fn kind_of(ty: Ty) -> K {
    if ty == Ty::Str {
        K::Str
    } else {
        K::Long
    }
}

impl Gen<'_, '_> {
    /// `f(args)` of user function `index`: rax (rdx) = its result.
    pub(super) fn call_user(&mut self, index: usize, c: &Call) -> R<K> {
        let prog = self.env.prog;
        let body = prog.script.probes.len() + index;
        let func = prog
            .script
            .functions
            .get(index)
            .ok_or_else(|| self.no(format!("the function {}()", c.name.name)))?;
        if walk::function_body(prog, index).is_none() {
            return Err(self.no(format!("the embedded-C function {}()", c.name.name)));
        }
        if c.args.len() != func.params.len() {
            return Err(self.no(format!(
                "{}() called with {} arguments, not {}",
                c.name.name,
                c.args.len(),
                func.params.len()
            )));
        }
        let types = prog.locals.get(body);
        let param_kinds: Vec<K> = func
            .params
            .iter()
            .map(|p| {
                kind_of(
                    types
                        .and_then(|t| t.get(&p.name.name))
                        .copied()
                        .unwrap_or(Ty::Long),
                )
            })
            .collect();
        let max = self.env.limits.max_nesting.min(i32::MAX as usize) as i32;
        let nesting = self.errors.nesting;
        asm!(self, self.a.cmp(r12, max))?;
        asm!(self, self.a.jae(nesting))?;
        let mut pushed = 0i32;
        for (a, want) in c.args.iter().zip(&param_kinds) {
            let k = self.expr(a)?;
            if k != *want {
                return Err(self.no(format!(
                    "an argument of {}() of another type than its parameter",
                    c.name.name
                )));
            }
            self.push(k)?;
            pushed += if k == K::Str { 16 } else { 8 };
        }
        let label = self.function_label(index);
        let r = (|| {
            self.a.inc(r12)?;
            self.a.call(label)?;
            self.a.dec(r12)?;
            if pushed > 0 {
                self.a.add(rsp, pushed)?;
            }
            Ok(())
        })();
        asm!(self, r)?;
        Ok(kind_of(
            prog.function_ret.get(index).copied().unwrap_or(Ty::Long),
        ))
    }

    fn function_label(&mut self, index: usize) -> CodeLabel {
        if let Some(l) = self.functions.labels.get(&index) {
            return *l;
        }
        let l = self.a.create_label();
        self.functions.labels.insert(index, l);
        self.functions.pending.push(index);
        l
    }

    /// `return` (in a function): the value in rax (rdx), then the function's exit.
    pub(super) fn ret(&mut self, e: Option<&Expr>) -> R<()> {
        let Some((exit, want)) = self.functions.current else {
            return Err(self.no("return in a kernel probe"));
        };
        if self.try_pushed > 0 {
            return Err(self.no("return out of a try block that calls user functions"));
        }
        match e {
            Some(e) => {
                let k = self.expr(e)?;
                if k != want {
                    return Err(self.no("a return value of another type than the function's"));
                }
            }
            None => {
                asm!(self, self.a.xor(eax, eax))?;
                asm!(self, self.a.xor(edx, edx))?;
            }
        }
        asm!(self, self.a.jmp(exit))
    }

    /// Emits every user function the body called (and those they call). A probe error
    /// inside one goes to the `try` that the catch record names, or else to the probe's
    /// counters.
    pub(super) fn emit_functions(&mut self) -> R<()> {
        if self.functions.pending.is_empty() {
            return Ok(());
        }
        let dynamic = Errors {
            div: self.a.create_label(),
            budget: self.a.create_label(),
            fault: self.a.create_label(),
            overflow: self.a.create_label(),
            empty: self.a.create_label(),
            other: self.a.create_label(),
            nesting: self.a.create_label(),
            strings: self.a.create_label(),
            argument: self.a.create_label(),
        };
        let probe = std::mem::replace(&mut self.errors, dynamic);
        let mut result = Ok(());
        while let Some(index) = self.functions.pending.pop() {
            result = self.emit_function(index);
            if result.is_err() {
                break;
            }
        }
        self.errors = probe;
        result?;
        // Each kind: no record → the probe's counters; else its message, then the handler.
        let mut dispatch = self.a.create_label();
        let kinds = [
            (dynamic.div, probe.div, Some(DIV_MESSAGE)),
            (dynamic.budget, probe.budget, Some(BUDGET_MESSAGE)),
            (dynamic.fault, probe.fault, Some(FAULT_MESSAGE)),
            (dynamic.overflow, probe.overflow, Some(OVERFLOW_MESSAGE)),
            (dynamic.empty, probe.empty, Some(EMPTY_MESSAGE)),
            (dynamic.nesting, probe.nesting, Some(NESTING_MESSAGE)),
            (dynamic.strings, probe.strings, Some(STRINGS_MESSAGE)),
            (dynamic.other, probe.other, None),
            (dynamic.argument, probe.argument, None),
        ];
        for (mut here, counted, message) in kinds {
            asm!(self, self.a.set_label(&mut here))?;
            asm!(self, self.a.cmp(qword_ptr(rbx), 0))?;
            asm!(self, self.a.je(counted))?;
            if let Some(m) = message {
                self.host_string(m)?;
            }
            asm!(self, self.a.jmp(dispatch))?;
        }
        let r = (|| {
            self.a.set_label(&mut dispatch)?;
            self.a.mov(rbp, qword_ptr(rbx + 8))?;
            self.a.mov(r12, qword_ptr(rbx + 16))?;
            self.a.jmp(qword_ptr(rbx))
        })();
        asm!(self, r)
    }

    fn emit_function(&mut self, index: usize) -> R<()> {
        let prog = self.env.prog;
        let func = &prog.script.functions[index];
        let body = walk::function_body(prog, index)
            .ok_or_else(|| self.no(format!("the embedded-C function {}()", func.name.name)))?;
        self.span = func.span;
        if !super::memory::text_locals(body).is_empty() {
            return Err(self.no(format!(
                "a string read from memory held in a local of {}()",
                func.name.name
            )));
        }
        let types = prog.locals.get(prog.script.probes.len() + index);
        let mut names: Vec<(&String, &Ty)> = types.map(|t| t.iter().collect()).unwrap_or_default();
        names.sort_by(|x, y| x.0.cmp(y.0));
        let mut locals = HashMap::new();
        let mut size = 0i32;
        for (name, ty) in names {
            if prog.globals.contains_key(name) {
                continue;
            }
            let k = match ty {
                Ty::Long | Ty::Unknown => K::Long,
                Ty::Str => K::Str,
                _ => {
                    return Err(self.no(format!(
                        "the local {name} of type {ty} in {}()",
                        func.name.name
                    )))
                }
            };
            size += if k == K::Str { 16 } else { 8 };
            locals.insert(name.clone(), (size, k));
        }
        let tables = walk::uses_tables(prog, body);
        let ret = kind_of(prog.function_ret.get(index).copied().unwrap_or(Ty::Long));
        let saved = (
            std::mem::replace(&mut self.locals, locals),
            std::mem::replace(&mut self.locals_size, size),
            std::mem::take(&mut self.texts),
            std::mem::take(&mut self.loops),
            self.key_levels,
            self.foreach_levels,
            self.foreach_depth,
            self.depth,
            std::mem::take(&mut self.try_pushed),
            self.try_loops.take(),
        );
        self.key_levels = if tables { MAX_KEY_DEPTH } else { 0 };
        self.foreach_levels = if tables {
            super::foreach::FOREACH_LEVELS
        } else {
            0
        };
        self.foreach_depth = 0;
        self.depth = 0;
        let result = self.function_code(index, body, ret);
        let (locals, size, texts, loops, keys, foreach, open, depth, pushed, try_loops) = saved;
        self.try_pushed = pushed;
        self.try_loops = try_loops;
        self.locals = locals;
        self.locals_size = size;
        self.texts = texts;
        self.loops = loops;
        self.key_levels = keys;
        self.foreach_levels = foreach;
        self.foreach_depth = open;
        self.depth = depth;
        self.functions.current = None;
        result
    }

    fn function_code(&mut self, index: usize, body: &Block, ret: K) -> R<()> {
        let prog = self.env.prog;
        let func = &prog.script.functions[index];
        let frame = self.frame_size();
        let params: Vec<(i32, K)> = func
            .params
            .iter()
            .map(|p| self.locals.get(&p.name.name).copied())
            .collect::<Option<_>>()
            .ok_or_else(|| self.no(format!("a parameter of {}()", func.name.name)))?;
        let args: i32 = params
            .iter()
            .map(|(_, k)| if *k == K::Str { 16 } else { 8 })
            .sum();
        let per_level = i64::from(frame) + 16 + i64::from(args);
        let levels = self.env.limits.max_nesting as i64;
        if per_level.saturating_mul(levels) > STACK_BUDGET {
            return Err(self.no(format!(
                "{}(), whose {levels} levels of nesting (MAXNESTING) would take {} bytes of \
                 kernel stack (at most {STACK_BUDGET})",
                func.name.name,
                per_level.saturating_mul(levels)
            )));
        }
        let mut label = self.function_label(index);
        let mut exit = self.a.create_label();
        self.functions.current = Some((exit, ret));
        let r = (|| {
            self.a.set_label(&mut label)?;
            self.a.push(rbp)?;
            self.a.mov(rbp, rsp)?;
            self.a.sub(rsp, frame)?;
            self.zero_locals()?;
            // Parameter i sits above the return address, after the ones pushed later.
            let mut at = 16 + args;
            for &(off, k) in &params {
                at -= if k == K::Str { 16 } else { 8 };
                self.a.mov(rax, qword_ptr(rbp + at))?;
                self.a.mov(qword_ptr(rbp - off), rax)?;
                if k == K::Str {
                    self.a.mov(rax, qword_ptr(rbp + at + 8))?;
                    self.a.mov(qword_ptr(rbp - off + 8), rax)?;
                }
            }
            Ok(())
        })();
        asm!(self, r)?;
        self.block(body)?;
        let r = (|| {
            self.a.xor(eax, eax)?;
            self.a.xor(edx, edx)?;
            self.a.set_label(&mut exit)?;
            self.a.mov(rsp, rbp)?;
            self.a.pop(rbp)?;
            self.a.ret()
        })();
        asm!(self, r)
    }

    /// `error(msg)`: a probe error, or inside `try` the handler with `msg`.
    pub(super) fn error(&mut self, c: &Call) -> R<K> {
        let arg = c
            .args
            .first()
            .ok_or_else(|| self.no("error() without a message"))?;
        if self.expr(arg)? != K::Str {
            return Err(self.no("error() of a number"));
        }
        let other = self.errors.other;
        asm!(self, self.a.jmp(other))?;
        Ok(K::Long)
    }

    /// `try { body } catch (var) { handler }`.
    pub(super) fn try_catch(&mut self, t: &TryStmt) -> R<()> {
        let prog = self.env.prog;
        let called: Vec<usize> = t
            .body
            .stmts
            .iter()
            .flat_map(|s| walk::called_functions(prog, s))
            .collect();
        let reached = walk::reachable_functions(prog, &called);
        if t.var.is_some() {
            let mut reads = false;
            walk::block_exprs(&t.body, &mut |e| reads |= walk::reads_memory(e));
            for &i in &reached {
                if let Some(b) = walk::function_body(prog, i) {
                    walk::block_exprs(b, &mut |e| reads |= walk::reads_memory(e));
                }
            }
            if reads {
                return Err(self.no(
                    "a guest memory read inside try with catch (msg) (the interpreter's message \
                     names the host's error)",
                ));
            }
        }
        let var = match &t.var {
            Some(v) => Some(
                *self
                    .locals
                    .get(&v.name)
                    .ok_or_else(|| self.no(format!("the catch variable {}", v.name)))?,
            ),
            None => None,
        };
        // With user functions in the body, their errors find the handler through the catch
        // record; the record in force before is saved on the stack and put back on the way
        // out (normally or through the handler).
        let record = !reached.is_empty();
        let frame = self.frame_size();
        let base = self.try_pushed;
        let mut handler = self.a.create_label();
        if record {
            let r = (|| {
                self.a.push(qword_ptr(rbx + 16))?;
                self.a.push(qword_ptr(rbx + 8))?;
                self.a.push(qword_ptr(rbx))?;
                self.a.lea(rax, qword_ptr(handler))?;
                self.a.mov(qword_ptr(rbx), rax)?;
                self.a.mov(qword_ptr(rbx + 8), rbp)?;
                self.a.mov(qword_ptr(rbx + 16), r12)
            })();
            asm!(self, r)?;
        }
        let caught = Errors {
            div: self.a.create_label(),
            budget: self.a.create_label(),
            fault: self.a.create_label(),
            overflow: self.a.create_label(),
            empty: self.a.create_label(),
            other: self.a.create_label(),
            nesting: self.a.create_label(),
            strings: self.a.create_label(),
            argument: self.a.create_label(),
        };
        let outer = std::mem::replace(&mut self.errors, caught);
        let outer_loops = self.try_loops;
        if record {
            self.try_pushed += 24;
            self.try_loops = Some(self.loops.len());
        }
        let body = self.block(&t.body);
        self.errors = outer;
        self.try_pushed = base;
        self.try_loops = outer_loops;
        body?;
        let mut done = self.a.create_label();
        let mut restore = self.a.create_label();
        if record {
            let r = (|| {
                self.a.pop(qword_ptr(rbx))?;
                self.a.pop(qword_ptr(rbx + 8))?;
                self.a.pop(qword_ptr(rbx + 16))
            })();
            asm!(self, r)?;
        }
        asm!(self, self.a.jmp(done))?;
        let kinds = [
            (caught.div, DIV_MESSAGE),
            (caught.budget, BUDGET_MESSAGE),
            (caught.fault, FAULT_MESSAGE),
            (caught.overflow, OVERFLOW_MESSAGE),
            (caught.empty, EMPTY_MESSAGE),
            (caught.nesting, NESTING_MESSAGE),
            (caught.strings, STRINGS_MESSAGE),
        ];
        for (mut label, message) in kinds {
            asm!(self, self.a.set_label(&mut label))?;
            self.host_string(message)?;
            asm!(self, self.a.jmp(restore))?;
        }
        let mut other = caught.other;
        self.place(&mut other)?;
        let mut argument = caught.argument;
        self.place(&mut argument)?;
        // From a function (rbp and r12 already the owner's) or from the body itself. A
        // function reaches it by `jmp [rbx]`, an indirect branch: it begins with `endbr64`,
        // as IBT requires of every indirect target (a nop where IBT is not enforced).
        let r = (|| {
            self.a.set_label(&mut handler)?;
            self.a.endbr64()
        })();
        asm!(self, r)?;
        self.place(&mut restore)?;
        let top = -(frame + base);
        let r = (|| {
            if record {
                for (i, at) in [0, 8, 16].into_iter().enumerate() {
                    self.a.mov(rcx, qword_ptr(rbp + top - 24 + 8 * i as i32))?;
                    self.a.mov(qword_ptr(rbx + at), rcx)?;
                }
            }
            self.a.lea(rsp, qword_ptr(rbp + top))?;
            if let Some((off, k)) = var {
                self.a.mov(qword_ptr(rbp - off), rax)?;
                if k == K::Str {
                    self.a.mov(qword_ptr(rbp - off + 8), rdx)?;
                }
            }
            Ok(())
        })();
        asm!(self, r)?;
        self.block(&t.handler)?;
        self.place(&mut done)
    }
}

/// The interpreter's message of each kind of probe error (probes/lang/src/eval*.rs), which
/// `catch (msg)` receives.
const DIV_MESSAGE: &str = "division by 0";
const BUDGET_MESSAGE: &str = "MAXACTION exceeded";
const FAULT_MESSAGE: &str = "kernel read fault";
const OVERFLOW_MESSAGE: &str = "array overflow, check MAXMAPENTRIES";
const EMPTY_MESSAGE: &str = "empty aggregate";
const NESTING_MESSAGE: &str = "MAXNESTING exceeded";
/// A string built in the guest that its string table had no room for (not an interpreter
/// error: the interpreter never runs out).
const STRINGS_MESSAGE: &str = "string table full";

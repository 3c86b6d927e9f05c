//! Unwinding synthetic stacks with synthetic tables: every frame type, every stop, and
//! hostile input. The tests on the real Debian vmlinux are in `real_kernel_tests.rs`.

use super::testing::*;
use super::*;

/// The task stack of the synthetic tests.
const STACK: u64 = 0xffff_c900_0001_0000;
/// A second stack (IRQ stack) for stack switches.
const IRQ_STACK: u64 = 0xffff_c900_0100_0000;

/// Functions of the synthetic text, by offset from TEXT:
/// - leaf 0x000: entry `call(8)`; from 0x10 (after two pushes) `call(24)`.
/// - mid 0x100: entry `call(8)`; from 0x108 (after `push %rbp`) sp+16, bp at prev_sp-16.
/// - top 0x200: entry `call(8)`; from 0x210 `call(16)`.
/// - bottom 0x300: end of stack.
/// - entry code 0x400: a full `pt_regs` at sp.
/// - entry code 0x500: an iret frame at sp.
/// - frame-pointer code 0x600: sp = bp+16, bp saved at prev_sp-16.
/// - gap 0x700: an undefined entry (terminator without the end bit).
/// - 0x800: sp from r13 (entry code).
/// - 0x900: sp from the word at sp, plus 8 (return from the IRQ stack).
/// - 0xa00: sp from the word at bp-8.
/// - 0xb00: a hostile rule whose caller's sp is below the callee's.
/// - 0xc00: type 3, which the 4.14 layout does not define.
/// - 0xd00: sp_reg 12, which no kernel defines.
fn kernel() -> OrcTable {
    text_table(&[
        (0x000, call(8)),
        (0x010, call(24)),
        (0x100, call(8)),
        (0x108, entry(SP, 16, PREV_SP, -16, CALL)),
        (0x200, call(8)),
        (0x210, call(16)),
        (0x300, end_of_stack()),
        (0x400, entry(SP, 0, 0, 0, REGS)),
        (0x500, entry(SP, 0, 0, 0, REGS_PARTIAL)),
        (0x600, entry(BP, 16, PREV_SP, -16, CALL)),
        (0x700, RawOrcEntry::default()),
        (0x800, entry(R13, 0, 0, 0, CALL)),
        (0x900, entry(SP_INDIRECT, 8, 0, 0, CALL)),
        (0xa00, entry(BP_INDIRECT, -8, 0, 0, CALL)),
        (0xb00, call(-8)),
        (0xc00, entry(SP, 8, 0, 0, 3)),
        (0xd00, entry(12, 8, 0, 0, CALL)),
    ])
}

fn start(ip: u64, sp: u64, bp: u64) -> UnwindStart {
    UnwindStart {
        ip,
        sp,
        bp,
        regs: None,
        signal: true,
    }
}

fn kernel_regs(ip: u64, sp: u64) -> PtRegs {
    PtRegs {
        ip,
        sp,
        cs: 0x10,
        ss: 0x18,
        flags: 0x246,
        ..PtRegs::default()
    }
}

fn pcs(bt: &Backtrace) -> Vec<u64> {
    bt.pcs().map(|pc| pc - TEXT).collect()
}

fn sps(bt: &Backtrace) -> Vec<u64> {
    bt.frames.iter().map(|f| f.sp).collect()
}

#[test]
fn call_frames_follow_sp_offsets_to_the_end_of_the_stack() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    stack
        .put(STACK + 16, TEXT + 0x140)
        .put(STACK + 24, 0xbbbb)
        .put(STACK + 32, TEXT + 0x250)
        .put(STACK + 48, TEXT + 0x310);

    let bt =
        Unwinder::new(&table, 0).unwind(&start(TEXT + 0x20, STACK, 0xaaaa), &mut stack.snapshot());

    assert_eq!(pcs(&bt), [0x20, 0x140, 0x250, 0x310]);
    assert_eq!(sps(&bt), [STACK, STACK + 24, STACK + 40, STACK + 56]);
    assert_eq!(bt.frames[2].bp, 0xbbbb);
    assert!(matches!(bt.end, StackEnd::EndOfStack));
    assert!(bt.is_reliable());
}

#[test]
fn return_address_is_looked_up_one_byte_back() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    // Returning right at 0x10: the call instruction is still in the 8-deep part before it.
    stack.put(STACK, TEXT + 0x10).put(STACK + 8, TEXT + 0x310);

    let bt = Unwinder::new(&table, 0).unwind(&start(TEXT + 0x100, STACK, 0), &mut stack.snapshot());

    assert_eq!(pcs(&bt), [0x100, 0x10, 0x310]);
    assert_eq!(sps(&bt), [STACK, STACK + 8, STACK + 16]);
}

#[test]
fn regs_frame_takes_ip_sp_and_bp_from_pt_regs() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    let interrupted = PtRegs {
        bp: 0xb0b0,
        ..kernel_regs(TEXT + 0x10, IRQ_STACK)
    };
    stack.put_words(STACK, &interrupted.to_words());
    let mut irq = StackImage::new(IRQ_STACK, 0x100);
    irq.put(IRQ_STACK + 16, TEXT + 0x310);
    let mut mem = stack.snapshot();
    mem.add_region(IRQ_STACK, irq.bytes());

    let bt = Unwinder::new(&table, 0).unwind(&start(TEXT + 0x410, STACK, 0), &mut mem);

    assert_eq!(pcs(&bt), [0x410, 0x10, 0x310]);
    assert_eq!(sps(&bt), [STACK, IRQ_STACK, IRQ_STACK + 24]);
    assert_eq!(
        bt.frames
            .iter()
            .map(|f| (f.kind, f.signal))
            .collect::<Vec<_>>(),
        [
            (FrameKind::Start, true),
            (FrameKind::Interrupt, true),
            (FrameKind::Call, false)
        ]
    );
    assert_eq!(bt.frames[1].bp, 0xb0b0);
    assert_eq!(bt.frames[1].regs, Some(interrupted));
    assert!(matches!(bt.end, StackEnd::EndOfStack));
}

#[test]
fn regs_frame_from_user_mode_ends_the_unwind() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    let user = PtRegs {
        cs: 0x33,
        ..kernel_regs(0x7f00_0000_1234, 0x7ffc_0000_0000)
    };
    stack.put_words(STACK, &user.to_words());

    let bt = Unwinder::new(&table, 0).unwind(&start(TEXT + 0x410, STACK, 0), &mut stack.snapshot());

    assert_eq!(pcs(&bt), [0x410]);
    assert!(matches!(
        bt.end,
        StackEnd::UserMode {
            pc: 0x7f00_0000_1234,
            sp: 0x7ffc_0000_0000
        }
    ));
    assert!(bt.is_complete());
}

#[test]
fn partial_regs_frame_reads_the_iret_frame() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    stack.put_words(STACK, &[TEXT + 0x10, 0x10, 0x246, STACK + 0x80, 0x18]);
    stack.put(STACK + 0x80 + 16, TEXT + 0x310);

    let bt =
        Unwinder::new(&table, 0).unwind(&start(TEXT + 0x510, STACK, 0x5555), &mut stack.snapshot());

    assert_eq!(pcs(&bt), [0x510, 0x10, 0x310]);
    assert_eq!(sps(&bt), [STACK, STACK + 0x80, STACK + 0x98]);
    assert_eq!(bt.frames[1].kind, FrameKind::Iret);
    assert_eq!(bt.frames[1].bp, 0x5555);
    assert!(matches!(bt.end, StackEnd::EndOfStack));
}

#[test]
fn frame_pointer_frame_restores_bp_from_the_stack() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    stack
        .put(STACK + 0x40, 0xf00d)
        .put(STACK + 0x48, TEXT + 0x310);

    let bt = Unwinder::new(&table, 0).unwind(
        &start(TEXT + 0x610, STACK, STACK + 0x40),
        &mut stack.snapshot(),
    );

    assert_eq!(pcs(&bt), [0x610, 0x310]);
    assert_eq!(sps(&bt), [STACK, STACK + 0x50]);
    assert_eq!(bt.frames[1].bp, 0xf00d);
    assert!(matches!(bt.end, StackEnd::EndOfStack));
}

#[test]
fn end_of_stack_entry_stops_with_only_the_start() {
    let table = kernel();

    let bt = Unwinder::new(&table, 0).unwind(
        &start(TEXT + 0x310, STACK, 0),
        &mut StackImage::new(STACK, 8).snapshot(),
    );

    assert_eq!(pcs(&bt), [0x310]);
    assert!(bt.is_reliable());
}

#[test]
fn undefined_entry_is_an_error() {
    let table = kernel();

    let bt = Unwinder::new(&table, 0).unwind(
        &start(TEXT + 0x710, STACK, 0),
        &mut StackImage::new(STACK, 8).snapshot(),
    );

    assert!(matches!(bt.end, StackEnd::Error(UnwindError::Undefined { pc }) if pc == TEXT + 0x710));
    assert!(!bt.is_complete());
}

#[test]
fn r13_based_sp_needs_a_full_register_set() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    stack.put(STACK + 0x20, TEXT + 0x310);

    let without =
        Unwinder::new(&table, 0).unwind(&start(TEXT + 0x810, STACK, 0), &mut stack.snapshot());
    let regs = PtRegs {
        r13: STACK + 0x28,
        ..kernel_regs(TEXT + 0x810, STACK)
    };
    let with =
        Unwinder::new(&table, 0).unwind(&UnwindStart::from_regs(regs), &mut stack.snapshot());

    assert!(matches!(
        without.end,
        StackEnd::Error(UnwindError::MissingRegister {
            reg: OrcReg::R13,
            ..
        })
    ));
    assert_eq!(pcs(&with), [0x810, 0x310]);
    assert_eq!(sps(&with), [STACK, STACK + 0x28]);
}

#[test]
fn sp_indirect_switches_back_to_the_task_stack() {
    let table = kernel();
    let mut irq = StackImage::new(IRQ_STACK, 0x100);
    irq.put(IRQ_STACK, STACK + 0x40);
    let mut task = StackImage::new(STACK, 0x100);
    task.put(STACK + 0x40, TEXT + 0x310);
    let mut mem = irq.snapshot();
    mem.add_region(STACK, task.bytes());

    let bt = Unwinder::new(&table, 0).unwind(&start(TEXT + 0x910, IRQ_STACK, 0), &mut mem);

    assert_eq!(pcs(&bt), [0x910, 0x310]);
    assert_eq!(sps(&bt), [IRQ_STACK, STACK + 0x48]);
    assert!(matches!(bt.end, StackEnd::EndOfStack));
}

#[test]
fn bp_indirect_loads_the_callers_sp() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    stack
        .put(STACK + 0x38, STACK + 0x80)
        .put(STACK + 0x78, TEXT + 0x310);

    let bt = Unwinder::new(&table, 0).unwind(
        &start(TEXT + 0xa10, STACK, STACK + 0x40),
        &mut stack.snapshot(),
    );

    assert_eq!(pcs(&bt), [0xa10, 0x310]);
    assert_eq!(sps(&bt), [STACK, STACK + 0x80]);
}

#[test]
fn caller_sp_below_callee_sp_is_an_error() {
    let table = kernel();
    let mut stack = StackImage::new(STACK - 0x100, 0x200);
    stack.put(STACK - 16, TEXT + 0x310);

    let bt = Unwinder::new(&table, 0).unwind(&start(TEXT + 0xb10, STACK, 0), &mut stack.snapshot());

    assert!(matches!(
        bt.end,
        StackEnd::Error(UnwindError::WrongDirection { sp, prev_sp, .. }) if sp == STACK - 8 && prev_sp == STACK
    ));
}

#[test]
fn stack_switch_back_to_the_same_frame_is_a_cycle() {
    let table = kernel();
    // The saved stack pointer leads back to this very frame: same sp, same pc.
    let mut stack = StackImage::new(STACK - 8, 0x100);
    stack.put(STACK - 8, TEXT + 0x911).put(STACK, STACK - 8);

    let bt = Unwinder::new(&table, 0).unwind(&start(TEXT + 0x911, STACK, 0), &mut stack.snapshot());

    assert!(matches!(bt.end, StackEnd::Error(UnwindError::Cycle { sp, .. }) if sp == STACK));
    assert_eq!(pcs(&bt), [0x911]);
}

#[test]
fn declared_stack_forbids_going_down_even_across_regs_frames() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x200);
    stack.put_words(
        STACK + 0x100,
        &kernel_regs(TEXT + 0x10, STACK + 0x40).to_words(),
    );
    let unwinder = Unwinder::new(&table, 0).with_stack(STACK..STACK + 0x200);

    let bt = unwinder.unwind(
        &start(TEXT + 0x410, STACK + 0x100, 0),
        &mut stack.snapshot(),
    );

    assert!(matches!(
        bt.end,
        StackEnd::Error(UnwindError::WrongDirection { .. })
    ));
}

#[test]
fn recursion_stops_at_the_frame_limit() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x1000);
    for depth in 0..200u64 {
        stack.put(STACK + 8 + depth * 16, TEXT + 0x220);
    }

    let bt = Unwinder::new(&table, 0)
        .with_max_frames(10)
        .unwind(&start(TEXT + 0x220, STACK, 0), &mut stack.snapshot());

    assert_eq!(bt.frames.len(), 10);
    assert!(matches!(bt.end, StackEnd::FrameLimit { max: 10 }));
}

#[test]
fn return_address_outside_the_tables_is_no_entry() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    stack.put(STACK + 16, 0xffff_ffff_a000_0000);

    let bt = Unwinder::new(&table, 0).unwind(&start(TEXT + 0x20, STACK, 0), &mut stack.snapshot());

    assert_eq!(pcs(&bt), [0x20]);
    assert!(matches!(
        bt.end,
        StackEnd::Error(UnwindError::NoEntry {
            pc: 0xffff_ffff_a000_0000
        })
    ));
}

#[test]
fn frame_pointer_guess_covers_code_without_orc_and_marks_it_unreliable() {
    let table = kernel();
    let bpf = 0xffff_ffff_a000_0000;
    let mut stack = StackImage::new(STACK, 0x100);
    stack
        .put(STACK + 16, bpf)
        .put(STACK + 0x40, 0)
        .put(STACK + 0x48, TEXT + 0x310);

    let bt = Unwinder::new(&table, 0)
        .with_frame_pointer_guess(true)
        .unwind(
            &start(TEXT + 0x20, STACK, STACK + 0x40),
            &mut stack.snapshot(),
        );

    assert_eq!(
        bt.pcs().collect::<Vec<_>>(),
        [TEXT + 0x20, bpf, TEXT + 0x310]
    );
    assert_eq!(
        bt.frames.iter().map(|f| f.reliable).collect::<Vec<_>>(),
        [true, false, false]
    );
    assert!(bt.is_complete() && !bt.is_reliable());
}

#[test]
fn slide_moves_the_table_to_running_addresses() {
    let table = kernel();
    let slide = 0x2e0_0000;
    let mut stack = StackImage::new(STACK, 0x100);
    stack.put(STACK + 16, TEXT + slide + 0x310);

    let bt = Unwinder::new(&table, slide)
        .unwind(&start(TEXT + slide + 0x20, STACK, 0), &mut stack.snapshot());

    assert_eq!(
        bt.pcs().collect::<Vec<_>>(),
        [TEXT + slide + 0x20, TEXT + slide + 0x310]
    );
    assert!(matches!(bt.end, StackEnd::EndOfStack));
}

#[test]
fn module_table_joins_the_kernel_table() {
    let kernel_table = kernel();
    let module_text = 0xffff_ffff_c000_0000;
    let module = table_at(module_text, &[(0, call(16))]);
    let mut stack = StackImage::new(STACK, 0x100);
    stack.put(STACK + 8, TEXT + 0x310);

    let bt = Unwinder::new(&kernel_table, 0)
        .with_table(&module, 0)
        .unwind(&start(module_text + 0x40, STACK, 0), &mut stack.snapshot());

    assert_eq!(
        bt.pcs().collect::<Vec<_>>(),
        [module_text + 0x40, TEXT + 0x310]
    );
}

#[test]
fn sleeping_task_starts_at_its_switch_frame() {
    let table = kernel();
    let thread_sp = STACK + 0x20;
    let mut stack = StackImage::new(STACK, 0x100);
    stack
        .put_words(thread_sp, &[15, 14, 13, 12, 11, 0xbeef, TEXT + 0x250])
        .put(thread_sp + 56 + 8, TEXT + 0x310);
    let mut mem = stack.snapshot();

    let begin = UnwindStart::from_inactive_task(&mut mem, thread_sp, None).unwrap();
    let bt = Unwinder::new(&table, 0).unwind(&begin, &mut mem);

    assert_eq!(
        (begin.ip, begin.sp, begin.bp, begin.signal),
        (TEXT + 0x250, thread_sp + 56, 0xbeef, false)
    );
    assert_eq!(pcs(&bt), [0x250, 0x310]);
    assert_eq!(sps(&bt), [thread_sp + 56, thread_sp + 56 + 16]);
}

#[test]
fn task_that_never_ran_starts_exactly_at_ret_from_fork() {
    let ret_from_fork = TEXT + 0x300;
    let mut stack = StackImage::new(STACK, 0x100);
    stack.put_words(STACK, &[0, 0, 0, 0, 0, 0, ret_from_fork]);

    let begin =
        UnwindStart::from_inactive_task(&mut stack.snapshot(), STACK, Some(ret_from_fork)).unwrap();

    assert!(begin.signal);
}

/// A vCPU stopped in `__switch_to`, reached by `__switch_to_asm`'s jump, on the stack of a
/// task that never ran: the return address is `ret_from_fork`'s first instruction, and one
/// byte back is the padding after the routine before it, which has no rule.
#[test]
fn a_return_to_the_first_instruction_of_ret_from_fork_is_looked_up_as_is() {
    let ret_from_fork = TEXT + 0x300;
    let table = text_table(&[
        (0x100, call(8)),
        (0x2f6, RawOrcEntry::default()),
        (0x300, end_of_stack()),
        (0x310, call(8)),
    ]);
    let mut stack = StackImage::new(STACK, 0x100);
    stack.put(STACK, ret_from_fork);
    let begin = UnwindStart {
        ip: TEXT + 0x120,
        sp: STACK,
        bp: 0,
        regs: None,
        signal: true,
    };

    let plain = Unwinder::new(&table, 0).unwind(&begin, &mut stack.snapshot());
    let known = Unwinder::new(&table, 0)
        .with_entry_return(ret_from_fork)
        .unwind(&begin, &mut stack.snapshot());

    assert!(matches!(
        plain.end,
        StackEnd::Error(UnwindError::Undefined { .. })
    ));
    assert_eq!(pcs(&known), [0x120, 0x300]);
    assert!(known.frames[1].signal);
    assert!(matches!(known.end, StackEnd::EndOfStack));
}

#[test]
fn task_frame_at_the_top_of_the_address_space_is_refused() {
    let stack = StackImage::new(STACK, 8);

    let err =
        UnwindStart::from_inactive_task(&mut stack.snapshot(), u64::MAX - 16, None).unwrap_err();

    assert!(matches!(err, UnwindError::TaskFrameOverflow { .. }));
}

#[test]
fn start_in_user_mode_has_no_kernel_frames() {
    let table = kernel();
    let regs = PtRegs {
        cs: 0x33,
        ..kernel_regs(0x40_1000, 0x7ffc_0000_0000)
    };

    let bt = Unwinder::new(&table, 0).unwind(
        &UnwindStart::from_regs(regs),
        &mut StackImage::new(STACK, 8).snapshot(),
    );

    assert!(bt.frames.is_empty());
    assert!(matches!(bt.end, StackEnd::UserMode { pc: 0x40_1000, .. }));
}

#[test]
fn call_through_null_pointer_unwinds_with_the_null_rule() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    stack.put(STACK, TEXT + 0x310);

    let bt = Unwinder::new(&table, 0).unwind(&start(0, STACK, 0), &mut stack.snapshot());

    assert_eq!(bt.pcs().collect::<Vec<_>>(), [0, TEXT + 0x310]);
    assert!(matches!(bt.end, StackEnd::EndOfStack));
}

#[test]
fn unreadable_return_address_reports_its_address() {
    let table = kernel();

    let bt = Unwinder::new(&table, 0).unwind(
        &start(TEXT + 0x20, STACK, 0),
        &mut StackImage::new(STACK, 8).snapshot(),
    );

    assert!(matches!(
        bt.end,
        StackEnd::Error(UnwindError::StackRead { what: "return address", addr, .. }) if addr == STACK + 16
    ));
}

#[test]
fn unknown_type_and_register_are_errors() {
    let table = kernel();
    let mut mem = StackImage::new(STACK, 0x100).snapshot();
    let unwinder = Unwinder::new(&table, 0);

    let bad_type = unwinder.unwind(&start(TEXT + 0xc10, STACK, 0), &mut mem);
    let bad_reg = unwinder.unwind(&start(TEXT + 0xd10, STACK, 0), &mut mem);

    assert!(matches!(
        bad_type.end,
        StackEnd::Error(UnwindError::UnknownType { value: 3, .. })
    ));
    assert!(matches!(
        bad_reg.end,
        StackEnd::Error(UnwindError::UnsupportedSpReg {
            reg: OrcReg::Unknown(12),
            ..
        })
    ));
}

#[test]
fn dx_based_sp_comes_from_the_previous_full_regs_after_an_iret_frame() {
    // An iret frame found from a full register set: rdx still comes from that set.
    let table = text_table(&[
        (0x000, call(24)),
        (0x300, end_of_stack()),
        (0x500, entry(SP, 0, 0, 0, REGS_PARTIAL)),
        (0x600, entry(DX, 0, 0, 0, CALL)),
    ]);
    let mut stack = StackImage::new(STACK, 0x200);
    stack.put_words(STACK, &[TEXT + 0x610, 0x10, 0x246, STACK + 0x80, 0x18]);
    stack.put(STACK + 0x100 - 8, TEXT + 0x310);
    let regs = PtRegs {
        dx: STACK + 0x100,
        ..kernel_regs(TEXT + 0x510, STACK)
    };

    let bt = Unwinder::new(&table, 0).unwind(&UnwindStart::from_regs(regs), &mut stack.snapshot());

    assert_eq!(pcs(&bt), [0x510, 0x610, 0x310]);
    assert!(matches!(bt.end, StackEnd::EndOfStack));
}

#[test]
fn formatter_names_frames_and_the_end() {
    let table = kernel();
    let mut stack = StackImage::new(STACK, 0x100);
    stack
        .put(STACK + 16, TEXT + 0x140)
        .put(STACK + 32, TEXT + 0x310);
    let bt = Unwinder::new(&table, 0).unwind(&start(TEXT + 0x20, STACK, 0), &mut stack.snapshot());
    let names = [(0x000, "leaf"), (0x100, "mid"), (0x300, "bottom")];

    let text = format_backtrace(&bt, |addr| {
        names
            .iter()
            .rev()
            .find(|(off, _)| TEXT + off <= addr)
            .map(|&(off, name)| (name, addr - TEXT - off))
    });

    assert_eq!(
        text,
        "#0  0xffffffff81000020 leaf+0x20 sp=0xffffc90000010000\n\
         #1  0xffffffff81000140 mid+0x40 sp=0xffffc90000010018\n\
         #2  0xffffffff81000310 bottom+0x10 sp=0xffffc90000010028\n\
         -- end of stack\n"
    );
}

#[test]
fn formatter_reports_the_error_with_its_cause() {
    let table = kernel();
    let bt = Unwinder::new(&table, 0).unwind(
        &start(TEXT + 0x20, STACK, 0),
        &mut StackImage::new(STACK, 8).snapshot(),
    );

    let text = format_backtrace(&bt, |_| None::<(&str, u64)>);

    assert_eq!(
        text,
        "#0  0xffffffff81000020 sp=0xffffc90000010000\n\
         -- stopped: reading the return address at 0xffffc90000010010 failed: \
         0xffffc90000010010 is outside the stack snapshot\n"
    );
}

/// xorshift64: a deterministic stream for the hostile-input test.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_tables_and_stacks_never_panic() {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let layouts = [
        OrcLayout::Linux4_14,
        OrcLayout::Linux6_3,
        OrcLayout::Linux6_4,
    ];
    let mut unwound = 0;
    for round in 0..3000 {
        let count = 1 + rng.below(24);
        let mut ip = TEXT;
        let mut ip_table = Vec::new();
        let mut entries = Vec::new();
        for i in 0..count {
            ip += rng.below(64);
            let slot = IP_TABLE + i * 4;
            ip_table.extend_from_slice(&((ip.wrapping_sub(slot)) as i32).to_le_bytes());
            entries.extend_from_slice(&rng.next().to_le_bytes()[..6]);
        }
        // Corrupt some inputs at random bytes, and some lengths.
        if round % 3 == 0 {
            let at = rng.below(ip_table.len() as u64) as usize;
            ip_table[at] ^= rng.next() as u8;
        }
        if round % 7 == 0 {
            entries.truncate(rng.below(entries.len() as u64) as usize);
        }
        let layout = layouts[round % 3];
        let Ok(table) = OrcTable::parse_with_layout(&ip_table, IP_TABLE, &entries, layout) else {
            continue;
        };
        let stack: Vec<u8> = (0..64)
            .flat_map(|_| {
                let word = match rng.below(4) {
                    0 => TEXT + rng.below(count * 64),
                    1 => STACK + rng.below(512),
                    _ => rng.next(),
                };
                word.to_le_bytes()
            })
            .collect();
        let mut mem = StackSnapshot::new(STACK, stack);
        let regs = PtRegs {
            r10: rng.next(),
            r13: STACK + rng.below(512),
            di: rng.next(),
            dx: STACK + rng.below(512),
            ..kernel_regs(TEXT + rng.below(count * 64), STACK + rng.below(512))
        };
        let begin = match rng.below(3) {
            0 => UnwindStart::from_regs(regs),
            1 => start(regs.ip, regs.sp, rng.next()),
            _ => match UnwindStart::from_inactive_task(&mut mem, regs.sp, None) {
                Ok(begin) => begin,
                Err(_) => continue,
            },
        };
        let unwinder = Unwinder::new(&table, 0)
            .with_max_frames(16)
            .with_frame_pointer_guess(round % 2 == 0);

        let bt = unwinder.unwind(&begin, &mut mem);
        let _ = format_backtrace(&bt, |_| None::<(&str, u64)>);

        assert!(bt.frames.len() <= 16);
        unwound += 1;
    }
    assert!(unwound > 1000, "only {unwound} rounds reached the unwinder");
}

/* Entry of the SPARC v9 mini-kernel. The host starts here with all registers zero.
 *
 * The kernel is built with -mflat (no register windows: no save/restore, %i7/%l*
 * saved in the frame like any callee-saved register), because Unicorn 2.1.5's SPARC64
 * CPU cannot run windowed code: it never resets the CPU (cpu_sparc_init does not call
 * sparc_cpu_reset), so it starts with PSTATE = 0 (user mode: `wrpr` raises
 * privileged-instruction trap 0x11) and CANSAVE = CLEANWIN = 0 (the first `save`
 * raises spill trap 0x80), and it never delivers traps to a trap table at TBA
 * (cpu_handle_exception hands them to UC_HOOK_INTR hooks or stops), so spill/fill
 * handlers could not run either.
 * kmain's checksum ends up in %o0 and in exotap_result; exotap_halt is where the host
 * stops the run. */
    .section .text.entry, "ax"
    .globl _start
_start:
    sethi %hi(exotap_stack_top), %g1
    or %g1, %lo(exotap_stack_top), %g1
    /* %sp is biased by 2047 in the 64-bit ABI; leave room for one register save area. */
    sub %g1, 2047 + 192, %sp
    mov 0, %fp
    call kmain
     nop
    sethi %hi(exotap_result), %g1
    stx %o0, [%g1 + %lo(exotap_result)]
    .globl exotap_halt
exotap_halt:
    ba,a exotap_halt
     nop

/* A leaf in assembly with the cases the splice planner must refuse, which gcc's output
 * does not have: rd %pc; a trap instruction (tn: trap never, a no-op); a delay slot
 * that is also a branch target; the delay slot of ba,a (never runs); and an annulling
 * conditional branch, whose delay slot runs only when taken.
 * u64 exotap_edges(u64 n): sum over n iterations. */
    .text
    .globl exotap_edges
    .type exotap_edges, #function
exotap_edges:
    mov %o0, %g1
    clr %o0
    rd %pc, %g4
    sub %g4, %g4, %g4
    tn %icc, 5
.Lloop:
    andcc %g1, 1, %g0
    bne,pt %xcc, .Lslot
     nop
    ba .Lnext
.Lslot:
     add %o0, 3, %o0
.Lnext:
    ba,a .Lcheck
     add %o0, 100, %o0
.Lcheck:
    subcc %g1, 1, %g1
    bg,a,pt %xcc, .Lloop
     add %o0, 5, %o0
    retl
     add %o0, %g1, %o0
    .size exotap_edges, .-exotap_edges

    .section .bss.stack, "aw", @nobits
    .align 16
    .globl exotap_stack_bottom
exotap_stack_bottom:
    .space 0x8000
    .globl exotap_stack_top
exotap_stack_top:
    .section .note.GNU-stack, "", @progbits

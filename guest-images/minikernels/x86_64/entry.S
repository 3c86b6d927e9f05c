/* Entry: the host sets rsp to the top of the stack it mapped and starts here.
 * kmain's checksum ends up in rax and in exotap_result; exotap_halt is where the
 * host stops the run. */
    .section .text.entry, "ax"
    .globl _start
_start:
    call kmain
    movq %rax, exotap_result(%rip)
    .globl exotap_halt
exotap_halt:
    hlt
    jmp exotap_halt
    .section .note.GNU-stack, "", @progbits

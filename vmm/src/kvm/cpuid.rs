//! CPUID and MSRs of a vCPU.
//!
//! CPUID starts from `KVM_GET_SUPPORTED_CPUID` (what this KVM can virtualize) and is filtered
//! per vCPU: its APIC id where the kernel reads it (leaf 1 EBX, leaves 0xb/0x1f EDX, AMD's
//! 0x8000001e EAX), the logical-processor count, the hypervisor bit. The boot MSRs are those
//! firecracker sets: SYSENTER/SYSCALL MSRs cleared, fast strings on, MTRRs on with
//! write-back as the default type (otherwise the kernel maps all RAM uncached).

use kvm_bindings::{kvm_cpuid_entry2, kvm_msr_entry};

/// Leaf 1 ECX: running under a hypervisor.
pub const CPUID1_ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 ECX: the local APIC timer has TSC-deadline mode.
pub const CPUID1_ECX_TSC_DEADLINE: u32 = 1 << 24;
/// Leaf 1 EDX: hyper-threading / multi-core (logical count valid).
pub const CPUID1_EDX_HTT: u32 = 1 << 28;

/// MSR numbers.
pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
/// SYSENTER ESP.
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
/// SYSENTER EIP.
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
/// STAR.
pub const MSR_STAR: u32 = 0xc000_0081;
/// LSTAR (the kernel's syscall entry).
pub const MSR_LSTAR: u32 = 0xc000_0082;
/// CSTAR.
pub const MSR_CSTAR: u32 = 0xc000_0083;
/// SYSCALL flag mask.
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// The swapped GS base.
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
/// Time-stamp counter.
pub const MSR_IA32_TSC: u32 = 0x10;
/// Misc enables.
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// MTRR default type.
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MISC_ENABLE fast strings.
pub const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default type write-back.
pub const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

/// Filters the supported CPUID for vCPU `id` of `count`. `tsc_deadline` says whether KVM
/// has `KVM_CAP_TSC_DEADLINE_TIMER`: KVM emulates TSC-deadline mode in its in-kernel LAPIC
/// but leaves the CPUID bit to the VMM (as QEMU and firecracker set it). With it the kernel
/// programs the LAPIC timer from the TSC frequency (kvmclock's) and skips calibrating it
/// against the PIT, a check that fails where the host's timing is erratic (nested under
/// TCG), leaving the guest without a one-shot timer.
pub fn filter(entries: &mut [kvm_cpuid_entry2], id: u32, count: u32, tsc_deadline: bool) {
    let logical = count.clamp(1, 255);
    for e in entries.iter_mut() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (id << 24) | (logical << 16);
                e.ecx |= CPUID1_ECX_HYPERVISOR;
                if tsc_deadline {
                    e.ecx |= CPUID1_ECX_TSC_DEADLINE;
                }
                if count > 1 {
                    e.edx |= CPUID1_EDX_HTT;
                }
            }
            0xb | 0x1f => e.edx = id,
            0x8000_001e => e.eax = id,
            _ => {}
        }
    }
}

/// XCR0 with every state component the CPUID offers enabled (leaf 0xd, subleaf 0: EAX the
/// low half, EDX the high half; x87 always), or `None` without XSAVE.
///
/// The kernel sets XCR0 to exactly this with `xsetbv` early in boot. The VMM sets it first
/// because a host that does not intercept `xsetbv` (QEMU TCG's emulated SVM, where this
/// backend is verified) would otherwise leave KVM's idea of XCR0 at the reset value: KVM then
/// reports the wrong XSAVE size in leaf 0xd (the kernel warns "XSAVE consistency problem")
/// and reloads the reset XCR0 on every VM entry. On hardware this is what the kernel does.
pub fn full_xcr0(entries: &[kvm_cpuid_entry2]) -> Option<u64> {
    let has_xsave = entries
        .iter()
        .any(|e| e.function == 1 && e.ecx & CPUID1_ECX_XSAVE != 0);
    let leaf = entries.iter().find(|e| e.function == 0xd && e.index == 0)?;
    has_xsave.then(|| (u64::from(leaf.edx) << 32 | u64::from(leaf.eax)) | 1)
}

/// Leaf 1 ECX: XSAVE.
pub const CPUID1_ECX_XSAVE: u32 = 1 << 26;

/// The MSRs set on every vCPU before it runs.
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
    .into_iter()
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ebx: 0xdead_0800,
            ..Default::default()
        }
    }

    #[test]
    fn apic_id_count_and_hypervisor_bit_are_set_per_vcpu() {
        let mut entries = [leaf(1, 0), leaf(0xb, 0), leaf(0xb, 1), leaf(0x8000_001e, 0)];

        filter(&mut entries, 2, 4, true);

        assert_eq!(entries[0].ebx >> 24, 2, "initial APIC id");
        assert_eq!((entries[0].ebx >> 16) & 0xff, 4, "logical processors");
        assert_eq!(entries[0].ebx & 0xffff, 0x0800, "CLFLUSH size kept");
        assert_ne!(entries[0].ecx & (1 << 31), 0, "hypervisor present");
        assert_ne!(entries[0].ecx & (1 << 24), 0, "TSC-deadline timer");
        assert_ne!(entries[0].edx & CPUID1_EDX_HTT, 0);
        assert_eq!((entries[1].edx, entries[2].edx), (2, 2), "x2APIC id");
        assert_eq!(entries[3].eax, 2, "extended APIC id");
    }

    #[test]
    fn tsc_deadline_bit_follows_kvms_capability() {
        let mut entries = [leaf(1, 0)];

        filter(&mut entries, 0, 1, false);

        assert_eq!(entries[0].ecx & (1 << 24), 0);
        assert_eq!(entries[0].edx & (1 << 28), 0, "one vCPU: no HTT");
    }

    #[test]
    fn full_xcr0_is_leaf_0xd_with_x87_and_needs_xsave() {
        let xsave = kvm_cpuid_entry2 {
            function: 1,
            ecx: 1 << 26,
            ..Default::default()
        };
        let xd = kvm_cpuid_entry2 {
            function: 0xd,
            eax: 0x206,
            edx: 0x1,
            ..Default::default()
        };

        assert_eq!(full_xcr0(&[xsave, xd]), Some(0x1_0000_0207));
        assert_eq!(full_xcr0(&[leaf(1, 0), xd]), None, "no XSAVE");
        assert_eq!(full_xcr0(&[xsave]), None, "no leaf 0xd");
    }

    #[test]
    fn boot_msrs_turn_mtrrs_on_with_write_back_default() {
        let msrs = boot_msrs();

        let mtrr = msrs.iter().find(|m| m.index == 0x2ff).unwrap();
        assert_eq!(mtrr.data, 0x806);
        assert!(msrs.iter().any(|m| m.index == MSR_LSTAR && m.data == 0));
    }
}

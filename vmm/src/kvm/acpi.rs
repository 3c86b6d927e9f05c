//! ACPI tables: how the kernel finds the vCPUs, the IOAPIC, and how to power off.
//!
//! Why ACPI and not only the MP table ([`super::mptable`]): Debian's cloud kernel is built
//! without `CONFIG_X86_MPPARSE`, so without ACPI it sees one CPU, skips the IOAPIC and runs
//! in virtual-wire mode. The tables describe a plain PC, like QEMU's `-M pc`:
//!
//! * RSDP (ACPI 2.0, found through `boot_params.acpi_rsdp_addr` and by the BIOS-area scan),
//!   XSDT listing the FADT and the MADT;
//! * FADT (revision 6) of a non-hardware-reduced platform, so the legacy PIC, the PIT and
//!   ISA IRQ routing stay as the kernel knows them: SCI on IRQ 9 (never raised), `SMI_CMD` 0
//!   (the machine is always in ACPI mode), a PM1a event block at [`PM1A_EVT`] and a PM1a
//!   control block at [`PM1A_CNT`] ([`super::devices`] emulates them: a write with `SLP_EN`
//!   powers the VM off), no PM timer, no GPEs, C2/C3 off. `IAPC_BOOT_ARCH` says there is no
//!   i8042 (the kernel skips a probe that costs seconds), no VGA and no CMOS RTC;
//! * FACS (the kernel wants one on a non-reduced platform);
//! * DSDT with nothing but `\_S5_` = {0, 0}: sleep type 0 is soft-off, what makes the kernel's
//!   `poweroff` write `SLP_TYP=0 | SLP_EN` to PM1a control;
//! * MADT: one enabled local APIC per vCPU (APIC id = index), the IOAPIC at GSI base 0,
//!   LINT1 as NMI, `PCAT_COMPAT` (there are 8259s). No interrupt source overrides: KVM's
//!   default routing sends ISA IRQ n (the PIT's 0 included) to IOAPIC pin n, which is what
//!   the kernel assumes without overrides.
//!
//! The tables are built by hand: a handful of fixed-offset fields, checked in the tests
//! against the offsets the ACPI specification (6.4, chapter 5.2) gives.

use super::mptable::{APIC_ADDR, IOAPIC_ADDR};

/// Where the tables go: the BIOS area the kernel scans for the RSDP (0xe0000..0x100000).
pub const ACPI_ADDR: u64 = 0xe_0000;
/// The PM1a event block (PM1_STS, PM1_EN: 2 bytes each), as QEMU's PIIX4 has it.
pub const PM1A_EVT: u16 = 0x600;
/// The PM1a control block (2 bytes).
pub const PM1A_CNT: u16 = 0x604;
/// The SCI's ISA IRQ.
pub const SCI_IRQ: u16 = 9;
/// PM1 control: SCI_EN (the machine is in ACPI mode).
pub const PM1_SCI_EN: u16 = 1 << 0;
/// PM1 control: SLP_EN (enter the sleep state SLP_TYP names).
pub const PM1_SLP_EN: u16 = 1 << 13;
/// PM1 control: the SLP_TYP field.
pub const PM1_SLP_TYP_SHIFT: u16 = 10;
/// The `\_S5_` sleep type (soft-off).
pub const S5_SLP_TYP: u16 = 0;

/// OEM id and table id.
const OEM_ID: &[u8; 6] = b"EXOTAP";
const OEM_TABLE_ID: &[u8; 8] = b"EXOTAPVM";

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// A system description table: the 36-byte header, then `body`; length and checksum filled.
fn sdt(signature: &[u8; 4], revision: u8, body: &[u8]) -> Vec<u8> {
    let mut t = Vec::with_capacity(36 + body.len());
    t.extend_from_slice(signature);
    t.extend_from_slice(&((36 + body.len()) as u32).to_le_bytes());
    t.push(revision);
    t.push(0); // checksum, below
    t.extend_from_slice(OEM_ID);
    t.extend_from_slice(OEM_TABLE_ID);
    t.extend_from_slice(&1u32.to_le_bytes()); // OEM revision
    t.extend_from_slice(b"EXTP"); // creator id
    t.extend_from_slice(&1u32.to_le_bytes()); // creator revision
    t.extend_from_slice(body);
    t[9] = checksum(&t);
    t
}

fn put16(t: &mut [u8], at: usize, v: u16) {
    t[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(t: &mut [u8], at: usize, v: u32) {
    t[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(t: &mut [u8], at: usize, v: u64) {
    t[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// FADT `IAPC_BOOT_ARCH`: legacy (ISA) devices present.
const BOOT_ARCH_LEGACY_DEVICES: u16 = 1 << 0;
/// `IAPC_BOOT_ARCH`: VGA not present.
const BOOT_ARCH_NO_VGA: u16 = 1 << 2;
/// `IAPC_BOOT_ARCH`: CMOS RTC not present.
const BOOT_ARCH_NO_CMOS_RTC: u16 = 1 << 5;
/// FADT flags: WBINVD works, C1 supported, power and sleep buttons are not fixed features.
const FADT_FLAGS: u32 = (1 << 0) | (1 << 2) | (1 << 4) | (1 << 5);

/// The FADT (276 bytes, revision 6) with the DSDT and FACS at the given addresses.
fn fadt(dsdt: u64, facs: u64) -> Vec<u8> {
    // Offsets are the specification's, from the start of the table; the header is filled in
    // by `sdt` over bytes 0..36.
    let mut t = vec![0u8; 276];
    put32(&mut t, 36, facs as u32); // FIRMWARE_CTRL
    put32(&mut t, 40, dsdt as u32); // DSDT
    put16(&mut t, 46, SCI_IRQ); // SCI_INT
    put32(&mut t, 56, u32::from(PM1A_EVT)); // PM1a_EVT_BLK
    put32(&mut t, 64, u32::from(PM1A_CNT)); // PM1a_CNT_BLK
    t[88] = 4; // PM1_EVT_LEN
    t[89] = 2; // PM1_CNT_LEN
    put16(&mut t, 96, 101); // P_LVL2_LAT > 100: no C2
    put16(&mut t, 98, 1001); // P_LVL3_LAT > 1000: no C3
    put16(
        &mut t,
        109,
        BOOT_ARCH_LEGACY_DEVICES | BOOT_ARCH_NO_VGA | BOOT_ARCH_NO_CMOS_RTC,
    ); // IAPC_BOOT_ARCH (bit 1, 8042, clear)
    put32(&mut t, 112, FADT_FLAGS); // Flags
    t[131] = 4; // FADT minor version (6.4)
    put64(&mut t, 140, dsdt); // X_DSDT
    sdt(b"FACP", 6, &t[36..])
}

/// The FACS (64 bytes, no checksum).
fn facs() -> Vec<u8> {
    let mut t = vec![0u8; 64];
    t[..4].copy_from_slice(b"FACS");
    put32(&mut t, 4, 64);
    t[32] = 2; // version
    t
}

/// The DSDT: `Name (_S5_, Package (0x04) { 0, 0, 0, 0 })` in AML.
fn dsdt() -> Vec<u8> {
    let aml = [
        0x08, // NameOp
        b'_', b'S', b'5', b'_', // NameString
        0x12, // PackageOp
        0x06, // PkgLength: itself, NumElements and four ZeroOps
        0x04, // NumElements
        0x00, 0x00, 0x00, 0x00, // ZeroOp x4: SLP_TYPa, SLP_TYPb, reserved
    ];
    sdt(b"DSDT", 2, &aml)
}

/// The MADT for `cpus` vCPUs (APIC ids 0..cpus) and the IOAPIC (id `cpus`).
fn madt(cpus: u32) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&APIC_ADDR.to_le_bytes());
    body.extend_from_slice(&1u32.to_le_bytes()); // PCAT_COMPAT
    for id in 0..cpus {
        // Processor Local APIC: type 0, length 8, ACPI processor UID, APIC id, flags (enabled).
        body.extend_from_slice(&[0, 8, id as u8, id as u8]);
        body.extend_from_slice(&1u32.to_le_bytes());
    }
    // I/O APIC: type 1, length 12, id, reserved, address, GSI base.
    body.extend_from_slice(&[1, 12, cpus as u8, 0]);
    body.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    // Local APIC NMI: type 4, length 6, all processors, flags (bus default), LINT1.
    body.extend_from_slice(&[4, 6, 0xff, 0, 0, 1]);
    sdt(b"APIC", 5, &body)
}

/// The XSDT listing `tables`.
fn xsdt(tables: &[u64]) -> Vec<u8> {
    let body: Vec<u8> = tables.iter().flat_map(|a| a.to_le_bytes()).collect();
    sdt(b"XSDT", 1, &body)
}

/// The RSDP (ACPI 2.0, 36 bytes) pointing at the XSDT.
fn rsdp(xsdt: u64) -> Vec<u8> {
    let mut t = vec![0u8; 36];
    t[..8].copy_from_slice(b"RSD PTR ");
    t[9..15].copy_from_slice(OEM_ID);
    t[15] = 2; // revision
    put32(&mut t, 20, 36); // length
    put64(&mut t, 24, xsdt);
    t[8] = checksum(&t[..20]);
    t[32] = checksum(&t);
    t
}

/// Errors of building the tables.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AcpiError {
    /// More vCPUs than APIC ids below the IOAPIC's 8-bit id.
    #[error("{0} vCPUs do not fit the MADT (at most 254)")]
    TooManyCpus(u32),
}

/// The tables, laid out from [`ACPI_ADDR`]: `(address, bytes)` each, the RSDP first.
///
/// # Errors
/// No vCPU, or more than 254.
pub fn build(cpus: u32) -> Result<Vec<(u64, Vec<u8>)>, AcpiError> {
    if cpus == 0 || cpus > 254 {
        return Err(AcpiError::TooManyCpus(cpus));
    }
    let align = |addr: u64, to: u64| addr.div_ceil(to) * to;
    let rsdp_addr = ACPI_ADDR;
    let facs_addr = align(rsdp_addr + 36, 64);
    let facs = facs();
    let dsdt_addr = align(facs_addr + facs.len() as u64, 16);
    let dsdt = dsdt();
    let fadt_addr = align(dsdt_addr + dsdt.len() as u64, 16);
    let fadt = fadt(dsdt_addr, facs_addr);
    let madt_addr = align(fadt_addr + fadt.len() as u64, 16);
    let madt = madt(cpus);
    let xsdt_addr = align(madt_addr + madt.len() as u64, 16);
    let xsdt = xsdt(&[fadt_addr, madt_addr]);
    Ok(vec![
        (rsdp_addr, rsdp(xsdt_addr)),
        (facs_addr, facs),
        (dsdt_addr, dsdt),
        (fadt_addr, fadt),
        (madt_addr, madt),
        (xsdt_addr, xsdt),
    ])
}

#[cfg(test)]
mod tests {
    //! Offsets and values from the ACPI specification 6.4: 5.2.5.3 (RSDP), 5.2.6 (header),
    //! 5.2.8 (XSDT), 5.2.9 (FADT, table 5.9), 5.2.10 (FACS), 5.2.12 (MADT), 7.4.2 (`\_Sx`),
    //! 4.8.3.2.1 (PM1 control: SLP_TYP bits 10-12, SLP_EN bit 13).
    use super::*;

    fn u16_at(b: &[u8], off: usize) -> u16 {
        u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
    }
    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }
    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    fn table(tables: &[(u64, Vec<u8>)], addr: u64) -> &[u8] {
        &tables.iter().find(|(a, _)| *a == addr).unwrap().1
    }

    #[test]
    fn rsdp_points_at_an_xsdt_that_lists_fadt_and_madt() {
        let tables = build(2).unwrap();
        let (at, rsdp) = &tables[0];

        assert_eq!(
            *at, 0xe0000,
            "in the 0xE0000..0xFFFFF area the kernel scans"
        );
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert_eq!(
            sum(&rsdp[..20]),
            0,
            "ACPI 1.0 checksum over the first 20 bytes"
        );
        assert_eq!(sum(&rsdp[..36]), 0, "extended checksum");
        assert_eq!(rsdp[15], 2, "revision 2 (ACPI 2.0+)");
        assert_eq!(u32_at(rsdp, 20), 36, "length");
        let xsdt = table(&tables, u64_at(rsdp, 24));
        assert_eq!(&xsdt[..4], b"XSDT");
        assert_eq!(u32_at(xsdt, 4) as usize, xsdt.len());
        assert_eq!(sum(xsdt), 0);
        let listed: Vec<&[u8]> = (36..xsdt.len())
            .step_by(8)
            .map(|o| &table(&tables, u64_at(xsdt, o))[..4])
            .collect();
        assert_eq!(listed, [b"FACP", b"APIC"]);
    }

    #[test]
    fn fadt_fields_sit_at_the_specified_offsets() {
        let tables = build(2).unwrap();
        let fadt = tables
            .iter()
            .find(|(_, t)| &t[..4] == b"FACP")
            .unwrap()
            .1
            .clone();

        assert_eq!(u32_at(&fadt, 4), 276, "revision 6 FADT length");
        assert_eq!(fadt[8], 6, "major version");
        assert_eq!(sum(&fadt), 0);
        let facs = table(&tables, u64::from(u32_at(&fadt, 36)));
        assert_eq!(&facs[..4], b"FACS");
        assert_eq!(u32_at(facs, 4), 64);
        let dsdt_addr = u64::from(u32_at(&fadt, 40));
        assert_eq!(u64_at(&fadt, 140), dsdt_addr, "X_DSDT = DSDT");
        assert_eq!(&table(&tables, dsdt_addr)[..4], b"DSDT");
        assert_eq!(u16_at(&fadt, 46), 9, "SCI_INT");
        assert_eq!(u32_at(&fadt, 48), 0, "SMI_CMD 0: always in ACPI mode");
        assert_eq!(u32_at(&fadt, 56), 0x600, "PM1a_EVT_BLK");
        assert_eq!(u32_at(&fadt, 64), 0x604, "PM1a_CNT_BLK");
        assert_eq!(u32_at(&fadt, 76), 0, "no PM_TMR_BLK");
        assert_eq!(
            (fadt[88], fadt[89], fadt[91]),
            (4, 2, 0),
            "PM1 evt/cnt, tmr lengths"
        );
        assert_eq!(u16_at(&fadt, 109) & 0x02, 0, "IAPC_BOOT_ARCH: no 8042");
        assert_eq!(
            u16_at(&fadt, 109) & 0x20,
            0x20,
            "IAPC_BOOT_ARCH: no CMOS RTC"
        );
        assert_eq!(u32_at(&fadt, 112) & (1 << 20), 0, "not HW_REDUCED_ACPI");
    }

    #[test]
    fn dsdt_names_s5_as_sleep_type_zero() {
        let tables = build(1).unwrap();
        let dsdt = tables
            .iter()
            .find(|(_, t)| &t[..4] == b"DSDT")
            .unwrap()
            .1
            .clone();

        assert_eq!(sum(&dsdt), 0);
        assert_eq!(u32_at(&dsdt, 4) as usize, dsdt.len());
        // NameOp "_S5_" PackageOp PkgLength NumElements ZeroOp...
        assert_eq!(&dsdt[36..44], &[0x08, b'_', b'S', b'5', b'_', 0x12, 6, 4]);
        assert_eq!(dsdt[44], 0x00, "SLP_TYPa = 0");
        assert_eq!(S5_SLP_TYP, 0);
    }

    #[test]
    fn madt_has_one_enabled_local_apic_per_vcpu_and_the_ioapic() {
        let tables = build(3).unwrap();
        let madt = tables
            .iter()
            .find(|(_, t)| &t[..4] == b"APIC")
            .unwrap()
            .1
            .clone();

        assert_eq!(sum(&madt), 0);
        assert_eq!(u32_at(&madt, 36), 0xfee0_0000, "local APIC address");
        assert_eq!(u32_at(&madt, 40) & 1, 1, "PCAT_COMPAT");
        let mut at = 44;
        let mut lapics = Vec::new();
        let mut ioapics = Vec::new();
        let mut nmis = 0;
        while at < madt.len() {
            let (kind, len) = (madt[at], madt[at + 1] as usize);
            match kind {
                0 => lapics.push((madt[at + 3], u32_at(&madt, at + 4))),
                1 => ioapics.push((madt[at + 2], u32_at(&madt, at + 4), u32_at(&madt, at + 8))),
                4 => {
                    assert_eq!(madt[at + 5], 1, "NMI on LINT1");
                    nmis += 1;
                }
                other => panic!("unexpected MADT entry type {other}"),
            }
            at += len;
        }
        assert_eq!(at, madt.len());
        assert_eq!(lapics, [(0, 1), (1, 1), (2, 1)], "APIC ids, enabled");
        assert_eq!(
            ioapics,
            [(3, 0xfec0_0000, 0)],
            "IOAPIC id, address, GSI base"
        );
        assert_eq!(nmis, 1);
    }

    #[test]
    fn tables_fit_the_bios_area_and_do_not_overlap() {
        let mut tables = build(254).unwrap();
        tables.sort_by_key(|(a, _)| *a);

        for pair in tables.windows(2) {
            assert!(pair[0].0 + pair[0].1.len() as u64 <= pair[1].0);
        }
        let (last, bytes) = tables.last().unwrap();
        assert!(last + bytes.len() as u64 <= 0x10_0000);
        assert_eq!(build(0), Err(AcpiError::TooManyCpus(0)));
        assert_eq!(build(255), Err(AcpiError::TooManyCpus(255)));
    }
}

//! An Intel MultiProcessor Specification 1.4 table: how the kernel learns about the vCPUs,
//! the IOAPIC and ISA interrupt routing without ACPI (as firecracker does).

use super::layout::MPTABLE_ADDR;

/// The local APIC's address.
pub const APIC_ADDR: u32 = 0xfee0_0000;
/// The IOAPIC's address.
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
/// IOAPIC pins KVM's in-kernel IOAPIC has.
pub const IOAPIC_PINS: u8 = 24;

/// Errors of building the table.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MpTableError {
    /// More vCPUs than the table's area holds.
    #[error("{0} vCPUs do not fit the MP table (at most 32)")]
    TooManyCpus(u32),
}

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// The MP table for `cpus` vCPUs (APIC ids 0..cpus), placed at [`MPTABLE_ADDR`]: the
/// floating pointer, then the configuration table.
///
/// # Errors
/// More than 32 vCPUs (the table must fit the last KiB of conventional memory).
pub fn build(cpus: u32) -> Result<Vec<u8>, MpTableError> {
    if cpus == 0 || cpus > 32 {
        return Err(MpTableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus as u8;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for id in 0..cpus {
        // Processor: type 0, APIC id, APIC version, flags (enabled, BSP), signature, features.
        entries.extend_from_slice(&[0, id as u8, 0x14, if id == 0 { 3 } else { 1 }]);
        entries.extend_from_slice(&0x600u32.to_le_bytes());
        entries.extend_from_slice(&0x201u32.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    // IOAPIC: type 2, id, version, enabled, address.
    entries.extend_from_slice(&[2, ioapic_id, 0x11, 1]);
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    count += 1;
    // ISA IRQ n to IOAPIC pin n, as KVM's default GSI routing has it.
    for irq in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // LINT0: ExtINT from the PIC; LINT1: NMI, on every local APIC.
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let config_addr = MPTABLE_ADDR + 16;
    let mut config = Vec::with_capacity(44 + entries.len());
    config.extend_from_slice(b"PCMP");
    config.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    config.push(4); // spec revision 1.4
    config.push(0); // checksum, below
    config.extend_from_slice(b"EXOTAP  ");
    config.extend_from_slice(b"KVM VMM     ");
    config.extend_from_slice(&0u32.to_le_bytes()); // OEM table
    config.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    config.extend_from_slice(&count.to_le_bytes());
    config.extend_from_slice(&APIC_ADDR.to_le_bytes());
    config.extend_from_slice(&[0, 0, 0, 0]); // extended table length, checksum, reserved
    config.extend_from_slice(&entries);
    config[7] = checksum(&config);

    let mut floating = Vec::with_capacity(16);
    floating.extend_from_slice(b"_MP_");
    floating.extend_from_slice(&(config_addr as u32).to_le_bytes());
    floating.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]);
    floating[10] = checksum(&floating);

    let mut table = floating;
    table.extend_from_slice(&config);
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn floating_pointer_and_config_table_check_out() {
        let table = build(2).unwrap();

        assert_eq!(&table[..4], b"_MP_");
        assert_eq!(sum(&table[..16]), 0);
        let config_at = u32::from_le_bytes(table[4..8].try_into().unwrap()) as u64;
        assert_eq!(config_at, MPTABLE_ADDR + 16);
        let config = &table[16..];
        assert_eq!(&config[..4], b"PCMP");
        let len = u16::from_le_bytes(config[4..6].try_into().unwrap()) as usize;
        assert_eq!(len, config.len());
        assert_eq!(sum(config), 0);
        assert!(table.len() <= 0x400, "fits the reserved KiB");
    }

    #[test]
    fn one_processor_entry_per_vcpu_with_the_first_as_bsp() {
        let table = build(3).unwrap();
        let entries = &table[16 + 44..];

        let cpus: Vec<(u8, u8)> = entries.chunks(20).take(3).map(|e| (e[1], e[3])).collect();

        assert_eq!(cpus, [(0, 3), (1, 1), (2, 1)]);
        assert_eq!(entries[60], 1, "then the ISA bus");
    }

    #[test]
    fn no_or_too_many_vcpus_are_refused() {
        assert_eq!(build(0), Err(MpTableError::TooManyCpus(0)));
        assert_eq!(build(33), Err(MpTableError::TooManyCpus(33)));
    }
}

//! The zero page (`struct boot_params`) for the 64-bit boot protocol
//! (Documentation/arch/x86/boot.rst, "64-bit Boot Protocol").
//!
//! The setup header comes from the bzImage (offset 0x1f1 of the file, copied to 0x1f1 of the
//! zero page); the loader then fills in what the protocol marks "write" for a boot loader:
//! `type_of_loader`, `loadflags`, `cmd_line_ptr`, `ramdisk_image`/`ramdisk_size`, `vid_mode`,
//! and the e820 table.

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use vm_memory::ByteValued;

use super::layout::E820Entry;

/// `HdrS` at offset 0x202: the header is a boot-protocol 2.x header.
pub const HDRS_MAGIC: u32 = 0x5372_6448;
/// "undefined" boot loader ID.
pub const LOADER_UNDEFINED: u8 = 0xff;
/// `loadflags` bit 0: the protected-mode code is loaded at 0x100000.
pub const LOADED_HIGH: u8 = 1 << 0;
/// `loadflags` bit 5: suppress early messages.
pub const QUIET_FLAG: u8 = 1 << 5;
/// `loadflags` bit 7: `heap_end_ptr` is valid.
pub const CAN_USE_HEAP: u8 = 1 << 7;
/// `xloadflags` bit 0: the kernel has the legacy 64-bit entry point at 0x200.
pub const XLF_KERNEL_64: u16 = 1 << 0;
/// `vid_mode` "normal".
pub const VID_MODE_NORMAL: u16 = 0xffff;
/// Entries the zero page's e820 table holds.
pub const E820_MAX: usize = 128;

/// Errors of building the zero page.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BootParamsError {
    /// No `HdrS`.
    #[error("the image has no boot-protocol header (no HdrS magic at 0x202)")]
    NotBzImage,
    /// Too old a protocol for a 64-bit entry.
    #[error("boot protocol {0:#x} is older than 2.12, which the 64-bit entry needs")]
    OldProtocol(u16),
    /// No 64-bit entry.
    #[error("the kernel has no 64-bit entry point (XLF_KERNEL_64 is clear)")]
    No64BitEntry,
    /// The command line is too long.
    #[error("the command line is {len} bytes, the kernel takes at most {max}")]
    CmdlineTooLong {
        /// Its length.
        len: usize,
        /// The kernel's `cmdline_size`.
        max: u32,
    },
    /// Too many e820 entries.
    #[error("{0} e820 entries do not fit the zero page")]
    TooManyE820(usize),
    /// An address does not fit a 32-bit header field.
    #[error("{what} at {addr:#x} is above 4 GiB")]
    Above4G {
        /// The field.
        what: &'static str,
        /// The address.
        addr: u64,
    },
}

/// What the loader puts in the zero page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootInputs {
    /// Where the command line is (NUL-terminated there).
    pub cmdline_addr: u64,
    /// Its length without the NUL.
    pub cmdline_len: usize,
    /// Initramfs (address, size), if any.
    pub initrd: Option<(u64, u64)>,
    /// The memory map.
    pub e820: Vec<E820Entry>,
    /// Where the ACPI RSDP is (`acpi_rsdp_addr`, protocol 2.14+), if there is one.
    pub acpi_rsdp: Option<u64>,
}

/// Checks the image's setup header for what the 64-bit entry needs.
///
/// # Errors
/// Not a bzImage, protocol before 2.12, or no 64-bit entry.
pub fn check_header(hdr: &setup_header) -> Result<(), BootParamsError> {
    if hdr.header != HDRS_MAGIC {
        return Err(BootParamsError::NotBzImage);
    }
    if hdr.version < 0x020c {
        return Err(BootParamsError::OldProtocol(hdr.version));
    }
    if hdr.xloadflags & XLF_KERNEL_64 == 0 {
        return Err(BootParamsError::No64BitEntry);
    }
    Ok(())
}

fn low32(what: &'static str, addr: u64) -> Result<u32, BootParamsError> {
    u32::try_from(addr).map_err(|_| BootParamsError::Above4G { what, addr })
}

/// Builds the zero page from the image's setup header and the loader's inputs.
///
/// # Errors
/// A header the 64-bit entry cannot use, a command line over `cmdline_size`, or too many
/// e820 entries.
pub fn build(hdr: &setup_header, inputs: &BootInputs) -> Result<boot_params, BootParamsError> {
    check_header(hdr)?;
    let max = if hdr.cmdline_size == 0 {
        255
    } else {
        hdr.cmdline_size
    };
    if inputs.cmdline_len > max as usize {
        return Err(BootParamsError::CmdlineTooLong {
            len: inputs.cmdline_len,
            max,
        });
    }
    if inputs.e820.len() > E820_MAX {
        return Err(BootParamsError::TooManyE820(inputs.e820.len()));
    }
    let mut params = boot_params {
        hdr: *hdr,
        ..Default::default()
    };
    params.hdr.type_of_loader = LOADER_UNDEFINED;
    params.hdr.loadflags = (hdr.loadflags | LOADED_HIGH | CAN_USE_HEAP) & !QUIET_FLAG;
    // The real-mode heap is not used by the 64-bit entry; the protocol wants a sane value.
    params.hdr.heap_end_ptr = 0xfe00;
    params.hdr.vid_mode = VID_MODE_NORMAL;
    params.hdr.cmd_line_ptr = low32("the command line", inputs.cmdline_addr)?;
    params.ext_cmd_line_ptr = 0;
    if let Some((addr, size)) = inputs.initrd {
        params.hdr.ramdisk_image = low32("the initramfs", addr)?;
        params.hdr.ramdisk_size = low32("the initramfs size", size)?;
    }
    if let Some(rsdp) = inputs.acpi_rsdp {
        params.acpi_rsdp_addr = rsdp;
    }
    params.e820_entries = inputs.e820.len() as u8;
    for (slot, e) in params.e820_table.iter_mut().zip(&inputs.e820) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind,
        };
    }
    Ok(params)
}

/// The zero page as the 4096 bytes the kernel reads.
pub fn bytes(params: &boot_params) -> &[u8] {
    params.as_slice()
}

#[cfg(test)]
mod tests {
    //! Offsets and values from Documentation/arch/x86/boot.rst ("THE REAL-MODE KERNEL
    //! HEADER", "DETAILS OF HEADER FIELDS", "THE ZERO PAGE" and zero-page.rst), not from the
    //! structure definitions used above.
    use super::*;
    use crate::kvm::layout::{E820_RAM, E820_RESERVED};

    fn u16_at(b: &[u8], off: usize) -> u16 {
        u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
    }
    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    /// A setup header as the Debian 6.1 bzImage carries it (protocol 2.15).
    fn debian_header() -> setup_header {
        setup_header {
            setup_sects: 0x1f,
            boot_flag: 0xaa55,
            header: HDRS_MAGIC,
            version: 0x020f,
            loadflags: LOADED_HIGH,
            code32_start: 0x100000,
            initrd_addr_max: 0x7fff_ffff,
            kernel_alignment: 0x20_0000,
            relocatable_kernel: 1,
            xloadflags: 0x7f,
            cmdline_size: 0x7ff,
            pref_address: 0x100_0000,
            init_size: 0x300_0000,
            ..Default::default()
        }
    }

    fn inputs() -> BootInputs {
        BootInputs {
            cmdline_addr: 0x20000,
            cmdline_len: 40,
            initrd: Some((0x3bf0_0000, 0x12_3456)),
            e820: vec![
                E820Entry {
                    addr: 0,
                    size: 0x9fc00,
                    kind: E820_RAM,
                },
                E820Entry {
                    addr: 0x9fc00,
                    size: 0x400,
                    kind: E820_RESERVED,
                },
                E820Entry {
                    addr: 0x100000,
                    size: 0x3bf0_0000,
                    kind: E820_RAM,
                },
            ],
            acpi_rsdp: Some(0xe0000),
        }
    }

    #[test]
    fn zero_page_is_one_page() {
        let params = build(&debian_header(), &inputs()).unwrap();

        assert_eq!(bytes(&params).len(), 4096);
    }

    #[test]
    fn setup_header_fields_sit_at_the_documented_offsets() {
        let params = build(&debian_header(), &inputs()).unwrap();
        let zp = bytes(&params);

        assert_eq!(zp[0x1f1], 0x1f, "setup_sects at 0x1f1");
        assert_eq!(u16_at(zp, 0x1fe), 0xaa55, "boot_flag at 0x1FE");
        assert_eq!(&zp[0x202..0x206], b"HdrS", "header at 0x202");
        assert_eq!(u16_at(zp, 0x206), 0x020f, "version at 0x206");
        assert_eq!(u32_at(zp, 0x214), 0x100000, "code32_start at 0x214");
        assert_eq!(u32_at(zp, 0x22c), 0x7fff_ffff, "initrd_addr_max at 0x22C");
        assert_eq!(u32_at(zp, 0x230), 0x20_0000, "kernel_alignment at 0x230");
        assert_eq!(zp[0x234], 1, "relocatable_kernel at 0x234");
        assert_eq!(u16_at(zp, 0x236), 0x7f, "xloadflags at 0x236");
        assert_eq!(u32_at(zp, 0x238), 0x7ff, "cmdline_size at 0x238");
        assert_eq!(u64_at(zp, 0x258), 0x100_0000, "pref_address at 0x258");
        assert_eq!(u32_at(zp, 0x260), 0x300_0000, "init_size at 0x260");
    }

    #[test]
    fn loader_fields_are_written_where_the_protocol_reads_them() {
        let params = build(&debian_header(), &inputs()).unwrap();
        let zp = bytes(&params);

        assert_eq!(u16_at(zp, 0x1fa), 0xffff, "vid_mode at 0x1FA: normal");
        assert_eq!(zp[0x210], 0xff, "type_of_loader at 0x210: undefined");
        assert_eq!(zp[0x211] & 0x01, 0x01, "loadflags LOADED_HIGH");
        assert_eq!(zp[0x211] & 0x80, 0x80, "loadflags CAN_USE_HEAP");
        assert_eq!(zp[0x211] & 0x20, 0, "loadflags QUIET_FLAG clear");
        assert_eq!(u32_at(zp, 0x218), 0x3bf0_0000, "ramdisk_image at 0x218");
        assert_eq!(u32_at(zp, 0x21c), 0x12_3456, "ramdisk_size at 0x21C");
        assert_eq!(u16_at(zp, 0x224), 0xfe00, "heap_end_ptr at 0x224");
        assert_eq!(u32_at(zp, 0x228), 0x20000, "cmd_line_ptr at 0x228");
        assert_eq!(u32_at(zp, 0x0c8), 0, "ext_cmd_line_ptr at 0x0C8");
        assert_eq!(u64_at(zp, 0x070), 0xe0000, "acpi_rsdp_addr at 0x070");
    }

    #[test]
    fn e820_table_is_at_0x2d0_with_20_byte_entries_and_count_at_0x1e8() {
        let params = build(&debian_header(), &inputs()).unwrap();
        let zp = bytes(&params);

        assert_eq!(zp[0x1e8], 3, "e820_entries at 0x1E8");
        let entry = |i: usize| {
            let at = 0x2d0 + 20 * i;
            (u64_at(zp, at), u64_at(zp, at + 8), u32_at(zp, at + 16))
        };
        assert_eq!(entry(0), (0, 0x9fc00, 1));
        assert_eq!(entry(1), (0x9fc00, 0x400, 2));
        assert_eq!(entry(2), (0x100000, 0x3bf0_0000, 1));
        assert_eq!(entry(3), (0, 0, 0));
        // The table holds 128 entries and ends at 0xCD0.
        assert_eq!(0x2d0 + 20 * E820_MAX, 0xcd0);
    }

    #[test]
    fn header_without_64_bit_entry_or_magic_is_refused() {
        let mut hdr = debian_header();
        hdr.xloadflags = 0;
        assert_eq!(
            build(&hdr, &inputs()).err(),
            Some(BootParamsError::No64BitEntry)
        );
        hdr.header = 0;
        assert_eq!(
            build(&hdr, &inputs()).err(),
            Some(BootParamsError::NotBzImage)
        );
        let mut old = debian_header();
        old.version = 0x020a;
        assert_eq!(
            build(&old, &inputs()).err(),
            Some(BootParamsError::OldProtocol(0x020a))
        );
    }

    #[test]
    fn too_long_command_line_is_refused() {
        let mut long = inputs();
        long.cmdline_len = 0x800;

        assert_eq!(
            build(&debian_header(), &long).err(),
            Some(BootParamsError::CmdlineTooLong {
                len: 0x800,
                max: 0x7ff
            })
        );
    }
}

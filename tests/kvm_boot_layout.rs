//! The kvm backend's guest memory at the kernel's entry, checked against the Linux x86 boot
//! protocol (Documentation/arch/x86/boot.rst and zero-page.rst) with the real Debian bzImage.
//! No `/dev/kvm` is needed: [`exotap_vmm::kvm::load_memory`] lays memory out exactly as the
//! VMM does before it creates the vCPUs. The expectations come from the documents and from
//! the bzImage file itself, not from the VMM's own structures:
//!
//! * the setup header is copied from file offset 0x1f1 to zero-page offset 0x1f1, its end
//!   being 0x202 + the byte at 0x201; a loader writes only the fields the protocol marks
//!   "write" (type_of_loader, loadflags, ramdisk_image/size, heap_end_ptr, cmd_line_ptr,
//!   vid_mode);
//! * the protected-mode kernel is the file from (setup_sects + 1) * 512 on (setup_sects 0
//!   means 4), loaded at 0x100000;
//! * the 64-bit protocol wants an identity map of the zero page, the command line and
//!   `init_size` bytes from the kernel's load address, `%rsi` = the zero page, entry at the
//!   load address + 0x200;
//! * the e820 table (count at 0x1e8, 20-byte entries at 0x2d0) must not list the patch heap;
//! * `acpi_rsdp_addr` (0x070) points at an RSDP ("RSD PTR ").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use exotap_guest_images as images;
use exotap_vmm::kvm::{cpu_setup, kvm_bindings, load_memory, KvmConfig, LoadedGuest};
use exotap_vmm::qemu::PatchHeapRange;

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}

/// Walks 4-level page tables in guest memory as the MMU does (Intel SDM vol. 3, 4.5).
fn walk(guest: &LoadedGuest, cr3: u64, va: u64) -> Option<u64> {
    let mut table = cr3 & 0x000f_ffff_ffff_f000;
    for level in (1..=4u32).rev() {
        let shift = 12 + 9 * (level - 1);
        let index = (va >> shift) & 0x1ff;
        let entry = u64_at(&guest.read(table + index * 8, 8)?, 0);
        if entry & 1 == 0 {
            return None;
        }
        if level == 1 || (entry & 0x80 != 0 && level <= 3) {
            let page = 1u64 << shift;
            return Some((entry & 0x000f_ffff_ffff_f000 & !(page - 1)) | (va & (page - 1)));
        }
        table = entry & 0x000f_ffff_ffff_f000;
    }
    None
}

struct Loaded {
    file: Vec<u8>,
    initrd: Vec<u8>,
    config: KvmConfig,
    guest: LoadedGuest,
    zp: Vec<u8>,
}

/// The layout, made once for all tests (checking the cached kernel costs seconds).
fn load() -> Option<&'static Loaded> {
    static LOADED: std::sync::OnceLock<Option<Loaded>> = std::sync::OnceLock::new();
    LOADED.get_or_init(make).as_ref()
}

fn make() -> Option<Loaded> {
    let kernel = match images::ensure_kernel(images::DEFAULT_KERNEL) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("SKIP: no guest kernel ({e:#})");
            return None;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let initrd_path = dir.path().join("initrd");
    let initrd: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + 3) as u8).collect();
    std::fs::write(&initrd_path, &initrd).unwrap();
    let mut config = KvmConfig::new(kernel.bzimage.clone(), initrd_path).unwrap();
    config.memory_mib = 512;
    config.cpus = 2;
    config.patch_heap = PatchHeapRange::place(512 << 20, 16 << 20).unwrap();
    let guest = load_memory(&config).unwrap();
    let zp = guest.read(guest.zero_page, 4096).unwrap();
    Some(Loaded {
        file: std::fs::read(&kernel.bzimage).unwrap(),
        initrd,
        config,
        guest,
        zp,
    })
}

#[test]
fn setup_header_is_the_files_with_only_the_loaders_fields_written() {
    let Some(l) = load() else { return };
    let end = 0x202 + l.file[0x201] as usize;
    // Fields a boot loader writes (boot.rst, "DETAILS OF HEADER FIELDS", "write" ones).
    let written: &[(usize, usize)] = &[
        (0x1fa, 2), // vid_mode
        (0x210, 1), // type_of_loader
        (0x211, 1), // loadflags
        (0x218, 4), // ramdisk_image
        (0x21c, 4), // ramdisk_size
        (0x224, 2), // heap_end_ptr
        (0x228, 4), // cmd_line_ptr
    ];
    let loader_field = |off: usize| written.iter().any(|(at, n)| (*at..at + n).contains(&off));

    assert_eq!(&l.zp[0x202..0x206], b"HdrS", "the header magic at 0x202");
    for off in 0x1f1..end {
        if !loader_field(off) {
            assert_eq!(
                l.zp[off], l.file[off],
                "zero page byte {off:#x} differs from the file"
            );
        }
    }
    assert_eq!(l.zp[0x210], 0xff, "type_of_loader: undefined");
    assert_eq!(l.zp[0x211] & 0x01, 0x01, "loadflags: LOADED_HIGH");
    assert_eq!(l.zp[0x211] & 0x80, 0x80, "loadflags: CAN_USE_HEAP");
    assert_eq!(u16_at(&l.zp, 0x1fa), 0xffff, "vid_mode: normal");
}

#[test]
fn command_line_and_initramfs_are_where_the_zero_page_says() {
    let Some(l) = load() else { return };

    let cmd_line_ptr = u64::from(u32_at(&l.zp, 0x228));
    let cmdline = l.config.cmdline();
    let mut expected = cmdline.clone().into_bytes();
    expected.push(0);
    assert_eq!(
        l.guest.read(cmd_line_ptr, expected.len()).unwrap(),
        expected,
        "NUL-terminated command line at cmd_line_ptr"
    );
    assert!(
        cmdline.len() < u32_at(&l.zp, 0x238) as usize,
        "shorter than cmdline_size"
    );
    let ramdisk_image = u64::from(u32_at(&l.zp, 0x218));
    let ramdisk_size = u32_at(&l.zp, 0x21c) as usize;
    assert_eq!(ramdisk_size, l.initrd.len());
    assert_eq!(l.guest.read(ramdisk_image, ramdisk_size).unwrap(), l.initrd);
    assert_eq!(ramdisk_image % 4096, 0, "page aligned");
    assert!(
        ramdisk_image + ramdisk_size as u64 <= u64::from(u32_at(&l.zp, 0x22c)) + 1,
        "below initrd_addr_max"
    );
}

#[test]
fn protected_mode_kernel_is_the_file_after_the_setup_sectors_at_1_mib() {
    let Some(l) = load() else { return };
    let setup_sects = match l.file[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let payload = &l.file[(setup_sects + 1) * 512..];

    assert_eq!(l.guest.kernel_load, 0x100000);
    assert_eq!(l.guest.read(0x100000, payload.len()).unwrap(), payload);
}

#[test]
fn e820_map_is_the_ram_below_the_heap_and_never_the_heap() {
    let Some(l) = load() else { return };
    let count = l.zp[0x1e8] as usize;
    let entries: Vec<(u64, u64, u32)> = (0..count)
        .map(|i| {
            let at = 0x2d0 + 20 * i;
            (
                u64_at(&l.zp, at),
                u64_at(&l.zp, at + 8),
                u32_at(&l.zp, at + 16),
            )
        })
        .collect();
    let heap = l.config.patch_heap;

    assert!(count >= 2, "{entries:x?}");
    assert!(entries
        .iter()
        .all(|(a, n, _)| a + n <= heap.base || *a >= heap.base + heap.size));
    let ram_top = entries
        .iter()
        .filter(|e| e.2 == 1)
        .map(|(a, n, _)| a + n)
        .max()
        .unwrap();
    assert_eq!(ram_top, heap.base, "RAM reaches the heap: {entries:x?}");
    let kernel_ram = entries
        .iter()
        .find(|(a, n, t)| *t == 1 && *a <= 0x100000 && a + n > 0x100000);
    assert!(kernel_ram.is_some(), "1 MiB and up is RAM: {entries:x?}");
    // Sorted and disjoint.
    for w in entries.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "{entries:x?}");
    }
}

#[test]
fn identity_map_covers_what_the_64_bit_entry_touches() {
    let Some(l) = load() else { return };
    let mut sregs = kvm_bindings::kvm_sregs::default();
    cpu_setup::long_mode_sregs(&mut sregs);
    let regs = cpu_setup::boot_regs(l.guest.kernel_load);
    let init_size = u64::from(u32_at(&l.zp, 0x260));
    let cmd_line_ptr = u64::from(u32_at(&l.zp, 0x228));

    assert_eq!(regs.rsi, l.guest.zero_page, "%rsi = the zero page");
    assert_eq!(
        regs.rip,
        l.guest.kernel_load + 0x200,
        "64-bit entry at +0x200"
    );
    assert_eq!(regs.rflags & (1 << 9), 0, "interrupts off");
    let cr3 = sregs.cr3;
    let mut must_map = vec![l.guest.zero_page, l.guest.zero_page + 4095, cmd_line_ptr];
    let mut at = l.guest.kernel_load;
    while at < l.guest.kernel_load + init_size {
        must_map.push(at);
        at += 0x1000;
    }
    must_map.push(l.guest.kernel_load + init_size - 1);
    for va in must_map {
        assert_eq!(
            walk(&l.guest, cr3, va),
            Some(va),
            "{va:#x} is identity-mapped"
        );
    }
}

#[test]
fn acpi_rsdp_addr_points_at_an_rsdp() {
    let Some(l) = load() else { return };
    let rsdp = u64_at(&l.zp, 0x070);

    assert_ne!(rsdp, 0);
    let bytes = l.guest.read(rsdp, 20).unwrap();
    assert_eq!(&bytes[..8], b"RSD PTR ");
    assert_eq!(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
}
